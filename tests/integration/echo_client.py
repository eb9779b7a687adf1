#!/usr/bin/env python3
"""Probe client for the network-namespace test lab.

Run inside a namespace, e.g.::

    ip netns exec kn1a2b3c-client python3 echo_client.py --host 10.96.0.10 --port 80 --count 20

Performs ``--count`` independent requests (a fresh socket, hence a fresh
source port and conntrack entry, for each) against an ``echo_server.py`` and
prints one JSON object per request on stdout, in request order::

    {"outcome": "ok", "backend": "web1", "server_ip": "10.244.1.10",
     "seen_client": "10.244.2.5", "seen_port": 40312, "error": null}

``outcome`` is one of

* ``ok``          a reply line was received,
* ``refused``     ECONNREFUSED / ECONNRESET: a TCP RST, or an ICMP
                  port-unreachable (the default ``REJECT``),
* ``unreachable`` EHOSTUNREACH / ENETUNREACH / EHOSTDOWN / ENETDOWN: an ICMP
                  host/net unreachable or admin-prohibited (``REJECT
                  --reject-with icmp-host-prohibited`` and friends) or no route,
* ``timeout``     nothing came back in time. When netfilter drops or rejects
                  a locally generated UDP packet in OUTPUT, ``send()`` fails
                  with EPERM at once; the client then still waits for the
                  reply: a REJECT has queued its ICMP error on the socket by
                  then (-> ``refused``/``unreachable``), a DROP has not
                  (-> ``timeout`` after the full timeout, ``error="EPERM"``),
                  so node clients behave like remote ones,
* ``error``       anything else (``error`` holds the errno name or reason).

UDP sockets are ``connect()``-ed so that ICMP errors are reported. Only the
standard library is used, and the interpreter may be started with ``-I -S``.
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REFUSED = {errno.ECONNREFUSED, errno.ECONNRESET}
UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
DROPPED = {errno.EPERM}
Result = dict[str, object]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=2.0, help="per request, seconds")
    parser.add_argument("--source", default=None, help="source address to bind")
    parser.add_argument("--concurrency", type=int, default=1)
    return parser.parse_args(argv)


def result(outcome: str, error: str | None = None) -> Result:
    return {"outcome": outcome, "backend": None, "server_ip": None,
            "seen_client": None, "seen_port": None, "error": error}


def parse_reply(data: bytes) -> Result:
    """Parse ``<name> <local_ip> <peer_ip>:<peer_port>``."""
    try:
        name, local_ip, peer = data.decode().strip().split(" ")
        peer_ip, peer_port = peer.rsplit(":", 1)
        parsed = result("ok")
        parsed.update(backend=name, server_ip=local_ip, seen_client=peer_ip, seen_port=int(peer_port))
        return parsed
    except ValueError:
        return result("error", f"malformed reply {data!r}")


def classify(exc: OSError) -> Result:
    if isinstance(exc, TimeoutError):
        return result("timeout")
    name = errno.errorcode.get(exc.errno or 0, str(exc))
    if exc.errno in REFUSED:
        return result("refused", name)
    if exc.errno in UNREACHABLE:
        return result("unreachable", name)
    if exc.errno in DROPPED:
        return result("timeout", name)
    return result("error", name)


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def new_socket(kind: socket.SocketKind, source: str | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    if source:
        sock.bind((source, 0))
    return sock


def tcp_request(args: argparse.Namespace) -> Result:
    deadline = time.monotonic() + args.timeout
    with new_socket(socket.SOCK_STREAM, args.source) as sock:
        sock.settimeout(remaining(deadline))
        sock.connect((args.host, args.port))
        data = b""
        while not data.endswith(b"\n"):
            sock.settimeout(remaining(deadline))
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    if not data:
        return result("error", "EOF")
    return parse_reply(data)


def udp_request(args: argparse.Namespace) -> Result:
    deadline = time.monotonic() + args.timeout
    dropped = None
    with new_socket(socket.SOCK_DGRAM, args.source) as sock:
        sock.connect((args.host, args.port))
        try:
            sock.send(b"ping\n")
        except OSError as exc:
            if exc.errno not in DROPPED:
                raise
            # Netfilter refused the packet in OUTPUT. A REJECT also queues an
            # ICMP error on the socket (seen by recv below); a DROP does not.
            dropped = errno.errorcode[exc.errno]
        sock.settimeout(remaining(deadline))
        try:
            return parse_reply(sock.recv(4096))
        except TimeoutError:
            return result("timeout", dropped)


def one_request(args: argparse.Namespace) -> Result:
    try:
        return tcp_request(args) if args.proto == "tcp" else udp_request(args)
    except OSError as exc:  # TimeoutError is an OSError too
        return classify(exc)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    workers = max(1, min(args.concurrency, args.count))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for res in pool.map(lambda _i: one_request(args), range(args.count)):
            print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
