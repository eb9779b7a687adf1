"""Self-tests of the namespace lab: plain routing works before any proxy rule exists.

Apart from the last tests (which install single hand-written rules to check
the routing of service IPs and REJECT reporting), no proxy rules are involved.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from lab import NODE_IP, NODE_IP6, STATE_DIR, Lab, LabError, Server, cleanup_stale, new_prefix, tally

BACKEND_IP = "10.244.1.10"
CLIENT_IP = "10.244.2.5"
EXTERNAL_IP = "192.168.50.2"
CLUSTER_IP = "10.96.0.10"
CLIENT_KINDS = ("client", "ext", "node")  # in-cluster pod, outside host, the node itself


def build(lab: Lab) -> None:
    """One backend pod, one client pod, one external host."""
    lab.add_pod("web1", BACKEND_IP)
    lab.add_client("client", CLIENT_IP)
    lab.add_external("ext", EXTERNAL_IP)


def expected_source(kind: str) -> str:
    return {"client": CLIENT_IP, "ext": EXTERNAL_IP, "node": NODE_IP}[kind]


def host_links() -> str:
    """Interface names of the host namespace (read only)."""
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


def process_gone(server: Server) -> bool:
    if server.process.poll() is None:
        return False
    try:
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"echo_server.py" not in cmdline  # pid reused by something else


# ---------------------------------------------------------------- topology


def test_names_use_a_unique_prefix_and_fit_ifnamsiz(lab: Lab) -> None:
    build(lab)
    assert re.fullmatch(r"kn[0-9a-f]{6}-", lab.prefix)
    assert all(ns.startswith(lab.prefix) for ns in lab.namespaces)
    assert lab.ns("node") == f"{lab.prefix}node"
    assert lab.ns("web1") == lab.hosts["web1"].ns
    node_links = lab.exec("node", ["ip", "-o", "link", "show"]).stdout
    names = re.findall(r"^\d+: ([^:@]+)", node_links, re.M)
    assert lab.hosts["web1"].peer_interface in names
    assert all(len(name) <= 15 for name in names)
    with pytest.raises(KeyError):
        lab.ns("nope")


def test_pod_to_pod_tcp_and_udp_keep_the_client_ip(lab: Lab) -> None:
    build(lab)
    tcp = lab.request("client", BACKEND_IP, 8080)
    udp = lab.request("client", BACKEND_IP, 5353, "udp")
    for reply in (tcp, udp):
        assert reply.outcome == "ok", reply
        assert reply.backend == "web1"
        assert reply.server_ip == BACKEND_IP
        assert reply.seen_client == CLIENT_IP


def test_pod_serves_extra_ports_and_refuses_closed_ones(lab: Lab) -> None:
    lab.add_pod("multi", "10.244.1.20", tcp_ports=[8080, 9090], udp_ports=[5353, 5354])
    lab.add_client("client", CLIENT_IP)
    for port, proto in ((8080, "tcp"), (9090, "tcp"), (5353, "udp"), (5354, "udp")):
        assert lab.request("client", "10.244.1.20", port, proto).backend == "multi"
    # Closed ports answer with RST / ICMP port unreachable, every time.
    assert tally(lab.request_many("client", "10.244.1.20", 1234, "tcp", count=10)) == {"refused": 10}
    assert tally(lab.request_many("client", "10.244.1.20", 1234, "udp", count=10)) == {"refused": 10}


def test_request_many_uses_fresh_source_ports(lab: Lab) -> None:
    build(lab)
    replies = lab.request_many("client", BACKEND_IP, 8080, count=20)
    assert tally(replies) == {"web1": 20}
    assert len({r.seen_port for r in replies}) == 20


def test_external_host_and_node_reach_each_other(lab: Lab) -> None:
    build(lab)
    lab.add_external("ext2", "192.168.50.3")
    lab.start_server("node", "node", tcp_ports=[30080], udp_ports=[30053])
    for ext, ip in (("ext", EXTERNAL_IP), ("ext2", "192.168.50.3")):
        for port, proto in ((30080, "tcp"), (30053, "udp")):
            reply = lab.request(ext, lab.node_ip, port, proto)
            assert (reply.backend, reply.server_ip, reply.seen_client) == ("node", NODE_IP, ip), reply
    # The node reaches pods directly, from the node IP.
    assert lab.request("node", BACKEND_IP, 8080).seen_client == NODE_IP


def test_unhandled_service_ip_times_out(lab: Lab) -> None:
    build(lab)
    for kind in CLIENT_KINDS:
        assert lab.request(kind, "10.96.0.99", 80, "udp", timeout=0.2).outcome == "timeout"


# ------------------------------------------------------------------ cleanup


def test_close_removes_namespaces_links_and_processes() -> None:
    lab = Lab()
    build(lab)
    node_server = lab.start_server("node", tcp_ports=[30080], udp_ports=[])
    namespaces, servers = lab.namespaces, list(lab.servers)
    assert len(namespaces) == 5 and len(servers) == 2
    lab.close()
    lab.close()  # idempotent
    remaining = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ns for ns in namespaces if ns in remaining.split()]
    assert lab.prefix not in remaining
    assert lab.prefix not in host_links()
    assert all(process_gone(server) for server in servers)
    assert process_gone(node_server)
    assert not (STATE_DIR / f"{lab.prefix.rstrip('-')}.owner").exists()


def test_failed_setup_is_cleaned_up(lab: Lab) -> None:
    lab.add_client("client", CLIENT_IP)
    with pytest.raises(LabError, match="did not become ready"):
        lab.add_pod("broken", "10.244.1.99", tcp_ports=[70000])  # server cannot bind
    with pytest.raises(ValueError):
        lab.add_pod("client", "10.244.1.98")  # duplicate name
    prefix = lab.prefix
    lab.close()
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout


def test_cleanup_stale_spares_live_labs(lab: Lab) -> None:
    stale = f"{new_prefix()}node"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        removed = cleanup_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)
    assert stale in removed
    assert not set(lab.namespaces) & set(removed)
    assert lab.request("node", NODE_IP, 9, timeout=0.5).outcome == "refused"  # lab still alive


# ---------------------------------------- routing of service IPs (hand-made rules)


DNAT_RULES = f"""*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A PREROUTING -d {CLUSTER_IP} -p tcp --dport 80 -j DNAT --to-destination {BACKEND_IP}:8080
-A OUTPUT -d {CLUSTER_IP} -p tcp --dport 80 -j DNAT --to-destination {BACKEND_IP}:8080
-A PREROUTING -d {CLUSTER_IP} -p udp --dport 53 -j DNAT --to-destination {BACKEND_IP}:5353
-A OUTPUT -d {CLUSTER_IP} -p udp --dport 53 -j DNAT --to-destination {BACKEND_IP}:5353
COMMIT
"""


def test_cluster_ip_dnat_from_every_client_kind(lab: Lab) -> None:
    build(lab)
    lab.iptables_restore(DNAT_RULES)
    for kind in CLIENT_KINDS:
        for port, proto in ((80, "tcp"), (53, "udp")):
            reply = lab.request(kind, CLUSTER_IP, port, proto)
            assert reply.outcome == "ok", (kind, proto, reply)
            assert (reply.backend, reply.server_ip) == ("web1", BACKEND_IP), (kind, proto, reply)
            # No masquerade rule: the backend sees the real source.
            assert reply.seen_client == expected_source(kind), (kind, proto, reply)


def test_reject_is_reported_as_refused_without_rate_limit(lab: Lab) -> None:
    build(lab)
    lab.iptables_restore(f"""*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -d {CLUSTER_IP} -j REJECT
-A OUTPUT -d {CLUSTER_IP} -j REJECT
-A FORWARD -d 10.96.0.12 -j REJECT --reject-with icmp-host-prohibited
-A OUTPUT -d 10.96.0.12 -j REJECT --reject-with icmp-host-prohibited
-A OUTPUT -d 10.96.0.13 -j DROP
COMMIT
""")
    for kind in CLIENT_KINDS:
        for proto in ("tcp", "udp"):  # every REJECT answers: ICMP rate limits are off
            replies = lab.request_many(kind, CLUSTER_IP, 80, proto, count=20)
            assert tally(replies) == {"refused": 20}, (kind, proto)
        assert lab.request(kind, "10.96.0.12", 80).outcome == "unreachable", kind
    # A DROP in the node's own OUTPUT chain (EPERM from send()) is a timeout too.
    assert lab.request("node", "10.96.0.13", 80, "udp", timeout=0.2).outcome == "timeout"


def test_external_host_is_not_redirected_around_the_node(lab: Lab) -> None:
    """Unhandled service traffic goes node -> gateway; ICMP redirects must not
    teach the external host to bypass the node once a rule is installed."""
    build(lab)
    probes = lab.request_many("ext", CLUSTER_IP, 53, "udp", count=4, timeout=0.1)
    assert tally(probes) == {"timeout": 4}
    lab.iptables_restore(DNAT_RULES)
    assert lab.request("ext", CLUSTER_IP, 53, "udp").backend == "web1"
    route = lab.exec("ext", ["ip", "route", "get", CLUSTER_IP]).stdout
    assert f"via {NODE_IP}" in route and "redirected" not in route


# ---------------------------------------------------------------- dual stack

BACKEND_IP6 = "fd00:10:244:1::10"
CLIENT_IP6 = "fd00:10:244:2::5"
EXTERNAL_IP6 = "fd00:50::2"
CLUSTER_IP6 = "fd00:10:96::10"


@pytest.fixture
def lab6():
    with Lab(dual_stack=True) as lab:
        lab.add_pod("web1", BACKEND_IP, ip6=BACKEND_IP6)
        lab.add_client("client", CLIENT_IP, ip6=CLIENT_IP6)
        lab.add_external("ext", EXTERNAL_IP, ip6=EXTERNAL_IP6)
        yield lab


def test_dual_stack_hosts_reach_each_other_over_both_families(lab6: Lab) -> None:
    # External hosts route only the service ranges via the node (as in IPv4): see the DNAT test.
    for kind, source4, source6 in (("client", CLIENT_IP, CLIENT_IP6), ("node", NODE_IP, NODE_IP6)):
        for proto in ("tcp", "udp"):
            for dest, port, source in ((BACKEND_IP, 8080 if proto == "tcp" else 5353, source4),
                                       (BACKEND_IP6, 8080 if proto == "tcp" else 5353, source6)):
                reply = lab6.request(kind, dest, port, proto)
                assert (reply.outcome, reply.backend, reply.server_ip, reply.seen_client) == \
                    ("ok", "web1", dest, source), (kind, proto, dest, reply)
    # An IPv6 service address nothing handles ends at the lan namespace: a timeout, as for IPv4.
    assert lab6.request("client", CLUSTER_IP6, 80, timeout=0.3).outcome == "timeout"


def test_ipv6_service_dnat_with_ip6tables_and_nft(lab6: Lab) -> None:
    """The node forwards IPv6 service traffic the way the proxy modes will program it."""
    lab6.exec("node", ["ip6tables-restore", "--noflush"], input=f"""*nat
-A PREROUTING -d {CLUSTER_IP6} -p tcp --dport 80 -j DNAT --to-destination [{BACKEND_IP6}]:8080
-A OUTPUT -d {CLUSTER_IP6} -p tcp --dport 80 -j DNAT --to-destination [{BACKEND_IP6}]:8080
COMMIT
""")
    dnat = f"ip6 daddr {CLUSTER_IP6} udp dport 53 dnat to [{BACKEND_IP6}]:5353"
    lab6.nft(f"""table ip6 labtest {{
  chain pre {{ type nat hook prerouting priority dstnat; {dnat}; }}
  chain out {{ type nat hook output priority -100; {dnat}; }}
}}
""")
    for kind, source in (("client", CLIENT_IP6), ("ext", EXTERNAL_IP6), ("node", NODE_IP6)):
        for port, proto in ((80, "tcp"), (53, "udp")):
            reply = lab6.request(kind, CLUSTER_IP6, port, proto)
            assert (reply.outcome, reply.backend, reply.server_ip, reply.seen_client) == \
                ("ok", "web1", BACKEND_IP6, source), (kind, proto, reply)


def test_ipv6_addresses_need_a_dual_stack_lab(lab: Lab) -> None:
    with pytest.raises(ValueError, match="dual_stack"):
        lab.add_pod("web6", BACKEND_IP, ip6=BACKEND_IP6)
