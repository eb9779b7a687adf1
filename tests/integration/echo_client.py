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

import errno
import json
import socket
import sys
import threading
import time

REFUSED = {errno.ECONNREFUSED, errno.ECONNRESET}
UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
DROPPED = {errno.EPERM}
Result = dict[str, object]


USAGE = ("usage: echo_client.py --host IP --port N [--proto tcp|udp] [--count N] "
         "[--timeout SECONDS] [--source IP] [--concurrency N]")


class Args:
    """Command line. Parsed by hand: argparse/getopt/dataclasses would add
    ~10-20 ms of imports to every probe."""

    def __init__(self, values: dict[str, str]) -> None:
        self.host: str = values["host"]
        self.port: int = int(values["port"])
        self.proto: str = values.get("proto", "tcp")
        self.count: int = int(values.get("count", "1"))
        self.timeout: float = float(values.get("timeout", "2.0"))  # per request, seconds
        self.source: str | None = values.get("source")  # source address to bind
        self.concurrency: int = int(values.get("concurrency", "1"))


def parse_args(argv: list[str]) -> Args:
    known = {"host", "port", "proto", "count", "timeout", "source", "concurrency"}
    try:
        if len(argv) % 2:
            raise ValueError("options take one value each")
        values = {}
        for option, value in zip(argv[::2], argv[1::2], strict=True):
            if not option.startswith("--") or option[2:] not in known:
                raise ValueError(f"unknown option {option}")
            values[option[2:]] = value
        args = Args(values)
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"{USAGE}\nerror: {exc}") from exc
    if args.proto not in ("tcp", "udp") or args.count < 1 or args.concurrency < 1:
        raise SystemExit(USAGE)
    return args


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


def new_socket(kind: socket.SocketKind, source: str | None, host: str = "") -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind)
    if source:
        sock.bind((source, 0))
    return sock


def tcp_request(args: Args) -> Result:
    deadline = time.monotonic() + args.timeout
    with new_socket(socket.SOCK_STREAM, args.source, args.host) as sock:
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


def udp_request(args: Args) -> Result:
    deadline = time.monotonic() + args.timeout
    dropped = None
    with new_socket(socket.SOCK_DGRAM, args.source, args.host) as sock:
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


def one_request(args: Args) -> Result:
    try:
        return tcp_request(args) if args.proto == "tcp" else udp_request(args)
    except OSError as exc:  # TimeoutError is an OSError too
        return classify(exc)


def run_all(args: Args) -> list[Result]:
    """Run ``args.count`` requests on ``args.concurrency`` threads, results in order."""
    results: list[Result] = [result("error", "not run")] * args.count
    indices = iter(range(args.count))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(indices, None)
            if index is None:
                return
            results[index] = one_request(args)

    threads = [threading.Thread(target=worker) for _worker in range(min(args.concurrency, args.count))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.write("".join(json.dumps(res) + "\n" for res in run_all(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
