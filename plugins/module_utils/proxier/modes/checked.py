# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# pylint: disable=unidiomatic-typecheck  # `type(v) is int` on purpose: bool and subclasses are refused
"""The compilers' second line of defence: every field of a ServicePort and its endpoints
that reaches kernel tool input is checked against kernel/text.py's rules before a rule or
an ipset entry is written. model.py validates objects as the API server does; objects
built any other way (a module, a test, a future source) are checked here too. A refused
field raises model.ValidationError naming the object and the field, so the proxier can
leave that one service out and serve the others.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

from ..kernel import text
from ..model import MAX_STICKY_SECONDS, Endpoint, ServicePort, ValidationError

# The longest fixed text a compiler puts around a port's name in one comment
# ("other traffic to NAME will be dropped by KUBE-PROXY-FIREWALL", "NAME -> [IPv6]:port").
COMMENT_OVERHEAD = 64
NAME_BUDGET = text.IPT_MAX_COMMENT - COMMENT_OVERHEAD
_PROTOCOLS = ("TCP", "UDP", "SCTP")  # a tuple: ``in`` compares, so an unhashable value is just refused
_pton = socket.inet_pton
_AF_INET = socket.AF_INET


def _object_name(sp: ServicePort) -> str:
    n = sp.name
    try:
        label = f"{n.namespace}/{n.name}"
    except Exception:  # a name that cannot even be formatted
        return "?"
    return label if text._PRINTABLE.fullmatch(label) and len(label) <= text.MAX_SHOWN else text.shown(label)


def port_name(sp: ServicePort, index: int) -> str:
    """The port's ``ns/name[:port]`` escaped for an iptables comment (unchanged for every
    name the API server admits), after checking the fields every port writes (cluster IP,
    port, protocol); the general compiler path checks the others (:func:`port_extras`).
    The first test is the fast path of a cold compile: no field path is formatted unless
    something fails."""
    full = sp.name.text
    p = sp.port
    try:
        _pton(_AF_INET, sp.cluster_ip)  # IPv6 fails here and is looked at again below
    except (OSError, ValueError, TypeError):
        p = None
    if (type(p) is int and 0 < p < 65536 and type(full) is str and len(full) <= NAME_BUDGET
            and full.isascii() and full.isprintable() and '"' not in full and "'" not in full
            and "\\" not in full and sp.protocol in _PROTOCOLS):
        return full
    try:
        return _slow_port(sp, index, extras=False)
    except text.UnsafeText as e:
        raise ValidationError("Service", _object_name(sp), e.field, e.problem) from None


def port_extras(sp: ServicePort, index: int) -> None:
    """NodePort, health check port, affinity, external and LB addresses, source ranges."""
    try:
        _extras(sp, index)
    except text.UnsafeText as e:
        raise ValidationError("Service", _object_name(sp), e.field, e.problem) from None


def port_fields(sp: ServicePort, index: int) -> None:
    """The port's addresses, numbers and protocol, not its name: what IPVS mode writes
    (ipset entries, iptables rules without per-service comments)."""
    try:
        _slow_port(sp, index, with_name=False)
    except text.UnsafeText as e:
        raise ValidationError("Service", _object_name(sp), e.field, e.problem) from None


def _slow_port(sp: ServicePort, index: int, with_name: bool = True, extras: bool = True) -> str:
    full = ""
    if with_name:
        full = sp.name.text
        if type(full) is not str or len(full) > NAME_BUDGET or text._IPT_PLAIN.fullmatch(full) is None:
            full = _slow_name(sp, index)
    text.ip(sp.cluster_ip, "spec.clusterIP")
    text.port(sp.port, f"spec.ports[{index}].port")
    text.protocol(sp.protocol, f"spec.ports[{index}].protocol")
    if extras:
        _extras(sp, index)
    return full


def _extras(sp: ServicePort, index: int) -> None:
    if sp.node_port:
        text.port(sp.node_port, f"spec.ports[{index}].nodePort")
    if sp.health_check_node_port:
        text.port(sp.health_check_node_port, "spec.healthCheckNodePort")
    if sp.session_affinity_seconds:
        text.number(sp.session_affinity_seconds, "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                    1, MAX_STICKY_SECONDS)
    if sp.external_ips:
        for i, value in enumerate(_seq(sp.external_ips, "spec.externalIPs")):
            text.ip(value, f"spec.externalIPs[{i}]")
    if sp.load_balancer_ips:
        for i, value in enumerate(_seq(sp.load_balancer_ips, "status.loadBalancer.ingress")):
            text.ip(value, f"status.loadBalancer.ingress[{i}].ip")
    if sp.load_balancer_source_ranges:
        for i, value in enumerate(_seq(sp.load_balancer_source_ranges, "spec.loadBalancerSourceRanges")):
            text.cidr(value, f"spec.loadBalancerSourceRanges[{i}]")


def _seq(value: Any, field: str) -> Sequence[Any]:
    if isinstance(value, (tuple, list)):
        return value
    raise text.UnsafeText(field, value, f"expected a list, got {type(value).__name__}")


def _slow_name(sp: ServicePort, index: int) -> str:
    """Which part of the name is refused, or the whole name escaped."""
    n = sp.name
    parts = ((n.namespace, "metadata.namespace"), (n.name, "metadata.name"), (n.port, f"spec.ports[{index}].name"))
    for value, field in parts:
        text.ipt_comment_text(value, field, NAME_BUDGET)
    full = n.text
    if len(full) > NAME_BUDGET:
        raise text.UnsafeText("metadata.name", full, f"namespace/name:port is longer than {NAME_BUDGET} characters")
    return text.ipt_comment_text(full, "metadata.name", NAME_BUDGET)


def endpoints(sp: ServicePort, eps: Sequence[Endpoint]) -> None:
    """Each endpoint's address and port (of the endpoints that reach the text). The loop is
    the fast path of a cold compile (one inet_pton per IPv4 endpoint); anything unusual is
    looked at again field by field."""
    try:
        for ep in eps:
            p = ep.port
            a = ep.ip
            if type(p) is not int or not 0 < p < 65536 or ":" in a:
                raise ValueError
            _pton(_AF_INET, a)
    except (OSError, ValueError, TypeError, AttributeError):
        _slow_endpoints(sp, eps)


def _slow_endpoints(sp: ServicePort, eps: Sequence[Endpoint]) -> None:
    for k, ep in enumerate(eps):
        endpoint(sp, k, ep)


def endpoint(sp: ServicePort, k: int, ep: Endpoint) -> None:
    """One endpoint, field by field: returns if it is fine (e.g. IPv6), else raises."""
    try:
        text.ip(getattr(ep, "ip", None), f"endpoints[{k}].addresses[0]")
        text.port(getattr(ep, "port", None), f"endpoints[{k}].port")
    except text.UnsafeText as e:
        raise ValidationError("EndpointSlice for Service", _object_name(sp), e.field, e.problem) from None
