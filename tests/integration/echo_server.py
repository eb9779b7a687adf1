"""Tiny TCP/UDP identity server for the network-namespace test lab.

Run inside a namespace, e.g.::

    ip netns exec kn1a2b3c-web1 python3 echo_server.py --name web1 --tcp 8080 --udp 5353

Every accepted TCP connection and every received UDP datagram is answered
with exactly one line and nothing else::

    <name> <local_ip> <peer_ip>:<peer_port>\\n

* ``name``      identifies the backend (the pod name),
* ``local_ip``  is the address the packet was addressed to after any DNAT,
* ``peer_ip``   is the client address the backend saw (after any SNAT /
  masquerade), ``peer_port`` the matching source port.

TCP connections are closed right after the line is sent; the client does not
have to send anything. UDP answers are sent from the address the datagram was
addressed to (``IP_PKTINFO``), so they also work in namespaces with several
addresses.

When every socket is bound and listening, the server prints ``READY`` on
stdout (and nothing else afterwards); the lab waits for that line. It runs
until it receives SIGTERM or SIGINT. Only the standard library is used, and
the interpreter may be started with ``-I -S``.
"""

from __future__ import annotations

import selectors
import signal
import socket
import struct
import sys
from types import FrameType

# Not exported by the socket module of every Python version (Linux value).
IP_PKTINFO: int = getattr(socket, "IP_PKTINFO", 8)
# struct in_pktinfo { int ipi_ifindex; struct in_addr ipi_spec_dst, ipi_addr; }
PKTINFO = struct.Struct("=i4s4s")
IPV6_RECVPKTINFO: int = getattr(socket, "IPV6_RECVPKTINFO", 49)
IPV6_PKTINFO: int = getattr(socket, "IPV6_PKTINFO", 50)
# struct in6_pktinfo { struct in6_addr ipi6_addr; int ipi6_ifindex; }
PKTINFO6 = struct.Struct("=16si")
SEND_TIMEOUT = 1.0


USAGE = "usage: echo_server.py --name NAME [--bind IP] [--bind6 IP6] [--tcp PORT]... [--udp PORT]..."


class Args:
    """Command line. Parsed by hand: argparse/getopt/dataclasses would add
    ~10-20 ms of imports to every server start."""

    def __init__(self) -> None:
        self.name = ""  # backend name to report
        self.bind = "0.0.0.0"
        self.bind6 = ""  # also serve IPv6 on this address (IPV6_V6ONLY: IPv4 stays on its own socket)
        self.tcp: list[int] = []
        self.udp: list[int] = []


def parse_args(argv: list[str]) -> Args:
    args = Args()
    try:
        if len(argv) % 2:
            raise ValueError("options take one value each")
        for option, value in zip(argv[::2], argv[1::2], strict=True):
            if option in ("--name", "--bind", "--bind6"):
                setattr(args, option[2:], value)
            elif option in ("--tcp", "--udp"):
                getattr(args, option[2:]).append(int(value))
            else:
                raise ValueError(f"unknown option {option}")
    except ValueError as exc:
        raise SystemExit(f"{USAGE}\nerror: {exc}") from exc
    if not args.name or not (args.tcp or args.udp):
        raise SystemExit(USAGE)
    return args


def reply_line(name: str, local_ip: str, peer: tuple[str, int]) -> bytes:
    return f"{name} {local_ip} {peer[0]}:{peer[1]}\n".encode()


def _family(bind: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in bind else socket.AF_INET


def open_tcp(bind: str, port: int) -> socket.socket:
    sock = socket.socket(_family(bind), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if ":" in bind:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((bind, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def open_udp(bind: str, port: int) -> socket.socket:
    sock = socket.socket(_family(bind), socket.SOCK_DGRAM)
    if ":" in bind:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
    sock.bind((bind, port))
    sock.setblocking(False)
    return sock


def serve_tcp(listener: socket.socket, name: str) -> None:
    try:
        conn, peer = listener.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return
    with conn:
        try:
            conn.settimeout(SEND_TIMEOUT)
            local_ip = conn.getsockname()[0]
            conn.sendall(reply_line(name, local_ip, peer[:2]))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # client went away or timed out; nothing useful to do


def destination_of(ancdata: list[tuple[int, int, bytes]], fallback: str) -> str:
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= PKTINFO.size:
            _ifindex, _spec_dst, addr = PKTINFO.unpack_from(data)
            return socket.inet_ntoa(addr)
        if level == socket.IPPROTO_IPV6 and kind == IPV6_PKTINFO and len(data) >= PKTINFO6.size:
            addr6, _ifindex = PKTINFO6.unpack_from(data)
            return socket.inet_ntop(socket.AF_INET6, addr6)
    return fallback


def serve_udp(sock: socket.socket, name: str) -> None:
    try:
        _data, ancdata, _flags, peer = sock.recvmsg(65535, socket.CMSG_SPACE(PKTINFO6.size))
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        return  # e.g. a queued ICMP error for an earlier reply
    local_ip = destination_of(ancdata, sock.getsockname()[0])
    if sock.family == socket.AF_INET6:
        cmsg = (socket.IPPROTO_IPV6, IPV6_PKTINFO, PKTINFO6.pack(socket.inet_pton(socket.AF_INET6, local_ip), 0))
    else:
        cmsg = (socket.IPPROTO_IP, IP_PKTINFO, PKTINFO.pack(0, socket.inet_aton(local_ip), bytes(4)))
    try:
        sock.sendmsg([reply_line(name, local_ip, peer[:2])], [cmsg], 0, peer)
    except OSError:
        pass  # reply dropped (e.g. by a filter rule); the client will time out


def install_signal_handlers() -> None:
    def stop(_signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    install_signal_handlers()
    selector = selectors.DefaultSelector()
    for port in args.tcp:
        selector.register(open_tcp(args.bind, port), selectors.EVENT_READ, serve_tcp)
    for port in args.udp:
        selector.register(open_udp(args.bind, port), selectors.EVENT_READ, serve_udp)
    if args.bind6:
        for port in args.tcp:
            selector.register(open_tcp(args.bind6, port), selectors.EVENT_READ, serve_tcp)
        for port in args.udp:
            selector.register(open_udp(args.bind6, port), selectors.EVENT_READ, serve_udp)
    print("READY", flush=True)
    while True:
        for key, _events in selector.select():
            key.data(key.fileobj, args.name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
