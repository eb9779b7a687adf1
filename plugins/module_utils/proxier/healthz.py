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
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Set, Tuple
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

class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds for a client to send its request / take the answer

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        # Like Go's net/http: a Date header but no Server header.
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def _dispatch(self) -> None:
        path = urlsplit(self.path).path or "/"
        try:
            status, headers, body = self.server.app(self.command, path)
        except Exception as e:  # never let a handler bug kill the connection silently
            self.server.log(f"{self.server.name}: error answering {self.command} {path}: {e!r}")
            status, headers, body = 500, TEXT_HEADERS, b"internal error\n"
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    def log_message(self, format: str, *args: Any) -> None:  # silence the per-request stderr lines
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # HTTPServerThread joins the request threads itself, with a deadline

    def __init__(self, host: str, port: int, app: App, name: str, log: LogFn) -> None:
        self.app = app
        self.name = name
        self.log = log
        self.active: Set[threading.Thread] = set()
        self.active_lock = threading.Lock()
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self.address_family = infos[0][0]
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would resolve the host name (getfqdn): slow, and unused.
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners do
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        t = threading.Thread(target=self._run_request, args=(request, client_address),
                             name=f"{self.name}-request", daemon=True)
        with self.active_lock:
            self.active.add(t)
        t.start()

    def _run_request(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self.active_lock:
                self.active.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, (ConnectionError, TimeoutError)):
            self.log(f"{self.name}: error serving {client_address}: {err!r}")


class HTTPServerThread:
    """One listening socket and its accept thread. ``start()`` binds (raising OSError
    when it cannot); ``close()`` stops accepting and closes the socket at once (no poll
    interval to wait for); ``join()`` waits a bounded time for requests in flight."""

    def __init__(self, host: str, port: int, app: App, name: str, log: Optional[LogFn] = None) -> None:
        self.host = host
        self.port = port
        self.app = app
        self.name = name
        self.log: LogFn = log or (lambda msg: None)
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self._wake: Optional[Tuple[socket.socket, socket.socket]] = None
        self._stopping = threading.Event()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> str:
        """The bound host:port once started (port 0 resolved), else the configured one."""
        if self._server is not None:
            host, port = self._server.server_address[:2]
            return join_host_port(str(host), int(port))
        return join_host_port(self.host, self.port)

    def start(self) -> None:
        if self._server is not None:
            return
        server = _Server(self.host, self.port, self.app, self.name, self.log)
        try:
            server.socket.setblocking(False)
            wake = socket.socketpair()
        except OSError:
            server.server_close()
            raise
        self._server, self._wake = server, wake
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        server, wake = self._server, self._wake
        if server is None or wake is None:
            raise RuntimeError("HTTP server thread started before its socket was bound")
        with selectors.DefaultSelector() as sel:
            sel.register(server.socket, selectors.EVENT_READ, "accept")
            sel.register(wake[0], selectors.EVENT_READ, "wake")
            while not self._stopping.is_set():
                for key, _unused in sel.select():
                    if key.data == "wake" or self._stopping.is_set():
                        return
                    server._handle_request_noblock()  # accept (non-blocking) and hand to a thread

    def close(self) -> List[threading.Thread]:
        """Stop accepting and close the listener; returns the requests still in flight."""
        server, thread, wake = self._server, self._thread, self._wake
        if server is None:
            return []
        self._stopping.set()
        if wake is not None:
            try:
                wake[1].send(b"x")
            except OSError:
                pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        server.server_close()
        if wake is not None:
            wake[0].close()
            wake[1].close()
        self._server = self._thread = self._wake = None
        with server.active_lock:
            return list(server.active)

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
