"""The IPVS-mode compiler against upstream's pkg/proxy/ipvs/proxier_test.go expectations.

Each test names the upstream test it was checked against by hand. Upstream's fake proxier
has no local-traffic detector, scheduler rr, and the node addresses the test passes;
``upstream_cfg`` builds the same configuration.
"""
import os
from collections import Counter

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Skipped,
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.plan import render
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs import compile as ipvs
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port

NODE = "test-node"  # upstream's testNodeName


def upstream_cfg(node_ips=(), node_port_ips=None, **kw):
    """Upstream's NewFakeProxier: NoOpLocalDetector, rr, the given node addresses."""
    kw.setdefault("iptables", IptablesConfig(local_mode="ClusterCIDR", local_cidrs=()))
    return ipvs.IpvsConfig(node_ips=tuple(node_ips),
                           node_port_ips=tuple(node_ips if node_port_ips is None else node_port_ips), **kw)


def build(services, slices, hostname=NODE):
    state = ProxyState(hostname)
    for s in services:
        state.set_service(parse_service(s))
    for s in slices:
        try:
            state.set_slice(parse_endpoint_slice(s))
        except Skipped:  # another IP family: the IPv4 proxier ignores it
            pass
    return state


def desired(state, cfg):
    compiled = {k: ipvs.compile_service(state.ports_of(k), state.endpoints_for(k), cfg) for k in state.service_keys()}
    return ipvs.assemble(compiled, cfg)


def vs_table(d):
    """{"ip:port/PROTO": ["ep:port", ...]} (upstream's FakeIPVS Services+Destinations)."""
    return {str(dest.service): [str(r) for r in dest.reals] for dest in d.virtual_servers.values()}


def entries(d):
    return {name: sorted(e) for name, e in d.ipsets.items() if e}


def chain_targets(d, table, chain):
    """(target, set) per rule: upstream's ExpectedIptablesChain (JumpChain, MatchSet)."""
    out = []
    for r in d.rules[(table, chain)]:
        target = f" {r}".split(" -j ", 1)[1].split(" ")[0]
        match_set = r.split("--match-set ", 1)[1].split(" ")[0] if "--match-set" in r else ""
        out.append((target, match_set))
    return out


# --- virtual services and real servers -----------------------------------------------------


def test_cluster_ip_with_three_endpoints():
    state = build([service("ns1", "svc1", "10.20.30.41", [port()])],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.3"), endpoint("10.180.0.1"),
                                                  endpoint("10.180.0.2")], [slice_port()])])
    d = desired(state, upstream_cfg())
    assert vs_table(d) == {"10.20.30.41:80/TCP": ["10.180.0.1:80", "10.180.0.2:80", "10.180.0.3:80"]}
    dest = d.virtual_servers[("TCP", "10.20.30.41", 80)]
    assert dest.service == ipvs.VirtualServer("TCP", "10.20.30.41", 80, "rr", 0, 0)
    assert all(r.weight == 1 for r in dest.reals)
    assert d.addresses == {"10.20.30.41"}
    assert entries(d) == {"KUBE-CLUSTER-IP": ["10.20.30.41,tcp:80"], "KUBE-IPVS-IPS": ["10.20.30.41"]}


def test_nodeport_ipv4_two_families_of_endpoints():
    """TestNodePortIPv4 "1 service with node port, has 2 endpoints": the IPv6 slice and the
    IPv6 node address are ignored by the IPv4 proxier."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="NodePort")],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port()], name="svc1-1"),
                   endpoint_slice("ns1", "svc1", [endpoint("1002:ab8::2:10")], [slice_port()], name="svc1-2",
                                  address_type="IPv6")])
    d = desired(state, upstream_cfg(["100.101.102.103"]))
    assert vs_table(d) == {"10.20.30.41:80/TCP": ["10.180.0.1:80"], "100.101.102.103:3001/TCP": ["10.180.0.1:80"]}
    assert d.addresses == {"10.20.30.41"}  # node addresses are never bound to kube-ipvs0


def test_nodeport_udp_sets_and_rules():
    """TestNodePortIPv4 "1 UDP service with node port, has endpoints"."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(protocol="UDP", node_port=3001)], type="NodePort")],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port(protocol="UDP")])])
    d = desired(state, upstream_cfg(["100.101.102.103"]))
    assert vs_table(d) == {"10.20.30.41:80/UDP": ["10.180.0.1:80"], "100.101.102.103:3001/UDP": ["10.180.0.1:80"]}
    assert entries(d)["KUBE-NODE-PORT-UDP"] == ["3001"]
    assert chain_targets(d, "nat", "KUBE-NODE-PORT") == [("KUBE-MARK-MASQ", "KUBE-NODE-PORT-UDP")]
    assert chain_targets(d, "filter", "KUBE-NODE-PORT") == [("ACCEPT", "KUBE-HEALTH-CHECK-NODE-PORT")]
    assert chain_targets(d, "nat", "KUBE-SERVICES") == [
        ("RETURN", ""), ("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"), ("KUBE-NODE-PORT", ""), ("ACCEPT", "KUBE-CLUSTER-IP")]
    assert d.rules[("nat", "KUBE-NODE-PORT")] == [
        '-p udp -m comment --comment "Kubernetes nodeport UDP port for masquerade purpose" '
        '-m set --match-set KUBE-NODE-PORT-UDP dst -j KUBE-MARK-MASQ']


def test_no_endpoints_keeps_virtual_services_without_real_servers():
    """TestNodePortIPv4 "service has node port but no endpoints" and TestIPv4Proxier
    "cluster IP service with no endpoints": the VS exists, with no real server (the kernel
    then answers ICMP port unreachable, see ip_vs_leave())."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="NodePort")], [])
    d = desired(state, upstream_cfg(["100.101.102.103"]))
    assert vs_table(d) == {"10.20.30.41:80/TCP": [], "100.101.102.103:3001/TCP": []}
    compiled = ipvs.compile_service(state.ports_of("ns1/svc1"), state.endpoints_for("ns1/svc1"), upstream_cfg())
    assert compiled.no_endpoint_ports == 1 and compiled.endpoints == 0


def test_sctp_nodeport_on_several_node_addresses():
    """TestNodePortIPv4 "node port service with protocol sctp on a node with multiple nodeIPs"."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(protocol="SCTP", node_port=3001)], type="NodePort")],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port(protocol="SCTP")])])
    ips = ["100.101.102.103", "100.101.102.104", "100.101.102.105"]
    d = desired(state, upstream_cfg(ips))
    assert vs_table(d) == {"10.20.30.41:80/SCTP": ["10.180.0.1:80"],
                           **{f"{ip}:3001/SCTP": ["10.180.0.1:80"] for ip in ips}}
    assert entries(d)["KUBE-NODE-PORT-SCTP-HASH"] == [f"{ip},sctp:3001" for ip in ips]


def test_sctp_nodeport_external_policy_local():
    """TestNodePortIPv4 "node port service with protocol sctp and externalTrafficPolicy local"."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(protocol="SCTP", node_port=3001)], type="NodePort",
                           externalTrafficPolicy="Local")],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1", node=NODE),
                                                  endpoint("10.180.1.1", node="other")],
                                  [slice_port(protocol="SCTP")])])
    d = desired(state, upstream_cfg(["100.101.102.103"]))
    assert vs_table(d) == {"10.20.30.41:80/SCTP": ["10.180.0.1:80", "10.180.1.1:80"],
                           "100.101.102.103:3001/SCTP": ["10.180.0.1:80"]}
    assert entries(d)["KUBE-NODE-PORT-SCTP-HASH"] == ["100.101.102.103,sctp:3001"]
    assert entries(d)["KUBE-NODE-PORT-LOCAL-SCTP-HASH"] == ["100.101.102.103,sctp:3001"]
    assert chain_targets(d, "nat", "KUBE-NODE-PORT") == [
        ("RETURN", "KUBE-NODE-PORT-LOCAL-SCTP-HASH"), ("KUBE-MARK-MASQ", "KUBE-NODE-PORT-SCTP-HASH")]
    assert d.rules[("nat", "KUBE-NODE-PORT")][0] == (
        "-p sctp -m comment --comment \"Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type "
        "'hash ip:port'\" -m set --match-set KUBE-NODE-PORT-LOCAL-SCTP-HASH dst,dst -j RETURN")


def test_nodeport_without_node_addresses_is_skipped_with_its_health_check_port():
    """Upstream `continue`s the service port when it found no node address for NodePorts."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="LoadBalancer",
                           externalTrafficPolicy="Local", healthCheckNodePort=30000)], [])
    d = desired(state, upstream_cfg([]))
    assert vs_table(d) == {"10.20.30.41:80/TCP": []}
    assert "KUBE-NODE-PORT-TCP" not in entries(d) and "KUBE-HEALTH-CHECK-NODE-PORT" not in entries(d)


def test_external_ips():
    """TestExternalIPs / TestExternalIPsNoEndpoint: one VS per external IP, same endpoints;
    the IPv6 external IP is dropped; an external IP the node holds is not bound."""
    svc = service("ns1", "svc1", "10.20.30.41", [port()], externalIPs=["50.60.70.81", "2012::51", "192.168.0.2"])
    state = build([svc], [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port()])])
    d = desired(state, upstream_cfg(["192.168.0.2"]))
    assert vs_table(d) == {"10.20.30.41:80/TCP": ["10.180.0.1:80"], "50.60.70.81:80/TCP": ["10.180.0.1:80"],
                           "192.168.0.2:80/TCP": ["10.180.0.1:80"]}
    assert d.addresses == {"10.20.30.41", "50.60.70.81"}
    assert entries(d)["KUBE-EXTERNAL-IP"] == ["192.168.0.2,tcp:80", "50.60.70.81,tcp:80"]
    # TestAcceptIPVSTraffic: the masquerade and the two ACCEPT rules for external IPs.
    assert chain_targets(d, "nat", "KUBE-SERVICES") == [
        ("RETURN", ""), ("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"), ("KUBE-MARK-MASQ", "KUBE-EXTERNAL-IP"),
        ("ACCEPT", "KUBE-EXTERNAL-IP"), ("ACCEPT", "KUBE-EXTERNAL-IP"), ("KUBE-NODE-PORT", ""),
        ("ACCEPT", "KUBE-CLUSTER-IP")]
    state = build([svc], [])
    assert vs_table(desired(state, upstream_cfg()))["50.60.70.81:80/TCP"] == []


def test_only_local_external_ips():
    """TestOnlyLocalExternalIPs: external-IP VS gets only the local endpoint; the entry goes
    to KUBE-EXTERNAL-IP-LOCAL (no masquerade rule for it)."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port()], type="NodePort", externalTrafficPolicy="Local",
                           externalIPs=["50.60.70.81"])],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1", node=NODE), endpoint("10.180.1.1", node="o")],
                                  [slice_port()])])
    d = desired(state, upstream_cfg())
    assert vs_table(d)["50.60.70.81:80/TCP"] == ["10.180.0.1:80"]
    assert vs_table(d)["10.20.30.41:80/TCP"] == ["10.180.0.1:80", "10.180.1.1:80"]
    assert entries(d)["KUBE-EXTERNAL-IP-LOCAL"] == ["50.60.70.81,tcp:80"]
    assert "KUBE-EXTERNAL-IP" not in entries(d)
    assert [t for t in chain_targets(d, "nat", "KUBE-SERVICES") if t[1].startswith("KUBE-EXTERNAL")] == [
        ("ACCEPT", "KUBE-EXTERNAL-IP-LOCAL"), ("ACCEPT", "KUBE-EXTERNAL-IP-LOCAL")]


def test_load_balancer():
    """TestLoadBalancer (upstream's fake has no node address: no NodePort VS)."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="LoadBalancer",
                           status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}})],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port()])])
    d = desired(state, upstream_cfg([]))
    assert vs_table(d) == {"10.20.30.41:80/TCP": ["10.180.0.1:80"], "1.2.3.4:80/TCP": ["10.180.0.1:80"]}
    assert entries(d)["KUBE-LOAD-BALANCER"] == ["1.2.3.4,tcp:80"]
    assert d.addresses == {"10.20.30.41", "1.2.3.4"}
    assert chain_targets(d, "nat", "KUBE-SERVICES") == [
        ("RETURN", ""), ("KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER"), ("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"),
        ("KUBE-NODE-PORT", ""), ("ACCEPT", "KUBE-CLUSTER-IP"), ("ACCEPT", "KUBE-LOAD-BALANCER")]
    assert chain_targets(d, "nat", "KUBE-LOAD-BALANCER") == [("KUBE-MARK-MASQ", "")]


def test_only_local_node_ports():
    """TestOnlyLocalNodePorts: nodePortAddresses 100.101.102.0/24 picks one node address."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="NodePort",
                           externalTrafficPolicy="Local")],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1", node=NODE), endpoint("10.180.1.1", node="o")],
                                  [slice_port()])])
    d = desired(state, upstream_cfg(["100.101.102.103", "10.0.0.5"], node_port_ips=["100.101.102.103"]))
    assert vs_table(d) == {"10.20.30.41:80/TCP": ["10.180.0.1:80", "10.180.1.1:80"],
                           "100.101.102.103:3001/TCP": ["10.180.0.1:80"]}
    assert entries(d)["KUBE-NODE-PORT-TCP"] == ["3001"] and entries(d)["KUBE-NODE-PORT-LOCAL-TCP"] == ["3001"]
    assert chain_targets(d, "nat", "KUBE-NODE-PORT") == [
        ("RETURN", "KUBE-NODE-PORT-LOCAL-TCP"), ("KUBE-MARK-MASQ", "KUBE-NODE-PORT-TCP")]


def test_health_check_node_ports():
    """TestHealthCheckNodePort: only externalTrafficPolicy=Local services have one."""
    svcs = [service("ns1", name, "10.20.30.41", [port(node_port=3000 + i)], type="LoadBalancer",
                    externalTrafficPolicy=etp, healthCheckNodePort=hc)
            for i, (name, etp, hc) in enumerate([("valid-svc1", "Local", 30000), ("valid-svc2", "Local", 30001),
                                                 ("invalid-svc3", "Cluster", 30002)])]
    d = desired(build(svcs, []), upstream_cfg(["100.101.102.103"]))
    assert entries(d)["KUBE-HEALTH-CHECK-NODE-PORT"] == ["30000", "30001"]
    assert chain_targets(d, "filter", "KUBE-NODE-PORT") == [("ACCEPT", "KUBE-HEALTH-CHECK-NODE-PORT")]


def test_load_balancer_source_ranges():
    """TestLoadBalancerSourceRanges: FW + SOURCE-CIDR entries; the node (not in the range)
    may not reach the LB IP: KUBE-IPVS-OUT-FILTER drops it (kubernetes#119656)."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port()], type="LoadBalancer",
                           loadBalancerSourceRanges=["10.0.0.0/8"],
                           status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}})],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1")], [slice_port()])])
    d = desired(state, upstream_cfg(["192.168.1.1"], primary_node_ip="192.168.1.1"))
    assert vs_table(d)["1.2.3.4:80/TCP"] == ["10.180.0.1:80"]
    assert {k: v for k, v in entries(d).items() if k.startswith("KUBE-LOAD")} == {
        "KUBE-LOAD-BALANCER": ["1.2.3.4,tcp:80"], "KUBE-LOAD-BALANCER-FW": ["1.2.3.4,tcp:80"],
        "KUBE-LOAD-BALANCER-SOURCE-CIDR": ["1.2.3.4,tcp:80,10.0.0.0/8"]}
    assert chain_targets(d, "filter", "KUBE-PROXY-FIREWALL") == [
        ("KUBE-SOURCE-RANGES-FIREWALL", "KUBE-LOAD-BALANCER-FW")]
    assert chain_targets(d, "filter", "KUBE-SOURCE-RANGES-FIREWALL") == [
        ("RETURN", "KUBE-LOAD-BALANCER-SOURCE-CIDR"), ("DROP", "")]
    assert d.rules[("filter", "KUBE-IPVS-OUT-FILTER")] == [
        "-s 1.2.3.4/32 -m ipvs --vproto 6 --vaddr 1.2.3.4 --vport 80 -j DROP"]
    # A range holding the node's address: the node may reach the LB IP (SOURCE-IP entry).
    d = desired(state, upstream_cfg(["10.1.1.1"], primary_node_ip="10.1.1.1"))
    assert entries(d)["KUBE-LOAD-BALANCER-SOURCE-IP"] == ["1.2.3.4,tcp:80,1.2.3.4"]
    assert d.rules[("filter", "KUBE-IPVS-OUT-FILTER")] == []
    assert chain_targets(d, "filter", "KUBE-SOURCE-RANGES-FIREWALL") == [
        ("RETURN", "KUBE-LOAD-BALANCER-SOURCE-CIDR"), ("RETURN", "KUBE-LOAD-BALANCER-SOURCE-IP"), ("DROP", "")]


def test_only_local_load_balancing():
    """TestOnlyLocalLoadBalancing."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="LoadBalancer",
                           externalTrafficPolicy="Local", status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}})],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.0.1", node=NODE), endpoint("10.180.1.1", node="o")],
                                  [slice_port()])])
    d = desired(state, upstream_cfg([]))
    assert vs_table(d)["1.2.3.4:80/TCP"] == ["10.180.0.1:80"]
    assert entries(d)["KUBE-LOAD-BALANCER-LOCAL"] == ["1.2.3.4,tcp:80"]
    assert chain_targets(d, "nat", "KUBE-LOAD-BALANCER") == [
        ("RETURN", "KUBE-LOAD-BALANCER-LOCAL"), ("KUBE-MARK-MASQ", "")]


def test_external_policy_local_without_local_endpoint_falls_back_to_cluster_endpoints():
    """syncEndpoint (kubernetes#97081): a policy-Local VS with no local endpoint uses the
    cluster endpoints (pods on the node keep working; outside clients are not masqueraded)."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="NodePort",
                           externalTrafficPolicy="Local")],
                  [endpoint_slice("ns1", "svc1", [endpoint("10.180.1.1", node="other")], [slice_port()])])
    d = desired(state, upstream_cfg(["100.101.102.103"]))
    assert vs_table(d)["100.101.102.103:3001/TCP"] == ["10.180.1.1:80"]


def test_session_affinity_makes_every_virtual_service_persistent():
    """TestSessionAffinity: ClusterIP, external IP and NodePort VS all persistent, 10800 s."""
    state = build([service("ns1", "svc1", "10.20.30.41", [port(node_port=3001)], type="NodePort",
                           externalIPs=["50.60.70.81"], sessionAffinity="ClientIP",
                           sessionAffinityConfig={"clientIP": {"timeoutSeconds": 10800}})], [])
    d = desired(state, upstream_cfg(["100.101.102.103"]))
    assert len(d.virtual_servers) == 3
    for dest in d.virtual_servers.values():
        assert dest.service.flags == ipvs.FLAG_PERSISTENT and dest.service.timeout == 10800


def test_scheduler_and_mh_source_hash_flag():
    state = build([service("ns1", "svc1", "10.20.30.41", [port()])], [])
    lc = desired(state, upstream_cfg(scheduler="lc")).virtual_servers.values()
    assert [v.service.scheduler for v in lc] == ["lc"]
    mh = desired(state, upstream_cfg(scheduler="mh")).virtual_servers[("TCP", "10.20.30.41", 80)].service
    assert mh.flags == ipvs.FLAG_SOURCE_HASH


@pytest.mark.parametrize("itp, eps, expect_rs, expect_loopback", [
    # TestTestInternalTrafficPolicyE2E, its four cases.
    ("Cluster", [("10.0.1.1", NODE), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")],
     ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"], 1),
    ("Cluster", [("10.0.1.1", "node0"), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")],
     ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"], 0),
    ("Local", [("10.0.1.1", NODE), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")], ["10.0.1.1:80"], 1),
    ("Local", [("10.0.1.1", "node0"), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")], [], 0),
])
def test_internal_traffic_policy(itp, eps, expect_rs, expect_loopback):
    state = build([service("ns1", "svc1", "172.20.1.1", [port(name="")], internalTrafficPolicy=itp)],
                  [endpoint_slice("ns1", "svc1", [endpoint(ip, node=n) for ip, n in eps], [slice_port(name="")])])
    d = desired(state, upstream_cfg())
    assert vs_table(d) == {"172.20.1.1:80/TCP": expect_rs}
    assert len(d.ipsets["KUBE-LOOP-BACK"]) == expect_loopback


def _terminating_slice(conds):
    return endpoint_slice("ns1", "svc1", [endpoint(ip, node=node, ready=r, serving=s, terminating=t)
                                          for ip, node, r, s, t in conds], [slice_port(name="")])


def _terminating_service(etp):
    return service("ns1", "svc1", "172.20.1.1", [port(name="")], type="NodePort", externalTrafficPolicy=etp,
                   internalTrafficPolicy="Cluster", externalIPs=["1.2.3.4"])


READY_AND_TERMINATING = [
    ("10.0.1.1", NODE, True, True, False), ("10.0.1.2", NODE, True, True, False),
    ("10.0.1.3", NODE, False, True, True), ("10.0.1.4", NODE, False, False, True),
    ("10.0.1.5", "another-node", True, True, False),
]
ONLY_TERMINATING = [
    ("10.0.1.1", NODE, False, True, True), ("10.0.1.2", NODE, False, True, True),
    ("10.0.1.3", NODE, False, False, True), ("10.0.1.4", "another-node", False, True, True),
]


@pytest.mark.parametrize("etp, conds, extra, cluster_rs, external_rs, loopback", [
    # Test_EndpointSliceReadyAndTerminatingCluster
    ("Cluster", READY_AND_TERMINATING, [], ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"],
     ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"], 4),
    # Test_EndpointSliceReadyAndTerminatingLocal
    ("Local", READY_AND_TERMINATING, [], ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"],
     ["10.0.1.1:80", "10.0.1.2:80"], 4),
    # Test_EndpointSliceOnlyReadyAndTerminatingCluster: fall back to serving terminating ones
    ("Cluster", ONLY_TERMINATING, [("10.0.1.5", "another-node", False, False, False)],
     ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.4:80"], ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.4:80"], 3),
    # Test_EndpointSliceOnlyReadyAndTerminatingLocal
    ("Local", ONLY_TERMINATING, [("10.0.1.5", "another-node", True, True, False)],
     ["10.0.1.5:80"], ["10.0.1.1:80", "10.0.1.2:80"], 3),
])
def test_terminating_endpoints(etp, conds, extra, cluster_rs, external_rs, loopback):
    state = build([_terminating_service(etp)], [_terminating_slice(conds + extra)])
    d = desired(state, upstream_cfg())
    assert vs_table(d)["172.20.1.1:80/TCP"] == cluster_rs
    assert vs_table(d)["1.2.3.4:80/TCP"] == external_rs
    # Every local endpoint, whatever its condition, is in KUBE-LOOP-BACK.
    assert len(d.ipsets["KUBE-LOOP-BACK"]) == loopback
    assert "10.0.1.1,tcp:80,10.0.1.1" in d.ipsets["KUBE-LOOP-BACK"]


# --- iptables rules ---------------------------------------------------------------------------


def test_chains_and_jumps_match_create_and_link_kube_chain():
    """TestCreateAndLinkKubeChain: the chains; and upstream's iptablesJumpChain."""
    rules = ipvs.iptables_rules(upstream_cfg(), frozenset())
    nat = [c for (t, c) in ipvs.CHAINS if t == "nat"]
    filt = [c for (t, c) in ipvs.CHAINS if t == "filter"]
    assert nat == ["KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ"]
    assert filt == ["KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL",
                    "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"]
    assert rules[("filter", "INPUT")] == [
        '-m comment --comment "kubernetes health check rules" -j KUBE-NODE-PORT',
        '-m comment --comment "kube-proxy firewall rules" -j KUBE-PROXY-FIREWALL',
        '-m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER']
    assert rules[("nat", "PREROUTING")] == ['-m comment --comment "kubernetes service portals" -j KUBE-SERVICES']
    # IPVS mode has no KUBE-EXTERNAL-SERVICES, KUBE-NODEPORTS or KUBE-FIREWALL.
    assert not {c for (_t, c) in rules} & {"KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS", "KUBE-FIREWALL"}


def test_masquerade_rule_variants():
    """writeIptablesRules' three KUBE-CLUSTER-IP masquerade rules."""
    nonempty = frozenset({"KUBE-CLUSTER-IP"})
    c = '-m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" '
    assert ipvs.iptables_rules(upstream_cfg(iptables=IptablesConfig(masquerade_all=True)), nonempty)[
        ("nat", "KUBE-SERVICES")][1] == c + "-m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"
    cidr = IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.244.0.0/16",))
    assert ipvs.iptables_rules(upstream_cfg(iptables=cidr), nonempty)[("nat", "KUBE-SERVICES")][1] == (
        "! -s 10.244.0.0/16 " + c + "-m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ")
    iface = IptablesConfig(local_mode="InterfaceNamePrefix", local_interface="veth")
    assert ipvs.iptables_rules(upstream_cfg(iptables=iface), nonempty)[("nat", "KUBE-SERVICES")][1] == (
        "! -i veth+ " + c + "-m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ")
    assert ipvs.iptables_rules(upstream_cfg(), nonempty)[("nat", "KUBE-SERVICES")][1] == (
        c + "-m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ")


def test_masquerade_random_fully_and_mark_bit():
    cfg = upstream_cfg(iptables=IptablesConfig(masquerade_bit=5, masquerade_random_fully=True))
    rules = ipvs.iptables_rules(cfg, frozenset())
    assert rules[("nat", "KUBE-POSTROUTING")] == [
        "-m mark ! --mark 0x20/0x20 -j RETURN", "-j MARK --set-xmark 0x20/0x0",
        '-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully']
    assert rules[("nat", "KUBE-MARK-MASQ")] == ["-j MARK --set-xmark 0x20/0x20"]


GOLDEN_FILE = os.path.join(os.path.dirname(__file__), "fixtures", "ipvs_lab_node_rules.save")


def lab_like_state():
    """A node like the VM lab's: web (ClusterIP, 3 endpoints), np (NodePort, ETP Local,
    one local endpoint), ext (external IP), lb (LoadBalancer with a source range)."""
    http = [port(name="http", port=80)]
    http_ep = [slice_port(name="http", port=8080)]
    return build([
        service("default", "web", "10.96.0.10", http),
        service("default", "np", "10.96.0.30", [port(name="http", port=80, node_port=30080)], type="NodePort",
                externalTrafficPolicy="Local"),
        service("default", "ext", "10.96.0.40", http, externalIPs=["203.0.113.40"]),
        service("default", "lb", "10.96.0.50", [port(name="http", port=80, node_port=30050)], type="LoadBalancer",
                loadBalancerSourceRanges=["192.168.50.2/32"],
                status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}),
    ], [
        endpoint_slice("default", "web", [endpoint(f"10.244.1.{i}", node="node1") for i in (1, 2, 3)], http_ep),
        endpoint_slice("default", "np", [endpoint("10.244.1.1", node="node1"), endpoint("10.244.1.2", node="node2")],
                       http_ep),
        endpoint_slice("default", "ext", [endpoint("10.244.1.3", node="node2")], http_ep),
        endpoint_slice("default", "lb", [endpoint("10.244.1.2", node="node2")], http_ep),
    ], hostname="node1")


LAB_CFG = ipvs.IpvsConfig(
    iptables=IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.244.0.0/16",)),
    node_ips=("192.168.50.1",), node_port_ips=("192.168.50.1",), primary_node_ip="192.168.50.1")


def test_golden_ruleset_for_a_lab_like_node():
    """Checked by hand against writeIptablesRules' order, and against iptables-save's
    canonical form (rules from an ipset-enabled namespace read back identical)."""
    d = desired(lab_like_state(), LAB_CFG)
    with open(GOLDEN_FILE, encoding="utf-8") as fh:
        assert render(d.rules, include_builtin=True) == fh.read()


def test_lab_like_node_kernel_objects():
    d = desired(lab_like_state(), LAB_CFG)
    assert vs_table(d) == {
        "10.96.0.10:80/TCP": ["10.244.1.1:8080", "10.244.1.2:8080", "10.244.1.3:8080"],
        "10.96.0.30:80/TCP": ["10.244.1.1:8080", "10.244.1.2:8080"],
        "192.168.50.1:30080/TCP": ["10.244.1.1:8080"],
        "10.96.0.40:80/TCP": ["10.244.1.3:8080"],
        "203.0.113.40:80/TCP": ["10.244.1.3:8080"],
        "10.96.0.50:80/TCP": ["10.244.1.2:8080"],
        "198.51.100.50:80/TCP": ["10.244.1.2:8080"],
        "192.168.50.1:30050/TCP": ["10.244.1.2:8080"],
    }
    assert d.addresses == {"10.96.0.10", "10.96.0.30", "10.96.0.40", "10.96.0.50", "203.0.113.40", "198.51.100.50"}
    assert entries(d) == {
        "KUBE-LOOP-BACK": ["10.244.1.1,tcp:8080,10.244.1.1", "10.244.1.2,tcp:8080,10.244.1.2",
                           "10.244.1.3,tcp:8080,10.244.1.3"],
        "KUBE-CLUSTER-IP": ["10.96.0.10,tcp:80", "10.96.0.30,tcp:80", "10.96.0.40,tcp:80", "10.96.0.50,tcp:80"],
        "KUBE-EXTERNAL-IP": ["203.0.113.40,tcp:80"],
        "KUBE-LOAD-BALANCER": ["198.51.100.50,tcp:80"],
        "KUBE-LOAD-BALANCER-FW": ["198.51.100.50,tcp:80"],
        "KUBE-LOAD-BALANCER-SOURCE-CIDR": ["198.51.100.50,tcp:80,192.168.50.2/32"],
        "KUBE-NODE-PORT-TCP": ["30050", "30080"],
        "KUBE-NODE-PORT-LOCAL-TCP": ["30080"],
        "KUBE-IPVS-IPS": sorted(d.addresses),
    }
    assert d.sysctls == {"net/ipv4/vs/conntrack": "1", "net/ipv4/vs/expire_nodest_conn": "1",
                         "net/ipv4/vs/expire_quiescent_template": "1", "net/ipv4/ip_forward": "1"}


# --- incremental aggregate ----------------------------------------------------------------------


def test_aggregate_partial_updates_equal_a_full_assemble():
    state = lab_like_state()
    compiled = {k: ipvs.compile_service(state.ports_of(k), state.endpoints_for(k), LAB_CFG)
                for k in state.service_keys()}
    agg = ipvs.Aggregate()
    for k in ["default/lb", "default/web", "default/np", "default/ext"]:
        agg.set(k, compiled[k])
    full = ipvs.assemble(compiled, LAB_CFG)
    got = agg.desired(LAB_CFG)
    assert got.virtual_servers == full.virtual_servers and got.ipsets == full.ipsets and got.rules == full.rules

    # Remove the only LoadBalancer: its VS go, its entries go, the LB rules go.
    delta = agg.set("default/lb", None)
    assert dict(delta.virtual_servers) == {
        ("TCP", "10.96.0.50", 80): None, ("TCP", "198.51.100.50", 80): None, ("TCP", "192.168.50.1", 30050): None}
    assert delta.addresses_removed == {"10.96.0.50", "198.51.100.50"} and not delta.addresses_added
    assert delta.entries_removed["KUBE-NODE-PORT-TCP"] == {"30050"}
    assert delta.entries_removed["KUBE-LOAD-BALANCER"] == {"198.51.100.50,tcp:80"}
    assert "KUBE-LOOP-BACK" not in delta.entries_removed  # 10.244.1.2 is still np's endpoint
    assert delta.rules_inputs_changed
    rest = {k: v for k, v in compiled.items() if k != "default/lb"}
    assert agg.desired(LAB_CFG).rules == ipvs.assemble(rest, LAB_CFG).rules


def test_aggregate_add_builds_what_set_builds():
    """Aggregate.add (full syncs: no Delta) leaves the same counts as set(): removing a
    service afterwards gives the same delta from either."""
    state = lab_like_state()
    compiled = {k: ipvs.compile_service(state.ports_of(k), state.endpoints_for(k), LAB_CFG)
                for k in state.service_keys()}
    by_set, by_add = ipvs.Aggregate(), ipvs.Aggregate()
    for k in sorted(compiled):
        by_set.set(k, compiled[k])
        by_add.add(k, compiled[k])
    by_add.add("default/none", None)  # a service the compiler left out
    assert vars(by_add) == vars(by_set)
    assert by_add.desired(LAB_CFG) == ipvs.assemble(compiled, LAB_CFG)
    assert by_add.set("default/lb", None) == by_set.set("default/lb", None)
    by_add.add("default/web", None)  # already there: as set()
    assert "default/web" not in by_add.services


def test_aggregate_endpoint_change_touches_only_that_service():
    state = lab_like_state()
    agg = ipvs.Aggregate()
    for k in state.service_keys():
        agg.set(k, ipvs.compile_service(state.ports_of(k), state.endpoints_for(k), LAB_CFG))
    state.set_slice(parse_endpoint_slice(endpoint_slice("default", "web", [endpoint("10.244.1.3", node="node1")],
                                                        [slice_port(name="http", port=8080)])))
    delta = agg.set("default/web", ipvs.compile_service(state.ports_of("default/web"),
                                                        state.endpoints_for("default/web"), LAB_CFG))
    assert list(delta.virtual_servers) == [("TCP", "10.96.0.10", 80)]
    assert [str(r) for r in delta.virtual_servers[("TCP", "10.96.0.10", 80)].reals] == ["10.244.1.3:8080"]
    assert not delta.addresses_added and not delta.addresses_removed
    assert not delta.rules_inputs_changed
    # 10.244.1.1 stays in KUBE-LOOP-BACK (np's local endpoint); 10.244.1.2 was local for web only.
    assert delta.entries_removed == {"KUBE-LOOP-BACK": {"10.244.1.2,tcp:8080,10.244.1.2"}}


def test_aggregate_same_virtual_service_from_two_services():
    a = service("ns", "a", "10.96.0.1", [port()], externalIPs=["203.0.113.9"])
    b = service("ns", "b", "10.96.0.2", [port()], externalIPs=["203.0.113.9"])
    state = build([a, b], [endpoint_slice("ns", "a", [endpoint("10.1.0.1")], [slice_port()]),
                           endpoint_slice("ns", "b", [endpoint("10.1.0.2")], [slice_port()])])
    agg = ipvs.Aggregate()
    comp = {k: ipvs.compile_service(state.ports_of(k), state.endpoints_for(k), upstream_cfg())
            for k in state.service_keys()}
    agg.set("ns/b", comp["ns/b"])
    agg.set("ns/a", comp["ns/a"])
    key = ("TCP", "203.0.113.9", 80)
    assert [str(r) for r in agg.virtual_server(key).reals] == ["10.1.0.1:80"]  # smallest key wins
    delta = agg.set("ns/a", None)
    assert [str(r) for r in delta.virtual_servers[key].reals] == ["10.1.0.2:80"]
    assert "203.0.113.9" in agg.addresses()  # still b's


# --- sysctls and set specs ---------------------------------------------------------------------


def test_sysctls_and_conn_reuse_mode():
    assert ipvs.sysctls(strict_arp=True)["net/ipv4/conf/all/arp_ignore"] == "1"
    assert ipvs.sysctls(strict_arp=True)["net/ipv4/conf/all/arp_announce"] == "2"
    assert "net/ipv4/conf/all/arp_ignore" not in ipvs.sysctls()
    assert ipvs.conn_reuse_mode("4.0.9") is None
    assert ipvs.conn_reuse_mode("5.4.0-42-generic") == "0"
    assert ipvs.conn_reuse_mode("5.9.0") is None
    assert ipvs.conn_reuse_mode("6.1.0-27-amd64") is None


def test_set_specs_are_upstreams():
    counts = Counter(ipvs.IPSET_BY_NAME[name].type for name in ipvs.IPSET_NAMES)
    assert counts == {"hash:ip,port": 8, "hash:ip,port,ip": 2, "hash:ip,port,net": 1, "bitmap:port": 5, "hash:ip": 1}
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs.proxier import _ipset

    node_port = _ipset("KUBE-NODE-PORT-TCP", ["30080"])
    assert (node_port.type, node_port.header_tokens()) == ("bitmap:port", ["range", "0-65535"])
    cluster_ip = _ipset("KUBE-CLUSTER-IP", ["10.96.0.10,tcp:80"])
    assert (cluster_ip.type, cluster_ip.header_tokens()) == (
        "hash:ip,port", ["family", "inet", "hashsize", "1024", "maxelem", "65536"])
    assert list(cluster_ip.entries) == ["10.96.0.10,tcp:80"]
