"""Rate-paced TCP probe client for the network-namespace test lab (reliability tests).

Run inside a namespace, e.g.::

    ip netns exec kn1a2b3c-client python3 paced_client.py --host 10.100.0.10 --port 80 \\
        --rate 200 --duration 15 --timeout 1

Opens a fresh TCP connection every ``1/rate`` seconds (never more than ``--count``, never
after ``--duration`` seconds), each to an ``echo_server.py``, and prints, once it has
stopped, one JSON object per connection in start order::

    {"t": 1765100000.123456, "dt": 0.0012, "connect": 0.0004, "outcome": "ok", "backend": "be1",
     "ip": "10.244.1.7", "port": 40312, "error": null}

``t`` is the wall-clock time (``time.time()``, the clock the test records its own changes
with) when the SYN was sent, ``dt`` how long the answer took, ``connect`` how long the TCP
handshake took (null: never established; over 1 s: a SYN was lost and resent), ``ip`` the address the server
was reached at after DNAT (the endpoint's identity), ``port`` the client's source port,
``outcome`` as in ``echo_client.py``: ok, refused, unreachable, timeout, error.

One thread and non-blocking sockets, so connections that hang (rules flushed, packets
dropped) do not slow the pace: a late start is recorded as late, never skipped. The run is
bounded in count and in time: it stops after ``duration + timeout + 1`` seconds whatever
happens. SIGTERM ends the run early (the open connections finish, then it prints).
Only the standard library; starts with ``python3 -I -S``.
"""

from __future__ import annotations

import errno
import json
import selectors
import signal
import socket
import sys
import threading
import time

REFUSED = {errno.ECONNREFUSED, errno.ECONNRESET}
UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
STOP = threading.Event()  # SIGTERM/SIGINT: start no more connections, finish the open ones, print
MAX_OPEN = 900  # below the default 1024 descriptors: beyond it, starts wait (and are recorded late)
USAGE = ("usage: paced_client.py --host IP --port N [--rate PER_SECOND] [--duration SECONDS] "
         "[--count N] [--timeout SECONDS]")


def parse_args(argv: list[str]) -> dict[str, float | str]:
    values: dict[str, float | str] = {"rate": 100.0, "duration": 10.0, "count": 1e9, "timeout": 1.0}
    try:
        if len(argv) % 2:
            raise ValueError("options take one value each")
        for option, value in zip(argv[::2], argv[1::2], strict=True):
            key = option[2:]
            if not option.startswith("--") or key not in ("host", "port", *values):
                raise ValueError(f"unknown option {option}")
            values[key] = value if key == "host" else float(value)
        if "host" not in values or "port" not in values:
            raise ValueError("--host and --port are required")
        if min(float(values["rate"]), float(values["duration"]), float(values["count"]),
               float(values["timeout"])) <= 0:
            raise ValueError("rate, duration, count and timeout must be positive")
    except ValueError as exc:
        raise SystemExit(f"{USAGE}\nerror: {exc}") from exc
    return values


class Probe:
    __slots__ = ("sock", "t", "start", "connected", "port", "data", "record")

    def __init__(self, sock: socket.socket, t: float, start: float) -> None:
        self.sock = sock
        self.t = t  # wall clock at the SYN
        self.start = start  # monotonic, for the timeout
        self.connected: float | None = None  # seconds from the SYN to the established connection
        self.port = 0  # the source port the kernel chose
        self.data = b""
        self.record: dict[str, object] | None = None

    def finish(self, outcome: str, error: str | None = None) -> None:
        backend = ip = None
        if outcome == "ok":
            try:
                backend, ip, _peer = self.data.decode().strip().split(" ")
            except ValueError:
                outcome, error = "error", f"malformed reply {self.data[:60]!r}"
        self.record = {"t": round(self.t, 6), "dt": round(time.monotonic() - self.start, 6),
                       "connect": None if self.connected is None else round(self.connected, 6), "outcome": outcome,
                       "backend": backend, "ip": ip, "port": self.port, "error": error}


def classify(exc: OSError) -> tuple[str, str]:
    name = errno.errorcode.get(exc.errno or 0, str(exc))
    if exc.errno in REFUSED:
        return "refused", name
    if exc.errno in UNREACHABLE:
        return "unreachable", name
    return "error", name


def run(host: str, port: int, rate: float, duration: float, count: int, timeout: float) -> list[Probe]:
    selector = selectors.DefaultSelector()
    probes: list[Probe] = []
    open_probes: dict[int, Probe] = {}
    began = time.monotonic()
    hard_stop = began + duration + timeout + 1.0

    def close(probe: Probe, outcome: str, error: str | None = None) -> None:
        probe.finish(outcome, error)
        selector.unregister(probe.sock)
        open_probes.pop(probe.sock.fileno(), None)
        probe.sock.close()

    while True:
        now = time.monotonic()
        scheduling = len(probes) < count and now - began < duration and not STOP.is_set()
        if not scheduling and not open_probes or now > hard_stop:
            break
        # Start every connection that is due (late ones at once, recorded with their real time).
        while scheduling and began + len(probes) / rate <= now and len(open_probes) < MAX_OPEN:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            probe = Probe(sock, time.time(), time.monotonic())
            probes.append(probe)
            code = sock.connect_ex((host, port))
            try:
                probe.port = sock.getsockname()[1]
            except OSError:
                pass
            if code not in (0, errno.EINPROGRESS):
                probe.finish(*classify(OSError(code, "")))
                sock.close()
            else:
                open_probes[sock.fileno()] = probe
                selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, probe)
            now = time.monotonic()
            scheduling = len(probes) < count and now - began < duration and not STOP.is_set()
        next_start = began + len(probes) / rate if scheduling else now + 0.05
        wait = max(0.0, min(next_start, now + 0.05) - time.monotonic())
        for key, events in selector.select(wait):
            probe = key.data
            if probe.connected is None:
                # Writable (or readable: the server talks first) = the handshake is done, or failed.
                code = probe.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    close(probe, *classify(OSError(code, "")))
                    continue
                probe.connected = time.monotonic() - probe.start
                selector.modify(probe.sock, selectors.EVENT_READ, probe)
                if not events & selectors.EVENT_READ:
                    continue
            try:
                chunk = probe.sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError as exc:
                close(probe, *classify(exc))
                continue
            probe.data += chunk
            if not chunk or probe.data.endswith(b"\n"):
                close(probe, "ok" if probe.data else "error", None if probe.data else "EOF")
        now = time.monotonic()
        for probe in [p for p in open_probes.values() if now - p.start > timeout]:
            close(probe, "timeout")
    for probe in list(open_probes.values()):
        close(probe, "timeout")
    return probes


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: STOP.set())
    probes = run(str(args["host"]), int(args["port"]), float(args["rate"]), float(args["duration"]),
                 int(args["count"]), float(args["timeout"]))
    sys.stdout.write("".join(json.dumps(p.record) + "\n" for p in probes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
