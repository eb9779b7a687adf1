"""The iptables compiler against upstream's golden ruleset and hand-checked cases."""
import os

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.plan import render
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import assemble
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
UPSTREAM_CFG = ipt.IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.0.0.0/8",), node_ips=("192.168.0.2",))


def build(services, slices, hostname="test-hostname"):
    state = ProxyState(hostname)
    for s in services:
        state.set_service(parse_service(s))
    for s in slices:
        state.set_slice(parse_endpoint_slice(s))
    return state


def compile_all(state, cfg=UPSTREAM_CFG):
    compiled = {k: ipt.compile_service(state.ports_of(k), state.endpoints_for(k), cfg) for k in state.service_keys()}
    return assemble(compiled, cfg)


def upstream_overall_state():
    """The six services of upstream's TestOverallIPTablesRules."""
    services = [
        service("ns1", "svc1", "172.30.0.41", [port()]),
        service("ns2", "svc2", "172.30.0.42", [port(node_port=3001)], type="LoadBalancer",
                externalTrafficPolicy="Local", externalIPs=["192.168.99.22"], healthCheckNodePort=30000,
                status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}),
        service("ns3", "svc3", "172.30.0.43", [port(node_port=3003)], type="NodePort"),
        service("ns4", "svc4", "172.30.0.44", [port()], type="NodePort", externalIPs=["192.168.99.33"]),
        service("ns5", "svc5", "172.30.0.45", [port(node_port=3002)], type="LoadBalancer",
                externalTrafficPolicy="Cluster", healthCheckNodePort=30000,
                loadBalancerSourceRanges=[" 203.0.113.0/25"], sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 10800}},
                status={"loadBalancer": {"ingress": [{"ip": "5.6.7.8"}]}}),
        service("ns6", "svc6", "172.30.0.46", [port()]),
    ]
    slices = [
        endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port()]),
        endpoint_slice("ns2", "svc2", [endpoint("10.180.0.2")], [slice_port()]),
        endpoint_slice("ns3", "svc3", [endpoint("10.180.0.3")], [slice_port()]),
        endpoint_slice("ns4", "svc4", [endpoint("10.180.0.4"), endpoint("10.180.0.5", node="test-hostname")],
                       [slice_port()]),
        endpoint_slice("ns5", "svc5", [endpoint("10.180.0.3")], [slice_port()]),
    ]
    return build(services, slices)


def test_matches_upstream_overall_golden_ruleset():
    with open(os.path.join(FIXTURES, "upstream_overall_rules.save")) as fh:
        expected = fh.read()
    assert render(compile_all(upstream_overall_state())) == expected


@pytest.mark.parametrize("spn,proto,chain", [
    # Chain names from upstream's golden rulesets.
    ("ns1/svc1:p80", "tcp", "KUBE-SVC-XPGD46QRK7WJZT7O"),
    ("ns2/svc2:p80", "tcp", "KUBE-SVC-GNZBNJ2PO5MGZ6GT"),
    ("ns5/svc5:p80", "tcp", "KUBE-SVC-NUKIZ6OKUXPJNT4C"),
])
def test_service_chain_hash_matches_upstream(spn, proto, chain):
    assert ipt.svc_chain(spn, proto) == chain


def test_endpoint_chain_hash_matches_upstream():
    assert ipt.sep_chain("ns1/svc1:p80", "tcp", "10.180.0.1:80") == "KUBE-SEP-SXIVWICOYRO3J4NJ"
    assert ipt.ext_chain("ns2/svc2:p80", "tcp") == "KUBE-EXT-GNZBNJ2PO5MGZ6GT"
    assert ipt.fw_chain("ns5/svc5:p80", "TCP") == "KUBE-FW-NUKIZ6OKUXPJNT4C"


@pytest.mark.parametrize("n,expected", [(2, "0.50000000000"), (3, "0.33333333349"), (4, "0.25000000000"),
                                        (7, "0.14285714272")])
def test_probability_is_kernel_rounded(n, expected):
    assert ipt.probability(n) == expected


def test_statistic_probabilities_cover_every_endpoint():
    state = build([service("ns", "s", "10.96.0.5", [port()])],
                  [endpoint_slice("ns", "s", [endpoint(f"10.244.0.{i}") for i in range(1, 5)], [slice_port()])])
    rules = compile_all(state)[("nat", ipt.svc_chain("ns/s:p80", "tcp"))]
    probs = [r.split("--probability ")[1].split()[0] for r in rules if "--probability" in r]
    assert probs == ["0.25000000000", "0.33333333349", "0.50000000000"]
    assert "--probability" not in rules[-1] and rules[-1].endswith(ipt.sep_chain("ns/s:p80", "tcp", "10.244.0.4:80"))


def test_internal_traffic_policy_local_without_local_endpoints_drops():
    state = build([service("ns", "s", "10.96.0.5", [port()], internalTrafficPolicy="Local")],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1", node="other")], [slice_port()])])
    desired = compile_all(state)
    assert desired[("filter", "KUBE-SERVICES")] == [
        '-d 10.96.0.5/32 -p tcp -m comment --comment "ns/s:p80 has no local endpoints" -m tcp --dport 80 -j DROP']
    assert not any(k[1].startswith("KUBE-SEP-") for k in desired)


def test_internal_traffic_policy_local_uses_svl_chain_with_local_endpoints_only():
    state = build([service("ns", "s", "10.96.0.5", [port()], internalTrafficPolicy="Local")],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1", node="other"),
                                              endpoint("10.244.0.2", node="test-hostname")], [slice_port()])])
    desired = compile_all(state)
    svl = ipt.svl_chain("ns/s:p80", "tcp")
    assert f"-j {svl}" in desired[("nat", "KUBE-SERVICES")][0]
    assert desired[("nat", svl)][-1].endswith(ipt.sep_chain("ns/s:p80", "tcp", "10.244.0.2:80"))
    assert len([k for k in desired if k[1].startswith("KUBE-SEP-")]) == 1


def test_terminating_endpoints_are_a_fallback_only():
    eps = [endpoint("10.244.0.1", ready=False, serving=True, terminating=True)]
    state = build([service("ns", "s", "10.96.0.5", [port()])], [endpoint_slice("ns", "s", eps, [slice_port()])])
    assert ipt.sep_chain("ns/s:p80", "tcp", "10.244.0.1:80") in {k[1] for k in compile_all(state)}
    eps.append(endpoint("10.244.0.2"))
    state = build([service("ns", "s", "10.96.0.5", [port()])], [endpoint_slice("ns", "s", eps, [slice_port()])])
    seps = {k[1] for k in compile_all(state) if k[1].startswith("KUBE-SEP-")}
    assert seps == {ipt.sep_chain("ns/s:p80", "tcp", "10.244.0.2:80")}


def test_not_ready_not_serving_endpoints_are_ignored():
    eps = [endpoint("10.244.0.1", ready=False, serving=False, terminating=True)]
    state = build([service("ns", "s", "10.96.0.5", [port()])], [endpoint_slice("ns", "s", eps, [slice_port()])])
    assert "has no endpoints" in compile_all(state)[("filter", "KUBE-SERVICES")][0]


def test_udp_and_sctp_rules_use_their_protocol():
    state = build([service("ns", "s", "10.96.0.5", [port("dns", 53, "UDP"), port("sc", 9, "SCTP")])],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1")],
                                  [slice_port("dns", 5353, "UDP"), slice_port("sc", 9, "SCTP")])])
    svc_rules = compile_all(state)[("nat", "KUBE-SERVICES")]
    assert any("-p udp" in r and "-m udp --dport 53" in r for r in svc_rules)
    assert any("-p sctp" in r and "-m sctp --dport 9" in r for r in svc_rules)
    sep = compile_all(state)[("nat", ipt.sep_chain("ns/s:dns", "udp", "10.244.0.1:5353"))]
    assert sep[1] == '-p udp -m comment --comment "ns/s:dns" -m udp -j DNAT --to-destination 10.244.0.1:5353'


def test_masquerade_all_marks_every_cluster_ip_packet():
    cfg = ipt.IptablesConfig(masquerade_all=True, local_cidrs=("10.244.0.0/16",))
    state = build([service("ns", "s", "10.96.0.5", [port()])],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1")], [slice_port()])])
    first = compile_all(state, cfg)[("nat", ipt.svc_chain("ns/s:p80", "tcp"))][0]
    assert first == ('-d 10.96.0.5/32 -p tcp -m comment --comment "ns/s:p80 cluster IP" -m tcp --dport 80 '
                     '-j KUBE-MARK-MASQ')


def test_no_local_detection_means_no_cluster_ip_masquerade_rule():
    cfg = ipt.IptablesConfig(local_cidrs=())
    state = build([service("ns", "s", "10.96.0.5", [port()])],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1")], [slice_port()])])
    rules = compile_all(state, cfg)[("nat", ipt.svc_chain("ns/s:p80", "tcp"))]
    assert not any("KUBE-MARK-MASQ" in r for r in rules)


def test_interface_prefix_local_detection():
    cfg = ipt.IptablesConfig(local_mode="InterfaceNamePrefix", local_interface="cali")
    state = build([service("ns", "s", "10.96.0.5", [port()])],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1")], [slice_port()])])
    first = compile_all(state, cfg)[("nat", ipt.svc_chain("ns/s:p80", "tcp"))][0]
    assert first.startswith("-d 10.96.0.5/32 ! -i cali+ -p tcp")


def test_large_cluster_drops_endpoint_comments():
    cfg = ipt.IptablesConfig(local_cidrs=("10.0.0.0/8",), large_cluster=True)
    state = build([service("ns", "s", "10.96.0.5", [port()])],
                  [endpoint_slice("ns", "s", [endpoint("10.244.0.1")], [slice_port()])])
    desired = compile_all(state, cfg)
    sep = desired[("nat", ipt.sep_chain("ns/s:p80", "tcp", "10.244.0.1:80"))]
    assert sep == ["-s 10.244.0.1/32 -j KUBE-MARK-MASQ", "-p tcp -m tcp -j DNAT --to-destination 10.244.0.1:80"]


def test_nodeport_addresses_and_localhost_nodeports():
    cfg = ipt.IptablesConfig(node_port_match_all=False, node_port_ips=("127.0.0.1", "192.168.50.1"),
                             localhost_nodeports=False)
    assert ipt.nodeports_tail(cfg) == [
        f'-d 192.168.50.1/32 -m comment --comment "{ipt.NODEPORTS_TAIL_COMMENT}" -j KUBE-NODEPORTS']
    cfg = ipt.IptablesConfig(localhost_nodeports=False)
    assert ipt.nodeports_tail(cfg)[0].startswith("! -d 127.0.0.0/8 ")
    assert ipt.infrastructure(cfg)[("filter", "KUBE-FIREWALL")] == []


def test_headless_externalname_and_other_proxy_services_are_skipped():
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import Skipped
    for obj in (service("ns", "h", "None", [port()]),
                service("ns", "e", "", [port()], type="ExternalName", externalName="example.org"),
                service("ns", "o", "10.96.0.9", [port()], labels={"service.kubernetes.io/service-proxy-name": "x"})):
        with pytest.raises(Skipped):
            parse_service(obj)


CLUSTER_IP_ONLY_CFGS = [
    UPSTREAM_CFG,
    ipt.IptablesConfig(local_cidrs=("10.0.0.0/8",), large_cluster=True),
    ipt.IptablesConfig(masquerade_all=True, local_cidrs=("10.0.0.0/8",)),
    ipt.IptablesConfig(local_mode="InterfaceNamePrefix", local_interface="cali"),
    ipt.IptablesConfig(local_mode="BridgeInterface", local_interface="cbr0"),
    ipt.IptablesConfig(local_mode="", local_cidrs=()),
]
CLUSTER_IP_ONLY_ENDPOINTS = [
    [],
    [endpoint("10.180.0.1")],
    [endpoint("10.180.0.1"), endpoint("10.180.0.2", node="test-hostname"), endpoint("10.180.0.3", ready=False)],
    # Only terminating endpoints: the serving ones are used (upstream's fallback), the rest not.
    [endpoint("10.180.0.4", ready=False, serving=True, terminating=True),
     endpoint("10.180.0.5", ready=False, serving=False, terminating=True)],
    [endpoint("10.180.0.9", ready=False)],
    [endpoint(f"10.181.0.{i}") for i in range(1, 8)],
]


@pytest.mark.parametrize("cfg", CLUSTER_IP_ONLY_CFGS, ids=lambda c: c.local_mode or "no-detection")
@pytest.mark.parametrize("eps", CLUSTER_IP_ONLY_ENDPOINTS, ids=lambda e: f"{len(e)}-endpoints")
@pytest.mark.parametrize("protocol", ["TCP", "UDP", "SCTP"])
def test_cluster_ip_only_short_path_writes_what_the_general_path_writes(cfg, eps, protocol):
    """compile_service() takes a short path for ClusterIP-only ports (most of a large
    cluster); it must produce exactly the general compiler's rules and totals."""
    # Two named ports, and one unnamed (the API server allows that only for a single port).
    state = build([service("ns", "web", "172.30.0.50", [port(name="http", protocol=protocol),
                                                        port(name="metrics", port=81, protocol=protocol)]),
                   service("ns", "one", "172.30.0.51", [port(name="", port=81, protocol=protocol)])],
                  [endpoint_slice("ns", "web", eps, [slice_port(name="http", protocol=protocol),
                                                     slice_port(name="metrics", port=8081, protocol=protocol)]),
                   endpoint_slice("ns", "one", eps, [slice_port(name="", port=8081, protocol=protocol)])])
    for key in ("ns/web", "ns/one"):
        ports = state.ports_of(key)
        endpoints = state.endpoints_for(key)
        assert all(ipt._is_cluster_ip_only(sp) for sp in ports)
        short = ipt.compile_service(ports, endpoints, cfg)
        general = ipt.ServiceRules()
        for sp in ports:
            ipt._compile_port(general, sp, endpoints.get(sp.name, []), cfg)
        assert short.chains == general.chains
        assert short.shared == general.shared
        assert (short.endpoints, short.no_endpoint_ports) == (general.endpoints, general.no_endpoint_ports)


@pytest.mark.parametrize("spec", [
    {"type": "NodePort"}, {"externalIPs": ["192.168.99.1"]}, {"internalTrafficPolicy": "Local"},
    {"sessionAffinity": "ClientIP"},
    {"type": "LoadBalancer", "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}},
])
def test_ports_with_more_than_a_cluster_ip_take_the_general_path(spec):
    ports = [port(node_port=30080)] if spec.get("type") in ("NodePort", "LoadBalancer") else [port()]
    state = build([service("ns", "web", "172.30.0.50", ports, **spec)], [])
    assert not any(ipt._is_cluster_ip_only(sp) for sp in state.ports_of("ns/web"))
