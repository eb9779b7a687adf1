# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure compiler: services + endpoints + config -> kube-proxy's iptables ruleset.

Chain layout, names, hashes and rule semantics follow upstream kube-proxy's iptables
proxier. Rules are emitted in the exact form ``iptables-save`` prints them (basic
matches first, ``/32`` masks, quoted comments, kernel-rounded probabilities), so a rule
we want and a rule the kernel has compare as plain strings: no normaliser sits between
the plan and the kernel, and restore input has the shape iptables-nft loads fastest.

No I/O and no clock in this module.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ...endpoints import Categorized, categorize
from ...kernel import text
from ...model import Endpoint, ServicePort

# The names live in names.py (a leaf); callers keep using ipt.KUBE_SERVICES and the like.
from ...names import (  # noqa: F401 pylint: disable=unused-import
    BUILTIN_CHAINS,
    FILTER,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FIREWALL,
    KUBE_FORWARD,
    KUBE_MARK_MASQ,
    KUBE_NODEPORTS,
    KUBE_POSTROUTING,
    KUBE_PROXY_FIREWALL,
    KUBE_SERVICES,
    NAT,
    OWN_STATIC_CHAINS,
    SERVICE_CHAIN_PREFIXES,
    SHARED_CHAINS,
    ChainKey,
)
from .. import checked

# Upstream drops comments from per-endpoint rules above this many endpoints (smaller ruleset).
LARGE_CLUSTER_ENDPOINTS = 1000

NODEPORTS_TAIL_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"

_pton = socket.inet_pton
_AF_INET = socket.AF_INET


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_B32_PAIRS = [_B32[i >> 5] + _B32[i & 31] for i in range(1024)]  # 10 bits -> 2 characters


def _hash16(text: str) -> str:
    """Upstream's name hash: base32(sha256(text))[:16]. The first 16 base32 characters
    are exactly the first 10 digest bytes (80 bits), encoded here as eight 10-bit table
    lookups: base64.b32encode is a Python loop, and this is the compiler's hottest function
    (four hashes per service at 10,000 services)."""
    x = int.from_bytes(hashlib.sha256(text.encode()).digest()[:10], "big")
    t = _B32_PAIRS
    return "".join([t[x >> 70], t[(x >> 60) & 1023], t[(x >> 50) & 1023], t[(x >> 40) & 1023],
                    t[(x >> 30) & 1023], t[(x >> 20) & 1023], t[(x >> 10) & 1023], t[x & 1023]])


# Not cached: a cold compile would only pay for filling the cache (and, at 10,000 services,
# hold tens of MB), and full syncs reuse unchanged services' compiled rules anyway.
def port_proto_hash(spn: str, protocol: str) -> str:
    return _hash16(spn + protocol.lower())


def svc_chain(spn: str, protocol: str) -> str:
    return "KUBE-SVC-" + port_proto_hash(spn, protocol)


def svl_chain(spn: str, protocol: str) -> str:
    return "KUBE-SVL-" + port_proto_hash(spn, protocol)


def ext_chain(spn: str, protocol: str) -> str:
    return "KUBE-EXT-" + port_proto_hash(spn, protocol)


def fw_chain(spn: str, protocol: str) -> str:
    return "KUBE-FW-" + port_proto_hash(spn, protocol)


def sep_chain(spn: str, protocol: str, endpoint: str) -> str:
    return "KUBE-SEP-" + _hash16(spn + protocol.lower() + endpoint)


@dataclass(frozen=True)
class IptablesConfig:
    """What the compiler needs beyond the cluster objects (all resolved beforehand)."""

    masquerade_bit: int = 14
    masquerade_all: bool = False
    # Local-traffic detection: ("", "ClusterCIDR", "NodeCIDR", "BridgeInterface",
    # "InterfaceNamePrefix") with its value (CIDRs or an interface name).
    local_mode: str = "ClusterCIDR"
    local_cidrs: Tuple[str, ...] = ()
    local_interface: str = ""
    # nodePortAddresses resolved to this node's addresses; empty means every local address.
    node_port_ips: Tuple[str, ...] = ()
    node_port_match_all: bool = True
    localhost_nodeports: bool = True
    node_ips: Tuple[str, ...] = ()  # this node's addresses (LB source-range self access)
    masquerade_random_fully: bool = False
    large_cluster: bool = False
    family: int = 4  # the IP family of this proxier's rules (6: written with ip6tables-restore)

    @property
    def mark(self) -> str:
        return "0x%x" % (1 << self.masquerade_bit)

    @functools.cached_property
    def detector(self) -> LocalDetector:
        """Local-traffic detection, resolved once per config: the compiler asks for it on
        every service port (cached_property writes the instance __dict__, which a frozen
        dataclass allows; equality and hashing still see only the fields)."""
        return LocalDetector(self)


# --- canonical rule text ---------------------------------------------------------------


def _host(ip: str) -> str:
    return ip + ("/128" if ":" in ip else "/32")


@functools.lru_cache(maxsize=4096)
def _net(cidr: str) -> str:
    net = ipaddress.ip_network(cidr, strict=False)
    if net.prefixlen == net.max_prefixlen:
        return _host(str(net.network_address))
    return str(net)


def _comment(body: str) -> str:
    """``body`` is fixed text, or built from names checked.port_name() escaped."""
    return f'-m comment --comment "{body}"'


@functools.lru_cache(maxsize=1024)
def probability(n: int) -> str:
    """1/n as upstream writes it (10 digits), rounded the way the kernel stores it."""
    p = float("%0.10f" % (1.0 / n))
    stored = int(p * 0x80000000 + 0.5)
    return "%.11f" % (stored / 0x80000000)


@functools.lru_cache(maxsize=256)
def _statistic_matches(n: int) -> Tuple[str, ...]:
    """The statistic match before each of ``n`` endpoint jumps (none before the last)."""
    return tuple(f"-m statistic --mode random --probability {probability(n - i)} " for i in range(n - 1)) + ("",)


class LocalDetector:
    def __init__(self, cfg: IptablesConfig) -> None:
        self.cfg = cfg
        mode = cfg.local_mode
        if mode in ("ClusterCIDR", "NodeCIDR"):
            self.implemented = bool(cfg.local_cidrs)
        else:
            self.implemented = mode in ("BridgeInterface", "InterfaceNamePrefix") and bool(cfg.local_interface)
        # The not-local match split around "-d ADDR" in iptables-save's order (-s before
        # -d, -i after it): what the masquerade rule of every cluster IP carries.
        self.not_local_before_dst = self.not_local_after_dst = ""
        if self.implemented:
            kind, value = self.if_not_local()
            if kind == "!src":
                self.not_local_before_dst = f"! -s {value} "
            else:
                self.not_local_after_dst = f" ! -i {value}"

    def _iface(self) -> str:
        name = text.iface(self.cfg.local_interface, "detectLocal.interface")
        return name + "+" if self.cfg.local_mode == "InterfaceNamePrefix" else name

    # Returns (prefix-part for the basic matches) to be merged into the rule's head.
    def if_local(self) -> Tuple[str, str]:
        if self.cfg.local_mode in ("ClusterCIDR", "NodeCIDR"):
            return ("src", _net(self.cfg.local_cidrs[0]))
        return ("in", self._iface())

    def if_not_local(self) -> Tuple[str, str]:
        kind, value = self.if_local()
        return ("!" + kind, value)


def rule(
    *,
    src: str = "",
    not_src: str = "",
    dst: str = "",
    not_dst: str = "",
    in_iface: str = "",
    not_in_iface: str = "",
    proto: str = "",
    comment: str = "",
    matches: Sequence[str] = (),
    dport: int = 0,
    target: str = "",
) -> str:
    """One rule in iptables-save's order: -s -d -i -p, then -m comment, other matches,
    the protocol match, and the target."""
    parts: List[str] = []
    if not_src:
        parts.append(f"! -s {not_src}")
    if src:
        parts.append(f"-s {src}")
    if not_dst:
        parts.append(f"! -d {not_dst}")
    if dst:
        parts.append(f"-d {dst}")
    if in_iface:
        parts.append(f"-i {in_iface}")
    if not_in_iface:
        parts.append(f"! -i {not_in_iface}")
    if proto:
        parts.append(f"-p {proto}")
    if comment:
        parts.append(_comment(comment))
    parts.extend(matches)
    if proto:
        parts.append(f"-m {proto} --dport {dport}" if dport else f"-m {proto}")
    if target:
        parts.append(f"-j {target}")
    return " ".join(parts)


def _local_kw(detector_part: Tuple[str, str]) -> Dict[str, str]:
    kind, value = detector_part
    return {{"src": "src", "!src": "not_src", "in": "in_iface", "!in": "not_in_iface"}[kind]: value}


# --- compiled output ------------------------------------------------------------------


@dataclass
class ServiceRules:
    """One Service's whole contribution: its own chains, and its rules in shared chains."""

    chains: Dict[ChainKey, List[str]] = field(default_factory=dict)
    shared: Dict[ChainKey, List[str]] = field(default_factory=dict)
    endpoints: int = 0
    no_endpoint_ports: int = 0

    def add_shared(self, table: str, chain: str, text: str) -> None:
        self.shared.setdefault((table, chain), []).append(text)

    def rule_count(self) -> int:
        return sum(len(r) for r in self.chains.values()) + sum(len(r) for r in self.shared.values())


def compile_service(
    ports: Sequence[ServicePort],
    endpoints: Dict,  # ServicePortName -> List[Endpoint]
    cfg: IptablesConfig,
) -> ServiceRules:
    """Raises model.ValidationError (naming the object and field) for a field that cannot
    be written into restore input: the caller leaves this service out (checked.py)."""
    out = ServiceRules()
    for i, sp in enumerate(ports):
        eps = endpoints.get(sp.name, [])
        name = checked.port_name(sp, i)
        if _is_cluster_ip_only(sp):
            _compile_cluster_ip_port(out, sp, eps, cfg, name)
        else:
            checked.port_extras(sp, i)
            _compile_port(out, sp, eps, cfg, name)
    return out


def _is_cluster_ip_only(svc: ServicePort) -> bool:
    """Most ports of a large cluster: reachable only on the cluster IP, Cluster internal
    policy, no affinity. They get the short path below; the rest the general one."""
    return not (svc.node_port or svc.external_ips or svc.load_balancer_ips or svc.internal_policy_local
                or svc.session_affinity_seconds or svc.health_check_node_port)


def _compile_cluster_ip_port(out: ServiceRules, svc: ServicePort, eps: Sequence[Endpoint],
                             cfg: IptablesConfig, name: str = "") -> None:
    """_compile_port() for a port _is_cluster_ip_only() accepts, with the branches that
    cannot apply left out: the same rules (test_iptables_compile holds the two paths equal),
    in a third of the time, which is what a cold 10,000-service compile is made of.
    ``name``: the port's name as checked.port_name() escaped it for comments."""
    proto = svc.protocol.lower()
    raw = svc.name.text  # hashed as it is; only comments carry the escaped form
    name = name or raw
    ready = [ep for ep in eps if ep.ready]
    if not ready:
        # Upstream's fallback to serving-terminating endpoints (endpoints.categorize).
        ready = [ep for ep in eps if ep.serving and ep.terminating]
    dst = _host(svc.cluster_ip)
    if not ready:
        out.add_shared(FILTER, KUBE_SERVICES, rule(
            proto=proto, dst=dst, comment=f"{name} has no endpoints", dport=svc.port,
            target="REJECT --reject-with icmp6-port-unreachable" if ":" in svc.cluster_ip
            else "REJECT --reject-with icmp-port-unreachable"))
        out.no_endpoint_ports += 1
        return
    svc_chain_name = "KUBE-SVC-" + port_proto_hash(raw, proto)
    match = f'-p {proto} -m comment --comment "{name} cluster IP" -m {proto} --dport {svc.port}'
    out.add_shared(NAT, KUBE_SERVICES, f"-d {dst} {match} -j {svc_chain_name}")
    jumps: List[str] = []
    if cfg.masquerade_all:
        jumps.append(f"-d {dst} {match} -j {KUBE_MARK_MASQ}")
    else:
        detector = cfg.detector
        if detector.implemented:
            jumps.append(f"{detector.not_local_before_dst}-d {dst}{detector.not_local_after_dst} {match} "
                         f"-j {KUBE_MARK_MASQ}")
    chains = out.chains
    chains[(NAT, svc_chain_name)] = jumps
    large = cfg.large_cluster
    comment = "" if large else f" {_comment(name)}"
    prefix = raw + proto
    n = len(ready)
    pton, af_inet = _pton, _AF_INET
    stats = _statistic_matches(n)
    for i, ep in enumerate(ready):
        # checked.endpoints() inlined (this loop is most of a cold compile): an IPv4
        # address inet_pton takes and a port number, or the field-by-field check.
        ip = ep.ip
        port = ep.port
        try:
            pton(af_inet, ip)
            host = ip + "/32"
        except (OSError, ValueError, TypeError):
            port = host = ""
        if type(port) is not int or not 0 < port < 65536:  # pylint: disable=unidiomatic-typecheck
            checked.endpoint(svc, i, ep)  # raises, or returns for an IPv6 address
            host = _host(ip)
        dest = ep.addr
        sep = "KUBE-SEP-" + _hash16(prefix + dest)
        head = "" if large else f"{_comment(f'{name} -> {dest}')} "
        jumps.append(f"{head}{stats[i]}-j {sep}")
        chains[(NAT, sep)] = [
            f"-s {host}{comment} -j {KUBE_MARK_MASQ}",
            f"-p {proto}{comment} -m {proto} -j DNAT --to-destination {dest}",
        ]
    out.endpoints += n


class _Port:
    """One service port's decisions, as upstream's syncProxyRules makes them before writing
    any rule: which chains exist, where each kind of traffic goes, and what a port without
    (local) endpoints answers."""

    __slots__ = ("proto", "raw", "name", "cat", "has_endpoints", "cluster_chain", "local_chain", "external_chain",
                 "firewall_chain", "uses_cluster_chain", "uses_local_chain", "internal_chain", "has_internal",
                 "external_policy_chain", "has_external", "uses_external_chain", "uses_fw_chain", "lb_chain",
                 "internal_target", "external_target", "internal_comment", "external_comment", "cluster_ip_match")

    def __init__(self, svc: ServicePort, cat: Categorized, name: str) -> None:
        proto = self.proto = svc.protocol.lower()
        raw = self.raw = svc.name.text  # hashed as it is; ``name`` (escaped for comments) goes into the text
        self.name = name = name or raw
        self.cat = cat
        has_endpoints = self.has_endpoints = cat.has_any

        port_hash = port_proto_hash(raw, proto)  # svc_chain() etc., with one hash for the four
        self.cluster_chain = "KUBE-SVC-" + port_hash
        self.local_chain = "KUBE-SVL-" + port_hash
        self.external_chain = "KUBE-EXT-" + port_hash
        self.firewall_chain = "KUBE-FW-" + port_hash
        self.uses_cluster_chain = bool(cat.cluster) and svc.uses_cluster_endpoints
        self.uses_local_chain = bool(cat.local) and svc.uses_local_endpoints

        self.internal_chain = self.cluster_chain
        self.has_internal = has_endpoints
        if svc.internal_policy_local:
            self.internal_chain = self.local_chain
            self.has_internal = has_endpoints and bool(cat.local)
        self.external_policy_chain = self.cluster_chain
        self.has_external = has_endpoints
        if svc.uses_external_local:
            self.external_policy_chain = self.local_chain
            self.has_external = has_endpoints and bool(cat.local)
        self.uses_external_chain = has_endpoints and svc.externally_accessible
        self.uses_fw_chain = has_endpoints and bool(svc.load_balancer_ips) and bool(svc.load_balancer_source_ranges)
        self.lb_chain = self.firewall_chain if self.uses_fw_chain else self.external_chain

        if not has_endpoints:
            self.internal_target = self.external_target = "REJECT --reject-with icmp-port-unreachable" \
                if ":" not in svc.cluster_ip else "REJECT --reject-with icmp6-port-unreachable"
            self.internal_comment = self.external_comment = f"{name} has no endpoints"
        else:
            self.internal_target = self.external_target = "DROP"
            self.internal_comment = self.external_comment = f"{name} has no local endpoints"
        # The cluster IP rules every port with endpoints has are written directly (the text
        # rule() gives; the golden tests hold both to upstream's output).
        self.cluster_ip_match = f'-p {proto} -m comment --comment "{name} cluster IP" -m {proto} --dport {svc.port}'

    def rule(self, **kw: object) -> str:
        return rule(proto=self.proto, **kw)  # type: ignore[arg-type]


def _compile_port(out: ServiceRules, svc: ServicePort, eps: Sequence[Endpoint], cfg: IptablesConfig,
                  name: str = "") -> None:
    """One service port, in the order of upstream's syncProxyRules: the service dispatch
    rules (cluster IP, external IPs, load balancer IPs, NodePort, health check), then the
    port's own chains (masquerade, external, firewall, endpoint jumps, endpoints)."""
    cat = categorize(eps, svc)
    checked.endpoints(svc, cat.reachable)  # the endpoints that reach the text
    p = _Port(svc, cat, name)
    if not p.has_endpoints:
        out.no_endpoint_ports += 1
    _cluster_ip_rules(out, p, svc)
    _external_ip_rules(out, p, svc)
    _load_balancer_rules(out, p, svc)
    _node_port_rules(out, p, svc)
    _health_check_rule(out, p, svc)
    _masquerade_rules(out.chains, p, svc, cfg)
    _external_chain(out.chains, p, svc, cfg)
    _firewall_chain(out.chains, p, svc, cfg)
    _endpoint_chains(out, p, svc, cfg)


def _add(chains: Dict[ChainKey, List[str]], chain: str, text: str) -> None:
    chains.setdefault((NAT, chain), []).append(text)


def _cluster_ip_rules(out: ServiceRules, p: _Port, svc: ServicePort) -> None:
    """ClusterIP: to the internal-policy chain, or rejected/dropped without endpoints."""
    if p.has_internal:
        out.add_shared(NAT, KUBE_SERVICES, f"-d {_host(svc.cluster_ip)} {p.cluster_ip_match} -j {p.internal_chain}")
    else:
        out.add_shared(FILTER, KUBE_SERVICES, p.rule(
            dst=_host(svc.cluster_ip), comment=p.internal_comment, dport=svc.port, target=p.internal_target))


def _external_ip_rules(out: ServiceRules, p: _Port, svc: ServicePort) -> None:
    """externalIPs: to the external chain; without (local) endpoints, rejected/dropped."""
    for ip in svc.external_ips:
        if p.has_endpoints:
            out.add_shared(NAT, KUBE_SERVICES, p.rule(
                dst=_host(ip), comment=f"{p.name} external IP", dport=svc.port, target=p.external_chain))
        if not p.has_external:
            out.add_shared(FILTER, KUBE_EXTERNAL_SERVICES, p.rule(
                dst=_host(ip), comment=p.external_comment, dport=svc.port, target=p.external_target))


def _load_balancer_rules(out: ServiceRules, p: _Port, svc: ServicePort) -> None:
    """LoadBalancer ingress IPs: to the firewall chain (source ranges) or the external
    chain; what the firewall does not accept is dropped in KUBE-PROXY-FIREWALL."""
    for ip in svc.load_balancer_ips:
        if p.has_endpoints:
            out.add_shared(NAT, KUBE_SERVICES, p.rule(
                dst=_host(ip), comment=f"{p.name} loadbalancer IP", dport=svc.port, target=p.lb_chain))
        if p.uses_fw_chain:
            out.add_shared(FILTER, KUBE_PROXY_FIREWALL, p.rule(
                dst=_host(ip), comment=f"{p.name} traffic not accepted by {p.firewall_chain}", dport=svc.port,
                target="DROP"))
    if not p.has_external:
        for ip in svc.load_balancer_ips:
            out.add_shared(FILTER, KUBE_EXTERNAL_SERVICES, p.rule(
                dst=_host(ip), comment=p.external_comment, dport=svc.port, target=p.external_target))


def _node_port_rules(out: ServiceRules, p: _Port, svc: ServicePort) -> None:
    """NodePort: to the external chain; without (local) endpoints, rejected/dropped."""
    if not svc.node_port:
        return
    if p.has_endpoints:
        out.add_shared(NAT, KUBE_NODEPORTS, p.rule(comment=p.name, dport=svc.node_port, target=p.external_chain))
    if not p.has_external:
        out.add_shared(FILTER, KUBE_EXTERNAL_SERVICES, p.rule(
            comment=p.external_comment, matches=("-m addrtype --dst-type LOCAL",), dport=svc.node_port,
            target=p.external_target))


def _health_check_rule(out: ServiceRules, p: _Port, svc: ServicePort) -> None:
    if svc.health_check_node_port:
        out.add_shared(FILTER, KUBE_NODEPORTS, rule(
            proto="tcp", comment=f"{p.name} health check node port", dport=svc.health_check_node_port,
            target="ACCEPT"))


def _masquerade_rules(chains: Dict[ChainKey, List[str]], p: _Port, svc: ServicePort, cfg: IptablesConfig) -> None:
    """Internal traffic: masquerade off-cluster sources so replies come back through us."""
    if not p.has_internal:
        return
    detector = cfg.detector
    if cfg.masquerade_all:
        _add(chains, p.internal_chain, f"-d {_host(svc.cluster_ip)} {p.cluster_ip_match} -j {KUBE_MARK_MASQ}")
    elif detector.implemented:
        _add(chains, p.internal_chain, f"{detector.not_local_before_dst}-d {_host(svc.cluster_ip)}"
                                       f"{detector.not_local_after_dst} {p.cluster_ip_match} -j {KUBE_MARK_MASQ}")


def _external_chain(chains: Dict[ChainKey, List[str]], p: _Port, svc: ServicePort, cfg: IptablesConfig) -> None:
    """KUBE-EXT-: masquerade external traffic (or, with the Local policy, only the node's
    own and pods' traffic), then the external-policy chain."""
    if not p.uses_external_chain:
        return
    chains.setdefault((NAT, p.external_chain), [])
    name = p.name
    if not svc.uses_external_local:
        _add(chains, p.external_chain, rule(comment=f"masquerade traffic for {name} external destinations",
                                            target=KUBE_MARK_MASQ))
    else:
        detector = cfg.detector
        if detector.implemented:
            # Pod -> external VIP traffic is not subject to the external policy: it acts
            # as if it went out to a load balancer and came back.
            _add(chains, p.external_chain, rule(comment=f"pod traffic for {name} external destinations",
                                                target=p.cluster_chain, **_local_kw(detector.if_local())))
        _add(chains, p.external_chain, rule(comment=f"masquerade LOCAL traffic for {name} external destinations",
                                            matches=("-m addrtype --src-type LOCAL",), target=KUBE_MARK_MASQ))
        _add(chains, p.external_chain, rule(comment=f"route LOCAL traffic for {name} external destinations",
                                            matches=("-m addrtype --src-type LOCAL",), target=p.cluster_chain))
    if p.has_external:
        _add(chains, p.external_chain, rule(target=p.external_policy_chain))


def _firewall_chain(chains: Dict[ChainKey, List[str]], p: _Port, svc: ServicePort, cfg: IptablesConfig) -> None:
    """KUBE-FW-: loadBalancerSourceRanges (and the node itself when a range holds one of
    its addresses) go on to the external chain; anything else falls through."""
    if not p.uses_fw_chain:
        return
    chains.setdefault((NAT, p.firewall_chain), [])
    name = p.name
    allow_from_node = False
    for cidr in svc.load_balancer_source_ranges:
        _add(chains, p.firewall_chain, rule(src=_net(cidr), comment=f"{name} loadbalancer IP", target=p.external_chain))
        net = ipaddress.ip_network(cidr)
        if any(ipaddress.ip_address(ip) in net for ip in cfg.node_ips if _same_family(ip, cidr)):
            allow_from_node = True
    if allow_from_node:
        for ip in svc.load_balancer_ips:
            _add(chains, p.firewall_chain, rule(src=_host(ip), comment=f"{name} loadbalancer IP",
                                                target=p.external_chain))
    _add(chains, p.firewall_chain, rule(comment=f"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"))


def _endpoint_chains(out: ServiceRules, p: _Port, svc: ServicePort, cfg: IptablesConfig) -> None:
    """KUBE-SVC-/KUBE-SVL- jumps to the endpoints, and each endpoint's KUBE-SEP- chain."""
    chains = out.chains
    cat = p.cat
    proto = p.proto
    # Each endpoint's chain name, hashed once (the policy chains' jumps use it again).
    seps = {ep.addr: sep_chain(p.raw, proto, ep.addr) for ep in cat.reachable}
    if p.uses_cluster_chain:
        _endpoint_jumps(chains, p.cluster_chain, p.name, svc, cat.cluster, seps, cfg)
    if p.uses_local_chain:
        _endpoint_jumps(chains, p.local_chain, p.name, svc, cat.local, seps, cfg)

    # Endpoint chains are most of a large ruleset: their two rules are written directly
    # (the same text rule() gives; the golden tests hold both to upstream's output).
    comment = "" if cfg.large_cluster else f" {_comment(p.name)}"
    for ep in cat.reachable:
        dest = ep.addr
        chain = seps[dest]
        affinity = f" -m recent --set --name {chain} --mask {_mask(ep.ip)} --rsource" \
            if svc.session_affinity_seconds else ""
        chains[(NAT, chain)] = [
            f"-s {_host(ep.ip)}{comment} -j {KUBE_MARK_MASQ}",
            f"-p {proto}{comment}{affinity} -m {proto} -j DNAT --to-destination {dest}",
        ]
    out.endpoints += len(cat.reachable)


def _same_family(ip: str, cidr: str) -> bool:
    return (":" in ip) == (":" in cidr)


def _mask(ip: str) -> str:
    return "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff" if ":" in ip else "255.255.255.255"


def _endpoint_jumps(chains: Dict[ChainKey, List[str]], chain: str, name: str, svc: ServicePort,
                    eps: List[Endpoint], seps: Dict[str, str], cfg: IptablesConfig) -> None:
    rules = chains.setdefault((NAT, chain), [])
    if svc.session_affinity_seconds:
        for ep in eps:
            sep = seps[ep.addr]
            rules.append(rule(
                comment="" if cfg.large_cluster else f"{name} -> {ep}",
                matches=(f"-m recent --rcheck --seconds {svc.session_affinity_seconds} --reap --name {sep} "
                         f"--mask {_mask(ep.ip)} --rsource",),
                target=sep))
    n = len(eps)
    for i, ep in enumerate(eps):
        dest = ep.addr
        head = "" if cfg.large_cluster else f"{_comment(f'{name} -> {dest}')} "
        stat = f"-m statistic --mode random --probability {probability(n - i)} " if i < n - 1 else ""
        rules.append(f"{head}{stat}-j {seps[dest]}")


# --- node-wide rules ------------------------------------------------------------------


def infrastructure(cfg: IptablesConfig) -> Dict[ChainKey, List[str]]:
    """Chains and rules that exist once per node, independent of services.

    Built-in chains appear with only our jump rules: those are ensured present, never
    used to rewrite the built-in chain.
    """
    mark = cfg.mark
    out: Dict[ChainKey, List[str]] = {
        (FILTER, KUBE_NODEPORTS): [],
        (FILTER, KUBE_SERVICES): [],
        (FILTER, KUBE_EXTERNAL_SERVICES): [],
        (FILTER, KUBE_FIREWALL): [],
        (FILTER, KUBE_FORWARD): [
            rule(matches=("-m conntrack --ctstate INVALID",), target="DROP"),
            rule(comment="kubernetes forwarding rules", matches=(f"-m mark --mark {mark}/{mark}",), target="ACCEPT"),
            rule(comment="kubernetes forwarding conntrack rule",
                 matches=("-m conntrack --ctstate RELATED,ESTABLISHED",), target="ACCEPT"),
        ],
        (FILTER, KUBE_PROXY_FIREWALL): [],
        (NAT, KUBE_NODEPORTS): [],
        (NAT, KUBE_SERVICES): [],
        (NAT, KUBE_MARK_MASQ): [rule(target=f"MARK --set-xmark {mark}/{mark}")],
        (NAT, KUBE_POSTROUTING): [
            rule(matches=(f"-m mark ! --mark {mark}/{mark}",), target="RETURN"),
            rule(target=f"MARK --set-xmark {mark}/0x0"),
            rule(comment="kubernetes service traffic requiring SNAT",
                 target="MASQUERADE" + (" --random-fully" if cfg.masquerade_random_fully else "")),
        ],
    }
    if cfg.localhost_nodeports:
        # route_localnet lets 127.0.0.1:<nodePort> work; do not let outsiders use it to
        # reach the node's loopback services.
        out[(FILTER, KUBE_FIREWALL)].append(rule(
            not_src="127.0.0.0/8", dst="127.0.0.0/8", comment="block incoming localnet connections",
            matches=("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT",), target="DROP"))
    new = "-m conntrack --ctstate NEW"
    out[(FILTER, "INPUT")] = [
        f"{new} {_comment('kubernetes load balancer firewall')} -j {KUBE_PROXY_FIREWALL}",
        f"{_comment('kubernetes health check service ports')} -j {KUBE_NODEPORTS}",
        f"{new} {_comment('kubernetes externally-visible service portals')} -j {KUBE_EXTERNAL_SERVICES}",
        f"-j {KUBE_FIREWALL}",
    ]
    out[(FILTER, "FORWARD")] = [
        f"{new} {_comment('kubernetes load balancer firewall')} -j {KUBE_PROXY_FIREWALL}",
        f"{_comment('kubernetes forwarding rules')} -j {KUBE_FORWARD}",
        f"{new} {_comment('kubernetes service portals')} -j {KUBE_SERVICES}",
        f"{new} {_comment('kubernetes externally-visible service portals')} -j {KUBE_EXTERNAL_SERVICES}",
    ]
    out[(FILTER, "OUTPUT")] = [
        f"{new} {_comment('kubernetes load balancer firewall')} -j {KUBE_PROXY_FIREWALL}",
        f"{new} {_comment('kubernetes service portals')} -j {KUBE_SERVICES}",
        f"-j {KUBE_FIREWALL}",
    ]
    out[(NAT, "PREROUTING")] = [f"{_comment('kubernetes service portals')} -j {KUBE_SERVICES}"]
    out[(NAT, "OUTPUT")] = [f"{_comment('kubernetes service portals')} -j {KUBE_SERVICES}"]
    out[(NAT, "POSTROUTING")] = [f"{_comment('kubernetes postrouting rules')} -j {KUBE_POSTROUTING}"]
    return out


def nodeports_tail(cfg: IptablesConfig) -> List[str]:
    """The last rules of nat KUBE-SERVICES: hand local-destination traffic to KUBE-NODEPORTS."""
    if cfg.node_port_match_all:
        # IPv6 has no route_localnet: upstream excludes ::1 always.
        not_dst = "::1/128" if cfg.family == 6 else ("" if cfg.localhost_nodeports else "127.0.0.0/8")
        return [rule(not_dst=not_dst, comment=NODEPORTS_TAIL_COMMENT, matches=("-m addrtype --dst-type LOCAL",),
                     target=KUBE_NODEPORTS)]
    out = []
    for ip in cfg.node_port_ips:
        text.ip(ip, "nodePortAddresses")
        if ipaddress.ip_address(ip).is_loopback and not cfg.localhost_nodeports:
            continue
        out.append(rule(dst=_host(ip), comment=NODEPORTS_TAIL_COMMENT, target=KUBE_NODEPORTS))
    return out
