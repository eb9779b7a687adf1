"""Stale UDP conntrack entries on the real kernel, and ConntrackCleaner removing them.

Rules are hand-written DNATs in a private nat chain of the lab's node namespace (no
proxier involved). Clients send from a FIXED source port, so every datagram belongs to
the same conntrack entry: NAT rules are only consulted for its first packet, so after
the DNAT target changes the entry keeps sending the client to the old backend until it
is deleted. Every namespace is the lab's (tests/integration/lab.py): deleted after each
test, also on failure.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.conntrack import (
    ConntrackCleaner,
    ConntrackError,
    Flow,
    ServiceTarget,
    delete_flows,
    list_flows,
)

SVC = "10.96.0.53"
OTHER_SVC = "10.96.0.54"
TCP_SVC = "10.96.0.80"
CLIENT_IP = "10.244.2.10"
EXT_IP = "192.168.50.2"
NODE_IP = "192.168.50.1"
BE1 = "10.244.1.1"
BE2 = "10.244.1.2"
DNS_PORT = 5353  # the echo servers' UDP port
HTTP_PORT = 8080  # the echo servers' TCP port
NODE_PORT = 30053
CHAIN = "KN-CT-TEST"

# One datagram from a fixed source port; prints the answering backend's name or "timeout".
SEND_ONE = r"""
import socket, sys
dst, port, sport, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", sport))
s.settimeout(timeout)
s.sendto(b"ping", (dst, port))
try:
    print(s.recvfrom(4096)[0].decode().split()[0])
except socket.timeout:
    print("timeout")
"""

# One datagram from each of COUNT source ports (one flow each); prints {backend: replies}.
SEND_MANY = r"""
import json, select, socket, sys, time
dst, port, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
socks = []
for sport in range(first, first + count):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", sport))
    s.setblocking(False)
    s.sendto(b"ping", (dst, port))
    socks.append(s)
seen, waiting, deadline = {}, set(socks), time.monotonic() + 10
while waiting and time.monotonic() < deadline:
    ready = select.select(list(waiting), [], [], 0.5)[0]
    for s in ready:
        name = s.recv(4096).decode().split()[0]
        seen[name] = seen.get(name, 0) + 1
        waiting.discard(s)
    if not ready:  # a datagram (or its answer) was dropped under load: resend, same flow
        for s in waiting:
            s.sendto(b"ping", (dst, port))
print(json.dumps(seen))
"""


def dnat(lab, *rules: tuple[str, str, int, str]) -> None:
    """Replace the test chain's rules: (proto, destination IP, port, DNAT target)."""
    lines = ["*nat", f":{CHAIN} - [0:0]"]  # with --noflush this flushes only our chain
    lines += [f"-A {CHAIN} -d {dst}/32 -p {proto} -m {proto} --dport {port} -j DNAT --to-destination {to}"
              for proto, dst, port, to in rules]
    lab.iptables_restore("\n".join([*lines, "COMMIT", ""]))


def send(lab, ns: str, dst: str, port: int, sport: int, timeout: float = 2.0) -> str:
    argv = [sys.executable, "-c", SEND_ONE, dst, str(port), str(sport), str(timeout)]
    return lab.exec(ns, argv, timeout=timeout + 15).stdout.strip()


def send_many(lab, ns: str, dst: str, port: int, first: int, count: int) -> dict[str, int]:
    argv = [sys.executable, "-c", SEND_MANY, dst, str(port), str(first), str(count)]
    return json.loads(lab.exec(ns, argv, timeout=30).stdout)


def flows(lab, protocols=("UDP",)) -> list[Flow]:
    return list_flows(lab.ns("node"), protocols, families=(4,))


def from_port(lab, sport: int, protocols=("UDP",)) -> list[Flow]:
    return [f for f in flows(lab, protocols) if f.orig_sport == sport]


def key(flow: Flow) -> tuple:
    return (flow.proto, flow.orig_src, flow.orig_sport, flow.orig_dst, flow.orig_dport)


def dns_target(*backends: str, ip: str = SVC, node_port: int = 0) -> ServiceTarget:
    return ServiceTarget(proto="UDP", ips={ip}, port=53, node_port=node_port,
                         endpoints={(b, DNS_PORT) for b in backends})


@pytest.fixture
def node(lab):
    """be1, be2 (echo servers), an in-cluster client, and an empty DNAT chain hooked
    into PREROUTING (its mere existence makes the node namespace track connections)."""
    lab.add_pod("be1", BE1)
    lab.add_pod("be2", BE2)
    lab.add_client("client", CLIENT_IP)
    lab.iptables_restore(f"*nat\n:{CHAIN} - [0:0]\n-A PREROUTING -j {CHAIN}\nCOMMIT\n")
    return lab


def test_stale_flow_keeps_old_backend_until_cleanup(node):
    lab = node
    dnat(lab, ("udp", SVC, 53, f"{BE1}:{DNS_PORT}"))
    assert send(lab, "client", SVC, 53, sport=40053) == "be1"
    [entry] = from_port(lab, 40053)
    assert (entry.orig_src, entry.orig_dst, entry.orig_dport) == (CLIENT_IP, SVC, 53)
    assert (entry.reply_src, entry.reply_sport) == (BE1, DNS_PORT)

    dnat(lab, ("udp", SVC, 53, f"{BE2}:{DNS_PORT}"))  # be1 left the service
    assert send(lab, "client", SVC, 53, sport=40053) == "be1"  # stale entry still wins
    assert send(lab, "client", SVC, 53, sport=40054) == "be2"  # a new 5-tuple follows the rule

    result = ConntrackCleaner(lab.ns("node")).cleanup([dns_target(BE2)])
    assert (result.deleted, result.vanished, result.errors) == (1, 0, [])
    assert result.scanned == 2 and result.seconds > 0

    assert send(lab, "client", SVC, 53, sport=40053) == "be2"
    [entry] = from_port(lab, 40053)
    assert entry.reply_src == BE2
    # a second pass finds nothing left to do
    assert ConntrackCleaner(lab.ns("node")).cleanup([dns_target(BE2)]).deleted == 0


def test_tcp_and_other_services_are_left_alone(node):
    lab = node
    dnat(lab, ("udp", SVC, 53, f"{BE1}:{DNS_PORT}"), ("udp", OTHER_SVC, 53, f"{BE1}:{DNS_PORT}"),
         ("tcp", TCP_SVC, 80, f"{BE1}:{HTTP_PORT}"), ("udp", "10.96.0.55", 53, f"{BE1}:{DNS_PORT}"))
    assert send(lab, "client", SVC, 53, sport=40053) == "be1"
    assert send(lab, "client", OTHER_SVC, 53, sport=40054) == "be1"  # service still has be1
    assert send(lab, "client", "10.96.0.55", 53, sport=40055) == "be1"  # service not in targets
    assert send(lab, "client", BE1, DNS_PORT, sport=40056) == "be1"  # straight to the pod
    assert lab.request("client", TCP_SVC, 80, "tcp").backend == "be1"
    before = {key(f): f for f in flows(lab, ("UDP", "TCP"))}
    assert any(f.proto == "TCP" and f.reply_src == BE1 for f in before.values())
    assert len(before) == 5

    targets = [dns_target(BE2), dns_target(BE1, ip=OTHER_SVC),
               ServiceTarget(proto="TCP", ips={TCP_SVC}, port=80, endpoints={(BE2, HTTP_PORT)})]
    result = ConntrackCleaner(lab.ns("node")).cleanup(targets)
    assert (result.deleted, result.errors) == (1, [])

    after = {key(f) for f in flows(lab, ("UDP", "TCP"))}
    assert set(before) - after == {("UDP", CLIENT_IP, 40053, SVC, 53)}


def test_node_port_flow_is_cleaned(node):
    lab = node
    lab.add_external("ext", EXT_IP)
    dnat(lab, ("udp", NODE_IP, NODE_PORT, f"{BE1}:{DNS_PORT}"))
    assert send(lab, "ext", NODE_IP, NODE_PORT, sport=40060) == "be1"
    dnat(lab, ("udp", NODE_IP, NODE_PORT, f"{BE2}:{DNS_PORT}"))
    assert send(lab, "ext", NODE_IP, NODE_PORT, sport=40060) == "be1"

    result = ConntrackCleaner(lab.ns("node")).cleanup([dns_target(BE2, node_port=NODE_PORT)])
    assert (result.deleted, result.errors) == (1, [])
    assert send(lab, "ext", NODE_IP, NODE_PORT, sport=40060) == "be2"


def test_flow_from_before_the_service_had_endpoints_is_cleaned(node):
    lab = node
    dnat(lab, ("udp", OTHER_SVC, 53, f"{BE1}:{DNS_PORT}"))  # nothing for SVC yet (REJECT/no rule)
    assert send(lab, "client", SVC, 53, sport=40070, timeout=0.5) == "timeout"
    [entry] = from_port(lab, 40070)
    assert entry.reply_src == SVC  # never DNATed

    dnat(lab, ("udp", SVC, 53, f"{BE1}:{DNS_PORT}"), ("udp", OTHER_SVC, 53, f"{BE1}:{DNS_PORT}"))
    assert send(lab, "client", SVC, 53, sport=40070, timeout=0.5) == "timeout"  # stuck on the old entry

    result = ConntrackCleaner(lab.ns("node")).cleanup([dns_target(BE1), dns_target(BE1, ip=OTHER_SVC)])
    assert (result.deleted, result.errors) == (1, [])
    assert send(lab, "client", SVC, 53, sport=40070) == "be1"


def test_service_without_endpoints_keeps_flows_unless_asked(node):
    lab = node
    dnat(lab, ("udp", SVC, 53, f"{BE1}:{DNS_PORT}"))
    assert send(lab, "client", SVC, 53, sport=40080) == "be1"
    assert ConntrackCleaner(lab.ns("node")).cleanup([dns_target()]).deleted == 0  # like upstream
    assert len(from_port(lab, 40080)) == 1
    result = ConntrackCleaner(lab.ns("node"), clear_without_endpoints=True).cleanup([dns_target()])
    assert (result.deleted, result.errors) == (1, [])
    assert from_port(lab, 40080) == []


def test_many_flows_in_batches(node):
    lab = node
    count = 300  # > 2 delete batches
    dnat(lab, ("udp", SVC, 53, f"{BE1}:{DNS_PORT}"), ("udp", OTHER_SVC, 53, f"{BE1}:{DNS_PORT}"))
    assert send_many(lab, "client", SVC, 53, first=41000, count=count) == {"be1": count}
    assert send(lab, "client", OTHER_SVC, 53, sport=40090) == "be1"
    dnat(lab, ("udp", SVC, 53, f"{BE2}:{DNS_PORT}"), ("udp", OTHER_SVC, 53, f"{BE1}:{DNS_PORT}"))

    cleaner = ConntrackCleaner(lab.ns("node"), batch_size=128)
    result = cleaner.cleanup([dns_target(BE2), dns_target(BE1, ip=OTHER_SVC)])
    assert (result.deleted, result.vanished, result.errors) == (count, 0, [])
    assert result.scanned == count + 1
    left = flows(lab)
    assert [f.orig_dst for f in left] == [OTHER_SVC]
    assert send_many(lab, "client", SVC, 53, first=41000, count=20) == {"be2": 20}


# --------------------------------------------------------------------------
# entries injected through ctnetlink: SCTP (no SCTP sockets needed), IPv6, races


def inject(ns: str, proto: int, src: str, sport: int, dst: str, dport: int, backend: str, bport: int) -> None:
    """Create a conntrack entry as if src:sport -> dst:dport had been DNATed to backend:bport."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    with Conntrack(netns=ns, flags=0, nfgen_family=family) as ct:
        ct.entry("add", timeout=300,
                 tuple_orig=NFCTAttrTuple(family=family, saddr=src, daddr=dst, proto=proto, sport=sport, dport=dport),
                 tuple_reply=NFCTAttrTuple(family=family, saddr=backend, daddr=src, proto=proto, sport=bport,
                                           dport=sport))


def test_sctp_and_ipv6_flows(node):
    ns = node.ns("node")
    inject(ns, 132, CLIENT_IP, 40000, SVC, 3868, BE1, 3868)  # stale
    inject(ns, 132, CLIENT_IP, 40001, SVC, 3868, BE2, 3868)  # active
    inject(ns, 17, "fd00:244::10", 40000, "fd00:96::35", 53, "fd00:244::1", DNS_PORT)  # stale
    inject(ns, 17, "fd00:244::10", 40001, "fd00:96::35", 53, "fd00:244::2", DNS_PORT)  # active
    inject(ns, 6, CLIENT_IP, 40002, SVC, 3868, BE1, 3868)  # TCP: never
    targets = [ServiceTarget(proto="SCTP", ips={SVC}, port=3868, endpoints={(BE2, 3868)}),
               ServiceTarget(proto="UDP", ips={"fd00:96::35"}, port=53, endpoints={("fd00:244::2", DNS_PORT)})]
    result = ConntrackCleaner(ns).cleanup(targets)
    assert (result.deleted, result.errors) == (2, [])

    left = list_flows(ns, ("UDP", "SCTP", "TCP"))
    assert sorted((f.proto, f.reply_src) for f in left) == [
        ("SCTP", BE2), ("TCP", BE1), ("UDP", "fd00:244::2")]
    # upstream's UDP-only behaviour leaves SCTP alone
    inject(ns, 132, CLIENT_IP, 40000, SVC, 3868, BE1, 3868)
    assert ConntrackCleaner(ns, protocols=("UDP",)).cleanup(targets).deleted == 0


def test_vanished_and_recreated_flows_are_not_errors(node):
    ns = node.ns("node")
    for sport in (40000, 40001, 40002):
        inject(ns, 17, CLIENT_IP, sport, SVC, 53, BE1, DNS_PORT)
    cleaner = ConntrackCleaner(ns)
    a, b, c = sorted(cleaner.list_flows(), key=lambda f: f.orig_sport)
    assert cleaner.delete([b]).deleted == 1
    # b is gone (ENOENT) in the middle of a batch: a and c are still deleted
    result = cleaner.delete([a, b, c])
    assert (result.deleted, result.vanished, result.errors) == (2, 1, [])
    # an entry with the same tuple but another conntrack id is a different entry: it stays
    inject(ns, 17, CLIENT_IP, 40000, SVC, 53, BE1, DNS_PORT)
    [current] = cleaner.list_flows()
    result = cleaner.delete([dataclasses.replace(current, ct_id=current.ct_id ^ 1)])
    assert (result.deleted, result.vanished, result.errors) == (0, 1, [])
    assert cleaner.list_flows() == [current]


def test_delete_flows_filters(node):
    ns = node.ns("node")
    inject(ns, 17, CLIENT_IP, 40000, SVC, 53, BE1, DNS_PORT)
    inject(ns, 17, CLIENT_IP, 40001, SVC, 53, BE2, DNS_PORT)
    inject(ns, 17, CLIENT_IP, 40002, SVC, 54, BE1, DNS_PORT)
    inject(ns, 6, CLIENT_IP, 40003, SVC, 53, BE1, DNS_PORT)
    inject(ns, 132, CLIENT_IP, 40004, OTHER_SVC, 53, BE1, DNS_PORT)
    assert delete_flows(ns, proto="udp", orig_dst=SVC, orig_dport=53, reply_src=BE1) == 1
    assert delete_flows(ns, orig_dst=SVC, orig_dport=53) == 2  # UDP to BE2 and the TCP flow
    assert delete_flows(ns, reply_src=BE1) == 2  # UDP :54 and SCTP
    assert list_flows(ns, ("UDP", "TCP", "SCTP")) == []
    with pytest.raises(ValueError):
        delete_flows(ns)


def test_missing_namespace_is_reported_not_created():
    name = "kn-ct-missing-ns"
    assert not os.path.exists(f"/run/netns/{name}")
    result = ConntrackCleaner(name).cleanup([dns_target(BE2)])
    assert result.deleted == 0 and result.errors
    with pytest.raises(ConntrackError):
        delete_flows(name, proto="UDP")
    assert not os.path.exists(f"/run/netns/{name}")
