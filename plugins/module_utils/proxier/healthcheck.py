# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
r"""Service health check servers (healthCheckNodePort of externalTrafficPolicy=Local
LoadBalancer services), as upstream's pkg/proxy/healthcheck/service_health.go.

One HTTP listener per service (on each bind IP). Any path answers (``\t`` is a tab)::

    {\n\t"service": {\n\t\t"namespace": "<ns>",\n\t\t"name": "<name>"\n\t},\n
    \t"localEndpoints": N,\n\t"serviceProxyHealthy": true\n}

(upstream's dedented text: tab-indented, no trailing newline, byte for byte) with 200 when N > 0 and the
proxy is healthy (ProxyHealthServer.is_healthy(): node eligibility is not part of it),
else 503; headers ``Content-Type: application/json``, ``X-Content-Type-Options:
nosniff``, ``X-Load-Balancing-Endpoint-Weight: N``.

``sync_services()`` makes the open listeners match the map exactly (a service whose port
changed is closed and reopened). A port that cannot be bound is logged with the service
name and returned, not raised; like upstream, the service is not recorded, so the next
sync retries it. ``sync_endpoints()`` sets the local endpoint counts (0 for services it
does not mention). Health checks opened after the last ``sync_endpoints()`` report 0
until the next one, as upstream (the proxier calls both on every sync).
"""

from __future__ import annotations

import json
import threading
from typing import Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

from .healthz import HTTPServerThread, LogFn, Response, join_host_port

NamespacedName = Tuple[str, str]  # (namespace, name)


class ProxyHealthSource(Protocol):
    def is_healthy(self) -> bool: ...


def _body(nsn: NamespacedName, count: int, healthy: bool) -> bytes:
    ns, name = json.dumps(nsn[0]), json.dumps(nsn[1])
    return (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {ns},\n'
        f'\t\t"name": {name}\n'
        "\t},\n"
        f'\t"localEndpoints": {count},\n'
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
        "}"
    ).encode()


class _Instance:
    def __init__(self, nsn: NamespacedName, port: int) -> None:
        self.nsn = nsn
        self.port = port
        self.servers: List[HTTPServerThread] = []
        self.endpoints = 0  # local endpoints of the service


class HealthCheckServers:
    """Upstream's ServiceHealthServer. ``bind_ip``: one address or several (upstream
    listens on each node IP matching nodePortAddresses; "0.0.0.0" / "::" for all)."""

    def __init__(self, bind_ip: Union[str, Sequence[str]], proxy_health: Optional[ProxyHealthSource],
                 log: Optional[LogFn] = None, hostname: str = "") -> None:
        self.bind_ips: Tuple[str, ...] = (bind_ip,) if isinstance(bind_ip, str) else tuple(bind_ip)
        self.proxy_health = proxy_health
        self.log: LogFn = log or (lambda msg: None)
        self.hostname = hostname
        self._lock = threading.Lock()
        self._services: Dict[NamespacedName, _Instance] = {}

    # --- the engine's side ---

    def sync_services(self, services: Mapping[NamespacedName, int]) -> Dict[NamespacedName, str]:
        """Open/close listeners to match ``{(ns, name): healthCheckNodePort}``; returns
        ``{(ns, name): error}`` for those that could not be opened (retried next call)."""
        failures: Dict[NamespacedName, str] = {}
        in_flight: List[threading.Thread] = []
        with self._lock:
            for nsn, inst in list(self._services.items()):
                port = services.get(nsn)
                if port is None or port != inst.port:
                    self.log(f"closing healthcheck {nsn[0]}/{nsn[1]} on port {inst.port}")
                    for srv in inst.servers:
                        in_flight += srv.close()
                    del self._services[nsn]
            for nsn, port in services.items():
                if nsn in self._services:
                    continue
                inst = _Instance(nsn, port)
                error = self._open(inst)
                if error is not None:
                    node = f"node {self.hostname} " if self.hostname else ""
                    msg = f"{node}failed to start healthcheck \"{nsn[0]}/{nsn[1]}\" on port {port}: {error}"
                    self.log(msg)
                    failures[nsn] = msg
                    continue
                self.log(f"opened healthcheck {nsn[0]}/{nsn[1]} on port {port}")
                self._services[nsn] = inst
        HTTPServerThread.join(in_flight)  # outside the lock: those requests may be waiting for it
        return failures

    def _open(self, inst: _Instance) -> Optional[str]:
        if not isinstance(inst.port, int) or isinstance(inst.port, bool) or not 0 <= inst.port <= 65535:
            return f"invalid port {inst.port!r}"
        nsn = inst.nsn
        for ip in self.bind_ips:
            srv = HTTPServerThread(ip, inst.port, lambda method, path, nsn=nsn: self.handle(nsn),
                                   f"healthcheck-{nsn[0]}/{nsn[1]}", self.log)
            try:
                srv.start()
            except OSError as e:
                for opened in inst.servers:  # release what was opened, so a retry can succeed
                    opened.close()
                inst.servers = []
                return f"listen {join_host_port(ip, inst.port)}: {e.strerror or e}"
            inst.servers.append(srv)
        return None

    def sync_endpoints(self, endpoints: Mapping[NamespacedName, int]) -> None:
        """``{(ns, name): local endpoint count}``; services not listed get 0, counts for
        services without a health check are dropped."""
        with self._lock:
            for nsn, inst in self._services.items():
                inst.endpoints = int(endpoints.get(nsn, 0))

    def stop(self) -> None:
        self.sync_services({})

    # --- inspection ---

    def services(self) -> Dict[NamespacedName, int]:
        """The open health checks: ``{(ns, name): port}``."""
        with self._lock:
            return {nsn: inst.port for nsn, inst in self._services.items()}

    def addresses(self, nsn: NamespacedName) -> List[str]:
        """Bound host:port of a service's listeners (useful with port 0)."""
        with self._lock:
            inst = self._services.get(nsn)
            return [srv.address for srv in inst.servers] if inst else []

    def local_endpoints(self, nsn: NamespacedName) -> Optional[int]:
        with self._lock:
            inst = self._services.get(nsn)
            return inst.endpoints if inst else None

    # --- the answer ---

    def handle(self, nsn: NamespacedName) -> Response:
        with self._lock:
            inst = self._services.get(nsn)
            count = inst.endpoints if inst is not None else None
        if count is None:
            # A request racing with the close of its health check: upstream logs and
            # writes nothing, which net/http turns into an empty 200.
            return 200, [], b""
        healthy = self.proxy_health.is_healthy() if self.proxy_health is not None else True
        headers = [("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"),
                   ("X-Load-Balancing-Endpoint-Weight", str(count))]
        return (200 if count != 0 and healthy else 503), headers, _body(nsn, count, healthy)
