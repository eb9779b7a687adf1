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

import base64
import functools
import hashlib
import ipaddress
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ..endpoints import categorize
from ..model import Endpoint, ServicePort

FILTER = "filter"
NAT = "nat"

KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
KUBE_FIREWALL = "KUBE-FIREWALL"

# Per-service chain prefixes; only chains with these prefixes are ever garbage-collected.
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")
# Chains every service adds rules to: diffed rule by rule, never rewritten for one service.
SHARED_CHAINS = frozenset({KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL})
OWN_STATIC_CHAINS = frozenset({
    KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ, KUBE_FORWARD,
    KUBE_PROXY_FIREWALL, KUBE_FIREWALL,
})
BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
# Upstream drops comments from per-endpoint rules above this many endpoints (smaller ruleset).
LARGE_CLUSTER_ENDPOINTS = 1000

NODEPORTS_TAIL_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"

ChainKey = Tuple[str, str]  # (table, chain)


def _hash16(text: str) -> str:
    """Upstream's name hash: base32(sha256(text))[:16]. The first 16 base32 characters
    are exactly the first 10 digest bytes, so only those are encoded (this is the
    compiler's hottest function)."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()[:10]).decode("ascii")


@functools.lru_cache(maxsize=1 << 16)
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


@functools.lru_cache(maxsize=1 << 17)
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

    @property
    def mark(self) -> str:
        return "0x%x" % (1 << self.masquerade_bit)


# --- canonical rule text ---------------------------------------------------------------


def _host(ip: str) -> str:
    return ip + ("/128" if ":" in ip else "/32")


@functools.lru_cache(maxsize=4096)
def _net(cidr: str) -> str:
    net = ipaddress.ip_network(cidr, strict=False)
    if net.prefixlen == net.max_prefixlen:
        return _host(str(net.network_address))
    return str(net)


def _comment(text: str) -> str:
    return f'-m comment --comment "{text}"'


@functools.lru_cache(maxsize=1024)
def probability(n: int) -> str:
    """1/n as upstream writes it (10 digits), rounded the way the kernel stores it."""
    p = float("%0.10f" % (1.0 / n))
    stored = int(p * 0x80000000 + 0.5)
    return "%.11f" % (stored / 0x80000000)


class LocalDetector:
    def __init__(self, cfg: IptablesConfig) -> None:
        self.cfg = cfg

    @property
    def implemented(self) -> bool:
        mode = self.cfg.local_mode
        if mode in ("ClusterCIDR", "NodeCIDR"):
            return bool(self.cfg.local_cidrs)
        return mode in ("BridgeInterface", "InterfaceNamePrefix") and bool(self.cfg.local_interface)

    def _iface(self) -> str:
        name = self.cfg.local_interface
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
    out = ServiceRules()
    for sp in ports:
        _compile_port(out, sp, endpoints.get(sp.name, []), cfg)
    return out


def _compile_port(out: ServiceRules, svc: ServicePort, eps: List[Endpoint], cfg: IptablesConfig) -> None:
    proto = svc.protocol.lower()
    name = str(svc.name)
    detector = LocalDetector(cfg)
    cat = categorize(eps, svc)
    has_endpoints = cat.has_any

    cluster_chain = svc_chain(name, proto)
    local_chain = svl_chain(name, proto)
    external_chain = ext_chain(name, proto)
    firewall_chain = fw_chain(name, proto)
    uses_cluster_chain = bool(cat.cluster) and svc.uses_cluster_endpoints
    uses_local_chain = bool(cat.local) and svc.uses_local_endpoints

    internal_chain = cluster_chain
    has_internal = has_endpoints
    if svc.internal_policy_local:
        internal_chain = local_chain
        has_internal = has_internal and bool(cat.local)
    external_policy_chain = cluster_chain
    has_external = has_endpoints
    if svc.uses_external_local:
        external_policy_chain = local_chain
        has_external = has_external and bool(cat.local)
    uses_external_chain = has_endpoints and svc.externally_accessible
    uses_fw_chain = has_endpoints and bool(svc.load_balancer_ips) and bool(svc.load_balancer_source_ranges)
    lb_chain = firewall_chain if uses_fw_chain else external_chain

    if not has_endpoints:
        internal_target = external_target = "REJECT --reject-with icmp-port-unreachable" if ":" not in svc.cluster_ip \
            else "REJECT --reject-with icmp6-port-unreachable"
        internal_comment = external_comment = f"{name} has no endpoints"
        out.no_endpoint_ports += 1
    else:
        internal_target = external_target = "DROP"
        internal_comment = external_comment = f"{name} has no local endpoints"

    def port_rule(**kw: object) -> str:
        return rule(proto=proto, **kw)  # type: ignore[arg-type]

    # ClusterIP
    if has_internal:
        out.add_shared(NAT, KUBE_SERVICES, port_rule(
            dst=_host(svc.cluster_ip), comment=f"{name} cluster IP", dport=svc.port, target=internal_chain))
    else:
        out.add_shared(FILTER, KUBE_SERVICES, port_rule(
            dst=_host(svc.cluster_ip), comment=internal_comment, dport=svc.port, target=internal_target))

    # externalIPs
    for ip in svc.external_ips:
        if has_endpoints:
            out.add_shared(NAT, KUBE_SERVICES, port_rule(
                dst=_host(ip), comment=f"{name} external IP", dport=svc.port, target=external_chain))
        if not has_external:
            out.add_shared(FILTER, KUBE_EXTERNAL_SERVICES, port_rule(
                dst=_host(ip), comment=external_comment, dport=svc.port, target=external_target))

    # LoadBalancer ingress IPs
    for ip in svc.load_balancer_ips:
        if has_endpoints:
            out.add_shared(NAT, KUBE_SERVICES, port_rule(
                dst=_host(ip), comment=f"{name} loadbalancer IP", dport=svc.port, target=lb_chain))
        if uses_fw_chain:
            out.add_shared(FILTER, KUBE_PROXY_FIREWALL, port_rule(
                dst=_host(ip), comment=f"{name} traffic not accepted by {firewall_chain}", dport=svc.port,
                target="DROP"))
    if not has_external:
        for ip in svc.load_balancer_ips:
            out.add_shared(FILTER, KUBE_EXTERNAL_SERVICES, port_rule(
                dst=_host(ip), comment=external_comment, dport=svc.port, target=external_target))

    # NodePort
    if svc.node_port:
        if has_endpoints:
            out.add_shared(NAT, KUBE_NODEPORTS, port_rule(
                comment=name, dport=svc.node_port, target=external_chain))
        if not has_external:
            out.add_shared(FILTER, KUBE_EXTERNAL_SERVICES, port_rule(
                comment=external_comment, matches=("-m addrtype --dst-type LOCAL",), dport=svc.node_port,
                target=external_target))

    if svc.health_check_node_port:
        out.add_shared(FILTER, KUBE_NODEPORTS, rule(
            proto="tcp", comment=f"{name} health check node port", dport=svc.health_check_node_port,
            target="ACCEPT"))

    chains = out.chains

    def add(chain: str, text: str) -> None:
        chains.setdefault((NAT, chain), []).append(text)

    # Internal traffic: masquerade off-cluster sources so replies come back through us.
    if has_internal:
        head = dict(dst=_host(svc.cluster_ip), comment=f"{name} cluster IP", dport=svc.port, target=KUBE_MARK_MASQ)
        if cfg.masquerade_all:
            add(internal_chain, port_rule(**head))
        elif detector.implemented:
            add(internal_chain, port_rule(**head, **_local_kw(detector.if_not_local())))

    if uses_external_chain:
        chains.setdefault((NAT, external_chain), [])
        if not svc.uses_external_local:
            add(external_chain, rule(comment=f"masquerade traffic for {name} external destinations",
                                     target=KUBE_MARK_MASQ))
        else:
            if detector.implemented:
                # Pod -> external VIP traffic is not subject to the external policy: it acts
                # as if it went out to a load balancer and came back.
                add(external_chain, rule(comment=f"pod traffic for {name} external destinations",
                                         target=cluster_chain, **_local_kw(detector.if_local())))
            add(external_chain, rule(comment=f"masquerade LOCAL traffic for {name} external destinations",
                                     matches=("-m addrtype --src-type LOCAL",), target=KUBE_MARK_MASQ))
            add(external_chain, rule(comment=f"route LOCAL traffic for {name} external destinations",
                                     matches=("-m addrtype --src-type LOCAL",), target=cluster_chain))
        if has_external:
            add(external_chain, rule(target=external_policy_chain))

    if uses_fw_chain:
        chains.setdefault((NAT, firewall_chain), [])
        allow_from_node = False
        for cidr in svc.load_balancer_source_ranges:
            add(firewall_chain, rule(src=_net(cidr), comment=f"{name} loadbalancer IP", target=external_chain))
            net = ipaddress.ip_network(cidr)
            if any(ipaddress.ip_address(ip) in net for ip in cfg.node_ips if _same_family(ip, cidr)):
                allow_from_node = True
        if allow_from_node:
            for ip in svc.load_balancer_ips:
                add(firewall_chain, rule(src=_host(ip), comment=f"{name} loadbalancer IP", target=external_chain))
        add(firewall_chain, rule(comment=f"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"))

    if uses_cluster_chain:
        _endpoint_jumps(chains, cluster_chain, name, proto, svc, cat.cluster, cfg)
    if uses_local_chain:
        _endpoint_jumps(chains, local_chain, name, proto, svc, cat.local, cfg)

    # Endpoint chains are most of a large ruleset: their two rules are written directly
    # (the same text rule() gives; the golden tests hold both to upstream's output).
    comment = "" if cfg.large_cluster else f" {_comment(name)}"
    for ep in cat.reachable:
        dest = str(ep)
        chain = sep_chain(name, proto, dest)
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


def _endpoint_jumps(chains: Dict[ChainKey, List[str]], chain: str, name: str, proto: str, svc: ServicePort,
                    eps: List[Endpoint], cfg: IptablesConfig) -> None:
    rules = chains.setdefault((NAT, chain), [])
    if svc.session_affinity_seconds:
        for ep in eps:
            sep = sep_chain(name, proto, str(ep))
            rules.append(rule(
                comment="" if cfg.large_cluster else f"{name} -> {ep}",
                matches=(f"-m recent --rcheck --seconds {svc.session_affinity_seconds} --reap --name {sep} "
                         f"--mask {_mask(ep.ip)} --rsource",),
                target=sep))
    n = len(eps)
    for i, ep in enumerate(eps):
        dest = str(ep)
        head = "" if cfg.large_cluster else f"{_comment(f'{name} -> {dest}')} "
        stat = f"-m statistic --mode random --probability {probability(n - i)} " if i < n - 1 else ""
        rules.append(f"{head}{stat}-j {sep_chain(name, proto, dest)}")


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
        v6 = False  # IPv4 family for now; IPv6 excludes ::1 always
        not_dst = "::1/128" if v6 else ("" if cfg.localhost_nodeports else "127.0.0.0/8")
        return [rule(not_dst=not_dst, comment=NODEPORTS_TAIL_COMMENT, matches=("-m addrtype --dst-type LOCAL",),
                     target=KUBE_NODEPORTS)]
    out = []
    for ip in cfg.node_port_ips:
        if ipaddress.ip_address(ip).is_loopback and not cfg.localhost_nodeports:
            continue
        out.append(rule(dst=_host(ip), comment=NODEPORTS_TAIL_COMMENT, target=KUBE_NODEPORTS))
    return out
