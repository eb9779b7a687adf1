"""The family split of a dual-stack node: which families the node serves, what each
family's state receives from the one intake, the meta-proxier's contract over the
families, and the per-family pieces (ip6tables tools, IPv6 options and names)."""
import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import app
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.config import ProxyConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.errors import LockBusy
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import IptablesKernel
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.metaproxier import MetaProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import Endpoint
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.options import iptables_config
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import compile as nc
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import nftables_config
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.provider import ProxierBase, SyncResult
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port

NODE_ADDRS = {4: ["192.168.50.1"], 6: ["fd00:50::1"]}


# --- the node's families ----------------------------------------------------------------


@pytest.mark.parametrize("cidrs, npa, addrs, mode, want", [
    (("10.244.0.0/16", "fd00:10:244::/48"), (), NODE_ADDRS, "iptables", (4, 6)),
    (("fd00:10:244::/48", "10.244.0.0/16"), (), NODE_ADDRS, "nftables", (6, 4)),  # primary first
    (("10.244.0.0/16",), (), NODE_ADDRS, "iptables", (4,)),  # the config says: IPv4 only
    (("fd00:10:244::/48",), (), NODE_ADDRS, "iptables", (6,)),  # IPv6-only node
    ((), ("fd00:50::/64",), NODE_ADDRS, "iptables", (6,)),  # from nodePortAddresses
    ((), (), NODE_ADDRS, "nftables", (4, 6)),  # from the node's addresses, IPv4 first
    ((), (), {4: [], 6: ["fd00:50::1"]}, "iptables", (6,)),
    ((), (), {4: [], 6: []}, "iptables", (4,)),  # nothing known: IPv4
    (("10.244.0.0/16", "fd00:10:244::/48"), (), NODE_ADDRS, "ipvs", (4,)),  # IPVS: IPv4 only so far
    (("fd00:10:244::/48",), (), NODE_ADDRS, "ipvs", (4,)),
])
def test_served_families(cidrs, npa, addrs, mode, want):
    cfg = ProxyConfig(cluster_cidrs=cidrs, node_port_addresses=npa, mode=mode)
    assert app.served_families(cfg, addresses=addrs) == want


# --- the intake splits each object by family --------------------------------------------


def dual_daemon():
    states = {4: ProxyState("node1"), 6: ProxyState("node1")}
    logs = []
    daemon = Daemon(None, states[4], 0.0, 60.0, logs.append, family=4, states=states)
    return daemon, states, logs


DS = service("shop", "ds", "fd00::11", [port("http", 80, node_port=30080)], type="NodePort",
             clusterIPs=["fd00::11", "10.96.0.11"], ipFamilies=["IPv6", "IPv4"], ipFamilyPolicy="RequireDualStack",
             externalIPs=["203.0.113.5", "2001:db8::5"])
V6 = service("shop", "v6", "fd00::10", [port("http", 80)], ipFamilies=["IPv6"])
V4 = service("shop", "v4", "10.96.0.10", [port("http", 80)])
SLICE4 = endpoint_slice("shop", "ds", [endpoint("10.244.0.1")], [slice_port("http", 8080)])
SLICE6 = endpoint_slice("shop", "ds", [endpoint("fd00:10:244::1")], [slice_port("http", 8080)],
                        address_type="IPv6", name="ds-v6")


def test_each_family_gets_its_half_of_a_dual_stack_service_and_its_own_slices():
    daemon, states, logs = dual_daemon()
    daemon.on_relist("Service", [DS, V6, V4])
    daemon.on_relist("EndpointSlice", [SLICE4, SLICE6])
    daemon._drain()
    assert set(states[4].services) == {"shop/ds", "shop/v4"}
    assert set(states[6].services) == {"shop/ds", "shop/v6"}
    assert states[4].services["shop/ds"].ports[0].cluster_ip == "10.96.0.11"
    assert states[6].services["shop/ds"].ports[0].cluster_ip == "fd00::11"
    assert states[4].services["shop/ds"].ports[0].external_ips == ("203.0.113.5",)
    assert states[6].services["shop/ds"].ports[0].external_ips == ("2001:db8::5",)
    assert states[6].services["shop/ds"].ports[0].node_port == 30080  # the NodePort serves both families
    eps4 = states[4].endpoints_for("shop/ds")
    eps6 = states[6].endpoints_for("shop/ds")
    assert [e.ip for es in eps4.values() for e in es] == ["10.244.0.1"]
    assert [e.ip for es in eps6.values() for e in es] == ["fd00:10:244::1"]
    assert not daemon.rejected and not logs


def test_an_event_moves_a_service_between_families_and_a_delete_reaches_both():
    daemon, states, _logs = dual_daemon()
    daemon.on_event("Service", "ADDED", DS)
    daemon._drain()
    assert "shop/ds" in states[4].services and "shop/ds" in states[6].services
    v6only = service("shop", "ds", "fd00::11", [port("http", 80)], ipFamilies=["IPv6"])
    daemon.on_event("Service", "MODIFIED", v6only)
    daemon._drain()
    assert "shop/ds" not in states[4].services and "shop/ds" in states[6].services
    daemon.on_event("Service", "DELETED", v6only)
    daemon._drain()
    assert not states[4].services and not states[6].services


def test_an_invalid_object_is_rejected_once_and_keeps_both_halves():
    daemon, states, logs = dual_daemon()
    daemon.on_event("Service", "ADDED", DS)
    daemon._drain()
    bad = service("shop", "ds", "fd00::11", [port("http", 0)], clusterIPs=["fd00::11", "10.96.0.11"],
                  ipFamilies=["IPv6", "IPv4"], ipFamilyPolicy="RequireDualStack")
    daemon.on_relist("Service", [bad])
    daemon._drain()
    assert "shop/ds" in states[4].services and "shop/ds" in states[6].services
    assert len([m for m in logs if "spec.ports[0].port" in m]) == 1, logs


def test_the_node_reaches_both_states():
    daemon, states, _logs = dual_daemon()
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"},
            "spec": {"podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"]}}
    daemon.on_event("Node", "ADDED", node)
    daemon._drain()
    assert states[4].node is not None and states[4].node is states[6].node


# --- the meta-proxier -------------------------------------------------------------------


class FakeProxier(ProxierBase):
    """A family's proxier: counts its syncs, fails when told to."""

    name = "fake"

    def __init__(self, state, fail=None, rules=1):
        super().__init__(state, cfg=None)
        self.fail = fail
        self.rules = rules
        self.syncs = []

    def sync(self, force_full=False):
        full = self._begin(force_full)
        changed = self.state.take_changes()
        self.syncs.append(full)
        if self.fail is not None:
            self._requeue(changed)
            raise self.fail
        return self._done(SyncResult(full=full, services=len(self.state.services), endpoints=0,
                                     rules=self.rules, rules_written=self.rules, changes=[f"r{self.rules}"]), changed)

    def check(self):
        return self.rules == 6

    def cleanup(self):
        return self.rules

    def rule_counts(self):
        return {"nat": self.rules}


def test_meta_proxier_merges_the_families_results():
    p4, p6 = FakeProxier(ProxyState("n"), rules=4), FakeProxier(ProxyState("n"), rules=6)
    meta = MetaProxier({4: p4, 6: p6})
    result = meta.sync(force_full=True)
    assert (result.full, result.rules, result.changes) == (True, 10, ["r4", "r6"])
    assert meta.rule_counts() == {"nat": 10} and meta.cleanup() == 10
    assert meta.check() is True  # one family needs a repair
    assert not meta.need_full and meta.state is p4.state and meta.states == {4: p4.state, 6: p6.state}


def test_one_family_failing_does_not_stop_the_other():
    p4, p6 = FakeProxier(ProxyState("n")), FakeProxier(ProxyState("n"))
    meta = MetaProxier({4: p4, 6: p6})
    meta.sync()
    p4.fail = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        meta.sync()
    assert p6.syncs == [True, False]  # the IPv6 proxier synced (partially) all the same
    assert p4.need_full and not p6.need_full and meta.need_full


def test_a_family_that_failed_leaves_the_others_result_for_the_daemons_hooks():
    # The daemon opens health check node ports and removes stale flows of what did sync
    # (partly_synced); healthz and the sync metrics wait for a whole sync.
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon

    p4, p6 = FakeProxier(ProxyState("n"), rules=4), FakeProxier(ProxyState("n"), rules=6)
    meta = MetaProxier({4: p4, 6: p6})
    p6.fail = RuntimeError("no ip6 nat")
    with pytest.raises(RuntimeError) as caught:
        meta.sync(force_full=True)
    assert caught.value.partial_result.rules == 4 and caught.value.partial_result.full

    class Hooks:
        def __init__(self):
            self.calls = []

        def partly_synced(self, result):
            self.calls.append(("partly", result.rules))

        def synced(self, result, latencies):
            self.calls.append(("synced", result.rules))

    daemon = Daemon.__new__(Daemon)  # only _sync's failure path is exercised
    daemon.proxier, daemon.hooks, daemon._started = meta, Hooks(), 0.0
    daemon._drain = lambda: ([], False)
    with pytest.raises(RuntimeError, match="no ip6 nat"):
        daemon._sync(True)
    assert daemon.hooks.calls == [("partly", 4)]


def test_retry_soon_only_when_every_family_failure_was_a_held_lock():
    lock = LockBusy("the xtables lock was held")
    p4, p6 = FakeProxier(ProxyState("n"), fail=lock), FakeProxier(ProxyState("n"), fail=RuntimeError("nft failed"))
    with pytest.raises(LockBusy) as info:
        MetaProxier({4: p4, 6: p6}).sync()
    assert not getattr(info.value, "retry_soon", False)
    lock2 = LockBusy("the xtables lock was held")
    p6.fail = lock2
    p4.fail = LockBusy("again")
    with pytest.raises(LockBusy) as info:
        MetaProxier({4: p4, 6: p6}).sync()
    assert getattr(info.value, "retry_soon", False)


# --- the IPv6 pieces --------------------------------------------------------------------


@pytest.mark.parametrize("binary, six", [
    ("iptables", "ip6tables"), ("iptables-nft", "ip6tables-nft"), ("iptables-legacy", "ip6tables-legacy"),
    ("/usr/sbin/iptables-nft", "/usr/sbin/ip6tables-nft"),
])
def test_the_ipv6_tools(binary, six):
    k6 = IptablesKernel(netns="x", binary=binary).for_family(6)
    assert (k6.binary, k6.family, k6.prefix) == (six, 6, ["ip", "netns", "exec", "x"])
    assert k6.for_family(4).binary == binary


def test_ipv6_options_keep_their_family_and_have_no_localhost_nodeports():
    cfg = ProxyConfig(cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/48"), node_port_addresses=())
    addrs = ["127.0.0.1", "192.168.50.1", "::1", "fd00:50::1"]
    v4 = iptables_config(cfg, addresses=addrs, family=4)
    v6 = iptables_config(cfg, addresses=addrs, family=6)
    assert (v4.family, v4.local_cidrs, v4.node_ips, v4.localhost_nodeports) == (
        4, ("10.244.0.0/16",), ("127.0.0.1", "192.168.50.1"), True)
    assert (v6.family, v6.local_cidrs, v6.node_ips, v6.localhost_nodeports) == (
        6, ("fd00:10:244::/48",), ("::1", "fd00:50::1"), False)
    # Upstream's IPv6 NodePort dispatch: never to ::1.
    assert ipt.nodeports_tail(v6)[0].startswith("! -d ::1/128 ")
    assert ipt.nodeports_tail(v4)[0].startswith("-m comment")  # localhost NodePorts on IPv4
    assert "127.0.0.0/8" not in "\n".join(r for rules in ipt.infrastructure(v6).values() for r in rules)
    assert nftables_config(cfg, v6, "").family == "ip6" and nftables_config(cfg, v4, "").family == "ip"


def test_ipv6_endpoint_chain_names_as_upstream():
    ep = Endpoint("fd00:10:244::1", 8080)
    name = nc.endpoint_base("ns1", "svc1", "p80", "tcp", ep)
    assert name.endswith("-ns1/svc1/tcp/p80__fd00.10.244..1/8080") and ":" not in name
    assert nc.endpoint_base("ns1", "svc1", "p80", "tcp", Endpoint("10.180.0.1", 80)).endswith("__10.180.0.1/80")
    long = nc.endpoint_base("a" * 63, "b" * 63, "c" * 63, "sctp",
                            Endpoint("fd00:1111:2222:3333:4444:5555:6666:7777", 65535))
    assert len(long) == 240 and long.endswith("...")
