# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure compiler for IPVS mode: services + endpoints + config -> the kernel state
upstream kube-proxy's IPVS proxier (pkg/proxy/ipvs/proxier.go) programs:

- the addresses on the ``kube-ipvs0`` dummy link (cluster IPs, and external/LB IPs that
  are not already node addresses);
- IPVS virtual services and their real servers (ClusterIP, each NodePort address,
  externalIPs, LoadBalancer ingress IPs), with upstream's endpoint selection
  (CategorizeEndpoints, internal/external traffic policy with the fall back to cluster
  endpoints when a policy-Local VS has no local endpoint, terminating endpoints);
- the contents of upstream's ipsets (names, types and entry syntax as upstream's
  ``utilipset.Entry.String()``);
- the iptables rules upstream keeps in IPVS mode, in the canonical form
  ``iptables-save`` prints, as ``{(table, chain): [rule, ...]}`` for the existing
  iptables planner (modes/iptables/plan.py);
- the sysctls IPVS mode needs.

Everything is computed per Service (``compile_service``) so a partial sync recompiles
only what changed; ``assemble`` merges the per-service results into the node's whole
desired state. No I/O and no clock in this module.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ... import names
from ...endpoints import categorize
from ...model import Endpoint, ServicePort

# Upstream's set names live in one table: names.py (data, no I/O).
from ...names import (
    KUBE_CLUSTER_IP,
    KUBE_EXTERNAL_IP,
    KUBE_EXTERNAL_IP_LOCAL,
    KUBE_HEALTH_CHECK_NODE_PORT,
    KUBE_IPSET_MATCHES,
    KUBE_IPSETS,
    KUBE_IPSETS_BY_NAME,
    KUBE_IPVS_IPS,
    KUBE_LOAD_BALANCER,
    KUBE_LOAD_BALANCER_FW,
    KUBE_LOAD_BALANCER_LOCAL,
    KUBE_LOAD_BALANCER_SOURCE_CIDR,
    KUBE_LOAD_BALANCER_SOURCE_IP,
    KUBE_LOOP_BACK,
    KUBE_NODE_PORT_LOCAL_SCTP,
    KUBE_NODE_PORT_LOCAL_TCP,
    KUBE_NODE_PORT_LOCAL_UDP,
    KUBE_NODE_PORT_SCTP,
    KUBE_NODE_PORT_TCP,
    KUBE_NODE_PORT_UDP,
    KubeIPSetSpec,
)
from .. import checked
from ..iptables.compile import FILTER, NAT, ChainKey, IptablesConfig, LocalDetector, _comment, _local_kw, rule

DUMMY_DEVICE = names.DUMMY_DEVICE  # ipvsc.DUMMY_DEVICE, for the proxier and tests
DEFAULT_SCHEDULER = "rr"

# Virtual service flags (include/uapi/linux/ip_vs.h; upstream utilipvs.Flag*).
FLAG_PERSISTENT = 0x1
FLAG_HASHED = 0x2
FLAG_SOURCE_HASH = 0x10  # IP_VS_SVC_F_SCHED2 (mh-port): upstream sets it for the "mh" scheduler

# --- ipsets (pkg/proxy/ipvs/ipset.go): names, types and comments are kernel/ipset_specs.py's

KUBE_LOAD_BALANCER_SET = KUBE_LOAD_BALANCER  # the set; KUBE_LOAD_BALANCER below is the chain
IPSET_BY_NAME: Dict[str, KubeIPSetSpec] = KUBE_IPSETS_BY_NAME
IPSET_NAMES: Tuple[str, ...] = tuple(s.name for s in KUBE_IPSETS)

_NODE_PORT_SETS = {"tcp": (KUBE_NODE_PORT_TCP, KUBE_NODE_PORT_LOCAL_TCP),
                   "udp": (KUBE_NODE_PORT_UDP, KUBE_NODE_PORT_LOCAL_UDP),
                   "sctp": (KUBE_NODE_PORT_SCTP, KUBE_NODE_PORT_LOCAL_SCTP)}

# --- iptables chains upstream keeps in IPVS mode ----------------------------------------

KUBE_SERVICES = "KUBE-SERVICES"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_NODE_PORT = "KUBE-NODE-PORT"
KUBE_LOAD_BALANCER = "KUBE-LOAD-BALANCER"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
KUBE_SOURCE_RANGES_FIREWALL = "KUBE-SOURCE-RANGES-FIREWALL"
KUBE_IPVS_FILTER = "KUBE-IPVS-FILTER"
KUBE_IPVS_OUT_FILTER = "KUBE-IPVS-OUT-FILTER"

CHAINS: Tuple[ChainKey, ...] = (
    (NAT, KUBE_SERVICES), (NAT, KUBE_POSTROUTING), (NAT, KUBE_NODE_PORT), (NAT, KUBE_LOAD_BALANCER),
    (NAT, KUBE_MARK_MASQ),
    (FILTER, KUBE_FORWARD), (FILTER, KUBE_NODE_PORT), (FILTER, KUBE_PROXY_FIREWALL),
    (FILTER, KUBE_SOURCE_RANGES_FIREWALL), (FILTER, KUBE_IPVS_FILTER), (FILTER, KUBE_IPVS_OUT_FILTER),
)
CHAIN_NAMES: FrozenSet[str] = frozenset(c for _t, c in CHAINS)

# (table, from, to, comment), in upstream's order; each is prepended like EnsureRule(Prepend).
JUMPS: Tuple[Tuple[str, str, str, str], ...] = (
    (NAT, "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
    (NAT, "PREROUTING", KUBE_SERVICES, "kubernetes service portals"),
    (NAT, "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules"),
    (FILTER, "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules"),
    (FILTER, "INPUT", KUBE_NODE_PORT, "kubernetes health check rules"),
    (FILTER, "INPUT", KUBE_PROXY_FIREWALL, "kube-proxy firewall rules"),
    (FILTER, "FORWARD", KUBE_PROXY_FIREWALL, "kube-proxy firewall rules"),
    (FILTER, "INPUT", KUBE_IPVS_FILTER, "kubernetes ipvs access filter"),
    (FILTER, "OUTPUT", KUBE_IPVS_OUT_FILTER, "kubernetes ipvs access filter"),
)

IP_PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "sctp": 132}

# --- sysctls ----------------------------------------------------------------------------------


def sysctls(strict_arp: bool = False) -> Dict[str, str]:
    """What upstream's NewProxier ensures (EnsureSysctl: set when different). conn_reuse_mode
    is set to 0 only on kernels older than 5.9 (upstream leaves it alone on fixed kernels,
    and cannot set it before 4.1): see :func:`conn_reuse_mode`."""
    out = {
        "net/ipv4/vs/conntrack": "1",
        "net/ipv4/vs/expire_nodest_conn": "1",
        "net/ipv4/vs/expire_quiescent_template": "1",
        "net/ipv4/ip_forward": "1",
    }
    if strict_arp:
        out["net/ipv4/conf/all/arp_ignore"] = "1"
        out["net/ipv4/conf/all/arp_announce"] = "2"
    return out


def conn_reuse_mode(kernel_release: str) -> Optional[str]:
    """The value upstream writes to net/ipv4/vs/conn_reuse_mode for this kernel, or None to
    leave it alone (< 4.1: not supported; >= 5.9: the 1-second delay bug is fixed)."""
    nums: List[int] = []
    for part in kernel_release.split("-", 1)[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits or 0))
    version = tuple(nums + [0] * (3 - len(nums)))
    if version < (4, 1, 0) or version >= (5, 9, 0):
        return None
    return "0"


# --- configuration and output types ---------------------------------------------------------


@dataclass(frozen=True)
class IpvsConfig:
    """What the compiler needs beyond the cluster objects (all resolved beforehand).

    ``iptables`` carries the settings IPVS mode shares with iptables mode (masquerade
    bit, masqueradeAll, local-traffic detection, random-fully)."""

    iptables: IptablesConfig = field(default_factory=IptablesConfig)
    scheduler: str = DEFAULT_SCHEDULER
    # This node's addresses except those on kube-ipvs0: an external or LB IP that is one of
    # them is not bound to kube-ipvs0 (upstream's nodeAddressSet).
    node_ips: Tuple[str, ...] = ()
    # The addresses NodePort virtual services are created on (nodePortAddresses resolved,
    # loopback and IPv6 link-local left out as upstream does).
    node_port_ips: Tuple[str, ...] = ()
    # Upstream's single nodeIP: an LB source range containing it lets the node reach the LB IP.
    primary_node_ip: str = ""
    exclude_cidrs: Tuple[str, ...] = ()  # virtual services in these ranges are never removed
    ipv6: bool = False
    strict_arp: bool = False
    tcp_timeout: float = 0.0
    tcp_fin_timeout: float = 0.0
    udp_timeout: float = 0.0

    @property
    def mark(self) -> str:
        return self.iptables.mark

    @property
    def flags(self) -> int:
        return FLAG_SOURCE_HASH if self.scheduler == "mh" else 0


@dataclass(frozen=True, order=True)
class RealServer:
    ip: str
    port: int
    weight: int = 1

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


VSKey = Tuple[str, str, int]  # (protocol "TCP"/"UDP"/"SCTP", address, port)


@dataclass(frozen=True, order=True)
class VirtualServer:
    protocol: str  # TCP, UDP or SCTP
    ip: str
    port: int
    scheduler: str = DEFAULT_SCHEDULER
    flags: int = 0
    timeout: int = 0  # persistence timeout (ClientIP affinity), seconds

    @property
    def key(self) -> VSKey:
        return (self.protocol, self.ip, self.port)

    @property
    def persistent(self) -> bool:
        return bool(self.flags & FLAG_PERSISTENT)

    def __str__(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{host}:{self.port}/{self.protocol}"


@dataclass(frozen=True)
class Destination:
    """One virtual service with the real servers it should have (sorted)."""

    service: VirtualServer
    reals: Tuple[RealServer, ...]
    owner: str = ""  # the service port ("ns/name:port") it was compiled from


@dataclass(frozen=True)
class NoNodeAccess:
    """An LB IP:port whose source ranges do not contain the node: node-originated
    connections to it are dropped (KUBE-IPVS-OUT-FILTER)."""

    ip: str
    protocol: str  # lower case
    port: int


@dataclass
class ServiceIPVS:
    """One Service's whole contribution to the node's IPVS-mode state."""

    virtual_servers: Dict[VSKey, Destination] = field(default_factory=dict)
    addresses: Set[str] = field(default_factory=set)  # to bind on kube-ipvs0
    ipsets: Dict[str, Set[str]] = field(default_factory=dict)
    no_node_access: List[NoNodeAccess] = field(default_factory=list)
    endpoints: int = 0  # real servers over all virtual services
    no_endpoint_ports: int = 0
    health_check_node_port: int = 0

    def add_entry(self, set_name: str, entry: str) -> None:
        self.ipsets.setdefault(set_name, set()).add(entry)


@dataclass
class DesiredState:
    """The node's whole IPVS-mode kernel state."""

    virtual_servers: Dict[VSKey, Destination]
    addresses: FrozenSet[str]
    ipsets: Dict[str, FrozenSet[str]]
    rules: Dict[ChainKey, List[str]]
    sysctls: Dict[str, str]


# --- compile ------------------------------------------------------------------------------------


def _host(ip: str) -> str:
    return ip + ("/128" if ":" in ip else "/32")


def _real_servers(eps: Iterable[Endpoint]) -> Tuple[RealServer, ...]:
    return tuple(sorted({RealServer(ep.ip, ep.port) for ep in eps}, key=_rs_sort_key))


def _rs_sort_key(rs: RealServer) -> Tuple[bytes, int]:
    return (_packed(rs.ip), rs.port)


@functools.lru_cache(maxsize=1 << 16)
def _packed(ip: str) -> bytes:
    """Numeric order of addresses, IPv4 first (a hot path: ipaddress is 20x slower)."""
    if ":" in ip:
        return b"\x06" + socket.inet_pton(socket.AF_INET6, ip)
    return b"\x04" + socket.inet_pton(socket.AF_INET, ip)


def compile_service(ports: Sequence[ServicePort], endpoints: Mapping, cfg: IpvsConfig) -> ServiceIPVS:
    """``endpoints``: ServicePortName -> [Endpoint] (ProxyState.endpoints_for). Raises
    model.ValidationError for a field that cannot be written (modes/checked.py)."""
    out = ServiceIPVS()
    for i, sp in enumerate(ports):
        eps = list(endpoints.get(sp.name, []))
        # Refuse what cannot be an ipset entry or rule token (model.ValidationError): the
        # proxier leaves this service out and serves the others.
        checked.port_fields(sp, i)
        checked.endpoints(sp, eps)
        _compile_port(out, sp, eps, cfg)
    return out


def _compile_port(out: ServiceIPVS, svc: ServicePort, eps: List[Endpoint], cfg: IpvsConfig) -> None:
    proto = svc.protocol.lower()
    name = str(svc.name)
    cat = categorize(eps, svc)
    if not cat.has_any:
        out.no_endpoint_ports += 1

    # syncEndpoint: a policy-Local VS uses the local endpoints, or the cluster ones when
    # there is no local endpoint (kubernetes#97081: pods on the node keep working).
    def select(only_local: bool) -> Tuple[RealServer, ...]:
        if only_local and cat.local:
            return _real_servers(cat.local)
        return _real_servers(cat.cluster)

    internal = select(svc.internal_policy_local)
    external = select(svc.uses_external_local)
    flags = cfg.flags
    timeout = 0
    if svc.session_affinity_seconds:
        flags |= FLAG_PERSISTENT
        timeout = svc.session_affinity_seconds

    def add_vs(ip: str, port: int, reals: Tuple[RealServer, ...]) -> None:
        vs = VirtualServer(svc.protocol, ip, port, cfg.scheduler, flags, timeout)
        out.virtual_servers[vs.key] = Destination(vs, reals, name)
        out.endpoints += len(reals)

    # Hairpin: every local endpoint (whatever its state) talking to itself through a VIP.
    for ep in eps:
        if ep.is_local:
            out.add_entry(KUBE_LOOP_BACK, f"{ep.ip},{proto}:{ep.port},{ep.ip}")

    # ClusterIP: always bound to kube-ipvs0.
    out.add_entry(KUBE_CLUSTER_IP, f"{svc.cluster_ip},{proto}:{svc.port}")
    add_vs(svc.cluster_ip, svc.port, internal)
    out.addresses.add(svc.cluster_ip)

    node_ips = set(cfg.node_ips)
    for ip in svc.external_ips:
        out.add_entry(KUBE_EXTERNAL_IP_LOCAL if svc.uses_external_local else KUBE_EXTERNAL_IP,
                      f"{ip},{proto}:{svc.port}")
        add_vs(ip, svc.port, external)
        if ip not in node_ips:  # never steal an address another interface holds
            out.addresses.add(ip)

    for ip in svc.load_balancer_ips:
        entry = f"{ip},{proto}:{svc.port}"
        out.add_entry(KUBE_LOAD_BALANCER_SET, entry)
        if svc.uses_external_local:
            out.add_entry(KUBE_LOAD_BALANCER_LOCAL, entry)
        if svc.load_balancer_source_ranges:
            out.add_entry(KUBE_LOAD_BALANCER_FW, entry)
            allow_from_node = False
            for cidr in svc.load_balancer_source_ranges:
                out.add_entry(KUBE_LOAD_BALANCER_SOURCE_CIDR, f"{ip},{proto}:{svc.port},{cidr}")
                if cfg.primary_node_ip and _contains(cidr, cfg.primary_node_ip):
                    allow_from_node = True
            if allow_from_node:
                # The node reaches its own LB IP with the LB IP as source (it is local).
                out.add_entry(KUBE_LOAD_BALANCER_SOURCE_IP, f"{ip},{proto}:{svc.port},{ip}")
            else:
                out.no_node_access.append(NoNodeAccess(ip, proto, svc.port))
        add_vs(ip, svc.port, external)
        if ip not in node_ips:
            out.addresses.add(ip)

    if svc.node_port:
        if not cfg.node_port_ips:
            # Upstream skips the rest of this service port (health check port included)
            # when it found no node address to put NodePorts on.
            return
        masq_set, local_set = _NODE_PORT_SETS[proto]
        if proto == "sctp":
            entries = [f"{ip},{proto}:{svc.node_port}" for ip in cfg.node_port_ips]
        else:
            entries = [str(svc.node_port)]
        for entry in entries:
            out.add_entry(masq_set, entry)
            if svc.uses_external_local:
                out.add_entry(local_set, entry)
        for ip in cfg.node_port_ips:
            add_vs(ip, svc.node_port, external)

    if svc.health_check_node_port:
        out.add_entry(KUBE_HEALTH_CHECK_NODE_PORT, str(svc.health_check_node_port))
        out.health_check_node_port = svc.health_check_node_port


def _contains(cidr: str, ip: str) -> bool:
    net = ipaddress.ip_network(cidr, strict=False)
    addr = ipaddress.ip_address(ip)
    return addr.version == net.version and addr in net


# --- node-wide assembly -------------------------------------------------------------------------


@dataclass
class Delta:
    """What one update of the :class:`Aggregate` changed (for a partial sync)."""

    virtual_servers: Dict[VSKey, Optional[Destination]] = field(default_factory=dict)  # None: remove
    addresses_added: Set[str] = field(default_factory=set)
    addresses_removed: Set[str] = field(default_factory=set)
    entries_added: Dict[str, Set[str]] = field(default_factory=dict)
    entries_removed: Dict[str, Set[str]] = field(default_factory=dict)
    rules_inputs_changed: bool = False  # which sets are empty, or the no-node-access list

    @property
    def empty(self) -> bool:
        return not (self.virtual_servers or self.addresses_added or self.addresses_removed
                    or self.entries_added or self.entries_removed or self.rules_inputs_changed)


class Aggregate:
    """The node's desired state as the union of per-service results, kept incrementally:
    replacing one service's result costs that service's size, not the node's.

    Two services claiming the same virtual service (an external IP:port given to both):
    the smallest service key wins, as a full sync would decide."""

    def __init__(self) -> None:
        self.services: Dict[str, ServiceIPVS] = {}
        self._vs_owners: Dict[VSKey, Dict[str, Destination]] = {}
        self._addresses: Dict[str, int] = {}
        self._entries: Dict[str, Dict[str, int]] = {name: {} for name in IPSET_NAMES}
        self._no_access: Dict[NoNodeAccess, int] = {}

    # --- updates ------------------------------------------------------------------------

    def set(self, key: str, result: Optional[ServiceIPVS]) -> Delta:
        """Replace service ``key``'s contribution (None removes it)."""
        delta = Delta()
        before_nonempty = self.nonempty_sets()
        before_no_access = set(self._no_access)
        old = self.services.pop(key, None)
        touched_vs: Set[VSKey] = set()
        if old is not None:
            touched_vs |= set(old.virtual_servers)
            for vk in old.virtual_servers:
                owners = self._vs_owners.get(vk, {})
                owners.pop(key, None)
                if not owners:
                    self._vs_owners.pop(vk, None)
            for ip in old.addresses:
                self._count(self._addresses, ip, -1, delta.addresses_removed)
            for name, entries in old.ipsets.items():
                for e in entries:
                    self._count(self._entries[name], e, -1, delta.entries_removed.setdefault(name, set()))
            for na in old.no_node_access:
                self._count(self._no_access, na, -1, set())
        effective_before = {vk: self._effective_before(vk, key, old) for vk in touched_vs}
        if result is not None:
            self.services[key] = result
            touched_vs |= set(result.virtual_servers)
            for vk, dest in result.virtual_servers.items():
                self._vs_owners.setdefault(vk, {})[key] = dest
            for ip in result.addresses:
                self._count(self._addresses, ip, 1, delta.addresses_added)
            for name, entries in result.ipsets.items():
                for e in entries:
                    self._count(self._entries[name], e, 1, delta.entries_added.setdefault(name, set()))
            for na in result.no_node_access:
                self._count(self._no_access, na, 1, set())
        # An address or entry removed and added back within one update is no change.
        for ip in delta.addresses_added & delta.addresses_removed:
            delta.addresses_added.discard(ip)
            delta.addresses_removed.discard(ip)
        for name in set(delta.entries_added) | set(delta.entries_removed):
            added = delta.entries_added.get(name, set())
            removed = delta.entries_removed.get(name, set())
            both = added & removed
            added -= both
            removed -= both
            if not added:
                delta.entries_added.pop(name, None)
            if not removed:
                delta.entries_removed.pop(name, None)
        for vk in sorted(touched_vs):
            now = self.virtual_server(vk)
            was = effective_before.get(vk)
            if now != was:
                delta.virtual_servers[vk] = now
        delta.rules_inputs_changed = (self.nonempty_sets() != before_nonempty
                                      or set(self._no_access) != before_no_access)
        return delta

    def add(self, key: str, result: Optional[ServiceIPVS]) -> None:
        """:meth:`set` for a service not in the aggregate yet, without working out a
        :class:`Delta` (a full sync builds a fresh aggregate and needs none): the same
        counts, a fraction of the work."""
        if key in self.services:
            self.set(key, result)
            return
        if result is None:
            return
        self.services[key] = result
        for vk, dest in result.virtual_servers.items():
            self._vs_owners.setdefault(vk, {})[key] = dest
        addresses = self._addresses
        for ip in result.addresses:
            addresses[ip] = addresses.get(ip, 0) + 1
        for name, entries in result.ipsets.items():
            counts = self._entries[name]
            for e in entries:
                counts[e] = counts.get(e, 0) + 1
        for na in result.no_node_access:
            self._no_access[na] = self._no_access.get(na, 0) + 1

    def _effective_before(self, vk: VSKey, key: str, old: Optional[ServiceIPVS]) -> Optional[Destination]:
        owners = dict(self._vs_owners.get(vk, {}))
        if old is not None and vk in old.virtual_servers:
            owners[key] = old.virtual_servers[vk]
        return owners[min(owners)] if owners else None

    @staticmethod
    def _count(counts: Dict, item: object, step: int, changed: Set) -> None:
        n = counts.get(item, 0) + step
        if n > 0:
            counts[item] = n
            if n == 1 and step > 0:
                changed.add(item)
        else:
            counts.pop(item, None)
            changed.add(item)

    # --- views --------------------------------------------------------------------------

    def virtual_server(self, vk: VSKey) -> Optional[Destination]:
        owners = self._vs_owners.get(vk)
        return owners[min(owners)] if owners else None

    def virtual_servers(self) -> Dict[VSKey, Destination]:
        return {vk: owners[min(owners)] for vk, owners in self._vs_owners.items()}

    def addresses(self) -> FrozenSet[str]:
        return frozenset(self._addresses)

    def ipset_entries(self, name: str) -> FrozenSet[str]:
        if name == KUBE_IPVS_IPS:
            return frozenset(self._addresses)
        return frozenset(self._entries[name])

    def nonempty_sets(self) -> FrozenSet[str]:
        out = {name for name, entries in self._entries.items() if entries}
        if self._addresses:
            out.add(KUBE_IPVS_IPS)
        return frozenset(out)

    def no_node_access(self) -> List[NoNodeAccess]:
        return sorted(self._no_access, key=lambda n: (n.ip, n.protocol, n.port))

    def rules(self, cfg: IpvsConfig) -> Dict[ChainKey, List[str]]:
        return iptables_rules(cfg, self.nonempty_sets(), self.no_node_access())

    def desired(self, cfg: IpvsConfig) -> DesiredState:
        return DesiredState(
            virtual_servers=self.virtual_servers(), addresses=self.addresses(),
            ipsets={name: self.ipset_entries(name) for name in IPSET_NAMES},
            rules=self.rules(cfg), sysctls=sysctls(cfg.strict_arp),
        )


def assemble(compiled: Mapping[str, ServiceIPVS], cfg: IpvsConfig) -> DesiredState:
    """The node's whole desired state from every service's result."""
    agg = Aggregate()
    for key in sorted(compiled):
        agg.set(key, compiled[key])
    return agg.desired(cfg)


def _set_match(name: str, match: str) -> str:
    return f"-m set --match-set {name} {match}"


def _set_rule(set_name: str, match: str, target: str, proto: str = "") -> str:
    """``[-p proto] -m comment --comment "<set comment>" -m set --match-set <set> <match> -j
    <target>``: a protocol without a port match gets no ``-m <proto>`` in iptables-save."""
    head = f"-p {proto} " if proto else ""
    return f"{head}{_comment(IPSET_BY_NAME[set_name].comment)} {_set_match(set_name, match)} -j {target}"


Rules = Dict[ChainKey, List[str]]


def _add(out: Rules, table: str, chain: str, text: str) -> None:
    out.setdefault((table, chain), []).append(text)


def iptables_rules(cfg: IpvsConfig, nonempty: FrozenSet[str],
                   no_node_access: Sequence[NoNodeAccess] = ()) -> Rules:
    """Upstream's writeIptablesRules + createAndLinkKubeChain, as iptables-save prints them,
    in upstream's order (a chain's rules keep their order across the steps).

    ``nonempty``: the ipsets that have entries (rules for empty sets are left out, as
    upstream does). Built-in chains carry only our jump rules."""
    out: Rules = {key: [] for key in CHAINS}
    _add(out, NAT, KUBE_SERVICES, rule(src="::1/128" if cfg.ipv6 else "127.0.0.0/8", target="RETURN"))
    for m in KUBE_IPSET_MATCHES:  # upstream's ipsetWithIptablesChain, LOCAL sets first
        if m.set in nonempty:
            _add(out, m.table, m.chain, _set_rule(m.set, m.match, m.target, m.protocol))
    _cluster_ip_masquerade(out, cfg.iptables, nonempty)
    _external_ip_rules(out, nonempty)
    _add(out, NAT, KUBE_SERVICES, rule(matches=("-m addrtype --dst-type LOCAL",), target=KUBE_NODE_PORT))
    _add(out, NAT, KUBE_LOAD_BALANCER, rule(target=KUBE_MARK_MASQ))
    _add(out, FILTER, KUBE_SOURCE_RANGES_FIREWALL, rule(target="DROP"))
    _ipvs_out_filter(out, no_node_access)
    _accept_ipvs_traffic(out, nonempty)
    _forward_rules(out, cfg.mark)
    _ipvs_filter(out)
    _masquerade_chains(out, cfg.mark, cfg.iptables)
    for table, builtin, target, comment in JUMPS:
        _add(out, table, builtin, f"{_comment(comment)} -j {target}")
    return out


def _cluster_ip_masquerade(out: Rules, ipt: IptablesConfig, nonempty: FrozenSet[str]) -> None:
    """Masquerade traffic to a cluster IP that may leave the node again."""
    if KUBE_CLUSTER_IP not in nonempty:
        return
    comment = IPSET_BY_NAME[KUBE_CLUSTER_IP].comment
    detector = LocalDetector(ipt)
    if ipt.masquerade_all:
        _add(out, NAT, KUBE_SERVICES, rule(comment=comment, matches=(_set_match(KUBE_CLUSTER_IP, "dst,dst"),),
                                           target=KUBE_MARK_MASQ))
    elif detector.implemented:
        # Off-cluster traffic to a service VIP may leave the node again: masquerade it.
        _add(out, NAT, KUBE_SERVICES, rule(comment=comment, matches=(_set_match(KUBE_CLUSTER_IP, "dst,dst"),),
                                           target=KUBE_MARK_MASQ, **_local_kw(detector.if_not_local())))
    else:
        # No way to tell pod traffic: masquerade node-originated VIP -> VIP connections.
        _add(out, NAT, KUBE_SERVICES, rule(comment=comment, matches=(_set_match(KUBE_CLUSTER_IP, "src,dst"),),
                                           target=KUBE_MARK_MASQ))


def _external_ip_accept(out: Rules, set_name: str) -> None:
    head = (_set_match(set_name, "dst,dst"),)
    comment = IPSET_BY_NAME[set_name].comment
    # Off-machine traffic (not from a bridge port, not from a local process) is accepted
    # for the external IPs; so is traffic to an external IP that is a local address.
    _add(out, NAT, KUBE_SERVICES, rule(comment=comment, matches=head + (
        "-m physdev ! --physdev-is-in", "-m addrtype ! --src-type LOCAL"), target="ACCEPT"))
    _add(out, NAT, KUBE_SERVICES, rule(comment=comment, matches=head + ("-m addrtype --dst-type LOCAL",),
                                       target="ACCEPT"))


def _external_ip_rules(out: Rules, nonempty: FrozenSet[str]) -> None:
    """externalIPs: masquerade (Cluster policy), then accept off-node or node-local traffic."""
    if KUBE_EXTERNAL_IP in nonempty:
        _add(out, NAT, KUBE_SERVICES, rule(comment=IPSET_BY_NAME[KUBE_EXTERNAL_IP].comment,
                                           matches=(_set_match(KUBE_EXTERNAL_IP, "dst,dst"),), target=KUBE_MARK_MASQ))
        _external_ip_accept(out, KUBE_EXTERNAL_IP)
    if KUBE_EXTERNAL_IP_LOCAL in nonempty:
        _external_ip_accept(out, KUBE_EXTERNAL_IP_LOCAL)


def _ipvs_out_filter(out: Rules, no_node_access: Sequence[NoNodeAccess]) -> None:
    """KUBE-IPVS-OUT-FILTER: the node itself may not reach these VIPs (source ranges)."""
    seen: Set[NoNodeAccess] = set()
    for entry in no_node_access:
        if entry in seen:
            continue
        seen.add(entry)
        _add(out, FILTER, KUBE_IPVS_OUT_FILTER, rule(
            src=_host(entry.ip),
            # As iptables-save prints it (libxt_ipvs): numeric --vproto first, no /32 on --vaddr.
            matches=(f"-m ipvs --vproto {IP_PROTOCOL_NUMBERS[entry.protocol]} --vaddr {entry.ip} "
                     f"--vport {entry.port}",),
            target="DROP"))


def _accept_ipvs_traffic(out: Rules, nonempty: FrozenSet[str]) -> None:
    """acceptIPVSTraffic: must stay the last rules of KUBE-SERVICES."""
    for set_name in (KUBE_CLUSTER_IP, KUBE_LOAD_BALANCER_SET):
        if set_name in nonempty:
            _add(out, NAT, KUBE_SERVICES, rule(matches=(_set_match(set_name, "dst,dst"),), target="ACCEPT"))


def _forward_rules(out: Rules, mark: str) -> None:
    """KUBE-FORWARD (marked and established traffic) and the health check node ports."""
    _add(out, FILTER, KUBE_FORWARD, rule(comment="kubernetes forwarding rules",
                                         matches=(f"-m mark --mark {mark}/{mark}",), target="ACCEPT"))
    _add(out, FILTER, KUBE_FORWARD, rule(comment="kubernetes forwarding conntrack rule",
                                         matches=("-m conntrack --ctstate RELATED,ESTABLISHED",), target="ACCEPT"))
    _add(out, FILTER, KUBE_NODE_PORT, rule(comment=IPSET_BY_NAME[KUBE_HEALTH_CHECK_NODE_PORT].comment,
                                           matches=(_set_match(KUBE_HEALTH_CHECK_NODE_PORT, "dst"),), target="ACCEPT"))


def _ipvs_filter(out: Rules) -> None:
    """KUBE-IPVS-FILTER: only service ports may be reached through a VIP (kubernetes#72236)."""
    for set_name in (KUBE_LOAD_BALANCER_SET, KUBE_CLUSTER_IP, KUBE_EXTERNAL_IP, KUBE_EXTERNAL_IP_LOCAL):
        _add(out, FILTER, KUBE_IPVS_FILTER, rule(matches=(_set_match(set_name, "dst,dst"),), target="RETURN"))
    _add(out, FILTER, KUBE_IPVS_FILTER, rule(matches=(_set_match(KUBE_HEALTH_CHECK_NODE_PORT, "dst"),),
                                             target="RETURN"))
    _add(out, FILTER, KUBE_IPVS_FILTER, rule(matches=("-m conntrack --ctstate NEW", _set_match(KUBE_IPVS_IPS, "dst")),
                                             target="REJECT --reject-with icmp-port-unreachable"))


def _masquerade_chains(out: Rules, mark: str, ipt: IptablesConfig) -> None:
    """KUBE-POSTROUTING masquerades marked packets; KUBE-MARK-MASQ marks them."""
    _add(out, NAT, KUBE_POSTROUTING, rule(matches=(f"-m mark ! --mark {mark}/{mark}",), target="RETURN"))
    _add(out, NAT, KUBE_POSTROUTING, rule(target=f"MARK --set-xmark {mark}/0x0"))
    _add(out, NAT, KUBE_POSTROUTING, rule(comment="kubernetes service traffic requiring SNAT",
                                          target="MASQUERADE" + (" --random-fully" if ipt.masquerade_random_fully
                                                                 else "")))
    _add(out, NAT, KUBE_MARK_MASQ, rule(target=f"MARK --set-xmark {mark}/{mark}"))
