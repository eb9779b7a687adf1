# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Frozen value objects parsed and validated from Kubernetes API dicts.

Parsing is the only gate to the kernel: anything that reaches a backend has been
validated here, and a bad object is rejected with a message naming the object and the
field (``Service ns/name: spec.ports[0].port: ...``).
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple

PROTOCOLS = ("TCP", "UDP", "SCTP")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
DEFAULT_STICKY_SECONDS = 10800
MAX_STICKY_SECONDS = 86400


class ValidationError(ValueError):
    """A Kubernetes object that cannot be used; the message names object and field."""

    def __init__(self, kind: str, name: str, path: str, problem: str) -> None:
        self.kind = kind
        self.name = name
        self.path = path
        self.problem = problem
        super().__init__(f"{kind} {name}: {path}: {problem}")


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


# --- helpers -----------------------------------------------------------------------


def _meta(obj: Mapping[str, Any], kind: str) -> Tuple[str, str]:
    if not isinstance(obj, Mapping):
        raise ValidationError(kind, "?", "(object)", f"expected a mapping, got {type(obj).__name__}")
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise ValidationError(kind, "?", "metadata", "missing")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError(kind, "?", "metadata.name", "missing or not a string")
    namespace = meta.get("namespace") or "default"
    if not isinstance(namespace, str):
        raise ValidationError(kind, name, "metadata.namespace", "not a string")
    return namespace, name


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, Mapping) else {}


def _int(value: Any, err: _Err, path: str, lo: int, hi: int, default: Optional[int] = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise err(path, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise err(path, f"{value} is out of range {lo}-{hi}")
    return value


def _ip(value: Any, err: _Err, path: str) -> str:
    if not isinstance(value, str):
        raise err(path, f"expected an IP address string, got {value!r}")
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise err(path, f"{value!r} is not a valid IP address") from None


def _list(value: Any, err: _Err, path: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise err(path, f"expected a list, got {type(value).__name__}")
    return value


class _Err:
    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name

    def __call__(self, path: str, problem: str) -> ValidationError:
        return ValidationError(self.kind, self.name, path, problem)


def _family(ip: str) -> int:
    return ipaddress.ip_address(ip).version


# --- Service -----------------------------------------------------------------------


def parse_service(obj: Mapping[str, Any], proxy_name: str = "") -> Service:
    """Parse a v1 Service dict. Raises ValidationError or Skipped.

    The primary cluster IP decides the IP family; addresses of the other family
    (dual-stack) are dropped here as upstream's single-family proxier does.
    """
    namespace, name = _meta(obj, "Service")
    full = f"{namespace}/{name}"
    err = _Err("Service", full)
    labels = _labels(obj)
    if labels.get(SERVICE_PROXY_NAME_LABEL, "") != proxy_name:
        raise Skipped(f"Service {full}: {SERVICE_PROXY_NAME_LABEL} is not ours")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise err("spec", "missing")
    svc_type = spec.get("type") or "ClusterIP"
    if svc_type not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        raise err("spec.type", f"unknown type {svc_type!r}")
    if svc_type == "ExternalName":
        raise Skipped(f"Service {full}: ExternalName services are not proxied")
    cluster_ip = spec.get("clusterIP")
    if cluster_ip in (None, "", "None"):
        raise Skipped(f"Service {full}: headless (no cluster IP)")
    cluster_ip = _ip(cluster_ip, err, "spec.clusterIP")
    family = _family(cluster_ip)

    def same_family(values: Iterable[str]) -> Tuple[str, ...]:
        return tuple(v for v in values if _family(v) == family)

    external_ips = same_family(
        _ip(v, err, f"spec.externalIPs[{i}]")
        for i, v in enumerate(_list(spec.get("externalIPs"), err, "spec.externalIPs"))
    )
    status = obj.get("status") or {}
    ingress = _list(((status.get("loadBalancer") or {}).get("ingress")), err, "status.loadBalancer.ingress")
    lb_ips = []
    for i, ing in enumerate(ingress):
        if not isinstance(ing, Mapping):
            raise err(f"status.loadBalancer.ingress[{i}]", "expected a mapping")
        # ipMode Proxy: the load balancer proxies, so the VIP must not be captured on the node.
        if not ing.get("ip") or ing.get("ipMode") == "Proxy":
            continue
        lb_ips.append(_ip(ing["ip"], err, f"status.loadBalancer.ingress[{i}].ip"))
    lb_ips_t = same_family(lb_ips)

    ranges = []
    for i, cidr in enumerate(_list(spec.get("loadBalancerSourceRanges"), err, "spec.loadBalancerSourceRanges")):
        if not isinstance(cidr, str):
            raise err(f"spec.loadBalancerSourceRanges[{i}]", f"expected a CIDR string, got {cidr!r}")
        try:
            net = ipaddress.ip_network(cidr.strip(), strict=False)
        except ValueError:
            raise err(f"spec.loadBalancerSourceRanges[{i}]", f"{cidr!r} is not a valid CIDR") from None
        if net.version == family:
            ranges.append(str(net))

    etp = spec.get("externalTrafficPolicy") or "Cluster"
    if etp not in ("Cluster", "Local"):
        raise err("spec.externalTrafficPolicy", f"must be Cluster or Local, got {etp!r}")
    itp = spec.get("internalTrafficPolicy") or "Cluster"
    if itp not in ("Cluster", "Local"):
        raise err("spec.internalTrafficPolicy", f"must be Cluster or Local, got {itp!r}")

    affinity = spec.get("sessionAffinity") or "None"
    if affinity not in ("None", "ClientIP"):
        raise err("spec.sessionAffinity", f"must be None or ClientIP, got {affinity!r}")
    sticky = 0
    if affinity == "ClientIP":
        cfg = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {})
        sticky = _int(cfg.get("timeoutSeconds"), err, "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                      1, MAX_STICKY_SECONDS, default=DEFAULT_STICKY_SECONDS)

    hc_port = 0
    if svc_type == "LoadBalancer" and etp == "Local" and spec.get("healthCheckNodePort"):
        hc_port = _int(spec.get("healthCheckNodePort"), err, "spec.healthCheckNodePort", 1, 65535)

    raw_ports = _list(spec.get("ports"), err, "spec.ports")
    ports = []
    seen = set()
    for i, p in enumerate(raw_ports):
        path = f"spec.ports[{i}]"
        if not isinstance(p, Mapping):
            raise err(path, "expected a mapping")
        pname = p.get("name") or ""
        if not isinstance(pname, str):
            raise err(f"{path}.name", "not a string")
        proto = p.get("protocol") or "TCP"
        if proto not in PROTOCOLS:
            raise err(f"{path}.protocol", f"must be one of {', '.join(PROTOCOLS)}, got {proto!r}")
        port = _int(p.get("port"), err, f"{path}.port", 1, 65535)
        node_port = 0
        if svc_type in ("NodePort", "LoadBalancer") and p.get("nodePort"):
            node_port = _int(p.get("nodePort"), err, f"{path}.nodePort", 1, 65535)
        spn = ServicePortName(namespace, name, pname, proto)
        if (pname, proto) in seen:
            raise err(f"{path}.name", f"duplicate port {pname or '(unnamed)'}/{proto}")
        seen.add((pname, proto))
        ports.append(ServicePort(
            name=spn, cluster_ip=cluster_ip, port=port, protocol=proto, node_port=node_port,
            external_ips=external_ips, load_balancer_ips=lb_ips_t,
            load_balancer_source_ranges=tuple(ranges),
            external_policy_local=etp == "Local", internal_policy_local=itp == "Local",
            health_check_node_port=hc_port, session_affinity_seconds=sticky,
        ))
    return Service(namespace, name, tuple(ports))


# --- EndpointSlice -------------------------------------------------------------------


def parse_endpoint_slice(obj: Mapping[str, Any], proxy_name: str = "") -> EndpointSlice:
    namespace, name = _meta(obj, "EndpointSlice")
    err = _Err("EndpointSlice", f"{namespace}/{name}")
    labels = _labels(obj)
    service = labels.get(SERVICE_NAME_LABEL)
    if not service:
        raise Skipped(f"EndpointSlice {namespace}/{name}: no {SERVICE_NAME_LABEL} label")
    address_type = obj.get("addressType") or ""
    if address_type not in ("IPv4", "IPv6", "FQDN"):
        raise err("addressType", f"must be IPv4, IPv6 or FQDN, got {address_type!r}")
    if address_type == "FQDN":
        raise Skipped(f"EndpointSlice {namespace}/{name}: FQDN slices are not proxied")
    want = 4 if address_type == "IPv4" else 6
    ports = []
    for i, p in enumerate(_list(obj.get("ports"), err, "ports")):
        path = f"ports[{i}]"
        if not isinstance(p, Mapping):
            raise err(path, "expected a mapping")
        proto = p.get("protocol") or "TCP"
        if proto not in PROTOCOLS:
            raise err(f"{path}.protocol", f"must be one of {', '.join(PROTOCOLS)}, got {proto!r}")
        if p.get("port") is None:
            continue  # upstream ignores ports without a number
        ports.append(SlicePort(p.get("name") or "", _int(p.get("port"), err, f"{path}.port", 1, 65535), proto))
    endpoints = []
    for i, ep in enumerate(_list(obj.get("endpoints"), err, "endpoints")):
        path = f"endpoints[{i}]"
        if not isinstance(ep, Mapping):
            raise err(path, "expected a mapping")
        addrs = []
        for j, a in enumerate(_list(ep.get("addresses"), err, f"{path}.addresses")):
            ip = _ip(a, err, f"{path}.addresses[{j}]")
            if _family(ip) != want:
                raise err(f"{path}.addresses[{j}]", f"{ip} is not an {address_type} address")
            addrs.append(ip)
        cond = ep.get("conditions") or {}
        if not isinstance(cond, Mapping):
            raise err(f"{path}.conditions", "expected a mapping")
        for key in ("ready", "serving", "terminating"):
            if cond.get(key) is not None and not isinstance(cond.get(key), bool):
                raise err(f"{path}.conditions.{key}", f"expected true or false, got {cond.get(key)!r}")
        # Upstream semantics: nil ready means ready; nil serving follows ready.
        ready = cond.get("ready") is None or bool(cond.get("ready"))
        serving = ready if cond.get("serving") is None else bool(cond.get("serving"))
        terminating = bool(cond.get("terminating"))
        node_name = ep.get("nodeName") or ""
        if not isinstance(node_name, str):
            raise err(f"{path}.nodeName", "not a string")
        if addrs:
            # Upstream uses only the first address of an endpoint.
            endpoints.append(SliceEndpoint((addrs[0],), node_name, ready, serving, terminating))
    return EndpointSlice(namespace, name, service, address_type, tuple(ports), tuple(endpoints))


# --- Node ---------------------------------------------------------------------------


def parse_node(obj: Mapping[str, Any]) -> Node:
    name = _meta(obj, "Node")[1]
    err = _Err("Node", name)
    spec = obj.get("spec") or {}
    cidrs = []
    raw = _list(spec.get("podCIDRs"), err, "spec.podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    for i, c in enumerate(raw):
        try:
            cidrs.append(str(ipaddress.ip_network(c, strict=False)))
        except (ValueError, TypeError):
            raise err(f"spec.podCIDRs[{i}]", f"{c!r} is not a valid CIDR") from None
    labels = tuple(sorted((str(k), str(v)) for k, v in _labels(obj).items()))
    return Node(name, tuple(cidrs), labels)
