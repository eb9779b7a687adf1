# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The Kubernetes API server's rules for the objects and fields the proxy reads.

Pure functions, applied to every object (whatever its source) and to module options
before anything is compiled: names, ports, enum values, IP addresses and CIDRs, labels.
Upstream's facts (pkg/apis/core/validation, pkg/apis/discovery/validation,
apimachinery's util/validation, StrictIPCIDRValidation), written here afresh.

Two deliberate departures, both stricter: IPs and CIDRs are always checked strictly
(no leading zeros, no IPv4-mapped IPv6, no zones), and EndpointSlice port numbers must be
1-65535 (a DNAT target needs one). Rules that cannot change what the proxy programs and
differ between API server versions (e.g. externalTrafficPolicy on a ClusterIP Service) are
left out, so an object a real cluster admitted is not dropped; so are rules about fields
the proxy ignores in that case (a nodePort on a ClusterIP Service, a healthCheckNodePort
without LoadBalancer/Local, source ranges without LoadBalancer: all ignored, as upstream's
proxier ignores them).

Every error names kind, namespace/name and the field path; values and names in messages
are escaped and clipped, so a message stays one line of bounded length.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import reprlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import InvalidInput

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

VALUE_LIMIT = 200  # longest echo of a value (the brief's bound)
NAME_LIMIT = 120  # longest object name in a message prefix
PATH_LIMIT = 80
MESSAGE_BUDGET = 320  # the problem text is clipped (from its end, where the value is) to fit

PROTOCOLS = ("TCP", "UDP", "SCTP")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
TRAFFIC_POLICIES = ("Cluster", "Local")
SESSION_AFFINITIES = ("None", "ClientIP")
IP_FAMILIES = ("IPv4", "IPv6")
IP_FAMILY_POLICIES = ("SingleStack", "PreferDualStack", "RequireDualStack")
ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
LB_IP_MODES = ("VIP", "Proxy")
MAX_STICKY_SECONDS = 86400
MAX_SLICE_ENDPOINTS = 1000
MAX_ENDPOINT_ADDRESSES = 100
MAX_SLICE_PORTS = 20000


class ValidationError(InvalidInput):
    """An object (or module option) that cannot be used; the message names it and the field."""

    def __init__(self, kind: str, name: str, path: str, problem: str) -> None:
        self.kind = kind
        self.name = clip(printable(str(name)), NAME_LIMIT)
        self.path = clip(printable(str(path)), PATH_LIMIT)
        head = f"{kind} {self.name}: {self.path}: " if self.name else f"{kind}: {self.path}: "
        self.problem = clip(printable(problem), max(100, MESSAGE_BUDGET - len(head)), middle=False)
        super().__init__(head + self.problem)


# --- showing hostile values ----------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped (no line breaks)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def clip(text: str, limit: int, middle: bool = True) -> str:
    """At most ``limit`` characters; the middle (or the end) replaced by '...'."""
    if len(text) <= limit:
        return text
    if not middle:
        return text[:limit - 3] + "..."
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]


_repr = reprlib.Repr()
_repr.maxstring = VALUE_LIMIT
_repr.maxother = VALUE_LIMIT
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 4
_repr.maxlevel = 2


def shown(value: Any) -> str:
    """A value as messages echo it: repr-quoted, bounded even for huge or nested values."""
    try:
        text = _repr.repr(value)
    except Exception:  # a hostile __repr__ cannot reach here from JSON/YAML, but be safe
        text = f"<{type(value).__name__}>"
    return clip(printable(text), VALUE_LIMIT)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


# --- names ---------------------------------------------------------------------------------

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_IANA_SVC_NAME = re.compile(r"[-a-z0-9]+")
_IANA_HAS_LETTER = re.compile(r"[a-z]")


def dns1123_label(value: str) -> str:
    """'' if ``value`` is an RFC 1123 label (namespaces, Service port names), else the problem."""
    if len(value) > 63:
        return f"must be no more than 63 characters (has {len(value)})"
    if not _DNS1123_LABEL.fullmatch(value):
        return ("must be a lowercase RFC 1123 label: lowercase letters, digits and '-', "
                "starting and ending with a letter or digit")
    return ""


def dns1035_label(value: str) -> str:
    """'' if ``value`` is an RFC 1035 label (Service names), else the problem."""
    if len(value) > 63:
        return f"must be no more than 63 characters (has {len(value)})"
    if not _DNS1035_LABEL.fullmatch(value):
        return ("must be a lowercase RFC 1035 label: lowercase letters, digits and '-', "
                "starting with a letter and ending with a letter or digit")
    return ""


def dns1123_subdomain(value: str) -> str:
    """'' if ``value`` is an RFC 1123 subdomain (EndpointSlice and Node names), else the problem."""
    if len(value) > 253:
        return f"must be no more than 253 characters (has {len(value)})"
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        return ("must be a lowercase RFC 1123 subdomain: lowercase letters, digits, '-' and '.', "
                "starting and ending with a letter or digit")
    return ""


def iana_svc_name(value: str) -> str:
    """'' if ``value`` is an IANA service name (a named targetPort), else the problem."""
    if not 1 <= len(value) <= 15:
        return "must be 1-15 characters"
    if not _IANA_SVC_NAME.fullmatch(value):
        return "must contain only lowercase letters, digits and '-'"
    if not _IANA_HAS_LETTER.search(value):
        return "must contain at least one letter"
    if "--" in value or value.startswith("-") or value.endswith("-"):
        return "must not start or end with '-' or contain '--'"
    return ""


def label_key(value: str) -> str:
    """'' if ``value`` is a qualified name (a label key: optional DNS prefix '/' name)."""
    prefix, slash, name = value.rpartition("/")
    if slash:
        if not prefix:
            return "prefix part must be non-empty"
        if "/" in prefix:
            return "must be a name with an optional DNS subdomain prefix and one '/'"
        problem = dns1123_subdomain(prefix)
        if problem:
            return "prefix part " + problem
    if not name:
        return "name part must be non-empty"
    if len(name) > 63:
        return "name part must be no more than 63 characters"
    if not _QUALIFIED_NAME.fullmatch(name):
        return ("name part must consist of letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit")
    return ""


def label_value(value: str) -> str:
    if len(value) > 63:
        return f"must be no more than 63 characters (has {len(value)})"
    if value and not _QUALIFIED_NAME.fullmatch(value):
        return ("must be empty or consist of letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit")
    return ""


_NETNS_NAME = re.compile(r"[A-Za-z0-9_.@:+-]{1,255}")
_IPVS_SCHEDULER = re.compile(r"[a-z][a-z0-9]{0,14}")


def netns_name(value: str) -> str:
    """'' if ``value`` names a network namespace under /run/netns (no path, no '..')."""
    if not _NETNS_NAME.fullmatch(value) or value in (".", ".."):
        return "must be a network namespace name: letters, digits and '_.@:+-', not '.' or '..', no '/'"
    return ""


def ipvs_scheduler(value: str) -> str:
    """'' if ``value`` can name an IPVS scheduler (kernel module ip_vs_<name>)."""
    if not _IPVS_SCHEDULER.fullmatch(value):
        return "must be a scheduler name: a lowercase letter, then up to 14 lowercase letters or digits"
    return ""


# --- IP addresses and CIDRs ----------------------------------------------------------------

_IPV4_SHAPE = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}")
_LEADING_ZERO = re.compile(r"(^|\.)0[0-9]")


def parse_ip(value: Any) -> IPAddress:
    """A strictly written IP address (ValueError with the problem otherwise): no leading
    zeros (libc reads them as octal), no IPv4-mapped IPv6 (read as either family), no zone."""
    if not isinstance(value, str):
        raise ValueError(f"must be an IP address string, not {type_name(value)}")
    return _parse_ip_text(value)


@functools.lru_cache(maxsize=1 << 16)
def _parse_ip_text(value: str) -> IPAddress:
    # Cached: validation and the model read each address of an object more than once, and
    # a relist reparses every address (10,000 slices: ~60% of the parse time was here).
    # Only results are cached (lru_cache does not keep exceptions); addresses are immutable.
    bad = "must be a valid IP address (e.g. 10.9.8.7 or 2001:db8::ffff)"
    if len(value) > 45 or "%" in value:
        raise ValueError(bad)
    v4 = value.rsplit(":", 1)[-1] if ":" in value else value
    if "." in v4:
        if not _IPV4_SHAPE.fullmatch(v4):
            raise ValueError(bad)
        if _LEADING_ZERO.search(v4):
            raise ValueError("must not have leading 0s")
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(bad) from None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        raise ValueError("must not be an IPv4-mapped IPv6 address")
    return ip


def parse_cidr(value: Any) -> IPNetwork:
    """A strictly written CIDR (ValueError otherwise); host bits are allowed, as the API
    server's legacy fields allow them, and cleared."""
    if not isinstance(value, str):
        raise ValueError(f"must be a CIDR string, not {type_name(value)}")
    bad = "must be a valid CIDR value (e.g. 10.9.8.0/24 or 2001:db8::/64)"
    addr, slash, bits = value.partition("/")
    if not slash or not bits.isascii() or not bits.isdigit() or len(bits) > 3:
        raise ValueError(bad)
    if len(bits) > 1 and bits.startswith("0"):
        raise ValueError("must not have leading 0s in the prefix length")
    try:
        ip = parse_ip(addr)
    except ValueError as e:
        raise ValueError(bad if str(e).startswith("must be a") else str(e)) from None
    if int(bits) > ip.max_prefixlen:
        raise ValueError(f"prefix length must be at most {ip.max_prefixlen}")
    return ipaddress.ip_network(f"{ip}/{bits}", strict=False)


_V4_LINK_LOCAL_MULTICAST = ipaddress.ip_network("224.0.0.0/24")  # built once: every endpoint address is checked


def _link_local_multicast(ip: IPAddress) -> bool:
    # Go's net.IP.IsLinkLocalMulticast: 224.0.0.0/24 and ff02::/16 with any flags (ffX2::).
    if ip.version == 4:
        return ip in _V4_LINK_LOCAL_MULTICAST
    packed = ip.packed
    return packed[0] == 0xFF and packed[1] & 0x0F == 0x02


def endpoint_ip_problem(ip: IPAddress) -> str:
    """Upstream's ValidateEndpointIP (endpoint addresses, externalIPs): the addresses that
    make no sense as a destination elsewhere, or reach the node itself (the metadata service)."""
    if ip.is_unspecified:
        return f"may not be unspecified ({ip})"
    if ip.is_loopback:
        return "may not be in the loopback range (127.0.0.0/8, ::1/128)"
    if ip.is_link_local:
        return "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
    if _link_local_multicast(ip):
        return "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"
    return ""


def family_of(ip: Union[IPAddress, IPNetwork]) -> str:
    return "IPv4" if ip.version == 4 else "IPv6"


# --- one object's fields ---------------------------------------------------------------------

_MISSING = object()


class Fields:
    """Field access for one object: every check raises a ValidationError naming the object
    and the path, never a TypeError or KeyError."""

    def __init__(self, kind: str, name: str = "") -> None:
        self.kind = kind
        self.name = name

    def error(self, path: str, problem: str, value: Any = _MISSING) -> ValidationError:
        if value is not _MISSING:
            problem = f"{problem}: {shown(value)}"
        return ValidationError(self.kind, self.name, path, problem)

    def mapping(self, value: Any, path: str, required: bool = False) -> Mapping[str, Any]:
        if value is None:
            if required:
                raise self.error(path, "required")
            return {}
        if not isinstance(value, dict) and not isinstance(value, Mapping):
            raise self.error(path, f"must be an object, not {type_name(value)}")
        return value

    def list(self, value: Any, path: str, limit: int = 0) -> Sequence[Any]:
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            raise self.error(path, f"must be a list, not {type_name(value)}")
        if limit and len(value) > limit:
            raise self.error(path, f"must have at most {limit} items (has {len(value)})")
        return value

    def string(self, value: Any, path: str, default: str = "") -> str:
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(path, f"must be a string, not {type_name(value)}")
        return value

    def boolean(self, value: Any, path: str) -> Optional[bool]:
        if value is not None and not isinstance(value, bool):
            raise self.error(path, f"must be true or false, not {type_name(value)}")
        return value

    def integer(self, value: Any, path: str, lo: int, hi: int, default: Optional[int] = None) -> int:
        if value is None and default is not None:
            return default
        if value is None:
            raise self.error(path, "required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(path, f"must be an integer, not {type_name(value)}", value)
        if not lo <= value <= hi:
            raise self.error(path, f"must be between {lo} and {hi}, inclusive", value)
        return value

    def enum(self, value: Any, path: str, allowed: Sequence[str], default: str = "") -> str:
        if value is None or value == "":
            if default:
                return default
            raise self.error(path, f"required: one of {', '.join(allowed)}")
        if not isinstance(value, str) or value not in allowed:
            raise self.error(path, f"unsupported value; supported: {', '.join(allowed)}", value)
        return value

    def named(self, value: Any, path: str, rule: Any) -> str:
        text = self.string(value, path)
        problem = rule(text)
        if problem:
            raise self.error(path, problem, text)
        return text

    def ip(self, value: Any, path: str, endpoint: bool = False) -> IPAddress:
        """A strict IP; with ``endpoint`` also the addresses upstream refuses for endpoints."""
        try:
            ip = parse_ip(value)
        except ValueError as e:
            raise self.error(path, str(e), value) from None
        if endpoint:
            problem = endpoint_ip_problem(ip)
            if problem:
                raise self.error(path, problem, value)
        return ip

    def cidr(self, value: Any, path: str) -> IPNetwork:
        try:
            return parse_cidr(value)
        except ValueError as e:
            raise self.error(path, str(e), value) from None

    def labels(self, meta: Mapping[str, Any]) -> Dict[str, str]:
        raw = self.mapping(meta.get("labels"), "metadata.labels")
        out: Dict[str, str] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                raise self.error("metadata.labels", "keys must be strings", key)
            path = f"metadata.labels[{clip(printable(key), 40)}]"
            problem = label_key(key)
            if problem:
                raise self.error(path, "invalid key: " + problem, key)
            value = self.string(value, path)
            problem = label_value(value)
            if problem:
                raise self.error(path, problem, value)
            out[key] = value
        return out


def object_identity(obj: Any, kind: str, namespaced: bool = True) -> Tuple[str, str]:
    """(namespace, name) as far as they can be read, for messages and last-good lookups:
    never raises; '?' for what is unreadable."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        return ("default" if namespaced else "", "?")
    name = meta.get("name")
    ns = meta.get("namespace") if namespaced else ""
    if ns is None or ns == "":
        ns = "default" if namespaced else ""
    return (ns if isinstance(ns, str) else "?", name if isinstance(name, str) and name else "?")


def object_key(obj: Any, kind: str) -> str:
    ns, name = object_identity(obj, kind, kind != "Node")
    return f"{ns}/{name}" if ns else name


def validate_metadata(obj: Any, kind: str, name_rule: Any, namespaced: bool = True
                      ) -> Tuple[Fields, str, str, Dict[str, str]]:
    """(fields, namespace, name, labels) of a valid object's metadata."""
    ns_shown, name_shown = object_identity(obj, kind, namespaced)
    f = Fields(kind, f"{ns_shown}/{name_shown}" if namespaced else name_shown)
    if not isinstance(obj, Mapping):
        raise f.error("(object)", f"must be an object, not {type_name(obj)}")
    meta = f.mapping(obj.get("metadata"), "metadata", required=True)
    name = f.string(meta.get("name"), "metadata.name")
    if not name:
        raise f.error("metadata.name", "required")
    problem = name_rule(name)
    if problem:
        raise f.error("metadata.name", problem, name)
    namespace = ""
    if namespaced:
        namespace = f.string(meta.get("namespace"), "metadata.namespace") or "default"
        problem = dns1123_label(namespace)
        if problem:
            raise f.error("metadata.namespace", problem, namespace)
    return f, namespace, name, f.labels(meta)


# --- Service ---------------------------------------------------------------------------------


def validate_service_spec(f: Fields, obj: Mapping[str, Any]) -> None:
    """Upstream's ValidateService, for the fields the proxy reads (ExternalName and
    headless services only as far as they are read before being skipped)."""
    spec = f.mapping(obj.get("spec"), "spec", required=True)
    svc_type = f.enum(spec.get("type"), "spec.type", SERVICE_TYPES, default="ClusterIP")
    cluster_ip = f.string(spec.get("clusterIP"), "spec.clusterIP")
    headless = cluster_ip == "None"
    if cluster_ip and not headless:
        f.ip(cluster_ip, "spec.clusterIP")
    ips = f.list(spec.get("clusterIPs"), "spec.clusterIPs", limit=2)
    families = []
    for i, value in enumerate(ips):
        path = f"spec.clusterIPs[{i}]"
        value = f.string(value, path)
        if value == "None":
            if len(ips) > 1:
                raise f.error(path, "'None' must be the only entry")
            continue
        families.append(family_of(f.ip(value, path)))
    if ips and cluster_ip and ips[0] != cluster_ip:
        raise f.error("spec.clusterIPs[0]", f"must match spec.clusterIP {shown(cluster_ip)}", ips[0])
    if not ips and cluster_ip and not headless:
        families.append(family_of(parse_ip(cluster_ip)))  # clusterIPs defaults to [clusterIP]
    if len(families) == 2 and families[0] == families[1]:
        raise f.error("spec.clusterIPs", "must hold at most one address of each IP family", list(ips))
    declared = f.list(spec.get("ipFamilies"), "spec.ipFamilies", limit=2)
    for i, fam in enumerate(declared):
        f.enum(fam, f"spec.ipFamilies[{i}]", IP_FAMILIES)
        if i and fam == declared[0]:
            raise f.error(f"spec.ipFamilies[{i}]", "duplicate IP family", fam)
        if i < len(families) and fam != families[i]:
            raise f.error(f"spec.ipFamilies[{i}]", f"must match the family of spec.clusterIPs[{i}]", fam)
    if spec.get("ipFamilyPolicy") is not None:
        policy = f.enum(spec.get("ipFamilyPolicy"), "spec.ipFamilyPolicy", IP_FAMILY_POLICIES)
        if policy == "SingleStack" and (len(declared) > 1 or len(families) > 1):
            raise f.error("spec.ipFamilyPolicy", "SingleStack allows one IP family only", policy)

    ports = f.list(spec.get("ports"), "spec.ports")
    if not ports and not headless and svc_type != "ExternalName":
        raise f.error("spec.ports", "required")
    seen_names = set()
    seen_ports = set()
    seen_node_ports = set()
    for i, port in enumerate(ports):
        path = f"spec.ports[{i}]"
        port = f.mapping(port, path, required=True)
        name = f.string(port.get("name"), f"{path}.name")
        if name:
            f.named(name, f"{path}.name", dns1123_label)
        elif len(ports) > 1:
            raise f.error(f"{path}.name", "required when a Service has more than one port")
        if name in seen_names:
            raise f.error(f"{path}.name", "duplicate value", name)
        seen_names.add(name)
        proto = f.enum(port.get("protocol"), f"{path}.protocol", PROTOCOLS, default="TCP")
        number = f.integer(port.get("port"), f"{path}.port", 1, 65535)
        if (number, proto) in seen_ports:
            raise f.error(path, f"duplicate port {number}/{proto}")
        seen_ports.add((number, proto))
        target = port.get("targetPort")
        if isinstance(target, str) and target:
            f.named(target, f"{path}.targetPort", iana_svc_name)
        elif target is not None and target != 0 and target != "":
            f.integer(target, f"{path}.targetPort", 1, 65535)
        node_port = f.integer(port.get("nodePort"), f"{path}.nodePort", 0, 65535, default=0)
        if node_port and (node_port, proto) in seen_node_ports:
            raise f.error(f"{path}.nodePort", "duplicate value", node_port)
        seen_node_ports.add((node_port, proto))

    for i, value in enumerate(f.list(spec.get("externalIPs"), "spec.externalIPs")):
        f.ip(value, f"spec.externalIPs[{i}]", endpoint=True)
    f.enum(spec.get("externalTrafficPolicy"), "spec.externalTrafficPolicy", TRAFFIC_POLICIES, "Cluster")
    f.enum(spec.get("internalTrafficPolicy"), "spec.internalTrafficPolicy", TRAFFIC_POLICIES, "Cluster")
    affinity = f.enum(spec.get("sessionAffinity"), "spec.sessionAffinity", SESSION_AFFINITIES, "None")
    cfg = f.mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
    client = f.mapping(cfg.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
    if affinity == "ClientIP" and client.get("timeoutSeconds") is not None:
        f.integer(client.get("timeoutSeconds"), "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                  1, MAX_STICKY_SECONDS)
    f.integer(spec.get("healthCheckNodePort"), "spec.healthCheckNodePort", 0, 65535, default=0)
    for i, value in enumerate(f.list(spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges")):
        path = f"spec.loadBalancerSourceRanges[{i}]"
        # Upstream trims these (a leftover of the annotation they replaced).
        f.cidr(f.string(value, path).strip(), path)

    status = f.mapping(obj.get("status"), "status")
    lb = f.mapping(status.get("loadBalancer"), "status.loadBalancer")
    for i, ing in enumerate(f.list(lb.get("ingress"), "status.loadBalancer.ingress")):
        path = f"status.loadBalancer.ingress[{i}]"
        ing = f.mapping(ing, path, required=True)
        ip = f.string(ing.get("ip"), f"{path}.ip")
        if ip:
            f.ip(ip, f"{path}.ip")
        hostname = f.string(ing.get("hostname"), f"{path}.hostname")
        if hostname:
            f.named(hostname, f"{path}.hostname", dns1123_subdomain)
        if ing.get("ipMode") is not None:
            f.enum(ing.get("ipMode"), f"{path}.ipMode", LB_IP_MODES)
            if not ip:
                raise f.error(f"{path}.ipMode", "may only be set when ip is set")


# --- EndpointSlice ---------------------------------------------------------------------------


def validate_endpoint_slice_body(f: Fields, obj: Mapping[str, Any]) -> str:
    """Upstream's ValidateEndpointSlice; returns the address type."""
    address_type = f.enum(obj.get("addressType"), "addressType", ADDRESS_TYPES)
    for i, ep in enumerate(f.list(obj.get("endpoints"), "endpoints", MAX_SLICE_ENDPOINTS)):
        path = f"endpoints[{i}]"
        ep = f.mapping(ep, path, required=True)
        addrs = f.list(ep.get("addresses"), f"{path}.addresses", MAX_ENDPOINT_ADDRESSES)
        if not addrs:
            raise f.error(f"{path}.addresses", "must contain at least 1 address")
        for j, addr in enumerate(addrs):
            apath = f"{path}.addresses[{j}]"
            if address_type == "FQDN":
                f.named(addr, apath, dns1123_subdomain)
                continue
            ip = f.ip(addr, apath, endpoint=True)
            if family_of(ip) != address_type:
                raise f.error(apath, f"must be an {address_type} address", addr)
        cond = f.mapping(ep.get("conditions"), f"{path}.conditions")
        for key in ("ready", "serving", "terminating"):
            f.boolean(cond.get(key), f"{path}.conditions.{key}")
        node = f.string(ep.get("nodeName"), f"{path}.nodeName")
        if node:
            f.named(node, f"{path}.nodeName", dns1123_subdomain)
        hostname = f.string(ep.get("hostname"), f"{path}.hostname")
        if hostname:
            f.named(hostname, f"{path}.hostname", dns1123_label)
        f.string(ep.get("zone"), f"{path}.zone")
    names = set()
    for i, port in enumerate(f.list(obj.get("ports"), "ports", MAX_SLICE_PORTS)):
        path = f"ports[{i}]"
        port = f.mapping(port, path, required=True)
        name = f.string(port.get("name"), f"{path}.name")
        if name:
            f.named(name, f"{path}.name", dns1123_label)
        if name in names:
            raise f.error(f"{path}.name", "duplicate value", name)
        names.add(name)
        f.enum(port.get("protocol"), f"{path}.protocol", PROTOCOLS, default="TCP")
        if port.get("port") is not None:
            f.integer(port.get("port"), f"{path}.port", 1, 65535)
    return address_type


# --- Node ------------------------------------------------------------------------------------


def validate_node_spec(f: Fields, obj: Mapping[str, Any]) -> List[IPNetwork]:
    """The node's pod CIDRs (podCIDRs, else podCIDR), validated as upstream's ValidateNode."""
    spec = f.mapping(obj.get("spec"), "spec")
    single = f.string(spec.get("podCIDR"), "spec.podCIDR")
    raw = f.list(spec.get("podCIDRs"), "spec.podCIDRs", limit=2)
    cidrs = [f.cidr(c, f"spec.podCIDRs[{i}]") for i, c in enumerate(raw)]
    if len(cidrs) == 2 and cidrs[0].version == cidrs[1].version:
        raise f.error("spec.podCIDRs", "may hold at most one CIDR of each IP family", list(raw))
    if single:
        first = f.cidr(single, "spec.podCIDR")
        if cidrs and first != cidrs[0]:
            raise f.error("spec.podCIDR", "must match spec.podCIDRs[0]", single)
        if not cidrs:
            cidrs = [first]
    return cidrs
