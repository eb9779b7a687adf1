# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure compiler: services + endpoints + config -> the ``kube-proxy`` nftables table.

Names and layout follow upstream's pkg/proxy/nftables (table ``kube-proxy``, the
``services``/``service-ips``/``service-nodeports`` verdict maps, ``service-*``,
``external-*``, ``local-*``, ``firewall-*``, ``endpoint-*`` chains, ``affinity-*`` sets).
One difference, by measurement (docs/nftables-mode.md): the endpoint choice is written as
chained ``numgen random mod k == 0 goto`` rules (iptables' statistic split) instead of
upstream's anonymous ``numgen random mod N vmap { ... }`` per service, whose kernel load
cost grows with the number of anonymous sets (``ENDPOINT_VMAP`` keeps upstream's form
for the benchmark).

Output is data (:class:`ServiceNft` per service, :func:`infrastructure` once per node);
:func:`render_full` turns it into ``nft -f`` text. No I/O and no clock in this module.
Every value taken from an object reaches the text through kernel/text.py or
modes/checked.py: an unwritable field raises model.ValidationError naming it.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ...endpoints import categorize
from ...kernel import text
from ...model import Endpoint, ServicePort, ValidationError
from .. import checked
from ..iptables.compile import IptablesConfig, _hash16

TABLE = "kube-proxy"
ENDPOINT_CHAINED = "chained"  # numgen random mod k == 0 goto ..., one rule per endpoint
ENDPOINT_VMAP = "vmap"  # upstream: numgen random mod N vmap { 0 : goto ..., ... }

# Node-wide maps and sets (upstream's names).
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
FIREWALL_IPS = "firewall-ips"
CLUSTER_IPS = "cluster-ips"
NODEPORT_IPS = "nodeport-ips"
MARK_MASQ = "mark-for-masquerade"
# Not upstream's: one element that a `flush table`, `flush ruleset` or `delete table` takes
# away; listing this one set costs milliseconds at any table size (a chain listing makes
# nft fetch every set's elements: 1.4 s at 10,000 services).
CANARY_SET = "canary"
CANARY_ELEMENT = "1"
HAIRPIN_IPS = "hairpin-ips"  # not upstream's: inlined endpoints only (see _compile_port)
# Sets whose elements several services may add (an endpoint IP serves many services): the
# planner counts them and deletes an element when its last service lets go of it.
SHARED_ELEMENT_SETS = frozenset({HAIRPIN_IPS, "cluster-ips"})
REJECT_CHAIN = "reject-chain"
# Per-service object name prefixes: only these are ever deleted by a sync.
SERVICE_PREFIXES = ("service-", "external-", "local-", "firewall-", "endpoint-", "affinity-")
# Not upstream's: the endpoints of every service chain as elements of one map per protocol
# (``endpoints-tcp``...), keyed by the draw: ``numgen random mod k offset BASE map
# @endpoints-tcp``, BASE a block of keys the proxier gives the chain (EndpointSlots). An
# endpoint replaced is then element updates, which the kernel commits without validating
# the table's chain graph (a rule with a dnat or jump makes it walk every chain: 75-160 ms
# at 10,000 services). A few maps, not one per service: the kernel looks sets up by name in
# a list (10,000 named maps: a cold load 4-5x slower); and not one map for all: every element
# added to a map is checked against every rule using the map (one map: cold load 2x slower).
# ENDPOINT_MAP_SHARDS maps per protocol, a chain's key block deciding its map.
ENDPOINT_MAP_PREFIX = "endpoints-"
ENDPOINT_MAP_PROTOCOLS = ("tcp", "udp", "sctp")
ENDPOINT_MAP_SHARDS = 32


def endpoint_map(proto: str, base: int) -> str:
    return f"{ENDPOINT_MAP_PREFIX}{proto}-{base // 64 % ENDPOINT_MAP_SHARDS:02d}"


@dataclass(frozen=True)
class NftablesConfig:
    """The iptables mode's fields that mean the same here, plus the nftables choices."""

    base: IptablesConfig = field(default_factory=IptablesConfig)
    family: str = "ip"  # "ip" now; "ip6" when dual-stack arrives
    endpoint_selection: str = ENDPOINT_CHAINED
    # False (default): no endpoint-* chains, each endpoint's DNAT written into its service
    # chain, hairpin masquerade from one shared set: a quarter of the chains, and nft's
    # per-invocation cache and the kernel's commit both cost per chain (docs/nftables-mode.md
    # has the numbers). True: upstream's endpoint-* chains.
    endpoint_chains: bool = False
    # The service CIDRs, when known (upstream takes them from the ServiceCIDR objects):
    # cluster-ips-check then drops new connections to addresses in them that no Service
    # holds. Empty: not known, no such rule (as upstream).
    service_cidrs: Tuple[str, ...] = ()
    # Inlined layout, services without ClientIP affinity: the endpoints as elements of the
    # endpoints-<proto> maps (ENDPOINT_MAP_PREFIX) instead of one dnat rule each, when the
    # caller gives key blocks (compile_service's ``slots``). False: the rules.
    endpoint_maps: bool = True

    @property
    def mark(self) -> str:
        return self.base.mark

    @property
    def node_port_ips(self) -> Tuple[str, ...]:
        """As IptablesConfig's (the daemon binds health check node ports to them)."""
        return self.base.node_port_ips


@dataclass
class ServiceNft:
    """One Service's contribution: its own chains and sets, and elements of shared maps."""

    chains: Dict[str, List[str]] = field(default_factory=dict)  # chain -> rule bodies
    sets: Dict[str, str] = field(default_factory=dict)  # affinity set -> declaration body
    elements: Dict[str, List[str]] = field(default_factory=dict)  # shared map/set -> elements
    endpoints: int = 0
    no_endpoint_ports: int = 0

    def element(self, where: str, elem: str) -> None:
        self.elements.setdefault(where, []).append(elem)

    def rule_count(self) -> int:
        return sum(len(r) for r in self.chains.values())


@dataclass
class Infrastructure:
    """Node-wide objects: declarations in creation order, then rules and elements."""

    sets: Dict[str, str]  # set/map name -> declaration body
    chains: Dict[str, str]  # chain name -> declaration body ("" for a regular chain)
    rules: Dict[str, List[str]]
    elements: Dict[str, List[str]]


# --- names ---------------------------------------------------------------------------


CHAIN_BASE_MAX = 240  # upstream's chainNameBaseLengthMax


def chain_base(ns: str, name: str, port_name: str, proto: str) -> str:
    """Upstream's servicePortChainNameBase: ``HASH8-ns/name/proto/port``, HASH8 being the
    first 8 base32 characters of sha256 of the readable part (golden: ULMVA6XW-ns1/svc1/tcp/p80)."""
    readable = f"{ns}/{name}/{proto}/{port_name}"
    return f"{_hash16(readable)[:8]}-{readable}"


def endpoint_base(ns: str, name: str, port_name: str, proto: str, ep: Endpoint) -> str:
    """Upstream's servicePortEndpointChainNameBase: ``ip:port`` written ``ip/port``, an IPv6
    address with its colons as dots (a colon is not allowed in a chain name), truncated
    to 240 characters with "..." as upstream's hashAndTruncate."""
    readable = f"{ns}/{name}/{proto}/{port_name}__{ep.ip.replace(':', '.')}/{ep.port}"
    base = f"{_hash16(readable)[:8]}-{readable}"
    return base if len(base) <= CHAIN_BASE_MAX else base[:CHAIN_BASE_MAX - 3] + "..."


def _ident(sp: ServicePort, value: str) -> str:
    try:
        return text.nft_identifier(value, "metadata.name")
    except text.UnsafeText as e:
        raise ValidationError("Service", sp.name.service if isinstance(sp.name.service, str) else "?",
                              e.field, "namespace/name/port name cannot be an nft chain name: " + e.problem) from None


# --- pieces of rule text ---------------------------------------------------------------


def _addr_kw(cfg: NftablesConfig) -> str:
    return "ip6" if cfg.family == "ip6" else "ip"


def _net(cidr: str) -> str:
    return str(ipaddress.ip_network(cidr, strict=False))


@functools.lru_cache(maxsize=16)  # asked for on every port; the config rarely changes
def local_match(cfg: NftablesConfig, negate: bool) -> str:
    """Upstream's LocalTrafficDetector as nft text ("" when not configured)."""
    base = cfg.base
    detector = base.detector
    if not detector.implemented:
        return ""
    op = "!= " if negate else ""
    if base.local_mode in ("ClusterCIDR", "NodeCIDR"):
        cidr = _net(text.cidr(base.local_cidrs[0], "clusterCIDR"))
        return f"{_addr_kw(cfg)} saddr {op}{cidr}"
    name = text.iface(base.local_interface, "detectLocal.interface")
    if base.local_mode == "InterfaceNamePrefix":
        name = name + "*"
    return f"iifname {op}{text.nft_string(name, 'detectLocal.interface')}"


def _endpoint_choice(targets: Sequence[str], cfg: NftablesConfig, goto: bool = True) -> List[str]:
    """Rules sending a packet to one of ``targets`` with equal chance: endpoint chains
    (``goto``), or each endpoint's own statements (inlined: a ``dnat`` ends the rule)."""
    n = len(targets)
    if cfg.endpoint_selection == ENDPOINT_VMAP and goto:
        body = ", ".join(f"{i} : goto {t}" for i, t in enumerate(targets))
        return [f"numgen random mod {n} vmap {{ {body} }}"]
    verb = "goto " if goto else ""
    # The iptables statistic split: rule i takes 1/(n-i) of what reaches it.
    out = [f"numgen random mod {n - i} == 0 {verb}{t}" for i, t in enumerate(targets[:-1])]
    out.append(f"{verb}{targets[-1]}")
    return out


# --- per service -------------------------------------------------------------------------


# chain name, endpoint count -> the first key of a block of at least that many keys in the
# endpoints-<proto> map that only this chain uses, or None (write dnat rules instead).
Slots = Callable[[str, int], Optional[int]]


def compile_service(ports: Sequence[ServicePort], endpoints: Dict, cfg: NftablesConfig,
                    slots: Optional[Slots] = None) -> ServiceNft:
    """Raises model.ValidationError (naming the object and field) for a field that cannot
    be written into nft text: the caller leaves this service out. ``slots``: see Slots
    (the same chain and count must give the same block while the chain lives: the
    output is cached)."""
    out = ServiceNft()
    for i, sp in enumerate(ports):
        checked.port_name(sp, i)  # cluster IP, port, protocol
        checked.port_extras(sp, i)
        _compile_port(out, sp, endpoints.get(sp.name, []), cfg, slots)
    return out


def _compile_port(out: ServiceNft, svc: ServicePort, eps: Sequence[Endpoint], cfg: NftablesConfig,
                  slots: Optional[Slots] = None) -> None:
    proto = svc.protocol.lower()
    n = svc.name
    base = chain_base(n.namespace, n.name, n.port, proto)
    service_chain = _ident(svc, "service-" + base)
    local_chain = "local-" + base
    external_chain = "external-" + base
    firewall_chain = "firewall-" + base
    af = _addr_kw(cfg)

    cat = categorize(eps, svc)
    checked.endpoints(svc, cat.reachable)
    has_endpoints = cat.has_any
    uses_cluster_chain = bool(cat.cluster) and svc.uses_cluster_endpoints
    uses_local_chain = bool(cat.local) and svc.uses_local_endpoints

    internal_chain = service_chain
    has_internal = has_endpoints
    if svc.internal_policy_local:
        internal_chain = local_chain
        has_internal = has_internal and bool(cat.local)
    external_policy_chain = service_chain
    has_external = has_endpoints
    if svc.uses_external_local:
        external_policy_chain = local_chain
        has_external = has_external and bool(cat.local)
    uses_external_chain = has_endpoints and svc.externally_accessible
    uses_fw_chain = has_endpoints and bool(svc.load_balancer_ips) and bool(svc.load_balancer_source_ranges)

    # Upstream: reject when the service has no endpoints at all, drop when it has some but
    # none the policy may use.
    internal_verdict = "drop" if has_endpoints else f"goto {REJECT_CHAIN}"
    external_verdict = internal_verdict
    if not has_endpoints:
        out.no_endpoint_ports += 1

    cip = svc.cluster_ip
    port = svc.port
    if cip not in out.elements.get(CLUSTER_IPS, ()):  # several ports share the cluster IP
        out.element(CLUSTER_IPS, cip)
    if has_internal:
        out.element(SERVICE_IPS, f"{cip} . {proto} . {port} : goto {internal_chain}")
    else:
        out.element(NO_ENDPOINT_SERVICES, f"{cip} . {proto} . {port} : {internal_verdict}")

    for ip in svc.external_ips:
        if has_endpoints:
            out.element(SERVICE_IPS, f"{ip} . {proto} . {port} : goto {external_chain}")
        if not has_external:
            out.element(NO_ENDPOINT_SERVICES, f"{ip} . {proto} . {port} : {external_verdict}")
    for ip in svc.load_balancer_ips:
        if has_endpoints:
            out.element(SERVICE_IPS, f"{ip} . {proto} . {port} : goto {external_chain}")
        if uses_fw_chain:
            out.element(FIREWALL_IPS, f"{ip} . {proto} . {port} : goto {firewall_chain}")
        if not has_external:
            out.element(NO_ENDPOINT_SERVICES, f"{ip} . {proto} . {port} : {external_verdict}")
    if svc.node_port:
        if has_endpoints:
            out.element(SERVICE_NODEPORTS, f"{proto} . {svc.node_port} : goto {external_chain}")
        if not has_external:
            out.element(NO_ENDPOINT_NODEPORTS, f"{proto} . {svc.node_port} : {external_verdict}")

    chains = out.chains
    # Internal traffic from outside the cluster (or all, with masqueradeAll) is masqueraded
    # so that replies come back through this node.
    if has_internal:
        masq = [] if cfg.base.masquerade_all else [local_match(cfg, negate=True)]
        if cfg.base.masquerade_all or masq[0]:
            rule = " ".join([f"{af} daddr {cip} {proto} dport {port}", *masq, f"jump {MARK_MASQ}"])
            chains.setdefault(internal_chain, []).append(rule)

    if uses_external_chain:
        ext = chains.setdefault(external_chain, [])
        if not svc.uses_external_local:
            ext.append(f"jump {MARK_MASQ}")
        else:
            pods = local_match(cfg, negate=False)
            if pods:
                # Pod -> external VIP acts as if it went out to a load balancer and came back.
                ext.append(f'{pods} goto {service_chain} comment "short-circuit pod traffic"')
            ext.append(f'fib saddr type local jump {MARK_MASQ} comment "masquerade local traffic"')
            ext.append(f'fib saddr type local goto {service_chain} comment "short-circuit local traffic"')
        if has_external:
            ext.append(f"goto {external_policy_chain}")

    if uses_fw_chain:
        allowed = [_net(c) for c in svc.load_balancer_source_ranges]
        for cidr in svc.load_balancer_source_ranges:
            net = ipaddress.ip_network(cidr, strict=False)
            if any(ipaddress.ip_address(ip) in net for ip in cfg.base.node_ips if (":" in ip) == (":" in cidr)):
                allowed.extend(svc.load_balancer_ips)  # the node reaching its own LB IP
                break
        # In filter-prerouting (via @firewall-ips): drop what the ranges do not allow; the
        # rest returns and is DNATed by the nat chains.
        chains[firewall_chain] = [f"{af} saddr != {{ {', '.join(allowed)} }} drop"]

    # Per endpoint: its chain name (upstream's layout) or, inlined, the affinity set name
    # alone (the base is the same), and the endpoint's statements.
    ep_base = {ep.addr: _ident(svc, "endpoint-" + endpoint_base(n.namespace, n.name, n.port, proto, ep))[9:]
               for ep in cat.reachable}
    affinity = svc.session_affinity_seconds
    if affinity:
        decl = f"type {'ipv6_addr' if af == 'ip6' else 'ipv4_addr'} ; flags dynamic,timeout ; timeout {affinity}s ;"
        for ep in cat.reachable:
            out.sets["affinity-" + ep_base[ep.addr]] = decl

    def dnat(ep: Endpoint) -> str:
        """What an endpoint chain ends with: refresh the affinity entry, DNAT."""
        dest = f"[{ep.ip}]:{ep.port}" if ":" in ep.ip else ep.addr
        update = f"update @affinity-{ep_base[ep.addr]} {{ {af} saddr }} " if affinity else ""
        return f"{update}meta l4proto {proto} dnat to {dest}"

    inline = not cfg.endpoint_chains
    for chain, members, used in ((service_chain, cat.cluster, uses_cluster_chain),
                                 (local_chain, cat.local, uses_local_chain)):
        if not used:
            continue
        rules = chains.setdefault(chain, [])
        base = (slots(chain, len(members)) if slots is not None and inline and not affinity and cfg.endpoint_maps
                and cfg.endpoint_selection != ENDPOINT_VMAP and proto in ENDPOINT_MAP_PROTOCOLS else None)
        if base is not None:
            emap = endpoint_map(proto, base)
            k = len(members)
            rules.append(f"meta l4proto {proto} dnat {af} to numgen random mod {k} offset {base} map @{emap}")
            for i, ep in enumerate(members):
                out.element(emap, f"{base + i} : {ep.ip} . {ep.port}")
            continue
        if inline:
            if affinity:
                rules.extend(f"{af} saddr @affinity-{ep_base[ep.addr]} {dnat(ep)}" for ep in members)
            rules.extend(_endpoint_choice([dnat(ep) for ep in members], cfg, goto=False))
            continue
        if affinity:
            rules.extend(f"{af} saddr @affinity-{ep_base[ep.addr]} goto endpoint-{ep_base[ep.addr]}" for ep in members)
        rules.extend(_endpoint_choice(["endpoint-" + ep_base[ep.addr] for ep in members], cfg))

    if inline:
        # Hairpin (an endpoint sent to itself) is masqueraded in nat-postrouting, where the
        # packet's source equals its DNATed destination: one shared set, not a rule per
        # endpoint (elements are counted across services by the planner).
        for ep in cat.reachable:
            out.element(HAIRPIN_IPS, f"{ep.ip} . {ep.ip}")
    else:
        for ep in cat.reachable:
            chains["endpoint-" + ep_base[ep.addr]] = [f"{af} saddr {ep.ip} jump {MARK_MASQ}", dnat(ep)]
    out.endpoints += len(cat.reachable)


# --- node-wide ---------------------------------------------------------------------------


def infrastructure(cfg: NftablesConfig) -> Infrastructure:
    af = _addr_kw(cfg)
    addr_type = "ipv6_addr" if af == "ip6" else "ipv4_addr"
    mark = cfg.mark
    b = cfg.base
    sets = {
        CLUSTER_IPS: f'type {addr_type} ; comment "Active ClusterIPs" ;',
        NODEPORT_IPS: f'type {addr_type} ; comment "IPs that accept NodePort traffic" ;',
        FIREWALL_IPS: f"type {addr_type} . inet_proto . inet_service : verdict ; "
                      'comment "destinations that are subject to LoadBalancerSourceRanges" ;',
        NO_ENDPOINT_SERVICES: f"type {addr_type} . inet_proto . inet_service : verdict ; "
                              'comment "vmap to drop or reject packets to services with no endpoints" ;',
        NO_ENDPOINT_NODEPORTS: "type inet_proto . inet_service : verdict ; "
                               'comment "vmap to drop or reject packets to service nodeports with no endpoints" ;',
        SERVICE_IPS: f"type {addr_type} . inet_proto . inet_service : verdict ; "
                     'comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ;',
        SERVICE_NODEPORTS: 'type inet_proto . inet_service : verdict ; comment "NodePort traffic" ;',
        CANARY_SET: 'type inet_service ; comment "kubenode-proxy: gone or empty when the table was flushed" ;',
    }
    if not cfg.endpoint_chains:
        sets[HAIRPIN_IPS] = f'type {addr_type} . {addr_type} ; comment "endpoint IP . endpoint IP: hairpin traffic" ;'
        if cfg.endpoint_maps:
            for proto in ENDPOINT_MAP_PROTOCOLS:
                for shard in range(ENDPOINT_MAP_SHARDS):
                    sets[endpoint_map(proto, shard * 64)] = (
                        f"typeof numgen random mod 1 : {af} daddr . {proto} dport ; "
                        'comment "service chain key block + endpoint draw -> endpoint" ;')

    chains = {
        "filter-prerouting": "type filter hook prerouting priority dstnat - 10 ;",
        "filter-input": "type filter hook input priority -110 ;",
        "filter-forward": "type filter hook forward priority -110 ;",
        "filter-output": "type filter hook output priority -110 ;",
        "filter-output-post-dnat": "type filter hook output priority -90 ;",
        "nat-prerouting": "type nat hook prerouting priority -100 ;",
        "nat-output": "type nat hook output priority -100 ;",
        "nat-postrouting": "type nat hook postrouting priority 100 ;",
        MARK_MASQ: "", "masquerading": "", "services": "", "service-endpoints-check": "",
        "nodeport-endpoints-check": "", "cluster-ips-check": "", "firewall-check": "",
        REJECT_CHAIN: 'comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ;',
    }
    # Upstream leaves localhost out of NodePorts in nftables mode (no route_localnet).
    no_localhost = "ip6 daddr != ::1" if af == "ip6" else "ip daddr != 127.0.0.0/8"
    if b.node_port_match_all:
        nodeport_dst = f"fib daddr type local {no_localhost}"
    else:
        nodeport_dst = f"{af} daddr @{NODEPORT_IPS}"
    rules = {
        "filter-prerouting": ["ct state new jump firewall-check"],
        "filter-input": ["ct state new jump nodeport-endpoints-check", "ct state new jump service-endpoints-check"],
        "filter-forward": ["ct state new jump service-endpoints-check", "ct state new jump cluster-ips-check"],
        "filter-output": ["ct state new jump service-endpoints-check", "ct state new jump firewall-check"],
        "filter-output-post-dnat": ["ct state new jump cluster-ips-check"],
        "nat-prerouting": ["jump services"],
        "nat-output": ["jump services"],
        "nat-postrouting": ([] if cfg.endpoint_chains else
                            [f"ct status dnat {af} saddr . {af} daddr @{HAIRPIN_IPS} jump {MARK_MASQ}"])
        + ["jump masquerading"],
        MARK_MASQ: [f"mark set mark or {mark}"],
        "masquerading": [f"mark and {mark} == 0 return", f"mark set mark xor {mark}",
                         "masquerade fully-random" if b.masquerade_random_fully else "masquerade"],
        "services": [f"{af} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}",
                     f"{nodeport_dst} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}"],
        "service-endpoints-check": [f"{af} daddr . meta l4proto . th dport vmap @{NO_ENDPOINT_SERVICES}"],
        "nodeport-endpoints-check": [f"{nodeport_dst} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS}"],
        "cluster-ips-check": [f'{af} daddr @{CLUSTER_IPS} reject comment "Reject traffic to invalid ports of '
                              'ClusterIPs"'],
        "firewall-check": [f"{af} daddr . meta l4proto . th dport vmap @{FIREWALL_IPS}"],
        REJECT_CHAIN: ["reject"],
    }
    nets = [_net(text.cidr(c, "serviceCIDRs")) for c in cfg.service_cidrs if (":" in c) == (af == "ip6")]
    if nets:
        rules["cluster-ips-check"].append(f'{af} daddr {{ {", ".join(nets)} }} drop comment '
                                          '"Drop traffic to unallocated ClusterIPs"')
    elements: Dict[str, List[str]] = {CANARY_SET: [CANARY_ELEMENT]}
    if not b.node_port_match_all:
        ips = [text.ip(ip, "nodePortAddresses") for ip in b.node_port_ips if (":" in ip) == (af == "ip6")]
        elements[NODEPORT_IPS] = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
    return Infrastructure(sets, chains, rules, elements)


# --- text ---------------------------------------------------------------------------------

ELEMENTS_PER_LINE = 1000  # nft parses one long element list faster than many commands


class EndpointSlots:
    """Key blocks of the endpoints-<proto> maps, one per service chain (compile_service's
    ``slots``): stable while the chain lives and fits its block, so an endpoint change
    rewrites elements only. Blocks are never reused (keys freed in one transaction and
    taken in the same one would look like two services claiming a key): the u32 key space
    holds 33 million 64-key blocks; past it, or past MAX endpoints, dnat rules are written."""

    BLOCK = 64
    MAX = 1 << 16
    LIMIT = 1 << 31

    def __init__(self) -> None:
        self.blocks: Dict[str, Tuple[int, int]] = {}  # chain -> (first key, size)
        self.next = 0

    def __call__(self, chain: str, count: int) -> Optional[int]:
        have = self.blocks.get(chain)
        if have is not None and have[1] >= count:
            return have[0]
        if count > self.MAX:
            return None
        size = self.BLOCK
        while size < count:
            size *= 2
        if self.next + size > self.LIMIT:
            return None
        self.blocks[chain] = (self.next, size)
        self.next += size
        return self.blocks[chain][0]

    def keep_only(self, chains: Set[str]) -> None:
        """Forget the blocks of chains that are gone (after a full sync): memory, not keys."""
        for chain in [c for c in self.blocks if c not in chains]:
            del self.blocks[chain]


def set_kind(decl: str) -> str:
    """``map`` or ``set``, by the declaration (a map's type has a ``key : data`` part)."""
    return "map" if " : " in decl else "set"


def table_head(cfg: NftablesConfig) -> str:
    return f"{cfg.family} {TABLE}"


def elements_text(head: str, verb: str, where: str, elems: Sequence[str]) -> List[str]:
    out = []
    for i in range(0, len(elems), ELEMENTS_PER_LINE):
        out.append(f"{verb} element {head} {where} {{ {', '.join(elems[i:i + ELEMENTS_PER_LINE])} }}")
    return out


def encode_element(where: str, elem: str) -> Optional[Tuple[bytes, bytes]]:
    """(key, data) as the kernel stores an element of ``hairpin-ips`` or an ``endpoints-*``
    map (data b"" for a set, or a map element named by its key to delete it): the
    elements an endpoint change touches, written over netlink (kernel/nft_netlink.py).
    None for any other set: nft writes those. Concatenated fields are padded to 4 bytes;
    numgen's number is a host-order u32."""
    try:
        if where == HAIRPIN_IPS:
            a, b = elem.split(" . ")
            return ipaddress.ip_address(a.strip()).packed + ipaddress.ip_address(b.strip()).packed, b""
        if where.startswith(ENDPOINT_MAP_PREFIX):
            key, sep, data = elem.partition(" : ")
            k = struct.pack("=I", int(key))
            if not sep:
                return k, b""
            addr, port = data.split(" . ")
            return k, ipaddress.ip_address(addr.strip()).packed + struct.pack("!H", int(port)) + b"\0\0"
    except ValueError:
        return None
    return None


def element_key(elem: str) -> str:
    """A map element's key (a set element is its own key)."""
    return elem.split(" : ", 1)[0]


@dataclass
class Ownership:
    """Which service's element holds each key of the shared maps and sets. Two services
    claiming one key (the same external IP and port, an external IP that is another's
    cluster IP) would make nft refuse the whole transaction ("File exists"): the first
    service in name order keeps the key, the other is named in ``conflicts``."""

    owners: Dict[Tuple[str, str], str] = field(default_factory=dict)  # (map, key) -> service
    conflicts: Dict[str, str] = field(default_factory=dict)  # service -> why part of it is left out
    wanted_by_losers: Dict[Tuple[str, str], str] = field(default_factory=dict)  # (map, key) -> loser


def resolve(compiled: Dict[str, ServiceNft]) -> Tuple[Dict[str, List[str]], Ownership]:
    """Every service's elements by map or set, one per key (SHARED_ELEMENT_SETS are
    shared on purpose: deduplicated, not owned)."""
    own = Ownership()
    elements: Dict[str, List[str]] = {}
    shared: Dict[str, set] = {}
    for key in sorted(compiled):
        for where, elems in compiled[key].elements.items():
            if where in SHARED_ELEMENT_SETS:
                shared.setdefault(where, set()).update(elems)
                continue
            out = elements.setdefault(where, [])
            for e in elems:
                k = (where, element_key(e))
                owner = own.owners.get(k)
                if owner is None:
                    own.owners[k] = key
                    out.append(e)
                elif owner != key:
                    own.wanted_by_losers[k] = key
                    own.conflicts[key] = (f"Service {key}: {where} {k[1]} is already used by Service {owner}; "
                                          "that part of it is not programmed")
    for where, elems in shared.items():
        elements[where] = sorted(elems)
    return elements, own


def render_full(compiled: Dict[str, ServiceNft], cfg: NftablesConfig,
                resolved: Optional[Tuple[Dict[str, List[str]], Ownership]] = None) -> str:
    """The whole table as one ``nft -f`` transaction that replaces what is there (the
    ``add`` before the ``delete`` makes the delete valid on a node without the table).
    ``resolved``: resolve(compiled), when the caller has it already."""
    head = table_head(cfg)
    infra = infrastructure(cfg)
    lines = [f"add table {head}", f"delete table {head}",
             f'add table {head} {{ comment "rules for kube-proxy" ; }}']
    for name, decl in infra.sets.items():
        lines.append(f"add {set_kind(decl)} {head} {name} {{ {decl} }}")
    for name, decl in infra.chains.items():
        lines.append(f"add chain {head} {name}" + (f" {{ {decl} }}" if decl else ""))
    keys = sorted(compiled)
    for key in keys:  # declare every service chain and set first: rules reference them
        svc = compiled[key]
        for name, decl in svc.sets.items():
            lines.append(f"add {set_kind(decl)} {head} {name} {{ {decl} }}")
        for name in svc.chains:
            lines.append(f"add chain {head} {name}")
    for name, rules in infra.rules.items():
        for r in rules:
            lines.append(f"add rule {head} {name} {r}")
    for key in keys:
        for name, rules in compiled[key].chains.items():
            for r in rules:
                lines.append(f"add rule {head} {name} {r}")
    elements = dict((resolved or resolve(compiled))[0])
    for where, elems in infra.elements.items():
        elements[where] = list(elems) + elements.get(where, [])
    for where in sorted(elements):
        lines.extend(elements_text(head, "add", where, elements[where]))
    return "\n".join(lines) + "\n"


def kept_entries_text(head: str, sets: Dict[str, str], entries: Dict[str, List[Tuple[str, int]]]) -> str:
    """Affinity entries read before a full rewrite, re-added to the new table's sets of
    the same name (same service port and endpoint) with the time they had left, capped at
    the set's timeout now (the kernel refuses a longer expiry). ``sets``: name ->
    declaration, of the new table; ``entries``: name -> (address, ms left)."""
    lines: List[str] = []
    for name in sorted(entries):
        decl = sets.get(name)
        if decl is None or not entries[name]:
            continue
        m = re.search(r"timeout (\d+)s", decl)
        cap = int(m.group(1)) * 1000 if m else 0
        elems = [f"{addr} expires {min(ms, cap) if cap else ms}ms" for addr, ms in entries[name] if ms > 0]
        lines.extend(elements_text(head, "add", name, elems))
    return "\n".join(lines) + "\n" if lines else ""


def cleanup_text(cfg: NftablesConfig) -> str:
    head = table_head(cfg)
    return f"add table {head}\ndelete table {head}\n"


def count_objects(compiled: Dict[str, ServiceNft]) -> Tuple[int, int]:
    """(chains, rules) of the services."""
    chains = rules = 0
    for svc in compiled.values():
        chains += len(svc.chains)
        rules += svc.rule_count()
    return chains, rules
