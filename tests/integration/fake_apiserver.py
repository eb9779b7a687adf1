"""A small in-process Kubernetes API server for tests (list/watch of a few resources).

It speaks enough of the real API's HTTP semantics for the ``kubernetes`` Python
client (``CoreV1Api``, ``DiscoveryV1Api``, ``kubernetes.watch.Watch``) to work
against it unchanged::

    with FakeApiServer(bookmark_interval=1.0) as server:
        server.create({"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": "web", "namespace": "default"},
                       "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}})
        server.write_kubeconfig(tmp_path / "kubeconfig")
        ...

Served resources: v1 ``services`` and ``nodes`` and ``discovery.k8s.io/v1``
``endpointslices`` (GET only: list, watch, get), plus minimal ``/api``, ``/apis``,
``/api/v1``, ``/apis/discovery.k8s.io/v1``, ``/version``, ``/healthz``, ``/livez``
and ``/readyz``. The state is changed through Python methods (``create``,
``update``, ``apply``, ``delete``), never through HTTP.

How it mimics the real API server:

* One global resourceVersion counter (an int, served as a string), bumped by
  every change; every object carries ``metadata.resourceVersion`` (its last
  change), ``metadata.uid`` and ``metadata.creationTimestamp``. An update that
  changes nothing is a no-op (no new resourceVersion, no event), as upstream.
* LIST answers ``{"kind": "<Kind>List", "apiVersion": ..., "metadata":
  {"resourceVersion": <current>}, "items": [...]}``; items are sorted by
  namespace/name (etcd key order) and carry no kind/apiVersion. ``limit`` and
  ``continue`` work (continued pages read the current state, not a snapshot, and
  report the first page's resourceVersion).
* WATCH (``watch=true``/``1``) streams chunked ``application/json``, one
  ``{"type": ..., "object": ...}`` line per chunk, objects with kind/apiVersion.
  From ``resourceVersion=R``: every retained event newer than R, then live
  events. Without a resourceVersion, or with ``"0"``: a synthetic ADDED per
  current object, then live events. R older than the retained history (see
  ``history_limit`` and ``compact()``) is answered as upstream does: HTTP 200 and
  one ERROR event carrying a ``Status`` with ``code: 410, reason: "Expired"``,
  then the stream ends. With selectors, an object that stops matching is sent
  as DELETED (its previous content, the event's resourceVersion) and one that
  starts matching as ADDED, as upstream's watch cache does.
* ``timeoutSeconds`` ends the stream cleanly (terminating chunk) after that time.
  ``allowWatchBookmarks=true`` gets a BOOKMARK (``{"kind", "apiVersion",
  "metadata": {"resourceVersion": <current>}}``) every ``bookmark_interval``
  seconds of the stream and whenever ``bookmark()`` is called.
  ``sendInitialEvents=true`` gets the synthetic ADDED events followed by a
  BOOKMARK annotated ``k8s.io/initial-events-end: "true"``.
* Selectors: ``labelSelector`` (``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``,
  ``a in (x,y)``, ``a notin (x,y)``, comma-separated; ``!=`` and ``notin`` also
  match objects without the label) and ``fieldSelector`` on
  ``metadata.name``/``metadata.namespace`` (``=``, ``==``, ``!=``). Anything else
  is a 400 BadRequest ``Status``, like upstream.
* Errors are ``Status`` objects with the upstream reasons (NotFound,
  BadRequest, InternalError, ...).

Not modelled: authentication, writes over HTTP, resourceVersionMatch on lists
(lists always return the current state), "too large resourceVersion" waits
(a watch from a future resourceVersion just waits for events newer than it).

Only the standard library is used. Every thread the server starts is named
``fake-apiserver-...`` and ends in ``stop()``.
"""

from __future__ import annotations

import base64
import binascii
import collections
import copy
import json
import queue
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, urlsplit

JsonDict = dict[str, Any]

POLL_INTERVAL = 0.05  # how often an idle watch checks for a client that went away


@dataclass(frozen=True)
class ResourceType:
    """One served resource type."""

    kind: str
    plural: str
    api_version: str  # "v1" or "group/version"
    namespaced: bool
    field_labels: tuple[str, ...] = ("metadata.name", "metadata.namespace")

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"

    @property
    def singular(self) -> str:
        return self.kind.lower()


RESOURCES: tuple[ResourceType, ...] = (
    ResourceType("Service", "services", "v1", True),
    ResourceType("EndpointSlice", "endpointslices", "discovery.k8s.io/v1", True),
    ResourceType("Node", "nodes", "v1", False, ("metadata.name", "metadata.namespace", "spec.unschedulable")),
)

_REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status_object(code: int, message: str, reason: Optional[str] = None,
                  details: Optional[JsonDict] = None) -> JsonDict:
    """A ``Status`` object as the API server sends for failures."""
    obj: JsonDict = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        obj["details"] = details
    return obj


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _truthy(value: Optional[str]) -> bool:
    return value is not None and value.lower() in ("true", "1")


# --- selectors ----------------------------------------------------------------------

_KEY = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?)"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_RE_NOT_EXISTS = re.compile(rf"^!\s*({_KEY})$")
_RE_EXISTS = re.compile(rf"^({_KEY})$")
_RE_EQUALITY = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_RE_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s*\((.*)\)$")
_RE_NUMERIC = re.compile(rf"^({_KEY})\s*(<|>)\s*(-?[0-9]+)$")


class SelectorError(ValueError):
    pass


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("unbalanced ')'")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise SelectorError("unbalanced '('")
    parts.append("".join(current))
    return parts


Predicate = Callable[[dict[str, str]], bool]


def parse_label_selector(text: Optional[str]) -> Predicate:
    """A predicate over a label dict for a Kubernetes label selector string."""
    text = (text or "").strip()
    if not text:
        return lambda labels: True
    predicates: list[Predicate] = []
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"empty requirement in label selector {text!r}")
        if m := _RE_NOT_EXISTS.match(part):
            key = m.group(1)
            predicates.append(lambda labels, k=key: k not in labels)
        elif m := _RE_SET.match(part):
            key, op = m.group(1), m.group(2)
            values = frozenset(v.strip() for v in m.group(3).split(","))
            if "" in values and m.group(3).strip():
                raise SelectorError(f"invalid value list in {part!r}")
            if op == "in":
                predicates.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                predicates.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif m := _RE_EQUALITY.match(part):
            key, op, value = m.group(1), m.group(2), m.group(3)
            if op == "!=":
                predicates.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                predicates.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif m := _RE_NUMERIC.match(part):
            key, op, bound = m.group(1), m.group(2), int(m.group(3))

            def numeric(labels: dict[str, str], k: str = key, o: str = op, b: int = bound) -> bool:
                try:
                    n = int(labels[k])
                except (KeyError, ValueError):
                    return False
                return n > b if o == ">" else n < b

            predicates.append(numeric)
        elif m := _RE_EXISTS.match(part):
            key = m.group(1)
            predicates.append(lambda labels, k=key: k in labels)
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return lambda labels: all(p(labels) for p in predicates)


def parse_field_selector(text: Optional[str], allowed: Iterable[str]) -> Callable[[JsonDict], bool]:
    """A predicate over an object for a field selector (only the given field labels)."""
    text = (text or "").strip()
    if not text:
        return lambda obj: True
    allowed = tuple(allowed)
    terms: list[tuple[str, bool, str]] = []
    for raw in text.split(","):
        part = raw.strip()
        m = re.match(r"^([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)$", part)
        if not m:
            raise SelectorError(f"invalid selector: {part!r}; can't understand it")
        name, op, value = m.group(1), m.group(2), m.group(3).strip()
        if name not in allowed:
            raise SelectorError(f"field label not supported: {name}")
        terms.append((name, op != "!=", value))

    def predicate(obj: JsonDict) -> bool:
        for name, equal, value in terms:
            if (_field_value(obj, name) == value) != equal:
                return False
        return True

    return predicate


def _metadata(obj: JsonDict) -> JsonDict:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _labels(obj: JsonDict) -> dict[str, str]:
    labels = _metadata(obj).get("labels")
    return labels if isinstance(labels, dict) else {}


def _field_value(obj: JsonDict, name: str) -> str:
    if name == "metadata.name":
        return str(_metadata(obj).get("name") or "")
    if name == "metadata.namespace":
        return str(_metadata(obj).get("namespace") or "")
    if name == "spec.unschedulable":
        spec = obj.get("spec")
        return "true" if isinstance(spec, dict) and spec.get("unschedulable") is True else "false"
    return ""


# --- events and watches -------------------------------------------------------------


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    kind: str
    obj: JsonDict  # never mutated once stored
    prev: Optional[JsonDict] = None  # MODIFIED: the object before the change


@dataclass
class RequestRecord:
    """One HTTP request the server answered."""

    method: str
    path: str
    query: dict[str, str]
    kind: str  # "Service", "EndpointSlice", "Node", or "" for other paths
    verb: str  # "list", "watch", "get", or "" for other paths
    status: int = 0


@dataclass(eq=False)
class _Watch:
    resource: ResourceType
    namespace: Optional[str]
    labels: Predicate
    fields: Callable[[JsonDict], bool]
    bookmarks: bool
    sock: socket.socket
    items: queue.SimpleQueue[tuple[str, Any]] = field(default_factory=queue.SimpleQueue)
    streaming: bool = False  # response headers and the backlog have been sent

    def matches(self, obj: JsonDict) -> bool:
        if self.namespace is not None and _metadata(obj).get("namespace") != self.namespace:
            return False
        return self.labels(_labels(obj)) and self.fields(obj)

    def view(self, event: _Event) -> Optional[tuple[str, JsonDict]]:
        """What this watch sees of an event (upstream watch-cache filtering), if anything."""
        if event.kind != self.resource.kind:
            return None
        now = self.matches(event.obj)
        if event.type != "MODIFIED":
            return (event.type, event.obj) if now else None
        before = event.prev is not None and self.matches(event.prev)
        if now and before:
            return "MODIFIED", event.obj
        if now:
            return "ADDED", event.obj
        if before and event.prev is not None:
            gone = copy.deepcopy(event.prev)
            gone.setdefault("metadata", {})["resourceVersion"] = str(event.rv)
            return "DELETED", gone
        return None


class _ClientGone(Exception):
    pass


# --- HTTP plumbing ------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    server_version = "fake-apiserver/1"
    disable_nagle_algorithm = True  # as Go's net/http; else small writes wait for delayed ACKs (40 ms)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.fake._handle(self)

    def _not_allowed(self) -> None:
        self.server.fake._handle(self)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _not_allowed

    # helpers used by FakeApiServer
    def send_json(self, code: int, body: Any, headers: Optional[dict[str, str]] = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self.wfile.flush()

    def send_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # FakeApiServer.stop() joins the threads itself, with a timeout

    def __init__(self, address: tuple[str, int], fake: FakeApiServer) -> None:
        self.fake = fake
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name=f"fake-apiserver-conn-{client_address[1]}", daemon=True)
        if not self.fake._track(request, thread):
            self.shutdown_request(request)
            return
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        self.fake._untrack(request)
        super().shutdown_request(request)


@dataclass
class _Failure:
    remaining: int
    status: int
    kinds: Optional[frozenset[str]]
    verbs: Optional[frozenset[str]]
    message: str
    retry_after: Optional[int]


# --- the server ---------------------------------------------------------------------


class FakeApiServer:
    """A Kubernetes API server lookalike on 127.0.0.1 (see the module docstring).

    ``history_limit``: how many events are kept for watches resuming from a
    resourceVersion (None: all, until ``compact()``); older resourceVersions get
    410 Expired. ``bookmark_interval``: seconds between BOOKMARK events on
    watches that allow them (None: only on ``bookmark()``). ``watch_timeout``:
    a server-side limit on every watch, like the API server's
    ``--min-request-timeout`` (None: only ``timeoutSeconds`` ends a watch).
    """

    def __init__(self, *, history_limit: Optional[int] = None, bookmark_interval: Optional[float] = 1.0,
                 watch_timeout: Optional[float] = None, initial_resource_version: int = 1,
                 git_version: str = "v1.33.0") -> None:
        if initial_resource_version < 1:
            raise ValueError("initial_resource_version must be >= 1 ('0' means 'any' to the API)")
        self.history_limit = history_limit
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.git_version = git_version
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._rv = initial_resource_version
        self._history_start = initial_resource_version  # events with rv > this are retained
        self._history: collections.deque[_Event] = collections.deque()
        self._objects: dict[tuple[str, str, str], JsonDict] = {}
        self._watches: set[_Watch] = set()
        self._failures: list[_Failure] = []
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._log: list[RequestRecord] = []
        self._connections: dict[Any, threading.Thread] = {}
        self._threads: list[threading.Thread] = []
        self._httpd: Optional[_HTTPServer] = None
        self._serve_thread: Optional[threading.Thread] = None
        self._closing = False

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> FakeApiServer:
        if self._httpd is not None:
            raise RuntimeError("already started")
        self._closing = False
        self._httpd = _HTTPServer(("127.0.0.1", 0), self)
        self._serve_thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                              name="fake-apiserver-serve", daemon=True)
        self._serve_thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and join every server thread."""
        httpd = self._httpd
        if httpd is None:
            return
        httpd.shutdown()
        if self._serve_thread is not None:
            self._serve_thread.join(timeout)
        with self._lock:
            self._closing = True
            for w in self._watches:
                w.items.put(("stop", None))
            connections = list(self._connections)
            threads = list(self._threads)
        for sock in connections:
            _shutdown_socket(sock)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        httpd.server_close()
        self._httpd = None
        self._serve_thread = None
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"fake API server threads did not end: {alive}")

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: str | Path, *, context: str = "fake", namespace: str = "default") -> Path:
        """Write a kubeconfig (plain http, no credentials) pointing at this server."""
        path = Path(path)
        path.write_text(
            "apiVersion: v1\n"
            "kind: Config\n"
            "clusters:\n"
            f"- name: {context}\n"
            "  cluster:\n"
            f"    server: {self.url}\n"
            "users:\n"
            f"- name: {context}\n"
            "  user: {}\n"
            "contexts:\n"
            f"- name: {context}\n"
            "  context:\n"
            f"    cluster: {context}\n"
            f"    user: {context}\n"
            f"    namespace: {namespace}\n"
            f"current-context: {context}\n"
            "preferences: {}\n"
        )
        return path

    # --- state control --------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    @property
    def oldest_resource_version(self) -> str:
        """The oldest resourceVersion a watch may still start from."""
        with self._lock:
            return str(self._history_start)

    def create(self, obj: JsonDict) -> JsonDict:
        """Add an object (any JSON-able dict with ``kind`` and ``metadata.name``); ADDED.

        Namespaced objects without a namespace go to ``default``. Contents are not
        validated (malformed specs are stored and served as given). Returns the
        stored object (a copy), with resourceVersion/uid/creationTimestamp set.
        """
        rt, obj = self._prepare(obj)
        with self._lock:
            key = self._key(rt, obj)
            if key in self._objects:
                raise KeyError(f"{rt.plural} {key[1]}/{key[2]} already exists")
            meta = obj["metadata"]
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            return self._commit(rt, key, obj, None)

    def update(self, obj: JsonDict) -> JsonDict:
        """Replace an existing object; MODIFIED (nothing happens if nothing changed).

        uid and creationTimestamp are kept from the stored object; a
        resourceVersion in ``obj`` is ignored (no conflict checks).
        """
        rt, obj = self._prepare(obj)
        with self._lock:
            key = self._key(rt, obj)
            old = self._objects.get(key)
            if old is None:
                raise KeyError(f"{rt.plural} {key[1]}/{key[2]} not found")
            return self._replace(rt, key, old, obj)

    def apply(self, obj: JsonDict) -> JsonDict:
        """``create`` if absent, else ``update``."""
        rt, obj = self._prepare(obj)
        with self._lock:
            key = self._key(rt, obj)
            old = self._objects.get(key)
            if old is None:
                meta = obj["metadata"]
                meta["uid"] = str(uuid.uuid4())
                meta["creationTimestamp"] = _now()
                return self._commit(rt, key, obj, None)
            return self._replace(rt, key, old, obj)

    def delete(self, kind: str, namespace: Optional[str], name: str) -> JsonDict:
        """Remove an object; DELETED (the last state, with the deletion's resourceVersion).

        ``namespace`` is ignored for cluster-scoped kinds (Node).
        """
        rt = self._resource(kind)
        key = (rt.kind, (namespace or "default") if rt.namespaced else "", name)
        with self._lock:
            old = self._objects.pop(key, None)
            if old is None:
                raise KeyError(f"{rt.plural} {key[1]}/{name} not found")
            self._rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._record(_Event(self._rv, "DELETED", rt.kind, gone))
            return copy.deepcopy(gone)

    def get(self, kind: str, namespace: Optional[str], name: str) -> Optional[JsonDict]:
        """The stored object (a copy), or None."""
        rt = self._resource(kind)
        key = (rt.kind, (namespace or "default") if rt.namespaced else "", name)
        with self._lock:
            obj = self._objects.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str) -> list[JsonDict]:
        """Every stored object of a kind (copies), in namespace/name order."""
        rt = self._resource(kind)
        with self._lock:
            return [copy.deepcopy(self._objects[k]) for k in sorted(self._objects) if k[0] == rt.kind]

    def compact(self) -> str:
        """Forget the event history: watches from any older resourceVersion get 410.

        Open watches are not affected. Returns the new oldest usable resourceVersion.
        """
        with self._lock:
            self._history.clear()
            self._history_start = self._rv
            return str(self._rv)

    # --- fault injection and watch control ------------------------------------------

    def fail_next(self, n: int = 1, status: int = 500, *, kinds: Optional[Iterable[str]] = None,
                  verbs: Optional[Iterable[str]] = None, message: Optional[str] = None,
                  retry_after: Optional[int] = None) -> None:
        """Answer the next ``n`` matching requests with HTTP ``status`` and a ``Status`` body.

        ``kinds`` (e.g. ``["Service"]``) and ``verbs`` (``"list"``, ``"watch"``,
        ``"get"``) restrict which requests fail (default: any request, discovery
        included). ``retry_after`` adds a ``Retry-After`` header: beware that
        urllib3 then retries 413/429/503 answers by itself (up to 3 times).
        Calls queue up: each request consumes the first matching rule.
        """
        with self._lock:
            self._failures.append(_Failure(
                remaining=n, status=status,
                kinds=frozenset(self._resource(k).kind for k in kinds) if kinds is not None else None,
                verbs=frozenset(verbs) if verbs is not None else None,
                message=message or f"injected failure ({status})", retry_after=retry_after))

    def bookmark(self) -> int:
        """Send a BOOKMARK now on every open watch that allows them; returns how many."""
        with self._lock:
            sent = 0
            for w in self._watches:
                if w.bookmarks:
                    w.items.put(("bookmark", self._rv))
                    sent += 1
            return sent

    def drop_watches(self, *, graceful: bool = False, kind: Optional[str] = None, wait: float = 2.0) -> int:
        """End open watch streams (of one kind, or all); returns how many.

        ``graceful=False``: close the connection mid-stream (no terminating chunk),
        as a network failure or a killed API server would. ``graceful=True``:
        finish the chunked response properly, as the API server does when its own
        request timeout expires. Waits up to ``wait`` seconds for the streams to end.
        """
        rt = self._resource(kind) if kind else None
        with self._lock:
            targets = [w for w in self._watches if rt is None or w.resource is rt]
            for w in targets:
                # The stream's own thread ends it, after the response headers and the
                # backlog: a connection closed before any response would make urllib3
                # silently retry the request.
                w.items.put(("drop", graceful))
            deadline = time.monotonic() + wait
            while any(w in self._watches for w in targets):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            stuck = [w for w in targets if w in self._watches]
        for w in stuck:  # e.g. blocked writing to a client that does not read
            _shutdown_socket(w.sock)
        return len(targets)

    def error_watches(self, code: int = 410, message: Optional[str] = None, *, reason: Optional[str] = None,
                      kind: Optional[str] = None) -> int:
        """Send an ERROR event (a ``Status`` with ``code``) on open watches, then end them.

        The API server does this e.g. when a slow watcher falls out of the watch
        cache's window (410 Expired). Returns how many watches got it.
        """
        rt = self._resource(kind) if kind else None
        status = status_object(code, message or f"injected watch error ({code})", reason)
        with self._lock:
            targets = [w for w in self._watches if rt is None or w.resource is rt]
            for w in targets:
                w.items.put(("error", status))
        return len(targets)

    def active_watches(self, kind: Optional[str] = None) -> int:
        """How many watch streams are open (of one kind, or all).

        A stream counts once its response headers and backlog have been sent.
        """
        rt = self._resource(kind) if kind else None
        with self._lock:
            return sum(1 for w in self._watches if w.streaming and (rt is None or w.resource is rt))

    def wait_for_watches(self, count: int, kind: Optional[str] = None, timeout: float = 5.0) -> bool:
        """Wait until exactly ``count`` watch streams are open (of one kind, or all)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.active_watches(kind) != count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    # --- request accounting -----------------------------------------------------------

    def request_count(self, kind: Optional[str] = None, verb: Optional[str] = None) -> int:
        """How many requests were received for a kind and/or verb (list, watch, get).

        Failed requests (including injected failures) count too.
        """
        rt_kind = self._resource(kind).kind if kind else None
        with self._lock:
            return sum(n for (k, v), n in self._counts.items()
                       if (rt_kind is None or k == rt_kind) and (verb is None or v == verb))

    @property
    def counts(self) -> dict[tuple[str, str], int]:
        """Requests per ``(kind, verb)``, e.g. ``{("Service", "list"): 2}``."""
        with self._lock:
            return dict(self._counts)

    def requests(self) -> list[RequestRecord]:
        """Every request received so far, in order (copies)."""
        with self._lock:
            return [copy.copy(r) for r in self._log]

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
            self._log.clear()

    # --- internals: state -------------------------------------------------------------

    @staticmethod
    def _resource(kind: str) -> ResourceType:
        wanted = kind.lower()
        for rt in RESOURCES:
            if wanted in (rt.kind.lower(), rt.plural):
                return rt
        raise ValueError(f"unsupported kind {kind!r} (served: {', '.join(r.kind for r in RESOURCES)})")

    def _prepare(self, obj: JsonDict) -> tuple[ResourceType, JsonDict]:
        if not isinstance(obj, dict):
            raise TypeError("objects are dicts")
        try:
            obj = json.loads(json.dumps(obj))  # a deep copy, and proof that it can be served
        except (TypeError, ValueError) as exc:
            raise ValueError(f"object is not JSON-serialisable: {exc}") from exc
        kind = obj.get("kind")
        if not isinstance(kind, str):
            raise ValueError("object has no kind")
        rt = self._resource(kind)
        obj["kind"] = rt.kind
        obj.setdefault("apiVersion", rt.api_version)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
            raise ValueError("object has no metadata.name")
        if rt.namespaced and not meta.get("namespace"):
            meta["namespace"] = "default"
        return rt, obj

    @staticmethod
    def _key(rt: ResourceType, obj: JsonDict) -> tuple[str, str, str]:
        meta = obj["metadata"]
        return rt.kind, str(meta.get("namespace") or "") if rt.namespaced else "", meta["name"]

    def _replace(self, rt: ResourceType, key: tuple[str, str, str], old: JsonDict, obj: JsonDict) -> JsonDict:
        meta = obj["metadata"]
        meta["uid"] = old["metadata"].get("uid")
        meta["creationTimestamp"] = old["metadata"].get("creationTimestamp")
        meta["resourceVersion"] = old["metadata"].get("resourceVersion")
        if obj == old:
            return copy.deepcopy(old)
        return self._commit(rt, key, obj, old)

    def _commit(self, rt: ResourceType, key: tuple[str, str, str], obj: JsonDict, old: Optional[JsonDict]) -> JsonDict:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[key] = obj
        self._record(_Event(self._rv, "ADDED" if old is None else "MODIFIED", rt.kind, obj, old))
        return copy.deepcopy(obj)

    def _record(self, event: _Event) -> None:
        self._history.append(event)
        if self.history_limit is not None:
            while len(self._history) > self.history_limit:
                self._history_start = self._history.popleft().rv
        for w in self._watches:
            w.items.put(("event", event))
        self._changed.notify_all()

    def _matching(self, rt: ResourceType, namespace: Optional[str], labels: Predicate,
                  fields: Callable[[JsonDict], bool]) -> list[JsonDict]:
        out = []
        for key in sorted(self._objects):
            if key[0] != rt.kind or (namespace is not None and key[1] != namespace):
                continue
            obj = self._objects[key]
            if labels(_labels(obj)) and fields(obj):
                out.append(obj)
        return out

    # --- internals: connections ---------------------------------------------------------

    def _track(self, sock: Any, thread: threading.Thread) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._connections[sock] = thread
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            return True

    def _untrack(self, sock: Any) -> None:
        with self._lock:
            self._connections.pop(sock, None)

    # --- internals: HTTP --------------------------------------------------------------

    def _route(self, path: str) -> tuple[Optional[ResourceType], Optional[str], Optional[str]]:
        """(resource, namespace or None for all, name or None for a collection)."""
        for rt in RESOURCES:
            prefix = rt.prefix
            if not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1:].strip("/").split("/")
            if rt.namespaced and len(rest) in (3, 4) and rest[0] == "namespaces" and rest[2] == rt.plural:
                return rt, rest[1], rest[3] if len(rest) == 4 else None
            if rest[0] == rt.plural and len(rest) == 1:
                return rt, None, None
            if rest[0] == rt.plural and len(rest) == 2 and not rt.namespaced:
                return rt, None, rest[1]
        return None, None, None

    def _handle(self, h: _Handler) -> None:
        if h.command not in ("GET", "HEAD"):
            h.close_connection = True  # a request body, if any, is not read
        parts = urlsplit(h.path)
        path = parts.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        rt, namespace, name = self._route(path)
        watching = _truthy(query.get("watch"))
        verb = "" if rt is None else ("get" if name is not None else ("watch" if watching else "list"))
        record = RequestRecord(h.command, path, query, rt.kind if rt else "", verb)
        with self._lock:
            self._counts[(record.kind, verb)] += 1
            self._log.append(record)
            failure = self._take_failure(record)
        if failure is not None:
            record.status = failure.status
            headers = {"Retry-After": str(failure.retry_after)} if failure.retry_after is not None else None
            h.send_json(failure.status, status_object(failure.status, failure.message), headers)
            return
        if h.command not in ("GET", "HEAD"):
            record.status = 405
            h.send_json(405, status_object(405, f"the fake API server is read-only ({h.command} {path})"))
            return
        if rt is None:
            record.status = self._serve_other(h, path)
            return
        try:
            labels = parse_label_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"), rt.field_labels)
        except SelectorError as exc:
            record.status = 400
            h.send_json(400, status_object(400, str(exc)))
            return
        if name is not None:
            record.status = self._serve_get(h, rt, namespace, name)
        elif watching:
            record.status = 200
            self._serve_watch(h, rt, namespace, labels, fields, query)
        else:
            record.status = self._serve_list(h, rt, namespace, labels, fields, query)

    def _take_failure(self, record: RequestRecord) -> Optional[_Failure]:
        for failure in self._failures:
            if failure.kinds is not None and record.kind not in failure.kinds:
                continue
            if failure.verbs is not None and record.verb not in failure.verbs:
                continue
            failure.remaining -= 1
            if failure.remaining <= 0:
                self._failures.remove(failure)
            return failure
        return None

    def _serve_other(self, h: _Handler, path: str) -> int:
        if path in ("/healthz", "/livez", "/readyz"):
            h.send_text(200, "ok")
            return 200
        if path == "/version":
            major, minor = (self.git_version.lstrip("v").split(".") + ["0"])[:2]
            h.send_json(200, {"major": major, "minor": minor, "gitVersion": self.git_version,
                              "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z",
                              "goVersion": "go1.24.0", "compiler": "gc", "platform": "linux/amd64"})
            return 200
        if path == "/api":
            h.send_json(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]})
            return 200
        groups = sorted({rt.api_version for rt in RESOURCES if rt.api_version != "v1"})
        if path == "/apis":
            h.send_json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": gv.split("/")[0],
                 "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                 "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}}
                for gv in groups]})
            return 200
        for gv in ["v1", *groups]:
            prefix = "/api/v1" if gv == "v1" else f"/apis/{gv}"
            if path == prefix:
                h.send_json(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
                    {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced, "kind": rt.kind,
                     "verbs": ["get", "list", "watch"]}
                    for rt in RESOURCES if rt.api_version == gv]})
                return 200
        h.send_json(404, status_object(404, "the server could not find the requested resource"))
        return 404

    def _serve_get(self, h: _Handler, rt: ResourceType, namespace: Optional[str], name: str) -> int:
        with self._lock:
            obj = self._objects.get((rt.kind, namespace or "", name))
            body = copy.deepcopy(obj) if obj is not None else None
        if body is None:
            h.send_json(404, status_object(404, f'{rt.plural} "{name}" not found',
                                           details={"name": name, "kind": rt.plural}))
            return 404
        h.send_json(200, body)
        return 200

    def _serve_list(self, h: _Handler, rt: ResourceType, namespace: Optional[str], labels: Predicate,
                    fields: Callable[[JsonDict], bool], query: dict[str, str]) -> int:
        try:
            limit = int(query["limit"]) if query.get("limit") else 0
        except ValueError:
            h.send_json(400, status_object(400, f"invalid limit {query['limit']!r}"))
            return 400
        start = ""
        with self._lock:
            list_rv = self._rv
            if query.get("continue"):
                try:
                    token = json.loads(base64.urlsafe_b64decode(query["continue"].encode()))
                    start, list_rv = str(token["start"]), int(token["rv"])
                except (ValueError, KeyError, TypeError, binascii.Error):
                    h.send_json(400, status_object(400, "continue key is not valid"))
                    return 400
            matching = self._matching(rt, namespace, labels, fields)
            items = []
            for obj in matching:
                meta = _metadata(obj)
                if f"{meta.get('namespace') or ''}/{meta.get('name')}" <= start:
                    continue
                item = copy.deepcopy(obj)
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
        metadata: JsonDict = {"resourceVersion": str(list_rv)}
        if limit > 0 and len(items) > limit:
            rest = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]
            token = {"v": "meta.k8s.io/v1", "rv": list_rv,
                     "start": f"{last.get('namespace') or ''}/{last.get('name')}"}
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            metadata["remainingItemCount"] = rest
        h.send_json(200, {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": metadata,
                          "items": items})
        return 200

    def _serve_watch(self, h: _Handler, rt: ResourceType, namespace: Optional[str], labels: Predicate,
                     fields: Callable[[JsonDict], bool], query: dict[str, str]) -> None:
        try:
            timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
            rv_text = query.get("resourceVersion") or ""
            since = int(rv_text) if rv_text else 0
            if since < 0:
                raise ValueError(rv_text)
        except ValueError:
            h.send_json(400, status_object(400, "invalid resourceVersion or timeoutSeconds"))
            return
        if timeout is not None and timeout <= 0:
            timeout = None  # as upstream: 0 means the server's default
        if self.watch_timeout is not None:
            timeout = self.watch_timeout if timeout is None else min(timeout, self.watch_timeout)
        initial = since == 0 or _truthy(query.get("sendInitialEvents"))
        watch = _Watch(rt, namespace, labels, fields, _truthy(query.get("allowWatchBookmarks")), h.connection)
        backlog: list[tuple[str, JsonDict]] = []
        expired: Optional[JsonDict] = None
        with self._lock:
            if self._closing:
                h.close_connection = True
                return
            if initial:
                backlog = [("ADDED", obj) for obj in self._matching(rt, namespace, labels, fields)]
                if _truthy(query.get("sendInitialEvents")) and watch.bookmarks:
                    backlog.append(("BOOKMARK", self._bookmark_object(rt, self._rv, initial_end=True)))
            elif since < self._history_start:
                expired = status_object(410, f"too old resource version: {since} ({self._history_start})")
            else:
                for event in self._history:
                    if event.rv > since and (seen := watch.view(event)) is not None:
                        backlog.append(seen)
            if expired is None:
                self._watches.add(watch)
                self._changed.notify_all()
        graceful = True
        try:
            h.start_stream()
            if expired is not None:
                self._send_event(h, "ERROR", expired)
                h.end_stream()
                return
            for etype, obj in backlog:
                self._send_event(h, etype, obj)
            with self._lock:
                watch.streaming = True
                self._changed.notify_all()
            graceful = self._stream(h, watch, timeout)
            if graceful:
                h.end_stream()
        except (_ClientGone, OSError):
            graceful = False
        finally:
            with self._lock:
                self._watches.discard(watch)
                self._changed.notify_all()
            if not graceful:
                h.close_connection = True
                _shutdown_socket(h.connection)

    def _stream(self, h: _Handler, watch: _Watch, timeout: Optional[float]) -> bool:
        """Send live events until the stream should end; True to end it gracefully."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        interval = self.bookmark_interval if watch.bookmarks else None
        next_bookmark = None if interval is None else started + interval
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return True
            if next_bookmark is not None and now >= next_bookmark:
                with self._lock:
                    rv = self._rv if watch.items.empty() else None
                if rv is not None:
                    self._send_event(h, "BOOKMARK", self._bookmark_object(watch.resource, rv))
                    next_bookmark = now + (interval or 0.0)
            wait = POLL_INTERVAL
            if deadline is not None:
                wait = min(wait, deadline - now)
            if next_bookmark is not None:
                wait = min(wait, max(0.0, next_bookmark - now))
            try:
                what, payload = watch.items.get(timeout=max(0.0, wait))
            except queue.Empty:
                if _client_gone(h.connection):
                    raise _ClientGone() from None
                continue
            if what == "event":
                seen = watch.view(payload)
                if seen is not None:
                    self._send_event(h, *seen)
            elif what == "bookmark":
                self._send_event(h, "BOOKMARK", self._bookmark_object(watch.resource, payload))
            elif what == "error":
                self._send_event(h, "ERROR", payload)
                return True
            elif what == "drop":
                return bool(payload)
            else:  # stop
                return False

    @staticmethod
    def _bookmark_object(rt: ResourceType, rv: int, initial_end: bool = False) -> JsonDict:
        meta: JsonDict = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}

    @staticmethod
    def _send_event(h: _Handler, etype: str, obj: JsonDict) -> None:
        h.send_chunk(json.dumps({"type": etype, "object": obj}).encode() + b"\n")


def _shutdown_socket(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _client_gone(sock: socket.socket) -> bool:
    """True if the peer closed its end (EOF is readable) or the socket is broken."""
    try:
        readable, _unused, _unused = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
