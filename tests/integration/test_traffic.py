"""Every proxy mode on a real kernel, one scenario list: real TCP/UDP connections through
service IPs after ``kubenode-proxy --proxy-mode <mode> --once --manifests DIR`` (or the
daemon) programmed the lab's node namespace (tests/integration/lab.py).

Each scenario is written once and runs once per mode; one lab per mode serves all of them
(a ``--once`` run is a full sync: it replaces the previous test's services), conntrack is
flushed before each test. Where upstream's modes differ, ``DIFFERENCES`` says how and the
scenario asserts each mode's own behaviour:

- externalTrafficPolicy Local without a local endpoint: iptables and nftables DROP (the
  client times out); IPVS falls back to the cluster endpoints unmasqueraded
  (kubernetes#97081; this lab routes the reply back through the node, so it works).
- internalTrafficPolicy Local without a local endpoint: DROP; IPVS keeps an empty virtual
  service that refuses.
- localhost NodePorts (iptables.localhostNodePorts): iptables mode only, and it sets
  route_localnet itself; nftables and IPVS refuse 127.0.0.1 and leave the sysctl alone.
- how each mode's kernel objects look, and what ``--cleanup`` must leave behind.

IPVS needs ip_vs and dummy links: where this kernel lacks them (the build machine's) its
cases skip with the probe's reason, and tests/vm/test_ipvs_proxy_mode.py runs them (``-k
ipvs``) as root inside the VM lab's Debian guest, whose kernel has both. The mode-specific
in-process tests (partial syncs, canaries, repair) are in test_nftables_proxier.py,
test_iptables_sync.py and test_ipvs_mode_host.py.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter

import pytest
from lab import Lab, new_prefix
from proxyctl import BIN, NODE_NAME, eps, kube_chains, run_proxy, save, svc, tcp, wait_for, write_manifests
from test_conntrack_cleanup import send  # one UDP datagram from a fixed source port

MODES = ["iptables", "nftables", "ipvs"]
TRIES = 40  # with 3 backends, P(one backend never chosen) = 3 * (2/3)^40 < 1e-6
CLIENT_IP = "10.244.2.10"
EXT_IP = "192.168.50.2"
EXT2_IP = "192.168.50.3"
OTHER_NODE_IP = "192.168.60.1"  # a second node address, outside --nodeport-addresses 192.168.50.0/24
BACKENDS = {"be1": "10.244.1.1", "be2": "10.244.1.2", "be3": "10.244.1.3"}
HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
DNS = [tcp(53, "dns", protocol="UDP")]
DNS_EP = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"

# What upstream's modes do differently (see the module docstring).
DIFFERENCES = {
    "iptables": {"etp_local_without_local": "drop", "itp_local_without_local": "timeout", "localhost": True},
    "nftables": {"etp_local_without_local": "drop", "itp_local_without_local": "timeout", "localhost": False},
    "ipvs": {"etp_local_without_local": "fallback", "itp_local_without_local": "refused", "localhost": False},
}


@functools.cache
def unavailable(mode: str) -> str | None:
    """Why this kernel cannot run ``mode`` (None if it can)."""
    tools = {"iptables": ["iptables-restore", "conntrack"], "nftables": ["nft", "conntrack"],
             "ipvs": ["iptables-restore", "ipset", "ipvsadm", "conntrack"]}[mode]
    if mode == "ipvs":
        subprocess.run(["modprobe", "ip_vs"], capture_output=True, check=False)
        if not os.path.exists("/proc/net/ip_vs"):
            return ("this kernel has no IPVS (modprobe ip_vs failed); IPVS traffic runs in the VM lab "
                    "(tests/vm/test_ipvs_proxy_mode.py runs these cases in the guest)")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"{mode} mode needs {', '.join(missing)}"
    if mode != "ipvs":
        return None
    ns = f"{new_prefix()}probe"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        link = subprocess.run(["ip", "-n", ns, "link", "add", "kube-ipvs0", "type", "dummy"], capture_output=True,
                              text=True, check=False)
        if link.returncode != 0:
            return f"this kernel has no dummy links: {link.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    return None


class Cluster:
    """One mode's lab: three backend pods, a client pod, two external hosts."""

    def __init__(self, lab: Lab, mode: str, manifests) -> None:
        self.lab, self.mode, self.manifests = lab, mode, manifests
        self.differs = DIFFERENCES[mode]
        self.node = lab.ns("node")
        self.node_ip = lab.node_ip

    def __getattr__(self, name):  # request, request_many, exec, ns, iptables_restore, nft, spawn
        return getattr(self.lab, name)

    def apply(self, objects, *args):
        write_manifests(self.manifests, objects)
        return run_proxy(self.node, "--once", "--proxy-mode", self.mode, *args, manifests=self.manifests)

    def proxy(self, *args, check=True):
        return run_proxy(self.node, "--proxy-mode", self.mode, *args, check=check)

    # --- the kernel, as each mode keeps it ---

    def nft_table(self) -> str:
        proc = self.exec("node", ["nft", "list", "table", "ip", "kube-proxy"], check=False)
        return proc.stdout if proc.returncode == 0 else ""

    def ipvsadm(self) -> str:
        return self.exec("node", ["ipvsadm", "-Ln"]).stdout

    def real_servers(self, vip: str, port: int) -> dict:
        """{"10.244.1.1:8080": weight} of one virtual service (ipvsadm -Ln)."""
        out, current = {}, None
        for line in self.ipvsadm().splitlines():
            words = line.split()
            if words[:1] in (["TCP"], ["UDP"], ["SCTP"]):
                current = words[1]
            elif words[:1] == ["->"] and current == f"{vip}:{port}" and words[1][0].isdigit():
                out[words[1]] = int(words[3])
        return out

    def route_localnet(self) -> str:
        return self.exec("node", ["cat", ROUTE_LOCALNET]).stdout.strip()


@pytest.fixture(scope="module", params=MODES)
def mode_lab(request, tmp_path_factory):
    reason = unavailable(request.param)
    if reason:
        pytest.skip(reason)
    yield from lab_cluster(request.param, tmp_path_factory.mktemp(f"manifests-{request.param}"))


def lab_cluster(mode, manifests, dual=False):
    """The lab every case of one mode shares: the backends, a client, two external hosts and
    a second node address (the NodePort address scenario; ext reaches it via the node); with
    ``dual``, IPv6 addresses beside the IPv4 ones. Closed however the module's tests end."""
    lab = Lab(dual_stack=dual)
    try:
        for name, ip in BACKENDS.items():
            lab.add_pod(name, ip, **({"ip6": BACKENDS6[name]} if dual else {}))
        lab.add_client("client", CLIENT_IP, **({"ip6": CLIENT_IP6} if dual else {}))
        lab.add_external("ext", EXT_IP, **({"ip6": EXT_IP6} if dual else {}))
        lab.add_external("ext2", EXT2_IP)
        lab.exec("node", ["ip", "addr", "add", f"{OTHER_NODE_IP}/32", "dev", lab.node_interface])
        lab.exec("ext", ["ip", "route", "add", f"{OTHER_NODE_IP}/32", "via", lab.node_ip])
        yield Cluster(lab, mode, manifests)
    finally:
        lab.close()


@pytest.fixture
def cluster(mode_lab):
    # Flows of the previous test would pin its 5-tuples to its backends.
    mode_lab.exec("node", ["conntrack", "-F"], check=False)
    return mode_lab


def backends(replies):
    assert all(r.ok for r in replies), Counter((r.outcome, r.error) for r in replies)
    return Counter(r.backend for r in replies)


def every_backend(cluster, replies) -> bool:
    """All replies came back, from every backend; IPVS's round robin also spreads evenly."""
    seen = backends(replies)
    if cluster.mode == "ipvs":
        assert max(seen.values()) - min(seen.values()) <= 1, seen
    return set(seen) == set(BACKENDS)


def web(ips=BACKENDS.values(), **spec):
    return [svc("web", "10.96.0.10", HTTP, **spec), eps("web", ips, HTTP_EP)]


# --- scenarios --------------------------------------------------------------------------


def test_cluster_ip_tcp_keeps_pod_sources_and_masquerades_the_rest(cluster):
    cluster.apply(web())
    replies = cluster.request_many("client", "10.96.0.10", 80, count=TRIES)
    assert every_backend(cluster, replies)
    assert {r.seen_client for r in replies} == {CLIENT_IP}  # pod source kept
    for origin in ("ext", "node"):  # from outside the cluster CIDR: masqueraded
        replies = cluster.request_many(origin, "10.96.0.10", 80, count=TRIES)
        assert every_backend(cluster, replies), origin
        assert {r.seen_client for r in replies} == {cluster.node_ip}, origin
    # Each mode's own kernel objects, and none of another mode's.
    iptables = save(cluster.node)
    if cluster.mode == "iptables":
        assert any(c.startswith("KUBE-SVC-") for c in kube_chains(cluster.node))
        assert not cluster.nft_table()
    elif cluster.mode == "nftables":
        assert "service-ips" in cluster.nft_table()
        assert "KUBE-" not in iptables
    else:
        assert "10.96.0.10/32" in cluster.exec("node", ["ip", "-4", "addr", "show", "dev", "kube-ipvs0"]).stdout
        assert "state DOWN" in cluster.exec("node", ["ip", "link", "show", "kube-ipvs0"]).stdout
        assert cluster.real_servers("10.96.0.10", 80) == {f"{ip}:8080": 1 for ip in BACKENDS.values()}
        assert "TCP  10.96.0.10:80 rr" in cluster.ipvsadm()
        assert "10.96.0.10,tcp:80" in cluster.exec("node", ["ipset", "list", "KUBE-CLUSTER-IP"]).stdout
        assert "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT" in save(cluster.node, "nat")
        assert cluster.exec("node", ["sysctl", "-n", "net.ipv4.vs.conntrack"]).stdout.strip() == "1"
        assert "KUBE-SVC-" not in iptables


def test_udp_cluster_ip(cluster):
    cluster.apply([svc("dns", "10.96.0.53", DNS), eps("dns", BACKENDS.values(), DNS_EP)])
    assert every_backend(cluster, cluster.request_many("client", "10.96.0.53", 53, proto="udp", count=TRIES))


def test_service_without_endpoints_is_refused(cluster):
    cluster.apply([svc("empty", "10.96.0.20", [tcp(80, "http", node_port=30020)], type="NodePort",
                       externalIPs=["203.0.113.20"])])
    assert cluster.request("client", "10.96.0.20", 80, timeout=1).outcome == "refused"
    assert cluster.request("node", "10.96.0.20", 80, timeout=1).outcome == "refused"
    assert cluster.request("ext", "203.0.113.20", 80, timeout=1).outcome == "refused"
    assert cluster.request("ext", cluster.node_ip, 30020, timeout=1).outcome == "refused"
    if cluster.mode == "ipvs":
        assert cluster.real_servers("10.96.0.20", 80) == {}  # the virtual service exists, empty
        # A VIP's other ports are closed by KUBE-IPVS-FILTER (kubernetes#72236).
        assert cluster.request("client", "10.96.0.20", 22, timeout=1).outcome == "refused"


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
    assert every_backend(cluster, replies)
    assert {r.seen_client for r in replies} == {cluster.node_ip}
    # Local: only the local endpoint, and the client's own address arrives.
    replies = cluster.request_many("ext", cluster.node_ip, 30081, count=10)
    assert backends(replies) == Counter({"be1": 10})
    assert {r.seen_client for r in replies} == {EXT_IP}
    if cluster.differs["etp_local_without_local"] == "drop":
        # Local with no local endpoint: dropped (no REJECT, so the client times out).
        assert cluster.request("ext", cluster.node_ip, 30082, timeout=1).outcome == "timeout"
    else:
        replies = cluster.request_many("ext", cluster.node_ip, 30082, count=3)
        assert backends(replies) == Counter({"be3": 3}) and {r.seen_client for r in replies} == {EXT_IP}
        assert cluster.real_servers(cluster.node_ip, 30081) == {"10.244.1.1:8080": 1}
    # Pods still reach it through the cluster IP (internal policy is Cluster).
    assert backends(cluster.request_many("client", "10.96.0.32", 80, count=3)) == Counter({"be3": 3})


def test_nodeport_addresses_limit_where_nodeports_answer(cluster):
    objects = [svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
               eps("np", BACKENDS.values(), HTTP_EP)]
    cluster.apply(objects)  # default: every local address
    assert backends(cluster.request_many("ext", OTHER_NODE_IP, 30080, count=3)).keys() <= set(BACKENDS)
    cluster.apply(objects, "--nodeport-addresses", "192.168.50.0/24")
    assert every_backend(cluster, cluster.request_many("ext", cluster.node_ip, 30080, count=TRIES))
    assert not cluster.request("ext", OTHER_NODE_IP, 30080, timeout=1).ok
    # The cluster IP does not depend on it.
    assert backends(cluster.request_many("client", "10.96.0.30", 80, count=3)).keys() <= set(BACKENDS)


def test_external_ips_are_masqueraded(cluster):
    cluster.apply([svc("ext", "10.96.0.40", HTTP, externalIPs=["203.0.113.40"]),
                   eps("ext", BACKENDS.values(), HTTP_EP)])
    replies = cluster.request_many("ext", "203.0.113.40", 80, count=TRIES)
    assert every_backend(cluster, replies)
    assert {r.seen_client for r in replies} == {cluster.node_ip}  # Cluster policy: masqueraded


def test_load_balancer_source_ranges(cluster):
    cluster.apply([svc("lb", "10.96.0.50", [tcp(80, "http", node_port=30050)], type="LoadBalancer",
                       loadBalancerSourceRanges=[f"{EXT_IP}/32"],
                       status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}),
                   eps("lb", BACKENDS.values(), HTTP_EP)])
    assert every_backend(cluster, cluster.request_many("ext", "198.51.100.50", 80, count=TRIES))
    assert cluster.request("ext2", "198.51.100.50", 80, timeout=1).outcome == "timeout"
    if cluster.mode == "ipvs":  # the node is not in the range either: KUBE-IPVS-OUT-FILTER (kubernetes#119656)
        assert not cluster.request("node", "198.51.100.50", 80, timeout=1).ok
    # NodePorts are not subject to source ranges (as upstream).
    assert cluster.request("ext2", cluster.node_ip, 30050).ok


def test_load_balancer_local_policy(cluster):
    cluster.apply([svc("lbl", "10.96.0.51", [tcp(80, "http", node_port=30051)], type="LoadBalancer",
                       externalTrafficPolicy="Local", healthCheckNodePort=32000,
                       status={"loadBalancer": {"ingress": [{"ip": "198.51.100.51"}]}}),
                   eps("lbl", [BACKENDS["be2"]], HTTP_EP)])
    replies = cluster.request_many("ext", "198.51.100.51", 80, count=5)
    assert backends(replies) == Counter({"be2": 5}) and {r.seen_client for r in replies} == {EXT_IP}
    if cluster.mode == "iptables":  # a filter rule lets the health check node port in
        assert '-A KUBE-NODEPORTS -p tcp -m comment --comment "default/lbl:http health check node port" ' \
               '-m tcp --dport 32000 -j ACCEPT' in save(cluster.node, "filter")


def test_internal_traffic_policy_local(cluster):
    cluster.apply([svc("itp", "10.96.0.60", HTTP, internalTrafficPolicy="Local"),
                   eps("itp", [BACKENDS["be1"]], HTTP_EP, node="node1", name="itp-a"),
                   eps("itp", [BACKENDS["be2"], BACKENDS["be3"]], HTTP_EP, node="node2", name="itp-b"),
                   svc("itpn", "10.96.0.61", HTTP, internalTrafficPolicy="Local"),
                   eps("itpn", [BACKENDS["be2"]], HTTP_EP, node="node2")])
    assert backends(cluster.request_many("client", "10.96.0.60", 80, count=15)) == Counter({"be1": 15})
    expected = cluster.differs["itp_local_without_local"]
    assert cluster.request("client", "10.96.0.61", 80, timeout=1).outcome == expected


def test_terminating_endpoints_serve_when_none_is_ready(cluster):
    cluster.apply([svc("term", "10.96.0.65", HTTP),
                   eps("term", [BACKENDS["be1"]], HTTP_EP, ready=False, serving=False, terminating=True,
                       name="term-a"),
                   eps("term", [BACKENDS["be2"]], HTTP_EP, ready=False, serving=True, terminating=True,
                       name="term-b")])
    # Only the serving one of the terminating endpoints (the other is not serving).
    assert backends(cluster.request_many("client", "10.96.0.65", 80, count=10)) == Counter({"be2": 10})
    # A ready endpoint beside it takes all traffic again.
    cluster.apply([svc("term", "10.96.0.65", HTTP),
                   eps("term", [BACKENDS["be2"]], HTTP_EP, ready=False, serving=True, terminating=True,
                       name="term-b"),
                   eps("term", [BACKENDS["be3"]], HTTP_EP, name="term-c")])
    assert backends(cluster.request_many("client", "10.96.0.65", 80, count=10)) == Counter({"be3": 10})


def test_client_ip_session_affinity_sticks(cluster):
    cluster.apply(web(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}}))
    if cluster.mode == "ipvs":
        assert "persistent 300" in cluster.ipvsadm()
    assert len(backends(cluster.request_many("client", "10.96.0.10", 80, count=20))) == 1
    # Without affinity the same client spreads over all backends.
    cluster.apply(web())
    cluster.exec("node", ["conntrack", "-F"], check=False)
    if cluster.mode == "ipvs":
        assert "persistent" not in cluster.ipvsadm()
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)


def test_hairpin_is_masqueraded_and_only_hairpin(cluster):
    cluster.apply([svc("hp", "10.96.0.80", HTTP), eps("hp", [BACKENDS["be1"]], HTTP_EP)])
    reply = cluster.request("be1", "10.96.0.80", 80)
    assert reply.ok and reply.backend == "be1" and reply.seen_client == cluster.node_ip
    # Between two endpoints of one service: to itself masqueraded, to the other not.
    cluster.apply([svc("hp", "10.96.0.80", HTTP), eps("hp", [BACKENDS["be1"], BACKENDS["be2"]], HTTP_EP)])
    seen = {(r.backend, r.seen_client) for r in cluster.request_many("be1", "10.96.0.80", 80, count=TRIES)}
    assert seen == {("be1", cluster.node_ip), ("be2", BACKENDS["be1"])}


def test_endpoint_change_takes_effect_and_stale_objects_go(cluster):
    cluster.apply(web())
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    cluster.apply(web([BACKENDS["be3"]]))
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=10)) == Counter({"be3": 10})
    if cluster.mode == "iptables":
        assert len([c for c in kube_chains(cluster.node) if c.startswith("KUBE-SEP-")]) == 1
    elif cluster.mode == "nftables":
        table = cluster.nft_table()
        assert "10.244.1.3" in table and "10.244.1.1" not in table and "10.244.1.2" not in table
    else:
        # The old real servers still have (TIME_WAIT) connections: weight 0 until they are
        # gone, or already deleted (graceful termination as upstream).
        rs = cluster.real_servers("10.96.0.10", 80)
        assert rs.pop("10.244.1.3:8080") == 1
        assert all(weight == 0 for weight in rs.values()), rs


def test_second_sync_writes_nothing(cluster):
    objects = [*web(externalIPs=["203.0.113.10"]),
               svc("lb", "10.96.0.50", [tcp(80, "http", node_port=30050)], type="LoadBalancer",
                   loadBalancerSourceRanges=[f"{EXT_IP}/32"],
                   status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}),
               eps("lb", BACKENDS.values(), HTTP_EP)]
    cluster.apply(objects)
    before = cluster.exec("node", ["nft", "-s", "list", "table", "ip", "kube-proxy"]).stdout \
        if cluster.mode == "nftables" else ""
    out = cluster.apply(objects, "-v").stdout
    if cluster.mode != "nftables":
        assert "(0 written, 0 changes)" in out, out  # the kernel's canonical forms are the compiled ones
        return
    # nftables mode does not read the table back: a new process's first sync rewrites the
    # whole table in one transaction (docs/nftables-mode.md), to the same content.
    assert "table replaced" in out, out
    assert cluster.exec("node", ["nft", "-s", "list", "table", "ip", "kube-proxy"]).stdout == before


def test_localhost_nodeports(cluster, tmp_path):
    """iptables mode: localhost NodePorts (default on) as upstream's IPv4 packet-flow cases,
    with the node's route_localnet at 0: nobody but the proxy sets it (upstream's NewProxier
    does). Without it the kernel drops packets from 127.0.0.1 once DNAT has sent them to a
    pod. nftables and IPVS mode do not offer localhost NodePorts (as upstream): 127.0.0.1
    gets nothing and the sysctl stays as it was."""
    cluster.exec("node", ["sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=0"])
    objects = [
        svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
        eps("np", [BACKENDS["be1"], BACKENDS["be2"]], HTTP_EP),
        svc("dns", "10.96.0.53", [tcp(53, "dns", node_port=30053, protocol="UDP")], type="NodePort"),
        eps("dns", [BACKENDS["be1"], BACKENDS["be2"]], DNS_EP),
        svc("loc", "10.96.0.31", [tcp(80, "http", node_port=30081)], type="NodePort", externalTrafficPolicy="Local"),
        eps("loc", [BACKENDS["be1"]], HTTP_EP, name="loc-local"),
        eps("loc", [BACKENDS["be3"]], HTTP_EP, node="node2", name="loc-remote"),
        svc("empty", "10.96.0.32", [tcp(80, "http", node_port=30082)], type="NodePort"),
    ]
    local = {"be1", "be2"}
    # Where the proxy must leave the sysctl alone: nodePortAddresses without 127.0.0.1,
    # localhostNodePorts false.
    config = tmp_path / "config.yaml"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                      "iptables:\n  localhostNodePorts: false\n")
    for args in (["--nodeport-addresses", "192.168.50.0/24"], ["--config", str(config)]):
        proc = cluster.apply(objects, *args)
        assert cluster.route_localnet() == "0" and "route_localnet" not in proc.stdout, args
        assert not cluster.request("node", "127.0.0.1", 30080, timeout=1).ok, args
        assert set(backends(cluster.request_many("node", cluster.node_ip, 30080, count=4))) <= local

    proc = cluster.apply(objects)  # defaults: localhostNodePorts true
    if not cluster.differs["localhost"]:
        assert cluster.route_localnet() == "0" and "route_localnet" not in proc.stdout
        assert not cluster.request("node", "127.0.0.1", 30080, timeout=1).ok
        assert not cluster.request("node", "127.0.0.1", 30053, proto="udp", timeout=1).ok
        assert backends(cluster.request_many("node", cluster.node_ip, 30080, count=24)).keys() == local
        return
    assert cluster.route_localnet() == "1"
    assert "setting net.ipv4.conf.all.route_localnet=1 to allow NodePorts on localhost" in proc.stdout
    assert "sysctl net.ipv4.conf.all.route_localnet: 0 -> 1" in proc.stdout
    tries = 24  # 2 backends: P(one never chosen) = 2 * (1/2)^24 < 1e-6
    # localhost to NodePort gets masqueraded (the pod cannot answer 127.0.0.1).
    replies = cluster.request_many("node", "127.0.0.1", 30080, count=tries)
    assert backends(replies).keys() == local and {r.seen_client for r in replies} == {cluster.node_ip}
    replies = cluster.request_many("node", "127.0.0.1", 30053, proto="udp", count=tries)
    assert backends(replies).keys() == local and {r.seen_client for r in replies} == {cluster.node_ip}
    # eTP:Local: traffic from the node itself is masqueraded and may use every endpoint.
    replies = cluster.request_many("node", "127.0.0.1", 30081, count=tries)
    assert backends(replies).keys() == {"be1", "be3"} and {r.seen_client for r in replies} == {cluster.node_ip}
    # No endpoints: rejected, also on localhost.
    assert cluster.request("node", "127.0.0.1", 30082, timeout=1).outcome == "refused"
    # node to NodePort on the node IP: unchanged.
    assert backends(cluster.request_many("node", cluster.node_ip, 30080, count=tries)).keys() == local
    # A second run finds the sysctl set and changes nothing.
    proc = cluster.apply(objects)
    assert "sysctl net.ipv4.conf.all.route_localnet" not in proc.stdout and cluster.route_localnet() == "1"


def test_daemon_follows_manifest_edits_and_removes_stale_udp_flows(cluster, tmp_path):
    """The daemon: partial syncs follow manifest edits; a UDP flow keeps its conntrack entry,
    so after its endpoint goes it would stick to the old backend (still running here) unless
    the proxy deleted the entry (a `--once` run, a fresh process, knows no old endpoints)."""
    manifests, log = tmp_path / "daemon-manifests", tmp_path / "daemon.log"
    write_manifests(manifests, web())
    proc = cluster.spawn("node", [sys.executable, str(BIN), "--proxy-mode", cluster.mode,
                                  "--manifests", str(manifests), "--hostname-override", NODE_NAME,
                                  "--cluster-cidr", "10.244.0.0/16", "--nodeport-addresses", "192.168.50.0/24",
                                  "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0",
                                  f"--{'ipvs' if cluster.mode == 'ipvs' else 'iptables'}-min-sync-period", "0s"],
                         stdout=log)
    try:
        wait_for(lambda: cluster.request("client", "10.96.0.10", 80, timeout=0.5).ok, 60, what="the first sync")
        assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
        # The endpoint change, a new service, and a UDP flow whose endpoint goes.
        new = [svc("new", "10.96.0.11", HTTP), eps("new", [BACKENDS["be1"]], HTTP_EP)]
        write_manifests(manifests, [*web([BACKENDS["be2"]]), *new, svc("dns", "10.96.0.53", DNS),
                                    eps("dns", [BACKENDS["be1"]], DNS_EP)])
        wait_for(lambda: send(cluster.lab, "client", "10.96.0.53", 53, sport=41001, timeout=0.5) == "be1", 60)
        assert backends(cluster.request_many("client", "10.96.0.10", 80, count=5)) == Counter({"be2": 5})
        assert backends(cluster.request_many("client", "10.96.0.11", 80, count=3)) == Counter({"be1": 3})
        assert send(cluster.lab, "client", "10.96.0.53", 53, sport=41053) == "be1"  # the long-lived flow
        write_manifests(manifests, [*web([BACKENDS["be2"]]), *new, svc("dns", "10.96.0.53", DNS),
                                    eps("dns", [BACKENDS["be2"]], DNS_EP)])
        wait_flow_moves(lambda sport: send(cluster.lab, "client", "10.96.0.53", 53, sport=sport, timeout=0.5),
                        41002, 41053, "be2")
        stop_daemon(proc)
    finally:
        kill_daemon(proc)
    text = log.read_text()
    assert f"{cluster.mode} mode" in text and "partial sync" in text and "sync failed" not in text, text
    # SIGTERM leaves the rules in place.
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=3)) == Counter({"be2": 3})


def wait_flow_moves(send_from, new_sport, old_sport, backend):
    """After an endpoint change: a new 5-tuple reaches ``backend`` (the rules are in), then the
    long-lived one on ``old_sport`` does too, which it would not (its old backend still runs)
    had its conntrack entry stayed. The entry is deleted after the rules are in, as upstream
    does, so the second wait is needed (asserting at once failed 1 in ~10 runs)."""
    wait_for(lambda: send_from(new_sport) == backend, 60, what="the endpoint change")
    wait_for(lambda: send_from(old_sport) == backend, 10, what="the stale UDP flow's conntrack entry to go")


def stop_daemon(proc):
    """SIGTERM, and the daemon exits 0 within 30 s (it leaves the rules in place)."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def kill_daemon(proc):
    """A test's teardown: the daemon is gone whatever failed before."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_cleanup_removes_ours_and_leaves_foreign_rules(cluster):
    cluster.iptables_restore("*nat\n:MYCHAIN - [0:0]\n-A MYCHAIN -d 10.1.2.3/32 -j RETURN\n"
                             "-A PREROUTING -d 10.1.2.4/32 -j MYCHAIN\nCOMMIT\n"
                             "*filter\n-A INPUT -s 10.9.9.9/32 -j DROP\nCOMMIT\n")
    nft = shutil.which("nft") is not None  # the VM guest (IPVS) may have no nft
    if nft:
        cluster.nft("add table ip mine\nadd chain ip mine c\nadd rule ip mine c ip daddr 10.1.2.3 return\n")
    try:
        cluster.apply([*web(externalIPs=["203.0.113.10"]),
                       svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
                       eps("np", BACKENDS.values(), HTTP_EP)])
        cluster.apply(web([BACKENDS["be1"]]))  # a second sync over the foreign rules
        assert cluster.request("client", "10.96.0.10", 80).backend == "be1"
        foreign = ["-A MYCHAIN -d 10.1.2.3/32 -j RETURN", "-A PREROUTING -d 10.1.2.4/32 -j MYCHAIN",
                   "-A INPUT -s 10.9.9.9/32 -j DROP"]
        assert all(line in save(cluster.node) for line in foreign)
        cluster.proxy("--cleanup")
        text = save(cluster.node)
        assert "KUBE-" not in text and all(line in text for line in foreign)
        if nft:
            ruleset = cluster.exec("node", ["nft", "list", "ruleset"]).stdout
            assert "table ip kube-proxy" not in ruleset and "ip daddr 10.1.2.3 return" in ruleset
        if cluster.mode == "ipvs":
            lines = cluster.ipvsadm().splitlines()
            assert not [line for line in lines if line.startswith(("TCP", "UDP", "SCTP"))]
            assert cluster.exec("node", ["ip", "link", "show", "kube-ipvs0"], check=False).returncode != 0
            assert "KUBE-" not in cluster.exec("node", ["ipset", "list", "-n"]).stdout
        assert not cluster.request("client", "10.96.0.10", 80, timeout=1).ok
    finally:
        # The lab outlives this test: take the foreign rules away again.
        cluster.exec("node", ["iptables-restore", "--noflush"], check=False,
                     input="*nat\n-D PREROUTING -d 10.1.2.4/32 -j MYCHAIN\n-X MYCHAIN\nCOMMIT\n"
                           "*filter\n-D INPUT -s 10.9.9.9/32 -j DROP\nCOMMIT\n")
        if nft:
            cluster.exec("node", ["nft", "delete", "table", "ip", "mine"], check=False)


# --- IPv6 and dual-stack (iptables and nftables modes) -----------------------------------
#
# One dual-stack lab per mode: every pod and external host has an IPv6 address too, and
# the node runs one proxier per family (``--cluster-cidr`` with one CIDR per family).
# IPVS mode serves IPv4 only so far (IPv6 virtual servers, KUBE-6-* ipsets: not built):
# a dual-stack IPVS node programs the IPv4 half, so it has no case here.

DUAL_MODES = ["iptables", "nftables"]
DUAL_CIDRS = "10.244.0.0/16,fd00:10:244::/48"
BACKENDS6 = {"be1": "fd00:10:244::1:1", "be2": "fd00:10:244::1:2", "be3": "fd00:10:244::1:3"}
CLIENT_IP6 = "fd00:10:244::2:10"
EXT_IP6 = "fd00:50::2"
NODE_IP6 = "fd00:50::1"
WEB6 = "fd00:10:96::10"

# One UDP datagram over IPv6 from a fixed source port (one flow per port); prints the backend.
SEND6 = r"""
import socket, sys
dst, port, sport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", sport))
s.settimeout(float(sys.argv[4]))
s.sendto(b"ping", (dst, port))
try:
    print(s.recvfrom(4096)[0].decode().split()[0])
except socket.timeout:
    print("timeout")
"""


# GET a health check node port over IPv6; prints the body.
HEALTH6 = r"""
import http.client, sys
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=2)
conn.request("GET", "/")
print(conn.getresponse().read().decode())
"""


def send6(lab, ns: str, dst: str, port: int, sport: int, timeout: float = 2.0) -> str:
    return lab.exec(ns, [sys.executable, "-c", SEND6, dst, str(port), str(sport), str(timeout)],
                    timeout=timeout + 15).stdout.strip()


def eps6(service, ips, ports, **kw):
    return {**eps(service, ips, ports, name=kw.pop("name", f"{service}-v6"), **kw), "addressType": "IPv6"}


def dual(name, ip4, ip6, ports, **spec):
    """A dual-stack Service (PreferDualStack, IPv4 primary)."""
    return svc(name, ip4, ports, clusterIPs=[ip4, ip6], ipFamilies=["IPv4", "IPv6"],
               ipFamilyPolicy="PreferDualStack", **spec)


def single6(name, ip6, ports, **spec):
    return svc(name, ip6, ports, ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack", **spec)


@pytest.fixture(scope="module", params=DUAL_MODES)
def dual_lab(request, tmp_path_factory):
    reason = unavailable(request.param) or (None if shutil.which("ip6tables-restore") else "no ip6tables-restore")
    if reason:
        pytest.skip(reason)
    yield from lab_cluster(request.param, tmp_path_factory.mktemp(f"manifests6-{request.param}"), dual=True)


@pytest.fixture
def dual_cluster(dual_lab):
    dual_lab.exec("node", ["conntrack", "-F"], check=False)
    dual_lab.exec("node", ["conntrack", "-F", "-f", "ipv6"], check=False)
    return dual_lab


def apply_dual(cluster, objects, *args):
    return cluster.apply(objects, "--cluster-cidr", DUAL_CIDRS, *args)


def save6(cluster) -> str:
    return cluster.exec("node", ["ip6tables-save"]).stdout


def nft6(cluster) -> str:
    proc = cluster.exec("node", ["nft", "list", "table", "ip6", "kube-proxy"], check=False)
    return proc.stdout if proc.returncode == 0 else ""


def test_dual_stack_service_answers_on_both_families(dual_cluster):
    c = dual_cluster
    apply_dual(c, [dual("web", "10.96.0.10", WEB6, HTTP), eps("web", BACKENDS.values(), HTTP_EP),
                   eps6("web", BACKENDS6.values(), HTTP_EP),
                   dual("dns", "10.96.0.53", "fd00:10:96::53", DNS), eps("dns", BACKENDS.values(), DNS_EP),
                   eps6("dns", BACKENDS6.values(), DNS_EP)])
    replies = c.request_many("client", WEB6, 80, count=TRIES)  # IPv6 TCP
    assert every_backend(c, replies)
    assert {r.seen_client for r in replies} == {CLIENT_IP6}  # pod source kept
    assert {r.server_ip for r in replies} == set(BACKENDS6.values())  # IPv6 endpoints, not IPv4 ones
    replies = c.request_many("client", "10.96.0.10", 80, count=TRIES)  # the IPv4 half still works
    assert every_backend(c, replies) and {r.seen_client for r in replies} == {CLIENT_IP}
    replies = c.request_many("ext", WEB6, 80, count=TRIES)  # from outside the cluster CIDR: masqueraded
    assert every_backend(c, replies) and {r.seen_client for r in replies} == {NODE_IP6}
    assert every_backend(c, c.request_many("client", "fd00:10:96::53", 53, proto="udp", count=TRIES))
    assert every_backend(c, c.request_many("client", "10.96.0.53", 53, proto="udp", count=TRIES))
    # Each family's own ruleset: the IPv6 cluster IP only in the IPv6 one.
    if c.mode == "iptables":
        assert "-d fd00:10:96::10/128" in save6(c) and "fd00:" not in save(c.node)
        assert "-d 10.96.0.10/32" in save(c.node)
        assert not nft6(c)
    else:
        assert WEB6 in nft6(c) and "fd00:" not in c.nft_table() and "10.96.0.10" in c.nft_table()
        assert "KUBE-" not in save6(c)


def test_ipv6_service_without_endpoints_is_refused(dual_cluster):
    c = dual_cluster
    apply_dual(c, [single6("empty", "fd00:10:96::20", [tcp(80, "http", node_port=30020)], type="NodePort")])
    # ICMPv6 port unreachable; 3 s: a reply racing the connect() (socket still locked) is
    # dropped (TcpExtLockDroppedIcmps) and only the SYN retransmitted after 1 s gets its answer.
    assert c.request("client", "fd00:10:96::20", 80, timeout=3).outcome == "refused"
    assert c.request("ext", NODE_IP6, 30020, timeout=3).outcome == "refused"
    if c.mode == "iptables":
        assert "icmp6-port-unreachable" in save6(c)


def test_nodeport_on_ipv6_node_address(dual_cluster):
    c = dual_cluster
    apply_dual(c, [dual("np", "10.96.0.30", "fd00:10:96::30", [tcp(80, "http", node_port=30080)], type="NodePort"),
                   eps("np", BACKENDS.values(), HTTP_EP), eps6("np", BACKENDS6.values(), HTTP_EP),
                   dual("npl", "10.96.0.31", "fd00:10:96::31", [tcp(80, "http", node_port=30081)], type="NodePort",
                        externalTrafficPolicy="Local"),
                   eps6("npl", [BACKENDS6["be1"]], HTTP_EP, node="node1", name="npl-a"),
                   eps6("npl", [BACKENDS6["be2"]], HTTP_EP, node="node2", name="npl-b")])
    replies = c.request_many("ext", NODE_IP6, 30080, count=TRIES)
    assert every_backend(c, replies) and {r.seen_client for r in replies} == {NODE_IP6}
    assert every_backend(c, c.request_many("ext", c.node_ip, 30080, count=TRIES))  # and on the IPv4 address
    # externalTrafficPolicy Local over IPv6: the local endpoint only, the client's address kept.
    replies = c.request_many("ext", NODE_IP6, 30081, count=10)
    assert backends(replies) == Counter({"be1": 10}) and {r.seen_client for r in replies} == {EXT_IP6}
    # No NodePort on ::1 (IPv6 has no route_localnet): nothing answers there.
    assert not c.request("node", "::1", 30080, timeout=1).ok


def test_ipv6_only_node_serves_ipv6_services_only(dual_cluster):
    c = dual_cluster
    c.proxy("--cleanup")  # the IPv4 rules of the previous tests go
    c.apply([single6("web6", WEB6, HTTP), eps6("web6", BACKENDS6.values(), HTTP_EP),
             svc("web4", "10.96.0.10", HTTP), eps("web4", BACKENDS.values(), HTTP_EP)],
            "--cluster-cidr", "fd00:10:244::/48")
    assert every_backend(c, c.request_many("client", WEB6, 80, count=TRIES))
    assert not c.request("client", "10.96.0.10", 80, timeout=1).ok  # the IPv4 Service is not served
    if c.mode == "iptables":
        assert "KUBE-SVC-" in save6(c) and "KUBE-SVC-" not in save(c.node)
    else:
        assert nft6(c) and not c.nft_table()


def test_daemon_removes_stale_ipv6_udp_flows(dual_cluster, tmp_path):
    """The dual-stack daemon: an IPv6 UDP flow whose endpoint goes loses its conntrack entry
    (it would otherwise stick to the old backend, still running here)."""
    c = dual_cluster
    manifests, log = tmp_path / "daemon6", tmp_path / "daemon6.log"
    dns = [dual("dns", "10.96.0.53", "fd00:10:96::53", DNS),
           # A health check node port, probed over IPv6 (its local endpoint is IPv6's).
           dual("lb", "10.96.0.60", "fd00:10:96::60", [tcp(80, "http", node_port=30060)], type="LoadBalancer",
                externalTrafficPolicy="Local", healthCheckNodePort=32060),
           eps6("lb", [BACKENDS6["be3"]], HTTP_EP, node=NODE_NAME)]
    write_manifests(manifests, [*dns, eps6("dns", [BACKENDS6["be1"]], DNS_EP)])
    proc = c.spawn("node", [sys.executable, str(BIN), "--proxy-mode", c.mode, "--manifests", str(manifests),
                            "--hostname-override", NODE_NAME, "--cluster-cidr", DUAL_CIDRS,
                            "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0",
                            "--iptables-min-sync-period", "0s"], stdout=log)
    try:
        wait_for(lambda: send6(c.lab, "client", "fd00:10:96::53", 53, sport=42001, timeout=0.5) == "be1", 60,
                 what="the first sync")
        assert send6(c.lab, "client", "fd00:10:96::53", 53, sport=42053) == "be1"  # the long-lived flow
        health = wait_for(lambda: c.exec("ext", [sys.executable, "-c", HEALTH6, NODE_IP6, "32060"],
                                         check=False).stdout, 30, what="the health check node port over IPv6")
        assert '"localEndpoints": 1' in health, health
        write_manifests(manifests, [*dns, eps6("dns", [BACKENDS6["be2"]], DNS_EP)])
        wait_flow_moves(lambda sport: send6(c.lab, "client", "fd00:10:96::53", 53, sport=sport, timeout=0.5),
                        42002, 42053, "be2")
        stop_daemon(proc)
    finally:
        kill_daemon(proc)
    text = log.read_text()
    assert "(IPv4 and IPv6)" in text and "sync failed" not in text, text


def test_cleanup_removes_both_families(dual_cluster):
    c = dual_cluster
    apply_dual(c, [dual("web", "10.96.0.10", WEB6, HTTP), eps("web", BACKENDS.values(), HTTP_EP),
                   eps6("web", BACKENDS6.values(), HTTP_EP)])
    assert c.request("client", WEB6, 80).ok
    c.proxy("--cleanup")
    assert "KUBE-" not in save6(c) and "KUBE-" not in save(c.node)
    assert not nft6(c) and not c.nft_table()
    assert not c.request("client", WEB6, 80, timeout=1).ok
