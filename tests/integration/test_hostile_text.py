"""Hostile field values against the real kernel tools in a node namespace: a name that
would end the iptables-restore line, a name with quotes, an ipset_entry ``range`` that
would start a second ``ipset restore`` command. Objects are built directly (model.py's
validation bypassed): the kernel text writers are the second line of defence."""
from __future__ import annotations

from collections import Counter

import pytest
from playbook import python_in, run_tasks
from proxyctl import NODE_NAME, eps, save, svc, tcp

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import IptablesKernel
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Endpoint,
    EndpointSlice,
    Service,
    ServicePort,
    ServicePortName,
    SliceEndpoint,
    SlicePort,
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import IptablesProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
GOOD, BAD, QUOTED = "10.244.1.1", "10.244.1.2", "10.244.1.3"
INJECTION = '"\n-A KUBE-SERVICES -j ACCEPT\n#'


def hostile_service(namespace: str, name: str, port_name: str, cluster_ip: str, backend: str):
    """A Service and its EndpointSlice as model objects, as if some source had not validated them."""
    spn = ServicePortName(namespace, name, port_name, "TCP")
    service = Service(namespace, name, (ServicePort(spn, cluster_ip, 80, "TCP"),))
    endpoint_slice = EndpointSlice(namespace, name + "-1", name, "IPv4", (SlicePort(port_name, 8080, "TCP"),),
                                   (SliceEndpoint((backend,), NODE_NAME, True, True, False),))
    return service, endpoint_slice


@pytest.fixture
def proxy(lab):
    for name, ip in (("good", GOOD), ("bad", BAD), ("quoted", QUOTED)):
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    state = ProxyState(NODE_NAME)
    cfg = IptablesConfig(local_cidrs=("10.244.0.0/16",), node_ips=(lab.node_ip,))
    return lab, state, IptablesProxier(state, cfg, IptablesKernel(netns=lab.ns("node")))


def answered(lab, ip, count=10):
    replies = lab.request_many("client", ip, 80, count=count)
    return Counter(r.backend if r.ok else r.outcome for r in replies)


def test_a_name_that_ends_the_restore_line_injects_nothing_and_the_others_are_served(proxy):
    lab, state, proxier = proxy
    state.set_service(parse_service(svc("web", "10.96.0.1", HTTP)))
    state.set_slice(parse_endpoint_slice(eps("web", [GOOD], HTTP_EP)))
    bad_svc, bad_slice = hostile_service(f"evil{INJECTION}", "x", "http", "10.96.0.9", BAD)
    state.set_service(bad_svc)
    state.set_slice(bad_slice)

    result = proxier.sync(force_full=True)  # main: the injected rule lands (or the sync fails)
    nat = save(lab.ns("node"), "nat")
    assert "-A KUBE-SERVICES -j ACCEPT" not in nat and "evil" not in nat and "10.96.0.9" not in nat
    assert not any(line.startswith("-A KUBE-SERVICES -j ") for line in nat.splitlines())
    (key,) = result.rejected
    assert "metadata.namespace" in result.rejected[key] and "\n" not in result.rejected[key]
    assert answered(lab, "10.96.0.1") == Counter({"good": 10})

    # A partial sync with a second bad object (a port name this time) is isolated the same way;
    # a name with quotes is only text: escaped as iptables-save writes it, and served.
    bad2, bad2_slice = hostile_service("default", "y", f"http{INJECTION}", "10.96.0.8", BAD)
    quoted, quoted_slice = hostile_service("default", "q", "it's \"quoted\" \\", "10.96.0.7", QUOTED)
    for obj in (bad2, quoted):
        state.set_service(obj)
    for obj in (bad2_slice, quoted_slice):
        state.set_slice(obj)
    result = proxier.sync()
    assert not result.full
    assert "spec.ports[0].name" in result.rejected["default/y"]
    nat = save(lab.ns("node"), "nat")
    assert "10.96.0.8" not in nat and not any(line.startswith("-A KUBE-SERVICES -j ") for line in nat.splitlines())
    assert '--comment "default/q:it\\\'s \\"quoted\\" \\\\ cluster IP"' in nat
    assert answered(lab, "10.96.0.7") == Counter({"quoted": 10})
    assert answered(lab, "10.96.0.1") == Counter({"good": 10})
    # What we wrote is what iptables-save shows: a full sync finds nothing to change.
    assert proxier.sync(force_full=True).rules_written == 0


def test_endpoint_and_address_fields_that_are_not_addresses_are_refused(proxy):
    lab, state, proxier = proxy
    state.set_service(parse_service(svc("web", "10.96.0.1", HTTP)))
    state.set_slice(parse_endpoint_slice(eps("web", [GOOD], HTTP_EP)))
    bad_svc, bad_slice = hostile_service("default", "z", "http", "10.96.0.6 -j ACCEPT", BAD)
    state.set_service(bad_svc)
    state.set_slice(bad_slice)
    spn = ServicePortName("default", "w", "http", "TCP")
    state.set_service(Service("default", "w", (ServicePort(spn, "10.96.0.5", 80, "TCP"),)))
    # An endpoint address with a line break: state.endpoints_for hands it over as it is.
    state.set_slice(EndpointSlice("default", "w-1", "w", "IPv4", (SlicePort("http", 8080, "TCP"),),
                                  (SliceEndpoint((f"{BAD}\n-A KUBE-SERVICES -j ACCEPT",), NODE_NAME, True, True,
                                                 False),)))
    result = proxier.sync(force_full=True)
    assert "spec.clusterIP" in result.rejected["default/z"]
    assert "endpoints[0].addresses[0]" in result.rejected["default/w"]
    nat = save(lab.ns("node"), "nat")
    assert "10.96.0.6" not in nat and "10.96.0.5" not in nat
    assert not any(line.startswith("-A KUBE-SERVICES -j ") for line in nat.splitlines())
    assert answered(lab, "10.96.0.1") == Counter({"good": 10})
    assert Endpoint(GOOD, 8080)  # the model type itself accepts anything: the writer is what refuses


@pytest.fixture
def node(lab, tmp_path):
    lab.wrapper = python_in(lab, "node", tmp_path)
    lab.tmp = tmp_path
    return lab


def test_ipset_entry_range_with_a_newline_creates_no_second_set(node):
    task = {"kubenode.proxy.ipset_entry": {"name": "KN-PORTS", "type": "bitmap:port",
                                           "range": "0-65535\ncreate evil hash:ip"},
            "ignore_errors": True}
    comment = {"kubenode.proxy.ipset_entry": {"name": "KN-C", "type": "hash:ip", "entries": ["10.0.0.1"],
                                              "comment": "ok\"\ncreate evil2 hash:ip\n#"},
               "ignore_errors": True}
    r1, r2 = run_tasks(node.wrapper, node.tmp, [task, comment])
    assert r1["failed"] and r1["msg"].startswith("range:") and r1["option"] == "range"
    assert r2["failed"] and r2["msg"].startswith("comment:") and r2["option"] == "comment"
    names = node.exec("node", ["ipset", "list", "-n"]).stdout.split()
    assert not {"evil", "evil2", "KN-PORTS", "KN-C"} & set(names), names
