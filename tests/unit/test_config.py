"""KubeProxyConfiguration parsing: upstream field names, strict paths in errors."""
import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.config import (
    ConfigError,
    parse,
    parse_duration,
)

BASE = {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration"}


def test_fields_that_apply():
    cfg = parse({**BASE, "mode": "iptables", "hostnameOverride": "node1", "clusterCIDR": "10.244.0.0/16",
                 "detectLocalMode": "ClusterCIDR", "nodePortAddresses": ["192.168.50.0/24", "primary"],
                 "iptables": {"masqueradeAll": True, "masqueradeBit": 15, "localhostNodePorts": False,
                              "syncPeriod": "1m0s", "minSyncPeriod": "500ms"},
                 "healthzBindAddress": "0.0.0.0:10256", "metricsBindAddress": "127.0.0.1:10249",
                 "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "24h0m0s"},
                 "clientConnection": {"kubeconfig": "/etc/k.conf", "qps": 5}})
    assert cfg.cluster_cidrs == ("10.244.0.0/16",) and cfg.masquerade_all and cfg.masquerade_bit == 15
    assert cfg.sync_period == 60 and cfg.min_sync_period == 0.5 and not cfg.localhost_nodeports
    assert cfg.node_port_addresses == ("192.168.50.0/24", "primary")
    assert cfg.conntrack.tcp_established_timeout == 86400 and cfg.kubeconfig == "/etc/k.conf"


@pytest.mark.parametrize("doc,path", [
    ({"mode": "userspace"}, "mode"),
    ({"iptables": {"masqueradeBit": 40}}, "iptables.masqueradeBit"),
    ({"iptables": {"syncPeriod": "soon"}}, "iptables.syncPeriod"),
    ({"iptables": {"bogus": 1}}, "iptables.bogus"),
    ({"clusterCIDR": "10.244.0.0/40"}, "clusterCIDR"),
    ({"detectLocal": {"bridgeInterface": "br0", "other": 1}}, "detectLocal.other"),
    ({"detectLocalMode": "BridgeInterface"}, "detectLocal.bridgeInterface"),
    ({"healthzBindAddress": "localhost"}, "healthzBindAddress"),
    ({"conntrack": {"maxPerCore": -1}}, "conntrack.maxPerCore"),
    ({"somethingNew": True}, "somethingNew"),
    ({"apiVersion": "v1"}, "apiVersion"),
])
def test_errors_carry_the_field_path(doc, path):
    with pytest.raises(ConfigError) as err:
        parse({**BASE, **doc})
    assert err.value.path == path and path in str(err.value)


def test_upstream_fields_that_do_not_apply_are_accepted():
    cfg = parse({**BASE, "featureGates": {"X": True}, "oomScoreAdj": -999, "bindAddress": "0.0.0.0"})
    assert set(cfg.ignored) == {"featureGates", "oomScoreAdj", "bindAddress"}


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("1m30s", 90), ("500ms", 0.5), ("1h", 3600), ("0s", 0)])
def test_durations(text, seconds):
    assert parse_duration(text, "x") == seconds


@pytest.mark.parametrize("key, value", [
    ("bridgeInterface", "br0\n-A INPUT -j ACCEPT"), ("bridgeInterface", "x" * 16), ("bridgeInterface", "br 0"),
    ("interfaceNamePrefix", "veth\""), ("interfaceNamePrefix", "v" * 16),
])
def test_interface_names_that_cannot_go_into_rules_are_refused_at_load(key, value):
    # Before: accepted, then every sync failed when the rules were written.
    with pytest.raises(ConfigError, match=f"detectLocal.{key}: not an interface name"):
        parse({**BASE, "detectLocal": {key: value}})


def test_good_interface_names_load():
    cfg = parse({**BASE, "detectLocal": {"bridgeInterface": "cbr0", "interfaceNamePrefix": "cali"}})
    assert (cfg.bridge_interface, cfg.interface_name_prefix) == ("cbr0", "cali")
