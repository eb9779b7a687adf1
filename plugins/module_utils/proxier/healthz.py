# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""kube-proxy's proxy health server (/healthz, /livez) and metrics server (/metrics).

:class:`ProxyHealthServer` follows upstream's pkg/proxy/healthcheck/proxy_health.go
(ProxyHealthServer, Kubernetes 1.31+):

- per IP family, ``lastUpdated`` (last successful sync) and ``oldestPendingQueued``
  (the first change queued since that sync);
- a family is unhealthy when a queued change has waited ``>= health_timeout`` without an
  ``updated()``; a family that has never been ``updated()`` is not checked at all, so
  (like upstream's SyncLoop) call ``updated()`` once when the sync loop starts;
- kube-proxy passes ``healthTimeout = 2 * syncPeriod`` (cmd/kube-proxy/app/server.go):
  see :func:`health_timeout`;
- ``/healthz``: 200 when healthy and the node is eligible (not being deleted, not
  tainted ``ToBeDeletedByClusterAutoscaler``), else 503; ``/livez`` ignores the node.
  Body (Go's json.Marshal of ProxyHealth, compact, fields in this order)::

    {"lastUpdated":"<RFC 3339>","currentTime":"<RFC 3339>","nodeEligible":true,
     "healthy":true,"status":{"IPv4":{"lastUpdated":"<RFC 3339>","healthy":true}}}

  ``nodeEligible`` only in /healthz; ``status`` left out while empty; when the answer is
  200 the top-level ``lastUpdated`` is the current time (upstream keeps that for
  compatibility), when 503 it is the newest family's last update (Go's zero time
  ``0001-01-01T00:00:00Z`` if none). Times are UTC, RFC 3339 with up to microseconds.
  Headers ``Content-Type: application/json``, ``X-Content-Type-Options: nosniff``.
  Each answer counts in ``kubeproxy_proxy_healthz_total{code}`` /
  ``kubeproxy_proxy_livez_total{code}`` when metrics are given.

:class:`MetricsServer` is upstream's metrics mux (serveMetrics): ``/metrics`` (text
format 0.0.4), ``/healthz`` (component-base's ping check: ``ok``) and ``/proxyMode``.

Servers answer any method, over HTTP/1.0 (one request per connection), and never send
a ``Server`` header (Go's net/http does not).
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple
from urllib.parse import urlsplit

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
IPV4 = "IPv4"
IPV6 = "IPv6"
ZERO_TIME = "0001-01-01T00:00:00Z"  # Go's time.Time{} marshalled

Headers = List[Tuple[str, str]]
Response = Tuple[int, Headers, bytes]
App = Callable[[str, str], Response]  # (method, path) -> response
LogFn = Callable[[str], None]

JSON_HEADERS: Headers = [("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff")]
TEXT_HEADERS: Headers = [("Content-Type", "text/plain; charset=utf-8"), ("X-Content-Type-Options", "nosniff")]
NOT_FOUND: Response = (404, TEXT_HEADERS, b"404 page not found\n")  # Go's http.NotFound


def health_timeout(sync_period: float) -> float:
    """kube-proxy's healthTimeout for a syncPeriod: ``2 * syncPeriod`` (60 s by default)."""
    return 2.0 * sync_period


def rfc3339(ts: Optional[float]) -> str:
    """Epoch seconds as Go marshals a UTC time.Time (RFC 3339, trailing zeros of the
    fraction dropped); None is Go's zero time."""
    if ts is None:
        return ZERO_TIME
    dt = datetime.fromtimestamp(ts, tz=timezone.utc)  # noqa: UP017 - datetime.UTC is 3.11+, module_utils may run older
    frac = f".{dt.microsecond:06d}".rstrip("0") if dt.microsecond else ""
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + frac + "Z"


def split_host_port(address: str) -> Tuple[str, int]:
    """``"127.0.0.1:10256"``, ``"[::1]:10256"``, ``":10256"`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{address!r}: an IPv6 host must be in brackets")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- the HTTP plumbing shared by every server here and in healthcheck.py --------------
#
# One thread per listener runs a selector loop over the listener and its connections (no
# thread per connection): idle or slow clients cost a file descriptor and a small buffer,
# and are bounded in number, in header size and in time, so that 600 idle connections (or
# a slowloris) neither exhaust threads nor keep /healthz from answering.

MAX_CONNECTIONS = 1024  # per listener; beyond, the oldest connection still sending its request is dropped
MAX_HEADER_BYTES = 16 * 1024  # request line and headers; a probe sends ~200 bytes
REQUEST_TIMEOUT = 10.0  # seconds from accept to the end of the headers
WRITE_TIMEOUT = 10.0  # seconds for a client to take the answer
_SWEEP_INTERVAL = 0.25  # how often deadlines are checked while connections are open


def _http_date() -> str:
    from email.utils import formatdate

    return formatdate(usegmt=True)  # as BaseHTTPRequestHandler.date_time_string


def _reason(code: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


def render_response(status: int, headers: Headers, body: bytes, head: bool = False) -> bytes:
    """HTTP/1.0 answer: a Date header, no Server header (as Go's net/http), the body's length."""
    lines = [f"HTTP/1.0 {status} {_reason(status)}", f"Date: {_http_date()}"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head else body)


def _error(status: int, text: str) -> bytes:
    return render_response(status, TEXT_HEADERS, text.encode() + b"\n")


class _Conn:
    __slots__ = ("sock", "peer", "buf", "out", "deadline")

    def __init__(self, sock: socket.socket, peer: Any, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = b""
        self.out: Optional[bytes] = None  # the answer once the request is read
        self.deadline = now + REQUEST_TIMEOUT


def parse_request(head: bytes) -> Tuple[Optional[Tuple[str, str]], bytes]:
    """(method, path) of a request head (the bytes before the blank line), or None and
    the error answer. Headers are not used by these servers: only their size is checked."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/") or not parts[0].isalpha():
        return None, _error(400, "400 Bad Request")
    method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
    return (method, urlsplit(target).path or "/"), b""


class HTTPServerThread:
    """One listening socket and its serving thread. ``start()`` binds (raising OSError
    when it cannot); ``close()`` closes the listener at once (the port is free when it
    returns) and returns the serving thread, which drops its connections and ends;
    ``join()`` waits a bounded time for such threads."""

    def __init__(self, host: str, port: int, app: App, name: str, log: Optional[LogFn] = None) -> None:
        self.host = host
        self.port = port
        self.app = app
        self.name = name
        self.log: LogFn = log or (lambda msg: None)
        self._listener: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._wake: Optional[Tuple[socket.socket, socket.socket]] = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.connections = 0  # open now (for tests and metrics)
        self.dropped = 0  # connections closed for a limit: count, size or time

    @property
    def running(self) -> bool:
        return self._listener is not None

    @property
    def address(self) -> str:
        """The bound host:port once started (port 0 resolved), else the configured one."""
        listener = self._listener
        if listener is not None:
            try:
                host, port = listener.getsockname()[:2]
                return join_host_port(str(host), int(port))
            except OSError:
                pass
        return join_host_port(self.host, self.port)

    def start(self) -> None:
        if self._listener is not None:
            return
        infos = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners do
            listener.bind((self.host, self.port))
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
            wake = socket.socketpair()
        except OSError:
            listener.close()
            raise
        for w in wake:
            w.setblocking(False)
        self._listener, self._wake = listener, wake
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(listener, wake, self._stopping),
                                        name=self.name, daemon=True)
        self._thread.start()

    def _serve(self, listener: socket.socket, wake: Tuple[socket.socket, socket.socket],
               stopping: threading.Event) -> None:
        conns: Dict[socket.socket, _Conn] = {}  # in accept order (oldest first)
        sel = selectors.DefaultSelector()
        try:
            sel.register(listener, selectors.EVENT_READ, None)
            sel.register(wake[0], selectors.EVENT_READ, "wake")
            next_sweep = time.monotonic() + _SWEEP_INTERVAL
            while not stopping.is_set():
                timeout = max(0.0, next_sweep - time.monotonic()) if conns else None
                for key, _mask in sel.select(timeout):
                    if key.data == "wake" or stopping.is_set():
                        return
                    if key.data is None:
                        if not self._accept(listener, sel, conns):
                            return  # the listener was closed under us: close() is under way
                    else:
                        self._service(key.data, sel, conns)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + _SWEEP_INTERVAL
                    for conn in [c for c in conns.values() if c.deadline <= now]:
                        self.dropped += 1
                        self._drop(conn, sel, conns)
        except Exception as e:  # never silently: the port would stay open with nobody answering
            self.log(f"{self.name}: server loop failed: {e!r}")
        finally:
            for conn in list(conns.values()):
                self._drop(conn, sel, conns)
            sel.close()
            for w in wake:
                w.close()

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> bool:
        for _unused in range(64):  # a batch, then let the other connections be served
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if listener.fileno() < 0:
                    return False
                self.log(f"{self.name}: accept failed: {e.strerror or e}")  # e.g. EMFILE: retried on the next event
                time.sleep(0.05)
                return True
            sock.setblocking(False)
            if len(conns) >= MAX_CONNECTIONS:
                # Full: drop the oldest connection that has not finished its request (an
                # idle or slow client), so a flood of them cannot lock out the probes.
                victim = next((c for c in conns.values() if c.out is None), None)
                self.dropped += 1
                if victim is None:
                    sock.close()
                    continue
                self._drop(victim, sel, conns)
            conn = _Conn(sock, peer, time.monotonic())
            conns[sock] = conn
            self.connections = len(conns)
            sel.register(sock, selectors.EVENT_READ, conn)
        return True

    def _service(self, conn: _Conn, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        if conn.out is None:
            try:
                data = conn.sock.recv(8192)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(conn, sel, conns)
                return
            conn.buf += data
            end = conn.buf.find(b"\r\n\r\n")
            if end < 0:
                end = conn.buf.find(b"\n\n")
            if end < 0 or end > MAX_HEADER_BYTES:
                if len(conn.buf) > MAX_HEADER_BYTES:
                    self.dropped += 1
                    self._answer(conn, _error(431, "431 Request Header Fields Too Large"), sel, conns)
                return
            request, error = parse_request(conn.buf[:end])
            conn.buf = b""
            self._answer(conn, self._respond(*request) if request else error, sel, conns)
            return
        self._write(conn, sel, conns)

    def _respond(self, method: str, path: str) -> bytes:
        try:
            status, headers, body = self.app(method, path)
        except Exception as e:  # a handler bug answers 500, the server goes on
            self.log(f"{self.name}: error answering {method} {path[:200]}: {e!r}")
            status, headers, body = 500, TEXT_HEADERS, b"internal error\n"
        return render_response(status, headers, body, head=method == "HEAD")

    def _answer(self, conn: _Conn, out: bytes, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        conn.out = out
        conn.deadline = time.monotonic() + WRITE_TIMEOUT
        sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn, sel, conns)

    def _write(self, conn: _Conn, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        try:
            sent = conn.sock.send(conn.out or b"")
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, sel, conns)
            return
        conn.out = (conn.out or b"")[sent:]
        if not conn.out:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
                conn.sock.recv(65536)  # unread request bytes would turn the close into a reset
            except OSError:
                pass
            self._drop(conn, sel, conns)

    def _drop(self, conn: _Conn, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        conns.pop(conn.sock, None)
        self.connections = len(conns)
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> List[threading.Thread]:
        """Stop accepting and close the listener; returns the serving thread (still
        dropping its connections) for join()."""
        with self._lock:
            listener, thread, wake = self._listener, self._thread, self._wake
            if listener is None:
                return []
            self._listener = self._thread = self._wake = None
            self._stopping.set()
        if wake is not None:
            try:
                wake[1].send(b"x")
            except OSError:
                pass
        listener.close()  # the port is free now, even if the loop has not noticed yet
        return [thread] if thread is not None and thread is not threading.current_thread() else []

    @staticmethod
    def join(threads: List[threading.Thread], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def stop(self, timeout: float = 5.0) -> None:
        self.join(self.close(), timeout)


# --- the proxy health server ----------------------------------------------------------

@dataclass
class ProxierHealth:
    last_updated: float
    healthy: bool

    def to_json(self) -> Dict[str, Any]:
        return {"lastUpdated": rfc3339(self.last_updated), "healthy": self.healthy}


@dataclass
class ProxyHealth:
    current_time: float
    last_updated: Optional[float]  # newest family's last update; None if never updated
    healthy: bool  # all families healthy (the node is not part of this)
    status: Dict[str, ProxierHealth] = field(default_factory=dict)
    node_eligible: Optional[bool] = None  # set for /healthz answers only

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"lastUpdated": rfc3339(self.last_updated), "currentTime": rfc3339(self.current_time)}
        if self.node_eligible is not None:
            out["nodeEligible"] = self.node_eligible
        out["healthy"] = self.healthy
        if self.status:
            out["status"] = {fam: self.status[fam].to_json() for fam in sorted(self.status)}
        return out


class _HealthMetrics(Protocol):
    proxy_healthz_total: Any
    proxy_livez_total: Any


class ProxyHealthServer:
    """Upstream's ProxyHealthServer: the sync loop reports ``queued_update()`` /
    ``updated()``, the node watch reports ``node_deleting()`` (or ``sync_node()``),
    and probes read /healthz and /livez. Usable without ``start()`` (``is_healthy()``
    feeds the service health checks)."""

    def __init__(self, address: str, health_timeout: float, clock: Callable[[], float] = time.time,
                 metrics: Optional[_HealthMetrics] = None, log: Optional[LogFn] = None) -> None:
        host, port = split_host_port(address)
        self.health_timeout = float(health_timeout)
        self.clock = clock
        self.metrics = metrics
        self._lock = threading.Lock()
        self._last_updated: Dict[str, float] = {}
        self._oldest_pending_queued: Dict[str, float] = {}
        # Eligible (and so healthy) while starting up, until a node event says otherwise.
        self._node_eligible = True
        self._http = HTTPServerThread(host, port, self.handle, "proxy-healthz", log)

    # --- what the engine reports ---

    def queued_update(self, family: str = IPV4) -> None:
        """A Service/EndpointSlice change that needs a sync was received (keeps the oldest)."""
        with self._lock:
            self._oldest_pending_queued.setdefault(family, self.clock())

    def updated(self, family: str = IPV4) -> None:
        """The rules of this family were synced successfully (also call it once when
        the sync loop starts, as upstream's SyncLoop does)."""
        now = self.clock()
        with self._lock:
            self._oldest_pending_queued.pop(family, None)
            self._last_updated[family] = now

    def node_deleting(self, deleting: bool) -> None:
        """The node has a deletionTimestamp (or is otherwise going away)."""
        self.set_node_eligible(not deleting)

    def set_node_eligible(self, eligible: bool) -> None:
        with self._lock:
            self._node_eligible = bool(eligible)

    def sync_node(self, node: Optional[Mapping[str, Any]]) -> None:
        """Upstream's rule from a Node object (API dict): not eligible when it has a
        deletionTimestamp or the ToBeDeletedByClusterAutoscaler taint."""
        self.set_node_eligible(node_is_eligible(node))

    # --- what the probes read ---

    def node_eligible(self) -> bool:
        with self._lock:
            return self._node_eligible

    def health(self) -> ProxyHealth:
        with self._lock:
            now = self.clock()
            status: Dict[str, ProxierHealth] = {}
            healthy = True
            for fam, last in self._last_updated.items():
                queued = self._oldest_pending_queued.get(fam)
                # A change queued for a family is late once it waited health_timeout.
                fam_healthy = queued is None or now - queued < self.health_timeout
                status[fam] = ProxierHealth(last, fam_healthy)
                healthy = healthy and fam_healthy
            last_updated = max(self._last_updated.values()) if self._last_updated else None
        return ProxyHealth(current_time=now, last_updated=last_updated, healthy=healthy, status=status)

    def is_healthy(self) -> bool:
        """The proxier's health only (the node's eligibility is ignored), as the service
        health checks use it."""
        return self.health().healthy

    def healthz(self) -> Tuple[int, ProxyHealth]:
        health = self.health()
        eligible = self.node_eligible()
        health.node_eligible = eligible
        code = 200 if health.healthy and eligible else 503
        if code == 200:
            health.last_updated = self.clock()
        self._count("proxy_healthz_total", code)
        return code, health

    def livez(self) -> Tuple[int, ProxyHealth]:
        health = self.health()
        code = 200 if health.healthy else 503
        if code == 200:
            health.last_updated = self.clock()
        self._count("proxy_livez_total", code)
        return code, health

    def _count(self, attr: str, code: int) -> None:
        counter = getattr(self.metrics, attr, None) if self.metrics is not None else None
        if counter is not None:
            counter.labels(str(code)).inc()

    def handle(self, method: str, path: str) -> Response:
        if path == "/healthz":
            code, health = self.healthz()
        elif path == "/livez":
            code, health = self.livez()
        else:
            return NOT_FOUND
        return code, JSON_HEADERS, json.dumps(health.to_json(), separators=(",", ":")).encode()

    # --- the HTTP server ---

    @property
    def address(self) -> str:
        return self._http.address

    def start(self) -> None:
        self._http.start()

    def stop(self) -> None:
        self._http.stop()


def node_is_eligible(node: Optional[Mapping[str, Any]]) -> bool:
    """Upstream's NodeEligible for a Node API object (no object: eligible, as at start)."""
    if not node:
        return True
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        return False
    taints = (node.get("spec") or {}).get("taints") or []
    return not any(isinstance(t, Mapping) and t.get("key") == TO_BE_DELETED_TAINT for t in taints)


# --- the metrics server ----------------------------------------------------------------

class _Renders(Protocol):
    def render(self) -> str: ...


class MetricsServer:
    """Upstream's metrics mux: /metrics, /healthz (``ok``), /proxyMode."""

    def __init__(self, address: str, metrics: _Renders, proxy_mode: str = "iptables",
                 log: Optional[LogFn] = None) -> None:
        host, port = split_host_port(address)
        self.metrics = metrics
        self.proxy_mode = proxy_mode
        self._http = HTTPServerThread(host, port, self.handle, "proxy-metrics", log)

    def handle(self, method: str, path: str) -> Response:
        if path == "/metrics":
            return 200, [("Content-Type", METRICS_CONTENT_TYPE)], self.metrics.render().encode()
        if path in ("/healthz", "/healthz/ping"):
            return 200, TEXT_HEADERS, b"ok"
        if path == "/proxyMode":
            return 200, TEXT_HEADERS, self.proxy_mode.encode()
        return NOT_FOUND

    @property
    def address(self) -> str:
        return self._http.address

    def start(self) -> None:
        self._http.start()

    def stop(self) -> None:
        self._http.stop()
