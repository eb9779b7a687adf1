"""k8s_service_iptables argument handling (the kernel side is tested through ansible-playbook
in tests/integration/test_module_playbook.py)."""
import json

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.kubenode.proxy.plugins.module_utils import k8s_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.modules import k8s_service_iptables as mod


def run_module(capsys, args):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


FLAT = dict(name="web", namespace="shop", cluster_ip="10.96.0.10", type="NodePort",
            ports=[dict(name="http", port=80, protocol="TCP", target_port=8080, node_port=30080)],
            endpoints=[dict(address="10.244.1.5", node_name="n1", ready=True, serving=None, terminating=False)],
            external_ips=["203.0.113.9"], load_balancer_ips=[], load_balancer_source_ranges=[],
            external_traffic_policy="Local", internal_traffic_policy="Cluster", health_check_node_port=None,
            session_affinity="ClientIP", session_affinity_timeout=60)


def test_flat_options_become_api_objects():
    svc, slices = k8s_service.flat_objects(FLAT)
    parsed = parse_service(svc)
    sp = parsed.ports[0]
    assert (sp.cluster_ip, sp.port, sp.node_port, sp.external_ips) == ("10.96.0.10", 80, 30080, ("203.0.113.9",))
    assert sp.session_affinity_seconds == 60 and sp.external_policy_local
    sl = parse_endpoint_slice(slices[0])
    assert sl.service == "web" and sl.ports[0].port == 8080 and sl.endpoints[0].node_name == "n1"


def test_service_and_flat_options_are_mutually_exclusive(capsys):
    out = run_module(capsys, {"service": {"metadata": {"name": "x"}}, "name": "x"})
    assert out["failed"] and "mutually exclusive" in out["msg"]


def test_one_of_service_or_name_is_required(capsys):
    out = run_module(capsys, {"state": "present"})
    assert out["failed"] and "one of the following is required" in out["msg"]


def test_invalid_object_names_object_and_field(capsys):
    svc = {"kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
           "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 99999}]}}
    out = run_module(capsys, {"service": svc})
    assert out["failed"] and out["field"] == "spec.ports[0].port" and out["object"] == "shop/web"
    assert out["msg"].startswith("Service shop/web: spec.ports[0].port:")


@pytest.mark.parametrize("args,field,message", [
    (dict(FLAT, name="Web_Service"), "name", "k8s_service_iptables: name: must be a lowercase RFC 1035 label"),
    (dict(FLAT, name="w" * 64), "name", "no more than 63 characters"),
    (dict(FLAT, namespace="Shop"), "namespace", "RFC 1123 label"),
    (dict(FLAT, node_name="node_1"), "node_name", "RFC 1123 subdomain"),
    (dict(FLAT, cluster_cidr="10.244.0.0/16\n-A INPUT -j ACCEPT"), "cluster_cidr", "valid CIDR"),
    (dict(FLAT, masquerade_bit=40), "masquerade_bit", "between 0 and 31"),
    (dict(FLAT, ports=[dict(name="Http_Port", port=80)]), "spec.ports[0].name", "RFC 1123 label"),
    (dict(FLAT, ports=[dict(name="http", port=0)]), "spec.ports[0].port", "between 1 and 65535"),
    (dict(FLAT, cluster_ip="010.96.0.10"), "spec.clusterIP", "leading 0s"),
    (dict(FLAT, endpoints=[dict(address="169.254.169.254")]), "endpoints[0].addresses[0]", "link-local"),
    (dict(FLAT, endpoints=[dict(address="127.0.0.1")]), "endpoints[0].addresses[0]", "loopback"),
])
def test_hostile_options_fail_with_the_field(capsys, args, field, message):
    out = run_module(capsys, args)
    assert out["failed"] and out["field"] == field and message in out["msg"], out


def test_ipv6_service_is_refused_by_the_ipv4_module(capsys):
    out = run_module(capsys, dict(FLAT, cluster_ip="fd00::10", external_ips=[], endpoints=[dict(address="fd00::1")]))
    assert out["failed"] and "not proxied" in out["msg"] and "serves IPv4" in out["msg"]


def test_present_needs_a_cluster_ip_in_flat_form(capsys):
    out = run_module(capsys, {"name": "web"})
    assert out["failed"] and "cluster_ip is required" in out["msg"]


def test_slices_of_another_service_are_refused(capsys):
    svc = {"kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
           "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}}
    sl = {"kind": "EndpointSlice", "metadata": {"name": "db-1", "namespace": "shop",
                                                "labels": {"kubernetes.io/service-name": "db"}},
          "addressType": "IPv4", "endpoints": [], "ports": []}
    out = run_module(capsys, {"service": svc, "endpoint_slices": [sl]})
    assert out["failed"] and "belongs to service db" in out["msg"]


SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
           "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]}}


@pytest.fixture
def reached(monkeypatch):
    """Stands in for the kernel side: records that argument handling let the task through
    (on main, options given next to service= were dropped silently and the run went on)."""
    calls = []

    class Stub:
        def __init__(self, module):
            self.module = module

        def run(self):
            calls.append(self.module.params)
            self.module.exit_json(changed=False, reached=True)

    monkeypatch.setattr(mod, "ServiceIptables", Stub)
    return calls


# Every option that describes the Service: given with service= it would be ignored, so it fails.
@pytest.mark.parametrize("option,value", [
    ("namespace", "other"), ("cluster_ip", "10.96.0.11"), ("type", "NodePort"),
    ("ports", [{"port": 8080}]), ("endpoints", [{"address": "10.244.1.5"}]),
    ("external_ips", ["203.0.113.9"]), ("load_balancer_ips", ["198.51.100.1"]),
    ("load_balancer_source_ranges", ["192.0.2.0/24"]), ("external_traffic_policy", "Local"),
    ("internal_traffic_policy", "Local"), ("health_check_node_port", 30999),
    ("session_affinity", "ClientIP"), ("session_affinity_timeout", 60),
    # explicit values equal to the defaults are refused too: they are still ignored with service=
    ("type", "ClusterIP"), ("ports", []),
])
def test_service_with_an_option_describing_the_service_fails_naming_both(capsys, reached, option, value):
    out = run_module(capsys, {"service": SERVICE, option: value})
    assert out.get("failed") and "mutually exclusive: service|%s" % option in out["msg"], out
    assert not reached


def test_service_with_node_side_options_is_accepted(capsys, reached):
    out = run_module(capsys, {"service": SERVICE, "endpoint_slices": [], "node_name": "node1",
                              "cluster_cidr": "10.244.0.0/16", "masquerade_all": True, "masquerade_bit": 14,
                              "localhost_nodeports": False, "iptables_binary": "iptables-nft", "state": "absent"})
    assert out.get("reached") and not out.get("failed"), out
    assert reached[0]["service"] == SERVICE


def test_service_option_documents_exactly_the_refused_options():
    import re

    import yaml

    from ansible_collections.kubenode.proxy.plugins.doc_fragments.k8s_service import ModuleDocFragment
    from ansible_collections.kubenode.proxy.plugins.module_utils.k8s_service import FLAT_OPTIONS

    doc = yaml.safe_load(ModuleDocFragment.DOCUMENTATION)
    refused = set(re.findall(r"O\((\w+)\)", doc["options"]["service"]["description"][1]))
    assert refused == set(FLAT_OPTIONS) | {"name"}
    assert "kubenode.proxy.k8s_service" in yaml.safe_load(mod.DOCUMENTATION)["extends_documentation_fragment"]


@pytest.fixture
def module_config(monkeypatch):
    """The IptablesConfig the module builds (its run() stops there)."""
    seen = []

    def run(self):
        seen.append(self._config())
        self.module.exit_json(changed=False)

    monkeypatch.setattr(mod.ServiceIptables, "run", run)
    monkeypatch.setattr(k8s_service, "local_addresses", lambda: ["127.0.0.1", "192.168.50.1", "10.0.0.5"])
    return seen


def test_module_translates_options_as_the_daemon_does(capsys, module_config):
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.options import (
        iptables_config,
    )

    run_module(capsys, dict(FLAT, cluster_cidr="10.244.0.0/16", masquerade_bit=12,
                            node_port_addresses=["192.168.50.0/24"]))
    daemon = iptables_config(kpconfig.ProxyConfig(cluster_cidrs=("10.244.0.0/16",), masquerade_bit=12,
                                                  node_port_addresses=("192.168.50.0/24",)),
                             addresses=["127.0.0.1", "192.168.50.1", "10.0.0.5"])
    assert module_config[0] == daemon
    # nodePortAddresses is honoured (it was ignored: NodePorts answered on every address).
    assert not daemon.node_port_match_all and daemon.node_port_ips == ("192.168.50.1",)


def test_module_refuses_a_bad_node_port_address(capsys, module_config):
    out = run_module(capsys, dict(FLAT, node_port_addresses=["not-a-cidr"]))
    assert out["failed"] and "node_port_addresses[0]" in out["msg"]
    assert not module_config
