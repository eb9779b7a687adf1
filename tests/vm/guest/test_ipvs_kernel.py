"""The IPVS core layer (plugins/module_utils/proxier/kernel/ipvs.py) against a real kernel.

Runs INSIDE a VM lab guest (tests/vm/test_ipvs_module.py starts it there); skipped where
the kernel has no IPVS (the build machine). Everything happens in throw-away network
namespaces, through ``IPVSKernel(netns=...)``:

* every kind of virtual service and real server round-trips through the kernel, and the
  listing equals ``ipvsadm -Ln`` line for line; a second plan is empty;
* every scheduler of the kernel works and a missing one is named;
* refused operations are reported one by one while the rest of a batch applies;
* graceful removal, as the proxier drives it (``plan(..., graceful, pending, now)`` each
  sync): a real server with a held-open TCP connection is set to weight 0, gets no new
  connections, and is deleted once the connection is gone (or the timeout passed); UDP
  real servers go at once, as upstream.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
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

from lab import PYTHON, Lab, cleanup_stale, new_prefix  # noqa: E402


def _setup_path() -> None:
    loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", str(REPO / "bin" / "kubenode-proxy"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.setup_path()


_setup_path()
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipvs import (  # noqa: E402
    Graceful,
    RealServer,
    ServiceState,
    plan,
    virtual_server,
)


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "ipvsadm"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    subprocess.run(["modprobe", "ip_vs"], capture_output=True, check=False)
    if not os.path.exists("/proc/net/ip_vs"):
        return "kernel has no IPVS"
    return None


REASON = _probe()
# These run inside the VM lab guest (tests/vm/test_ipvs_proxy_mode.py starts them there and
# fails on any skip); a kernel without IPVS or dummy links cannot run them at all.
pytestmark = pytest.mark.skipif(REASON is not None,
                                reason=f"IPVS kernel tests run in the VM lab guest; "
                                       f"this kernel cannot: {REASON}")

VIP = "10.96.0.10"
HOLD_SERVER = r"""
import socket, sys, threading
name, port = sys.argv[1], int(sys.argv[2])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", port))
srv.listen(64)
print("READY", flush=True)
def serve(conn, peer):
    conn.sendall(("%s %s %s:%d\n" % (name, conn.getsockname()[0], peer[0], peer[1])).encode())
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    conn.close()
while True:
    conn, peer = srv.accept()
    threading.Thread(target=serve, args=(conn, peer), daemon=True).start()
"""
HOLD_CLIENT = r"""
import socket, struct, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
line = b""
while not line.endswith(b"\n"):
    line += sock.recv(4096)
print(line.decode().strip(), flush=True)
how = sys.stdin.readline().strip()
if how == "rst":
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
sock.close()
print("closed", flush=True)
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


@pytest.fixture(scope="module", autouse=True)
def _stale_labs():
    cleanup_stale()


@pytest.fixture
def netns():
    """A fresh network namespace with lo up (a namespace without any address refuses every
    real server: see test_a_namespace_without_addresses_explains_the_refusal)."""
    name = f"{new_prefix()}ipvs"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        sh("ip", "netns", "del", name, check=False)


@pytest.fixture
def kernel(netns):
    with ipvs.IPVSKernel(netns=netns) as k:
        yield k


TITLES = ("IP Virtual Server version", "Prot LocalAddress:Port", "  -> RemoteAddress:Port")


def ipvsadm(netns: str, *args: str) -> str:
    """``ipvsadm -Ln`` without its title lines, trailing blanks stripped."""
    out = sh("ip", "netns", "exec", netns, "ipvsadm", "-Ln", *args).stdout
    return "".join(line.rstrip() + "\n" for line in out.splitlines() if not line.startswith(TITLES))


def blocks(listing: str) -> list:
    """A listing as [(service line, sorted real server lines)]: ipvsadm orders an IPv4 and an
    IPv6 real server of one service by a signed 32-bit subtraction that overflows, so the
    real servers are compared as sets."""
    out: list = []
    for line in listing.splitlines():
        if line.startswith("  ->"):
            out[-1][1].append(line)
        else:
            out.append((line, []))
    return [(service, sorted(reals)) for service, reals in out]


EVERYTHING = [
    ServiceState(virtual_server("tcp", "10.96.0.10", 80, scheduler="sh", scheduler_flags=["sh-fallback", "sh-port"],
                                persistence_timeout=600, persistence_netmask="255.255.255.0"),
                 (RealServer("10.244.1.1", 8080, weight=3, u_threshold=100, l_threshold=20),
                  RealServer("10.244.1.2", 80, forwarding="route", weight=0),
                  RealServer("10.244.1.3", 80, forwarding="tunnel", tunnel_type="gue", tunnel_port=6080))),
    ServiceState(virtual_server("udp", "10.96.0.53", 0, scheduler="lc", persistence_timeout=60, one_packet=True),
                 (RealServer("10.244.1.4", 0),)),
    ServiceState(virtual_server("sctp", "fd00::10", 443, scheduler="wrr", persistence_timeout=30,
                                persistence_netmask=64),
                 (RealServer("10.244.1.5", 443, forwarding="tunnel"), RealServer("fd00:1::5", 8443, weight=7))),
    ServiceState(virtual_server(fwmark=7, scheduler="mh", scheduler_flags=["mh-port"]),
                 (RealServer("10.244.1.6", 0, forwarding="route"), RealServer("10.244.1.7", 9000))),
    ServiceState(virtual_server(fwmark=8, family=6, scheduler="dh", scheduler_flags=["flag-3"]),
                 (RealServer("fd00:1::8", 0, forwarding="tunnel", tunnel_type="gre"),)),
]


def test_every_kind_of_service_round_trips_and_lists_like_ipvsadm(kernel, netns):
    for s in EVERYTHING:
        s.validate()
    created = plan([], EVERYTHING)
    result = kernel.apply(created.ops)
    assert result.ok, [str(e) for _op, e in result.errors]
    assert result.applied == len(created.ops) == 5 + 9
    current = kernel.services()
    assert plan(current, EVERYTHING).empty
    by_key = {s.key: s for s in current}
    for want in EVERYTHING:
        have = by_key[want.key]
        assert have.virtual.same_config(want.virtual), (have.virtual, want.virtual)
        assert sorted(r.key for r in have.real_servers) == sorted(r.key for r in want.real_servers)
        for rs in want.real_servers:
            assert have.real_server(rs.key).same_config(rs), (have.real_server(rs.key), rs)
    assert sh("ipvsadm", "--version").stdout.startswith("ipvsadm v1.")
    assert blocks(ipvsadm(netns)) == blocks("".join(ipvs.format_service(s) for s in ipvs.sort_services(current)))
    assert kernel.get(EVERYTHING[2].virtual).virtual.netmask == 64
    assert kernel.get(virtual_server("tcp", "10.96.0.99", 80)) is None
    removed = kernel.apply(plan(current, []).ops)
    assert removed.ok and removed.applied == 5 and kernel.services() == []


def many_services(count: int) -> list:
    """``count`` services with 3 real servers each: mostly IPv4 TCP/UDP (the getsockopt
    path), some with settings that path must carry (weights, thresholds, route
    forwarding), fwmark services, IPv6 ones and tunnel ones (read over netlink)."""
    out = []
    for i in range(count):
        reals = tuple(RealServer(f"10.245.{(3 * i + j) // 256 % 256}.{(3 * i + j) % 256}", 8080 + j, weight=1 + j,
                                 u_threshold=(i % 7) * 10, l_threshold=i % 7) for j in range(3))
        if i % 40 == 1:
            vs = virtual_server(fwmark=1000 + i, scheduler="wlc")
            reals = tuple(RealServer(r.address, 0, forwarding="route") for r in reals)
        elif i % 40 == 2:
            vs = virtual_server("tcp", f"fd00:96::{i:x}", 443, scheduler="rr")
            reals = tuple(RealServer(f"fd00:245::{3 * i + j:x}", 8443) for j in range(3))
        elif i % 40 == 3:
            vs = virtual_server("tcp", f"10.97.{i // 256}.{i % 256}", 80)
            reals = reals[:2] + (RealServer("10.245.255.1", 80, forwarding="tunnel", tunnel_type="gue",
                                            tunnel_port=6080),)
        else:
            vs = virtual_server("udp" if i % 2 else "tcp", f"10.97.{i // 256}.{i % 256}", 53 if i % 2 else 80,
                                scheduler="rr", persistence_timeout=300 if i % 5 == 0 else 0)
        out.append(ServiceState(vs, reals))
    return out


def test_a_thousand_services_list_exactly_as_programmed(kernel, netns):
    """The fast listing (one service dump, IPv4 real servers by getsockopt, the rest by
    netlink) equals what was programmed, the old per-service netlink listing, and
    ``ipvsadm -Ln``."""
    want = many_services(1200)
    result = kernel.apply(plan([], want).ops)
    assert result.ok, [str(e) for _op, e in result.errors[:5]]
    listed = kernel.services()
    assert kernel._sockopt is not None and not kernel._sockopt_failed  # the getsockopt path ran
    assert len(listed) == 1200 and sum(len(s.real_servers) for s in listed) == 3600
    by_key = {s.key: s for s in listed}
    for s in want:
        have = by_key[s.key]
        assert have.virtual.same_config(s.virtual), (have.virtual, s.virtual)
        assert sorted(r.key for r in have.real_servers) == sorted(r.key for r in s.real_servers), s.virtual
        for rs in s.real_servers:
            assert have.real_server(rs.key).same_config(rs), (have.real_server(rs.key), rs)
    assert plan(listed, want).empty
    assert sorted(listed, key=lambda s: s.key) == sorted(kernel.services_each(), key=lambda s: s.key)
    # the same blocks; ipvsadm's own order (protocol first) is not sort_services'
    assert sorted(blocks(ipvsadm(netns))) == sorted(blocks("".join(ipvs.format_service(s) for s in listed)))


def test_timeouts_are_set_over_netlink_and_read_back_by_ipvsadm(kernel, netns):
    kernel.set_timeouts(901, 121, 301)
    assert kernel.timeouts() == (901, 121, 301)
    timeout_line = sh("ip", "netns", "exec", netns, "ipvsadm", "-L", "--timeout").stdout.strip()
    assert timeout_line == "Timeout (tcp tcpfin udp): 901 121 301"
    kernel.set_timeouts(0, 0, 61)  # 0 keeps a value, as ipvsadm --set
    assert sh("ip", "netns", "exec", netns, "ipvsadm", "-L", "--timeout").stdout.strip() == (
        "Timeout (tcp tcpfin udp): 901 121 61")
    with pytest.raises(ipvs.IPVSError) as exc:
        kernel.set_timeouts(2 ** 31 - 1, 0, 0)  # beyond INT_MAX / HZ: the kernel refuses it
    assert exc.value.code == 22 and kernel.timeouts() == (901, 121, 61)


def test_every_scheduler_the_kernel_has_works_and_a_missing_one_is_named(kernel):
    working, missing = [], []
    for i, name in enumerate(ipvs.SCHEDULERS):
        vs = virtual_server("tcp", f"10.96.1.{i + 1}", 80, scheduler=name)
        try:
            kernel.add_service(vs)
        except ipvs.SchedulerUnavailable as exc:
            assert str(exc) == f"scheduler '{name}' is not available in this kernel (module ip_vs_{name} not found)"
            missing.append(name)
            assert ipvs.scheduler_available(name) is False
            continue
        assert kernel.get(vs).virtual.scheduler == name
        working.append(name)
    print(f"schedulers: working {working}, missing {missing}")
    assert {"rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh"} <= set(working)
    with pytest.raises(ipvs.SchedulerUnavailable, match="ip_vs_nosuch"):
        kernel.add_service(virtual_server("tcp", "10.96.2.1", 80, scheduler="nosuch"))


def test_settings_are_edited_in_place(kernel, netns):
    vs = virtual_server("tcp", VIP, 80, scheduler="rr")
    rs = RealServer("10.244.1.1", 8080)
    kernel.apply(plan([], [ServiceState(vs, (rs,))]).ops).raise_first()
    vs2 = virtual_server("tcp", VIP, 80, scheduler="wlc", persistence_timeout=5, persistence_netmask=16)
    rs2 = RealServer("10.244.1.1", 8080, weight=9, forwarding="masquerade", u_threshold=4, l_threshold=1)
    edits = plan(kernel.services(), [ServiceState(vs2, (rs2,))])
    assert [op.kind for op in edits.ops] == [ipvs.EDIT_SERVICE, ipvs.EDIT_DEST]
    kernel.apply(edits.ops).raise_first()
    assert plan(kernel.services(), [ServiceState(vs2, (rs2,))]).empty
    assert ipvsadm(netns, "-t", f"{VIP}:80").splitlines() == [
        f"TCP  {VIP}:80 wlc persistent 5 mask 255.255.0.0",
        "  -> 10.244.1.1:8080              Masq    9      0          0"]


def test_refused_operations_are_reported_and_the_rest_of_the_batch_applies(kernel):
    vs = virtual_server("tcp", VIP, 80)
    kernel.add_service(vs)
    other = virtual_server("tcp", "10.96.0.77", 80)
    ops = [ipvs.Op(ipvs.ADD_SERVICE, vs),
           ipvs.Op(ipvs.ADD_DEST, other, RealServer("10.244.1.1", 80)),
           ipvs.Op(ipvs.DELETE_DEST, vs, RealServer("10.244.1.9", 80)),
           ipvs.Op(ipvs.ADD_DEST, vs, RealServer("10.244.1.2", 80, u_threshold=1, l_threshold=5)),
           ipvs.Op(ipvs.ADD_DEST, vs, RealServer("10.244.1.3", 80))]
    result = kernel.apply(ops)
    assert result.applied == 1
    assert [(e.code, str(e)) for _op, e in result.errors] == [
        (17, f"virtual service TCP {VIP}:80 already exists"),
        (3, "virtual service TCP 10.96.0.77:80 does not exist"),
        (2, f"real server 10.244.1.9:80 of TCP {VIP}:80 does not exist"),
        (34, f"real server 10.244.1.2:80 of TCP {VIP}:80: weight or thresholds out of range"),
    ]
    assert [rs.address for rs in kernel.real_servers(vs)] == ["10.244.1.3"]


def test_a_namespace_without_addresses_explains_the_refusal():
    name = f"{new_prefix()}bare"
    sh("ip", "netns", "add", name)
    try:
        with ipvs.IPVSKernel(netns=name) as k:
            vs = virtual_server("tcp", VIP, 80)
            k.add_service(vs)
            with pytest.raises(ipvs.IPVSError, match="not even lo up"):
                k.add_real_server(vs, RealServer("10.244.1.1", 80))
            sh("ip", "-n", name, "link", "set", "lo", "up")
            k.add_real_server(vs, RealServer("10.244.1.1", 80))
    finally:
        sh("ip", "netns", "del", name, check=False)


def test_a_missing_namespace_is_a_clear_error():
    with pytest.raises(ipvs.IPVSUnavailable, match="network namespace 'kn-no-such-ns' does not exist"):
        ipvs.IPVSKernel(netns="kn-no-such-ns").services()
    assert not os.path.exists("/run/netns/kn-no-such-ns")  # and it was not created


def test_flush_and_info(kernel):
    kernel.add_service(virtual_server("tcp", VIP, 80))
    assert kernel.info()[0] == "1.2.1"
    kernel.flush()
    assert kernel.services() == []


# -- graceful removal with real connections


class Held:
    """A TCP connection from the client pod through the VIP, held open until close()."""

    def __init__(self, lab: Lab, ip: str, port: int) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", lab.ns("client"), *PYTHON, "-c", HOLD_CLIENT, ip,
                                      str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if not line:
            raise RuntimeError("held connection failed")
        self.backend = line[0]

    def close(self, how: str = "fin") -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(how + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


@pytest.fixture
def hold_lab():
    """Pods be1, be2 with a server on TCP 9000 that keeps each connection open until the
    client closes it, echo servers on UDP 5353, a client pod, the VIP on a dummy link."""
    lab = Lab()
    try:
        pods = {"be1": "10.244.1.1", "be2": "10.244.1.2"}
        for name, ip in pods.items():
            lab.add_pod(name, ip, tcp_ports=(), udp_ports=(5353,))
            server = lab.spawn(name, [*PYTHON, "-c", HOLD_SERVER, name, "9000"])
            assert server.stdout.readline().strip() == "READY"
        lab.add_client("client", "10.244.2.10")
        for argv in (["ip", "link", "add", "ipvs0", "type", "dummy"], ["ip", "link", "set", "ipvs0", "up"],
                     ["ip", "addr", "add", f"{VIP}/32", "dev", "ipvs0"]):
            lab.exec("node", argv)
        lab.pods = pods
        yield lab
    finally:
        lab.close()


def sync(kernel, desired, graceful, pending):
    """One proxier sync: list, plan with the pending removals, apply."""
    p = plan(kernel.services(), desired, graceful=graceful, pending=pending, now=time.monotonic())
    kernel.apply(p.ops).raise_first()
    return p


def backends(lab, count):
    replies = lab.request_many("client", VIP, 80, count=count, timeout=5)
    assert all(r.ok for r in replies), Counter((r.outcome, r.error) for r in replies)
    return Counter(r.backend for r in replies)


def test_graceful_removal_waits_for_a_held_open_connection(hold_lab):
    lab = hold_lab
    vs = virtual_server("tcp", VIP, 80, scheduler="rr")
    reals = {name: RealServer(ip, 9000, forwarding="masquerade") for name, ip in lab.pods.items()}
    graceful = Graceful()  # no timeout: like upstream, wait for the connections
    with ipvs.IPVSKernel(netns=lab.ns("node")) as k:
        assert sync(k, [ServiceState(vs, tuple(reals.values()))], graceful, {}).ops
        held = Held(lab, VIP, 80)
        going = held.backend
        staying = next(name for name in reals if name != going)
        desired = [ServiceState(vs, (reals[staying],))]
        try:
            first = sync(k, desired, graceful, {})
            assert [(op.kind, op.real_server.address, op.real_server.weight) for op in first.ops] == [
                (ipvs.EDIT_DEST, lab.pods[going], 0)]
            pending = first.pending
            assert list(pending) == [(vs.key, reals[going].key)]
            quiesced = k.get(vs).real_server(reals[going].key)
            assert (quiesced.weight, quiesced.active_connections) == (0, 1)
            assert backends(lab, 6) == {staying: 6}  # no new connections to the quiesced server
            second = sync(k, desired, graceful, pending)
            assert second.empty and second.pending == pending  # still busy: keep waiting
            held.close("rst")  # the connection ends (RST: IPVS keeps it 10 s in CLOSE, inactive)
            started = time.monotonic()
            while k.get(vs).real_server(reals[going].key) is not None:
                assert time.monotonic() - started < 60, k.get(vs)
                time.sleep(1)
                pending = sync(k, desired, graceful, pending).pending
            print(f"deleted {time.monotonic() - started:.1f} s after the connection closed")
            assert pending == {}
            assert [rs.address for rs in k.get(vs).real_servers] == [lab.pods[staying]]
        finally:
            held.close()


def test_graceful_removal_gives_up_after_the_timeout(hold_lab):
    lab = hold_lab
    vs = virtual_server("tcp", VIP, 80, scheduler="rr")
    reals = {name: RealServer(ip, 9000, forwarding="masquerade") for name, ip in lab.pods.items()}
    graceful = Graceful(timeout=3)
    with ipvs.IPVSKernel(netns=lab.ns("node")) as k:
        sync(k, [ServiceState(vs, tuple(reals.values()))], graceful, {})
        held = Held(lab, VIP, 80)
        going = held.backend
        desired = [ServiceState(vs, tuple(r for name, r in reals.items() if name != going))]
        try:
            pending = sync(k, desired, graceful, {}).pending
            assert k.get(vs).real_server(reals[going].key).weight == 0
            time.sleep(1)
            pending = sync(k, desired, graceful, pending).pending
            busy = k.get(vs).real_server(reals[going].key)
            assert busy is not None and busy.active_connections == 1
            time.sleep(2.5)
            last = sync(k, desired, graceful, pending)
            assert [op.kind for op in last.ops] == [ipvs.DELETE_DEST] and last.pending == {}
            assert k.get(vs).real_server(reals[going].key) is None
        finally:
            held.close()


def test_udp_real_servers_are_removed_at_once(hold_lab):
    lab = hold_lab
    vs = virtual_server("udp", VIP, 53, scheduler="rr")
    reals = [RealServer(ip, 5353, forwarding="masquerade") for ip in lab.pods.values()]
    with ipvs.IPVSKernel(netns=lab.ns("node")) as k:
        sync(k, [ServiceState(vs, tuple(reals))], Graceful(), {})
        replies = lab.request_many("client", VIP, 53, "udp", count=4, timeout=5)
        assert Counter(r.backend for r in replies) == {"be1": 2, "be2": 2}
        assert all(rs.connections > 0 for rs in k.get(vs).real_servers)
        p = sync(k, [ServiceState(vs, (reals[0],))], Graceful(), {})
        assert [op.kind for op in p.ops] == [ipvs.DELETE_DEST] and p.pending == {}
        assert [rs.address for rs in k.get(vs).real_servers] == [reals[0].address]
