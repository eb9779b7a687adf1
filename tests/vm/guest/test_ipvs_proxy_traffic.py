"""IPVS mode on a real kernel: real TCP/UDP connections through IPVS virtual services.

Runs INSIDE a VM lab guest (the host-side tests/vm/test_ipvs_proxy_mode.py copies the
repository in and runs this file there): the guest kernel has ip_vs, xt_ipvs and dummy
links, which the build machine's kernel lacks. It reuses tests/integration/lab.py's
namespace lab: a node namespace that holds kube-ipvs0, the IPVS services, the ipsets
and the rules; backend pods 10.244.1.x (nodeName node1 = this node, node2 = "remote"
but reachable through the node); a client pod 10.244.2.10; external hosts on the
node network 192.168.50.0/24.

What upstream's IPVS mode does differently from iptables mode, and these tests pin:
- a service port without endpoints keeps its virtual service with no real server:
  IPVS answers ICMP port unreachable itself (ip_vs_leave()), so TCP clients are
  refused, where iptables mode REJECTs only for "no endpoints at all" and DROPs for
  "no local endpoints";
- externalTrafficPolicy: Local without a local endpoint falls back to the cluster
  endpoints without masquerading (kubernetes#97081); in a real cluster the reply leaves
  the other node directly and the client drops it; in this lab every pod sits behind
  the node, so the connection works and the backend sees the client's own address;
- internalTrafficPolicy: Local without a local endpoint: no real server, refused.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from lab import Lab, cleanup_stale, new_prefix  # noqa: E402
from proxyctl import BIN, NODE_NAME, eps, run_proxy, save, svc, tcp, write_manifests  # noqa: E402

TRIES = 30  # rr over 3 backends: every backend answers 10 times
CLIENT_IP = "10.244.2.10"
EXT_IP = "192.168.50.2"
EXT2_IP = "192.168.50.3"
BACKENDS = {"be1": "10.244.1.1", "be2": "10.244.1.2", "be3": "10.244.1.3"}
HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
IPVS = ["--proxy-mode", "ipvs"]


def _probe() -> str | None:
    """Why this kernel cannot run IPVS mode (None if it can)."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "iptables-restore", "ipset", "ipvsadm"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    subprocess.run(["modprobe", "ip_vs"], capture_output=True, check=False)
    if not os.path.exists("/proc/net/ip_vs"):
        return "kernel has no IPVS (modprobe ip_vs failed)"
    ns = f"{new_prefix()}probe"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        link = subprocess.run(["ip", "-n", ns, "link", "add", "kube-ipvs0", "type", "dummy"], capture_output=True,
                              text=True, check=False)
        if link.returncode != 0:
            return f"kernel has no dummy links: {link.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    return None


REASON = _probe()
# These run inside the VM lab guest (tests/vm/test_ipvs_proxy_mode.py starts them there and
# fails on any skip); a kernel without IPVS or dummy links cannot run them at all.
pytestmark = pytest.mark.skipif(REASON is not None,
                                reason=f"IPVS proxy traffic tests run in the VM lab guest; "
                                       f"this kernel cannot: {REASON}")


@pytest.fixture(scope="module", autouse=True)
def _stale_labs():
    cleanup_stale()


@pytest.fixture
def cluster(tmp_path):
    lab = Lab()
    try:
        for name, ip in BACKENDS.items():
            lab.add_pod(name, ip)
        lab.add_client("client", CLIENT_IP)
        lab.add_external("ext", EXT_IP)
        lab.add_external("ext2", EXT2_IP)
        node = lab.ns("node")
        manifests = tmp_path / "manifests"

        def apply(objects, *args):
            write_manifests(manifests, objects)
            return run_proxy(node, "--once", *IPVS, *args, manifests=manifests)

        lab.apply = apply
        lab.manifests = manifests
        yield lab
    finally:
        lab.close()


def backends(replies):
    assert all(r.ok for r in replies), Counter((r.outcome, r.error) for r in replies)
    return Counter(r.backend for r in replies)


def ipvsadm(lab) -> str:
    return lab.exec("node", ["ipvsadm", "-Ln"]).stdout


def real_servers(lab, vip: str, port: int) -> dict:
    """{"10.244.1.1:8080": weight} of one TCP virtual service (ipvsadm -Ln)."""
    out, current = {}, None
    for line in ipvsadm(lab).splitlines():
        words = line.split()
        if words[:1] in (["TCP"], ["UDP"], ["SCTP"]):
            current = words[1]
        elif words[:1] == ["->"] and current == f"{vip}:{port}" and words[1][0].isdigit():
            out[words[1]] = int(words[3])
    return out


def test_cluster_ip_reaches_every_backend_and_keeps_pod_sources(cluster):
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    replies = cluster.request_many("client", "10.96.0.10", 80, count=TRIES)
    assert backends(replies) == Counter({"be1": 10, "be2": 10, "be3": 10})  # rr
    assert {r.seen_client for r in replies} == {CLIENT_IP}
    for origin in ("ext", "node"):  # from outside the cluster CIDR: masqueraded
        replies = cluster.request_many(origin, "10.96.0.10", 80, count=6)
        assert set(backends(replies)) == set(BACKENDS), origin
        assert {r.seen_client for r in replies} == {cluster.node_ip}, origin
    # The kernel objects upstream's IPVS mode makes.
    node = cluster.ns("node")
    assert "10.96.0.10/32" in cluster.exec("node", ["ip", "-4", "addr", "show", "dev", "kube-ipvs0"]).stdout
    assert "state DOWN" in cluster.exec("node", ["ip", "link", "show", "kube-ipvs0"]).stdout
    assert real_servers(cluster, "10.96.0.10", 80) == {f"{ip}:8080": 1 for ip in BACKENDS.values()}
    assert "TCP  10.96.0.10:80 rr" in ipvsadm(cluster)
    sets = cluster.exec("node", ["ipset", "list", "KUBE-CLUSTER-IP"]).stdout
    assert "10.96.0.10,tcp:80" in sets
    assert "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT" in save(node, "nat")
    assert cluster.exec("node", ["sysctl", "-n", "net.ipv4.vs.conntrack"]).stdout.strip() == "1"


def test_udp_cluster_ip(cluster):
    dns = [tcp(53, "dns", protocol="UDP")]
    cluster.apply([svc("dns", "10.96.0.53", dns),
                   eps("dns", BACKENDS.values(), [{"name": "dns", "port": 5353, "protocol": "UDP"}])])
    replies = cluster.request_many("client", "10.96.0.53", 53, proto="udp", count=TRIES)
    assert set(backends(replies)) == set(BACKENDS)


def test_nodeport_cluster_and_local_policies(cluster):
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
    replies = cluster.request_many("ext", cluster.node_ip, 30081, count=6)
    assert backends(replies) == Counter({"be1": 6}) and {r.seen_client for r in replies} == {EXT_IP}
    # Local without a local endpoint: upstream IPVS falls back to the cluster endpoints,
    # unmasqueraded (this lab routes the reply back through the node, so it works).
    replies = cluster.request_many("ext", cluster.node_ip, 30082, count=3)
    assert backends(replies) == Counter({"be3": 3}) and {r.seen_client for r in replies} == {EXT_IP}
    assert real_servers(cluster, cluster.node_ip, 30081) == {"10.244.1.1:8080": 1}


def test_service_without_endpoints_is_refused_by_ipvs(cluster):
    cluster.apply([svc("empty", "10.96.0.20", [tcp(80, "http", node_port=30020)], type="NodePort",
                       externalIPs=["203.0.113.20"])])
    assert real_servers(cluster, "10.96.0.20", 80) == {}  # the virtual service exists, empty
    assert cluster.request("client", "10.96.0.20", 80, timeout=2).outcome == "refused"
    assert cluster.request("ext", "203.0.113.20", 80, timeout=2).outcome == "refused"
    assert cluster.request("ext", cluster.node_ip, 30020, timeout=2).outcome == "refused"
    # A VIP's other ports are closed by KUBE-IPVS-FILTER (kubernetes#72236).
    assert cluster.request("client", "10.96.0.20", 22, timeout=2).outcome == "refused"


def test_external_ips_are_masqueraded(cluster):
    cluster.apply([svc("ext", "10.96.0.40", HTTP, externalIPs=["203.0.113.40"]),
                   eps("ext", BACKENDS.values(), HTTP_EP)])
    replies = cluster.request_many("ext", "203.0.113.40", 80, count=TRIES)
    assert set(backends(replies)) == set(BACKENDS)
    assert {r.seen_client for r in replies} == {cluster.node_ip}


def test_load_balancer_source_ranges(cluster):
    cluster.apply([svc("lb", "10.96.0.50", [tcp(80, "http", node_port=30050)], type="LoadBalancer",
                       loadBalancerSourceRanges=[f"{EXT_IP}/32"],
                       status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}),
                   eps("lb", BACKENDS.values(), HTTP_EP)])
    assert set(backends(cluster.request_many("ext", "198.51.100.50", 80, count=TRIES))) == set(BACKENDS)
    assert cluster.request("ext2", "198.51.100.50", 80, timeout=1).outcome == "timeout"
    # The node is not in the range either: KUBE-IPVS-OUT-FILTER (kubernetes#119656).
    assert not cluster.request("node", "198.51.100.50", 80, timeout=1).ok
    # NodePorts are not subject to source ranges (as upstream).
    assert cluster.request("ext2", cluster.node_ip, 30050).ok


def test_internal_traffic_policy_local(cluster):
    cluster.apply([svc("itp", "10.96.0.60", HTTP, internalTrafficPolicy="Local"),
                   eps("itp", [BACKENDS["be1"]], HTTP_EP, node="node1", name="itp-a"),
                   eps("itp", [BACKENDS["be2"], BACKENDS["be3"]], HTTP_EP, node="node2", name="itp-b"),
                   svc("itpn", "10.96.0.61", HTTP, internalTrafficPolicy="Local"),
                   eps("itpn", [BACKENDS["be2"]], HTTP_EP, node="node2")])
    assert backends(cluster.request_many("client", "10.96.0.60", 80, count=10)) == Counter({"be1": 10})
    assert cluster.request("client", "10.96.0.61", 80, timeout=2).outcome == "refused"


def test_client_ip_session_affinity_sticks(cluster):
    cluster.apply([svc("sticky", "10.96.0.70", HTTP, sessionAffinity="ClientIP",
                       sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}}),
                   eps("sticky", BACKENDS.values(), HTTP_EP)])
    assert "persistent 300" in ipvsadm(cluster)
    assert len(backends(cluster.request_many("client", "10.96.0.70", 80, count=15))) == 1
    # Without affinity the same client spreads over all backends again.
    cluster.apply([svc("sticky", "10.96.0.70", HTTP), eps("sticky", BACKENDS.values(), HTTP_EP)])
    assert "persistent" not in ipvsadm(cluster)
    assert set(backends(cluster.request_many("client", "10.96.0.70", 80, count=TRIES))) == set(BACKENDS)


def test_hairpin_is_masqueraded(cluster):
    cluster.apply([svc("hp", "10.96.0.80", HTTP), eps("hp", [BACKENDS["be1"]], HTTP_EP)])
    reply = cluster.request("be1", "10.96.0.80", 80)
    assert reply.ok and reply.backend == "be1" and reply.seen_client == cluster.node_ip  # KUBE-LOOP-BACK


def test_endpoint_change_takes_effect_and_removed_real_servers_drain(cluster):
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    cluster.apply([svc("web", "10.96.0.10", HTTP), eps("web", [BACKENDS["be3"]], HTTP_EP)])
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=10)) == Counter({"be3": 10})
    # The old real servers still have (TIME_WAIT) connections: weight 0 until they are
    # gone, or already deleted (graceful termination as upstream).
    rs = real_servers(cluster, "10.96.0.10", 80)
    assert rs.pop("10.244.1.3:8080") == 1
    assert all(weight == 0 for weight in rs.values()), rs


def test_second_sync_writes_nothing(cluster):
    objects = [svc("web", "10.96.0.10", HTTP, externalIPs=["203.0.113.10"]), eps("web", BACKENDS.values(), HTTP_EP),
               svc("lb", "10.96.0.50", [tcp(80, "http", node_port=30050)], type="LoadBalancer",
                   loadBalancerSourceRanges=[f"{EXT_IP}/32"],
                   status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}),
               eps("lb", BACKENDS.values(), HTTP_EP)]
    cluster.apply(objects)
    out = cluster.apply(objects, "-v").stdout
    assert "(0 written, 0 changes)" in out, out  # the kernel's canonical forms are the compiled ones


def test_daemon_partial_syncs_follow_manifest_edits(cluster):
    node = cluster.ns("node")
    write_manifests(cluster.manifests, [svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    argv = [sys.executable, str(BIN), "--netns", node, "--hostname-override", NODE_NAME, "--cluster-cidr",
            "10.244.0.0/16", *IPVS, "--manifests", str(cluster.manifests), "--healthz-bind-address", "127.0.0.1:0",
            "--metrics-bind-address", "127.0.0.1:0", "--ipvs-min-sync-period", "0s"]
    daemon = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: len(real_servers(cluster, "10.96.0.10", 80)) == 3, 60), _drain(daemon)
        assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=9))) == set(BACKENDS)
        write_manifests(cluster.manifests, [svc("web", "10.96.0.10", HTTP), eps("web", [BACKENDS["be2"]], HTTP_EP),
                                            svc("new", "10.96.0.11", HTTP), eps("new", [BACKENDS["be1"]], HTTP_EP)])
        assert wait_for(lambda: cluster.request("client", "10.96.0.11", 80, timeout=1).ok, 60), _drain(daemon)
        assert backends(cluster.request_many("client", "10.96.0.10", 80, count=6)) == Counter({"be2": 6})
        assert backends(cluster.request_many("client", "10.96.0.11", 80, count=3)) == Counter({"be1": 3})
    finally:
        daemon.terminate()
        log = daemon.communicate(timeout=30)[0]
    assert "partial sync (ipvs)" in log, log
    assert "sync failed" not in log, log


def test_cleanup_leaves_nothing(cluster):
    cluster.apply([svc("web", "10.96.0.10", HTTP, externalIPs=["203.0.113.10"]),
                   eps("web", BACKENDS.values(), HTTP_EP),
                   svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
                   eps("np", BACKENDS.values(), HTTP_EP)])
    assert cluster.request("client", "10.96.0.10", 80).ok
    cluster.iptables_restore("*filter\n:MINE - [0:0]\n-A INPUT -s 10.9.9.9/32 -j MINE\nCOMMIT\n")
    node = cluster.ns("node")
    run_proxy(node, "--cleanup", *IPVS)
    assert not [line for line in ipvsadm(cluster).splitlines() if line.startswith(("TCP", "UDP", "SCTP"))]
    assert cluster.exec("node", ["ip", "link", "show", "kube-ipvs0"], check=False).returncode != 0
    assert "KUBE-" not in cluster.exec("node", ["ipset", "list", "-n"]).stdout
    text = save(node)
    assert "KUBE-" not in text and "-A INPUT -s 10.9.9.9/32 -j MINE" in text
    assert not cluster.request("client", "10.96.0.10", 80, timeout=1).ok


def wait_for(condition, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except Exception:  # the lab is still converging
            pass
        time.sleep(interval)
    return False


def _drain(proc) -> str:
    if proc.poll() is None:
        return "(daemon still running)"
    return proc.stdout.read() if proc.stdout else ""
