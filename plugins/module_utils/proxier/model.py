# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Frozen value objects parsed and validated from Kubernetes API dicts.

Parsing is the only gate to the kernel: anything that reaches a backend has been
validated (validation.py, the API server's rules), and a bad object is rejected with a
message naming the object and the field (``Service ns/name: spec.ports[0].port: ...``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Tuple

# ValidationError is part of this module's interface (re-exported).
from .validation import (  # noqa: F401 pylint: disable=unused-import
    ValidationError,
    dns1035_label,
    dns1123_subdomain,
    family_of,
    parse_cidr,
    parse_ip,
    validate_endpoint_slice_body,
    validate_metadata,
    validate_node_spec,
    validate_service_spec,
)

PROTOCOLS = ("TCP", "UDP", "SCTP")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
DEFAULT_STICKY_SECONDS = 10800
MAX_STICKY_SECONDS = 86400


class Skipped(Exception):
    """A valid object the proxy deliberately ignores (headless, ExternalName, ...)."""


@dataclass(frozen=True, order=True)
class ServicePortName:
    namespace: str
    name: str
    port: str
    protocol: str

    @property
    def service(self) -> str:
        return f"{self.namespace}/{self.name}"

    @functools.cached_property
    def text(self) -> str:
        # Upstream's ServicePortName.String(): "ns/name" plus ":port" when the port is named.
        # Cached: it is in every chain hash and comment the compiler writes for the port.
        return self.service + (f":{self.port}" if self.port else "")

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service: what a backend programs for it."""

    name: ServicePortName
    cluster_ip: str
    port: int
    protocol: str
    node_port: int = 0
    external_ips: Tuple[str, ...] = ()
    load_balancer_ips: Tuple[str, ...] = ()
    load_balancer_source_ranges: Tuple[str, ...] = ()
    external_policy_local: bool = False  # only meaningful when externally accessible
    internal_policy_local: bool = False
    health_check_node_port: int = 0
    session_affinity_seconds: int = 0  # 0: no ClientIP affinity

    @property
    def externally_accessible(self) -> bool:
        return bool(self.node_port or self.external_ips or self.load_balancer_ips)

    @property
    def uses_external_local(self) -> bool:
        return self.externally_accessible and self.external_policy_local

    @property
    def uses_cluster_endpoints(self) -> bool:
        return (not self.internal_policy_local) or (
            self.externally_accessible and not self.external_policy_local
        )

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or self.uses_external_local


@dataclass(frozen=True, order=True)
class Endpoint:
    ip: str
    port: int
    node_name: str = ""
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    is_local: bool = False

    @functools.cached_property
    def addr(self) -> str:
        """``ip:port`` (``[ip]:port`` for IPv6): names SEP chains and DNAT targets; cached
        because a large compile asks for it several times per endpoint."""
        if ":" in self.ip:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"

    def __str__(self) -> str:
        return self.addr


@dataclass(frozen=True)
class Node:
    name: str
    pod_cidrs: Tuple[str, ...] = ()
    labels: Tuple[Tuple[str, str], ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    ports: Tuple[ServicePort, ...]


@dataclass(frozen=True)
class SlicePort:
    name: str
    port: int
    protocol: str


@dataclass(frozen=True)
class SliceEndpoint:
    addresses: Tuple[str, ...]
    node_name: str
    ready: bool
    serving: bool
    terminating: bool


@dataclass(frozen=True)
class EndpointSlice:
    namespace: str
    name: str
    service: str  # the owning Service's name (label kubernetes.io/service-name)
    address_type: str
    ports: Tuple[SlicePort, ...]
    endpoints: Tuple[SliceEndpoint, ...]


# --- Service -----------------------------------------------------------------------


def _family_name(family: int) -> str:
    return "IPv6" if family == 6 else "IPv4"


def parse_service(obj: Mapping[str, Any], proxy_name: str = "", family: int = 4) -> Service:
    """Parse a v1 Service dict. Raises ValidationError or Skipped.

    The whole object is validated as the API server would (validation.py) before anything
    is read. Only the node's IP ``family`` is kept: a single-stack Service of the other
    family is skipped, a dual-stack one keeps its addresses of this family, as upstream's
    single-family proxier does.
    """
    f, namespace, name, labels = validate_metadata(obj, "Service", dns1035_label)
    full = f"{namespace}/{name}"
    _check_proxied(full, labels, proxy_name)
    validate_service_spec(f, obj)
    spec: Mapping[str, Any] = obj["spec"]
    svc_type = spec.get("type") or "ClusterIP"
    if svc_type == "ExternalName":
        raise Skipped(f"Service {full}: ExternalName services are not proxied")
    want = _family_name(family)
    cluster_ip = _cluster_ip(full, spec, want)
    external_ips, lb_ips, ranges = _served_addresses(obj, spec, want)
    etp = spec.get("externalTrafficPolicy") or "Cluster"
    itp = spec.get("internalTrafficPolicy") or "Cluster"
    sticky = _sticky_seconds(spec)
    hc_port = (spec.get("healthCheckNodePort") or 0) if svc_type == "LoadBalancer" and etp == "Local" else 0

    ports = []
    for p in spec.get("ports") or ():
        pname = p.get("name") or ""
        proto = p.get("protocol") or "TCP"
        node_port = (p.get("nodePort") or 0) if svc_type in ("NodePort", "LoadBalancer") else 0
        ports.append(ServicePort(
            name=ServicePortName(namespace, name, pname, proto), cluster_ip=cluster_ip, port=p["port"],
            protocol=proto, node_port=node_port, external_ips=external_ips, load_balancer_ips=lb_ips,
            load_balancer_source_ranges=ranges,
            external_policy_local=etp == "Local", internal_policy_local=itp == "Local",
            health_check_node_port=hc_port, session_affinity_seconds=sticky,
        ))
    return Service(namespace, name, tuple(ports))


def _check_proxied(full: str, labels: Mapping[str, str], proxy_name: str) -> None:
    """Skipped: another service proxy's Service, or a headless one by label."""
    if labels.get(SERVICE_PROXY_NAME_LABEL, "") != proxy_name:
        raise Skipped(f"Service {full}: {SERVICE_PROXY_NAME_LABEL} is not ours")
    if HEADLESS_LABEL in labels:
        raise Skipped(f"Service {full}: labelled {HEADLESS_LABEL}")


def _cluster_ip(full: str, spec: Mapping[str, Any], want: str) -> str:
    """The cluster IP of the node's family (Skipped: headless, or the other family only)."""
    cluster_ips = list(spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else []))
    if not cluster_ips or cluster_ips[0] in ("", "None"):
        raise Skipped(f"Service {full}: headless (no cluster IP)")
    mine = [ip for ip in map(parse_ip, cluster_ips) if family_of(ip) == want]
    if not mine:
        raise Skipped(f"Service {full}: {'/'.join(family_of(parse_ip(ip)) for ip in cluster_ips)} only; "
                      f"this node serves {want}")
    return str(mine[0])


def _served_addresses(obj: Mapping[str, Any], spec: Mapping[str, Any],
                      want: str) -> Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]:
    """(external IPs, load balancer ingress IPs, source ranges) of the node's family."""
    def served(values: Iterable[Any]) -> Tuple[str, ...]:
        ips = (parse_ip(v) for v in values)
        return tuple(str(ip) for ip in ips if family_of(ip) == want)

    external_ips = served(spec.get("externalIPs") or ())
    ingress = ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or ()
    # ipMode Proxy: the load balancer proxies, so the VIP must not be captured on the node.
    lb_ips = served(ing["ip"] for ing in ingress if ing.get("ip") and ing.get("ipMode") != "Proxy")
    ranges = tuple(str(net) for net in (parse_cidr(c.strip()) for c in spec.get("loadBalancerSourceRanges") or ())
                   if family_of(net) == want)
    return external_ips, lb_ips, ranges


def _sticky_seconds(spec: Mapping[str, Any]) -> int:
    """ClientIP session affinity's timeout (0: no affinity)."""
    if (spec.get("sessionAffinity") or "None") != "ClientIP":
        return 0
    cfg = (spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}
    return cfg.get("timeoutSeconds") or DEFAULT_STICKY_SECONDS


# --- EndpointSlice -------------------------------------------------------------------


def parse_endpoint_slice(obj: Mapping[str, Any], proxy_name: str = "", family: int = 4) -> EndpointSlice:
    """Parse a discovery.k8s.io/v1 EndpointSlice dict. Raises ValidationError or Skipped
    (no owning Service, FQDN, or addresses of the IP family this node does not serve)."""
    f, namespace, name, labels = validate_metadata(obj, "EndpointSlice", dns1123_subdomain)
    full = f"{namespace}/{name}"
    service = labels.get(SERVICE_NAME_LABEL)
    if not service:
        raise Skipped(f"EndpointSlice {full}: no {SERVICE_NAME_LABEL} label")
    if HEADLESS_LABEL in labels:
        raise Skipped(f"EndpointSlice {full}: labelled {HEADLESS_LABEL}")
    address_type = validate_endpoint_slice_body(f, obj)
    if address_type == "FQDN":
        raise Skipped(f"EndpointSlice {full}: FQDN slices are not proxied")
    if address_type != _family_name(family):
        raise Skipped(f"EndpointSlice {full}: {address_type}; this node serves {_family_name(family)}")
    ports = tuple(SlicePort(p.get("name") or "", p["port"], p.get("protocol") or "TCP")
                  for p in obj.get("ports") or ()
                  if p.get("port") is not None)  # upstream ignores ports without a number
    endpoints = []
    for ep in obj.get("endpoints") or ():
        cond = ep.get("conditions") or {}
        # Upstream semantics: nil ready means ready; nil serving follows ready.
        ready = cond.get("ready") is None or bool(cond.get("ready"))
        serving = ready if cond.get("serving") is None else bool(cond.get("serving"))
        # Upstream uses only the first address of an endpoint.
        endpoints.append(SliceEndpoint((str(parse_ip(ep["addresses"][0])),), ep.get("nodeName") or "",
                                       ready, serving, bool(cond.get("terminating"))))
    return EndpointSlice(namespace, name, service, address_type, ports, tuple(endpoints))


# --- Node ---------------------------------------------------------------------------


def parse_node(obj: Mapping[str, Any]) -> Node:
    f, _ns, name, labels = validate_metadata(obj, "Node", dns1123_subdomain, namespaced=False)
    cidrs = validate_node_spec(f, obj)
    return Node(name, tuple(str(c) for c in cidrs), tuple(sorted(labels.items())))
