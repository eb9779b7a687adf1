"""iptables mode on the real kernel: real TCP/UDP connections through service IPs.

Topology (tests/integration/lab.py): a node namespace holding the rules, backend pods
10.244.1.x (nodeName node1 = local, node2 = "remote" but reachable), an in-cluster
client pod 10.244.2.10, external hosts on the node network, and the node itself.
"""
from __future__ import annotations

from collections import Counter

import pytest
from proxyctl import eps, kube_chains, run_proxy, save, svc, tcp, write_manifests

TRIES = 40  # with 3 backends, P(one backend never chosen) = 3 * (2/3)^40 < 1e-6
CLIENT_IP = "10.244.2.10"
EXT_IP = "192.168.50.2"
EXT2_IP = "192.168.50.3"
BACKENDS = {"be1": "10.244.1.1", "be2": "10.244.1.2", "be3": "10.244.1.3"}
HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]


@pytest.fixture
def cluster(lab, tmp_path):
    for name, ip in BACKENDS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", CLIENT_IP)
    lab.add_external("ext", EXT_IP)
    lab.add_external("ext2", EXT2_IP)
    node = lab.ns("node")
    manifests = tmp_path / "manifests"

    def apply(objects, *args):
        write_manifests(manifests, objects)
        return run_proxy(node, "--once", *args, manifests=manifests)

    lab.apply = apply
    return lab


def backends(replies):
    assert all(r.ok for r in replies), Counter(r.outcome for r in replies)
    return Counter(r.backend for r in replies)


def test_cluster_ip_tcp_reaches_every_backend_without_masquerade_from_pods(cluster):
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    replies = cluster.request_many("client", "10.96.0.10", 80, count=TRIES)
    assert set(backends(replies)) == set(BACKENDS)
    assert {r.seen_client for r in replies} == {CLIENT_IP}  # pod source kept


def test_cluster_ip_from_outside_the_cluster_cidr_is_masqueraded(cluster):
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    for origin in ("ext", "node"):
        replies = cluster.request_many(origin, "10.96.0.10", 80, count=TRIES)
        assert set(backends(replies)) == set(BACKENDS)
        assert {r.seen_client for r in replies} == {cluster.node_ip}, origin


def test_udp_cluster_ip(cluster):
    dns = [tcp(53, "dns", protocol="UDP")]
    cluster.apply([svc("dns", "10.96.0.53", dns),
                   eps("dns", BACKENDS.values(), [{"name": "dns", "port": 5353, "protocol": "UDP"}])])
    replies = cluster.request_many("client", "10.96.0.53", 53, proto="udp", count=TRIES)
    assert set(backends(replies)) == set(BACKENDS)


def test_service_without_endpoints_rejects(cluster):
    cluster.apply([svc("empty", "10.96.0.20", [tcp(80, "http", node_port=30020)], type="NodePort",
                       externalIPs=["203.0.113.20"])])
    assert cluster.request("client", "10.96.0.20", 80, timeout=1).outcome == "refused"
    assert cluster.request("ext", "203.0.113.20", 80, timeout=1).outcome == "refused"
    assert cluster.request("ext", cluster.node_ip, 30020, timeout=1).outcome == "refused"


def test_nodeport_cluster_policy_masquerades_and_local_policy_keeps_source(cluster):
    cluster.apply([
        svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
        eps("np", BACKENDS.values(), HTTP_EP),
        svc("npl", "10.96.0.31", [tcp(80, "http", node_port=30081)], type="NodePort", externalTrafficPolicy="Local"),
        eps("npl", [BACKENDS["be1"]], HTTP_EP, node="node1", name="npl-a"),
        eps("npl", [BACKENDS["be2"]], HTTP_EP, node="node2", name="npl-b"),
        svc("npn", "10.96.0.32", [tcp(80, "http", node_port=30082)], type="NodePort", externalTrafficPolicy="Local"),
        eps("npn", [BACKENDS["be3"]], HTTP_EP, node="node2"),
    ])
    replies = cluster.request_many("ext", cluster.node_ip, 30080, count=TRIES)
    assert set(backends(replies)) == set(BACKENDS)
    assert {r.seen_client for r in replies} == {cluster.node_ip}
    # Local: only the local endpoint, and the client's own address arrives.
    replies = cluster.request_many("ext", cluster.node_ip, 30081, count=10)
    assert backends(replies) == Counter({"be1": 10})
    assert {r.seen_client for r in replies} == {EXT_IP}
    # Local with no local endpoint: dropped (no REJECT, so the client times out).
    assert cluster.request("ext", cluster.node_ip, 30082, timeout=1).outcome == "timeout"
    # Pods still reach it through the cluster IP (internal policy is Cluster).
    assert backends(cluster.request_many("client", "10.96.0.32", 80, count=3)) == Counter({"be3": 3})


def test_external_ips(cluster):
    cluster.apply([svc("ext", "10.96.0.40", HTTP, externalIPs=["203.0.113.40"]),
                   eps("ext", BACKENDS.values(), HTTP_EP)])
    replies = cluster.request_many("ext", "203.0.113.40", 80, count=TRIES)
    assert set(backends(replies)) == set(BACKENDS)
    assert {r.seen_client for r in replies} == {cluster.node_ip}  # Cluster policy: masqueraded


def test_load_balancer_source_ranges(cluster):
    cluster.apply([svc("lb", "10.96.0.50", [tcp(80, "http", node_port=30050)], type="LoadBalancer",
                       loadBalancerSourceRanges=[f"{EXT_IP}/32"],
                       status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}),
                   eps("lb", BACKENDS.values(), HTTP_EP)])
    assert set(backends(cluster.request_many("ext", "198.51.100.50", 80, count=TRIES))) == set(BACKENDS)
    assert cluster.request("ext2", "198.51.100.50", 80, timeout=1).outcome == "timeout"
    # NodePorts are not subject to source ranges (as upstream).
    assert cluster.request("ext2", cluster.node_ip, 30050).ok


def test_load_balancer_local_policy_health_check_rule(cluster):
    cluster.apply([svc("lbl", "10.96.0.51", [tcp(80, "http", node_port=30051)], type="LoadBalancer",
                       externalTrafficPolicy="Local", healthCheckNodePort=32000,
                       status={"loadBalancer": {"ingress": [{"ip": "198.51.100.51"}]}}),
                   eps("lbl", [BACKENDS["be2"]], HTTP_EP)])
    replies = cluster.request_many("ext", "198.51.100.51", 80, count=5)
    assert backends(replies) == Counter({"be2": 5}) and {r.seen_client for r in replies} == {EXT_IP}
    filt = save(cluster.ns("node"), "filter")
    assert '-A KUBE-NODEPORTS -p tcp -m comment --comment "default/lbl:http health check node port" ' \
           '-m tcp --dport 32000 -j ACCEPT' in filt


def test_internal_traffic_policy_local(cluster):
    cluster.apply([svc("itp", "10.96.0.60", HTTP, internalTrafficPolicy="Local"),
                   eps("itp", [BACKENDS["be1"]], HTTP_EP, node="node1", name="itp-a"),
                   eps("itp", [BACKENDS["be2"], BACKENDS["be3"]], HTTP_EP, node="node2", name="itp-b"),
                   svc("itpn", "10.96.0.61", HTTP, internalTrafficPolicy="Local"),
                   eps("itpn", [BACKENDS["be2"]], HTTP_EP, node="node2")])
    assert backends(cluster.request_many("client", "10.96.0.60", 80, count=15)) == Counter({"be1": 15})
    assert cluster.request("client", "10.96.0.61", 80, timeout=1).outcome == "timeout"


def test_client_ip_session_affinity_sticks(cluster):
    cluster.apply([svc("sticky", "10.96.0.70", HTTP, sessionAffinity="ClientIP",
                       sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}}),
                   eps("sticky", BACKENDS.values(), HTTP_EP)])
    first = backends(cluster.request_many("client", "10.96.0.70", 80, count=20))
    assert len(first) == 1
    # Without affinity the same client spreads over all backends.
    cluster.apply([svc("sticky", "10.96.0.70", HTTP), eps("sticky", BACKENDS.values(), HTTP_EP)])
    cluster.exec("node", ["conntrack", "-F"], check=False)
    assert set(backends(cluster.request_many("client", "10.96.0.70", 80, count=TRIES))) == set(BACKENDS)


def test_hairpin_is_masqueraded(cluster):
    cluster.apply([svc("hp", "10.96.0.80", HTTP), eps("hp", [BACKENDS["be1"]], HTTP_EP)])
    reply = cluster.request("be1", "10.96.0.80", 80)
    assert reply.ok and reply.backend == "be1" and reply.seen_client == cluster.node_ip


def test_endpoint_change_takes_effect(cluster):
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", [BACKENDS["be3"]], HTTP_EP)])
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=10)) == Counter({"be3": 10})
    stale = [c for c in kube_chains(cluster.ns("node")) if c.startswith("KUBE-SEP-")]
    assert len(stale) == 1  # the removed endpoints' chains are gone


def test_localhost_nodeport_without_route_localnet_preset(tmp_path):
    # The lab leaves route_localnet at 0: the proxy sets it itself, as upstream's proxier
    # (more cases: test_localhost_nodeports.py).
    from lab import Lab

    with Lab() as lab:
        lab.add_pod("be1", BACKENDS["be1"])
        sysctl = ["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]
        assert lab.exec("node", sysctl).stdout.strip() == "0"
        manifests = tmp_path / "m"
        write_manifests(manifests, [svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
                                    eps("np", [BACKENDS["be1"]], HTTP_EP)])
        run_proxy(lab.ns("node"), "--once", manifests=manifests)
        assert lab.exec("node", sysctl).stdout.strip() == "1"
        reply = lab.request("node", "127.0.0.1", 30080)
        assert reply.ok and reply.backend == "be1"


def test_foreign_rules_survive_sync_and_cleanup(cluster):
    node = cluster.ns("node")
    cluster.iptables_restore("*nat\n:MYCHAIN - [0:0]\n-A MYCHAIN -d 10.1.2.3/32 -j RETURN\n"
                             "-A PREROUTING -d 10.1.2.4/32 -j MYCHAIN\nCOMMIT\n"
                             "*filter\n-A INPUT -s 10.9.9.9/32 -j DROP\nCOMMIT\n")
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", [BACKENDS["be1"]], HTTP_EP)])
    foreign = ["-A MYCHAIN -d 10.1.2.3/32 -j RETURN", "-A PREROUTING -d 10.1.2.4/32 -j MYCHAIN",
               "-A INPUT -s 10.9.9.9/32 -j DROP"]
    text = save(node)
    assert all(line in text for line in foreign)
    run_proxy(node, "--cleanup")
    text = save(node)
    assert "KUBE-" not in text
    assert all(line in text for line in foreign)
    assert cluster.request("client", "10.96.0.10", 80, timeout=1).outcome == "timeout"


def test_second_sync_writes_nothing(cluster):
    objects = [svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)]
    cluster.apply(objects)
    out = cluster.apply(objects).stdout
    assert "(0 written, 0 changes)" in out, out
