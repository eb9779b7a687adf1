# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""IPVS virtual services and real servers over netlink.

Three layers, usable separately:

* **model** (pure): :class:`VirtualServer` (a virtual service: protocol +
  address + port, or a firewall mark; scheduler, flags, persistence),
  :class:`RealServer` (a destination: address, port, forwarding method,
  weight, thresholds; and, as read from the kernel, its connection counts),
  :class:`ServiceState` (a virtual server with its real servers), and the
  conversions between names and kernel values (forwarding methods
  ``IP_VS_CONN_F_*``, scheduler flag names and bits, persistence netmasks).
* **planning** (pure): :func:`plan` turns the current and the desired
  services into a list of :class:`Op` (add/edit/delete service, add/edit/
  delete real server), including graceful removal of real servers: weight 0
  first, delete once their connections are gone or a timeout has passed -
  the pending removals are state the caller keeps between syncs
  (:attr:`Plan.pending`), like upstream kube-proxy's graceful termination
  manager. :func:`format_service` prints a service the way ``ipvsadm -Ln``
  does; ``str(op)`` prints an operation as ``ipvsadm`` arguments.
* **kernel** (I/O): :class:`IPVSKernel` lists everything (services, their
  real servers, connection counts), applies single operations (raising
  :class:`IPVSError`) or whole plans in batches (:meth:`IPVSKernel.apply`,
  reporting errors per operation), optionally in another network namespace.
  The wire format lives in :mod:`.ipvs_netlink`.

Defaults follow the kernel and ``ipvsadm``: scheduler ``wlc``, weight 1,
persistence netmask /32 (IPv4) or /128 (IPv6). The forwarding method default
of :class:`RealServer` is masquerading (what kube-proxy uses); ``ipvsadm``'s
is direct routing.

Kernel behaviour this relies on (net/netfilter/ipvs/ip_vs_ctl.c): a missing
scheduler is loaded on demand (``request_module("ip_vs_<name>")``) and
adding or editing a service with an unknown one fails with ENOENT; the
generic netlink family lookup loads ``ip_vs`` itself, and fails with ENOENT
when the kernel has no IPVS.

pyroute2 is only needed for ``netns`` (see :mod:`.ipvs_netlink`), and
imported only then: this module imports without it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import KernelError, Unavailable
from . import ipvs_netlink as nl
from . import ipvs_sockopt

# --------------------------------------------------------------------------
# constants (include/uapi/linux/ip_vs.h)

PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": 132}
PROTOCOL_NAMES = {number: name for name, number in PROTOCOLS.items()}

IP_VS_SVC_F_PERSISTENT = 0x0001
IP_VS_SVC_F_HASHED = 0x0002  # set by the kernel; never compared
IP_VS_SVC_F_ONEPACKET = 0x0004
IP_VS_SVC_F_SCHED1 = 0x0008
IP_VS_SVC_F_SCHED2 = 0x0010
IP_VS_SVC_F_SCHED3 = 0x0020
IP_VS_SVC_F_SCHED_SH_FALLBACK = IP_VS_SVC_F_SCHED1
IP_VS_SVC_F_SCHED_SH_PORT = IP_VS_SVC_F_SCHED2
IP_VS_SVC_F_SCHED_MH_FALLBACK = IP_VS_SVC_F_SCHED1
IP_VS_SVC_F_SCHED_MH_PORT = IP_VS_SVC_F_SCHED2
SCHED_FLAGS_MASK = IP_VS_SVC_F_SCHED1 | IP_VS_SVC_F_SCHED2 | IP_VS_SVC_F_SCHED3

IP_VS_CONN_F_MASQ = 0
IP_VS_CONN_F_LOCALNODE = 1
IP_VS_CONN_F_TUNNEL = 2
IP_VS_CONN_F_DROUTE = 3
IP_VS_CONN_F_BYPASS = 4
IP_VS_CONN_F_FWD_MASK = 0x7

TUNNEL_TYPES = {"ipip": 0, "gue": 1, "gre": 2}
TUNNEL_NAMES = {value: name for name, value in TUNNEL_TYPES.items()}

IPVS_DEFAULT_SCHEDULER = "wlc"
PERSISTENT_DEFAULT_TIMEOUT = 300  # ipvsadm -p without a value
# The schedulers of mainline Linux (module ip_vs_<name>).
SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos")

# Forwarding method names, as this code writes them, and their kernel values.
FORWARDING = {
    "masquerade": IP_VS_CONN_F_MASQ,
    "local": IP_VS_CONN_F_LOCALNODE,
    "tunnel": IP_VS_CONN_F_TUNNEL,
    "route": IP_VS_CONN_F_DROUTE,
    "bypass": IP_VS_CONN_F_BYPASS,
}
FORWARDING_NAMES = {value: name for name, value in FORWARDING.items()}
FORWARDING_ALIASES = {
    "masq": "masquerade", "nat": "masquerade", "m": "masquerade",
    "droute": "route", "direct": "route", "dr": "route", "gatewaying": "route", "g": "route",
    "ipip": "tunnel", "tun": "tunnel", "i": "tunnel",
}
IPVSADM_FORWARD = {"masquerade": "Masq", "local": "Local", "tunnel": "Tunnel", "route": "Route",
                   "bypass": "Bypass"}
IPVSADM_SWITCH = {"masquerade": "-m", "local": "-m", "tunnel": "-i", "route": "-g", "bypass": "-g"}

# Scheduler flag names (ipvsadm -b) and their bits.
SCHEDULER_FLAGS = {
    "flag-1": IP_VS_SVC_F_SCHED1,
    "flag-2": IP_VS_SVC_F_SCHED2,
    "flag-3": IP_VS_SVC_F_SCHED3,
    "sh-fallback": IP_VS_SVC_F_SCHED_SH_FALLBACK,
    "sh-port": IP_VS_SVC_F_SCHED_SH_PORT,
    "mh-fallback": IP_VS_SVC_F_SCHED_MH_FALLBACK,
    "mh-port": IP_VS_SVC_F_SCHED_MH_PORT,
}

MAX_WEIGHT = 0x7FFFFFFF  # the kernel's limit (ipvsadm allows 0..65535)
FAMILIES = (4, 6)
_AF = {4: socket.AF_INET, 6: socket.AF_INET6}

# Operation kinds (Op.kind)
ADD_SERVICE = "add-service"
EDIT_SERVICE = "edit-service"
DELETE_SERVICE = "delete-service"
ADD_DEST = "add-dest"
EDIT_DEST = "edit-dest"
DELETE_DEST = "delete-dest"
OP_KINDS = (DELETE_SERVICE, ADD_SERVICE, EDIT_SERVICE, DELETE_DEST, EDIT_DEST, ADD_DEST)

ServiceKey = Tuple[int, str, str, int, int]  # (family, protocol, address, port, fwmark)
DestKey = Tuple[int, str, int]  # (family, address, port)
PendingKey = Tuple[ServiceKey, DestKey]


# --------------------------------------------------------------------------
# errors


class IPVSError(KernelError):
    """An IPVS operation failed. ``code`` is the errno (0 if none)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class IPVSUnavailable(IPVSError, Unavailable):
    """The kernel has no IPVS, or IPVS cannot be reached (missing network
    namespace, pyroute2 missing for a namespace, no permission)."""


class SchedulerUnavailable(IPVSError):
    """The kernel has no module for the requested scheduler."""

    def __init__(self, scheduler: str, pe_name: str = "") -> None:
        what = f"scheduler {scheduler!r} is not available in this kernel (module ip_vs_{scheduler} not found)"
        if pe_name:
            what += f", or persistence engine {pe_name!r} (module ip_vs_pe_{pe_name})"
        super().__init__(what, errno.ENOENT)
        self.scheduler = scheduler


# --------------------------------------------------------------------------
# conversions


def _packed(address: str) -> Tuple[int, bytes]:
    """(family, packed address); ValueError like ipaddress's for anything else."""
    family = 6 if ":" in address else 4
    try:
        return family, socket.inet_pton(_AF[family], address)
    except (OSError, ValueError, TypeError):
        raise ValueError(f"{address!r} does not appear to be an IPv4 or IPv6 address") from None


def ip_family(address: str) -> int:
    return _packed(address)[0]


def canonical_ip(address: str) -> str:
    family, raw = _packed(address)
    return socket.inet_ntop(_AF[family], raw)


def protocol_name(value: Union[str, int]) -> str:
    """"TCP"/"UDP"/"SCTP" from a name (any case) or a protocol number."""
    if isinstance(value, int):
        if value not in PROTOCOL_NAMES:
            raise ValueError(f"unsupported protocol number {value}: TCP, UDP or SCTP")
        return PROTOCOL_NAMES[value]
    name = str(value).upper()
    if name not in PROTOCOLS:
        raise ValueError(f"unsupported protocol {value!r}: TCP, UDP or SCTP")
    return name


def forwarding_name(value: Union[str, int]) -> str:
    """The canonical forwarding method name ("masquerade", "route",
    "tunnel", "local", "bypass") from a name, an alias (masq, nat, droute,
    direct, dr, gatewaying, ipip, ...) or an ``IP_VS_CONN_F_*`` value."""
    if isinstance(value, int):
        method = value & IP_VS_CONN_F_FWD_MASK
        if method not in FORWARDING_NAMES:
            raise ValueError(f"unknown IPVS forwarding method {value}")
        return FORWARDING_NAMES[method]
    name = str(value).lower()
    name = FORWARDING_ALIASES.get(name, name)
    if name not in FORWARDING:
        raise ValueError(f"unknown forwarding method {value!r}: masquerade, route or tunnel")
    return name


def forwarding_value(value: Union[str, int]) -> int:
    """The ``IP_VS_CONN_F_*`` value of a forwarding method name or alias."""
    return FORWARDING[forwarding_name(value)]


def scheduler_flag_bits(names: Iterable[str], scheduler: str = "") -> int:
    """Bits of scheduler flag names (``flag-1``, ``sh-port``, ...). Like
    ipvsadm, ``sh-*`` flags need scheduler sh and ``mh-*`` flags mh."""
    bits = 0
    for name in names:
        key = str(name).lower()
        if key not in SCHEDULER_FLAGS:
            raise ValueError(f"unknown scheduler flag {name!r}: one of {', '.join(SCHEDULER_FLAGS)}")
        family = key.split("-", 1)[0]
        if family in ("sh", "mh") and scheduler and scheduler != family:
            raise ValueError(f"scheduler flag {key!r} needs scheduler {family!r}, not {scheduler!r}")
        bits |= SCHEDULER_FLAGS[key]
    return bits


def scheduler_flag_names(flags: int, scheduler: str = "") -> List[str]:
    """Names of the scheduler flag bits set in ``flags``, as ipvsadm prints
    them: sh-fallback/sh-port for sh, mh-fallback/mh-port for mh, flag-N
    otherwise."""
    names = []
    for i, bit in enumerate((IP_VS_SVC_F_SCHED1, IP_VS_SVC_F_SCHED2, IP_VS_SVC_F_SCHED3), start=1):
        if not flags & bit:
            continue
        if scheduler in ("sh", "mh") and i < 3:
            names.append(f"{scheduler}-{'fallback' if i == 1 else 'port'}")
        else:
            names.append(f"flag-{i}")
    return names


def parse_netmask(value: Union[str, int, None], family: int) -> int:
    """A persistence netmask as a prefix length: from a prefix length (24,
    "24", "/24") or, for IPv4, a dotted mask ("255.255.255.0"). None or ""
    is the full mask (/32, /128)."""
    full = 128 if family == 6 else 32
    if value is None or value == "":
        return full
    text = str(value).strip().lstrip("/")
    if text.isdigit():
        prefix = int(text)
    elif family == 4:
        try:
            prefix = ipaddress.IPv4Network(f"0.0.0.0/{text}").prefixlen
        except ValueError as exc:
            raise ValueError(f"invalid persistence netmask {value!r}: a prefix length or a contiguous "
                             "IPv4 mask like 255.255.255.0") from exc
    else:
        raise ValueError(f"invalid IPv6 persistence netmask {value!r}: a prefix length 1-128")
    low = 1 if family == 6 else 0
    if not low <= prefix <= full:
        raise ValueError(f"persistence netmask /{prefix} out of range {low}-{full} for IPv{family}")
    return prefix


def netmask_text(prefix: int, family: int) -> str:
    """IPv4: the dotted mask ("255.255.255.0"); IPv6: the prefix length."""
    if family == 6:
        return str(prefix)
    return str(ipaddress.IPv4Network(f"0.0.0.0/{prefix}").netmask)


def scheduler_available(name: str, release: Optional[str] = None, modules_root: str = "/lib/modules",
                        sys_module: str = "/sys/module") -> Optional[bool]:
    """Whether the kernel has scheduler ``name``: True if module
    ``ip_vs_<name>`` is loaded, built in, or installed for the running kernel
    (``modules.builtin``/``modules.dep``), False if those lists exist and do
    not name it, None if that cannot be told (no module lists, e.g. in a
    container). For check mode: a real run asks the kernel itself."""
    module = f"ip_vs_{name}"
    if os.path.isdir(os.path.join(sys_module, module)):
        return True
    base = os.path.join(modules_root, release or os.uname().release)
    seen = False
    for listing in ("modules.builtin", "modules.dep"):
        try:
            with open(os.path.join(base, listing), encoding="utf-8", errors="replace") as fh:
                lines = fh.read().splitlines()
        except OSError:
            continue
        seen = True
        for line in lines:
            stem = os.path.basename(line.split(":", 1)[0]).split(".ko", 1)[0].replace("-", "_")
            if stem == module:
                return True
    return False if seen else None


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# --------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class VirtualServer:
    """A virtual service: ``protocol`` + ``address`` + ``port``, or
    ``fwmark`` (then address "", port 0, protocol "").

    ``family`` is 4 or 6 (taken from the address; needed for fwmark services,
    default 4). ``flags`` holds ``IP_VS_SVC_F_*`` bits - persistence
    (:data:`IP_VS_SVC_F_PERSISTENT`), one-packet scheduling, the scheduler
    flags - never the kernel's own HASHED bit. ``timeout`` is the persistence
    timeout in seconds and ``netmask`` the persistence granularity as a
    prefix length (default: full). Use :func:`virtual_server` to build one
    from option-like values.
    """

    address: str = ""
    port: int = 0
    protocol: str = "TCP"
    fwmark: int = 0
    family: int = 0
    scheduler: str = IPVS_DEFAULT_SCHEDULER
    flags: int = 0
    timeout: int = 0
    netmask: int = -1
    pe_name: str = ""

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.fwmark:
            put(self, "address", "")
            put(self, "port", 0)
            put(self, "protocol", "")
            put(self, "family", self.family or 4)
        else:
            if not self.address:
                raise ValueError("a virtual server needs an address (or a fwmark)")
            family, raw = _packed(self.address)
            put(self, "address", socket.inet_ntop(_AF[family], raw))
            put(self, "family", family)
            put(self, "protocol", protocol_name(self.protocol))
        if self.family not in FAMILIES:
            raise ValueError(f"family must be 4 or 6, not {self.family!r}")
        put(self, "flags", int(self.flags) & ~IP_VS_SVC_F_HASHED)
        if self.netmask is None or self.netmask < 0:
            put(self, "netmask", 128 if self.family == 6 else 32)

    @property
    def key(self) -> ServiceKey:
        return (self.family, self.protocol, self.address, self.port, self.fwmark)

    @property
    def persistent(self) -> bool:
        return bool(self.flags & IP_VS_SVC_F_PERSISTENT)

    @property
    def scheduler_flags(self) -> List[str]:
        return scheduler_flag_names(self.flags, self.scheduler)

    def same_config(self, other: VirtualServer) -> bool:
        """Same key and same settings (what an edit would change)."""
        return (self.key == other.key and self.scheduler == other.scheduler and self.flags == other.flags
                and self.timeout == other.timeout and self.netmask == other.netmask
                and self.pe_name == other.pe_name)

    def validate(self) -> None:
        """Raise ValueError for what the kernel or ipvsadm would refuse."""
        if self.fwmark:
            if not 0 < self.fwmark <= 0xFFFFFFFF:
                raise ValueError(f"fwmark {self.fwmark} out of range 1-4294967295")
        else:
            if not 0 <= self.port <= 65535:
                raise ValueError(f"port {self.port} out of range 0-65535")
            if self.port == 0 and not self.persistent:
                raise ValueError("a port 0 virtual service must be persistent (ipvsadm: "
                                 "'Zero port specified for non-persistent service')")
        if not self.scheduler or len(self.scheduler) > 15 or not self.scheduler.isascii():
            raise ValueError(f"invalid scheduler name {self.scheduler!r}")
        if self.flags & IP_VS_SVC_F_ONEPACKET and not self.fwmark and self.protocol != "UDP":
            raise ValueError("one-packet scheduling is only for UDP virtual services")
        scheduler_flag_bits(self.scheduler_flags, self.scheduler)
        if self.timeout < 0:
            raise ValueError("persistence timeout must not be negative")
        parse_netmask(self.netmask, self.family)

    def __str__(self) -> str:
        if self.fwmark:
            return f"FWM {self.fwmark}" + (" IPv6" if self.family == 6 else "")
        return f"{self.protocol} {_hostport(self.address, self.port)}"

    def ipvsadm_args(self) -> str:
        """``-t|-u|--sctp-service ADDR:PORT`` or ``-f MARK [-6]``."""
        if self.fwmark:
            return f"-f {self.fwmark}" + (" -6" if self.family == 6 else "")
        switch = {"TCP": "-t", "UDP": "-u", "SCTP": "--sctp-service"}[self.protocol]
        return f"{switch} {_hostport(self.address, self.port)}"

    def as_dict(self) -> Dict[str, object]:
        return {
            "protocol": self.protocol.lower() if self.protocol else None,
            "address": self.address or None,
            "port": self.port if not self.fwmark else None,
            "fwmark": self.fwmark or None,
            "family": f"ipv{self.family}",
            "scheduler": self.scheduler,
            "scheduler_flags": self.scheduler_flags,
            "persistence_timeout": self.timeout if self.persistent else 0,
            "persistence_netmask": netmask_text(self.netmask, self.family),
            "flags": self.flags,
        }


@dataclass(frozen=True)
class RealServer:
    """A real server (destination) of a virtual service.

    ``port`` 0 means "the port the client connected to" (fwmark services).
    ``forwarding`` is a name accepted by :func:`forwarding_name`. ``weight`` 0
    quiesces the server (no new connections). ``u_threshold``/``l_threshold``
    are connection limits (0: none). ``tunnel_type`` (ipip, gue, gre),
    ``tunnel_port`` and ``tunnel_flags`` matter with tunnel forwarding only.
    The connection counts are filled in when read from the kernel and are
    ignored by comparisons.
    """

    address: str
    port: int = 0
    weight: int = 1
    forwarding: str = "masquerade"
    u_threshold: int = 0
    l_threshold: int = 0
    tunnel_type: str = "ipip"
    tunnel_port: int = 0
    tunnel_flags: int = 0
    family: int = 0
    active_connections: int = field(default=0, compare=False)
    inactive_connections: int = field(default=0, compare=False)
    persistent_connections: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        family, raw = _packed(self.address)
        put(self, "address", socket.inet_ntop(_AF[family], raw))
        put(self, "family", family)
        put(self, "forwarding", forwarding_name(self.forwarding))
        tunnel = self.tunnel_type
        if isinstance(tunnel, int):
            tunnel = TUNNEL_NAMES.get(tunnel, str(tunnel))
        tunnel = str(tunnel).lower()
        if tunnel not in TUNNEL_TYPES:
            raise ValueError(f"unknown tunnel type {self.tunnel_type!r}: ipip, gue or gre")
        put(self, "tunnel_type", tunnel)

    @property
    def key(self) -> DestKey:
        return (self.family, self.address, self.port)

    @property
    def connections(self) -> int:
        """Active + inactive connections (what graceful removal waits for)."""
        return self.active_connections + self.inactive_connections

    def same_config(self, other: RealServer) -> bool:
        """Same key and settings. The kernel may report masquerading to a
        local address as "local" forwarding: that counts as the same."""
        def method(rs: RealServer) -> str:
            return "masquerade" if rs.forwarding == "local" else rs.forwarding
        return (self.key == other.key and self.weight == other.weight and method(self) == method(other)
                and self.u_threshold == other.u_threshold and self.l_threshold == other.l_threshold
                and self._tunnel() == other._tunnel())

    def _tunnel(self) -> Tuple[str, int, int]:
        if self.forwarding != "tunnel":
            return ("ipip", 0, 0)
        return (self.tunnel_type, self.tunnel_port, self.tunnel_flags)

    def validate(self, service: Optional[VirtualServer] = None) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"real server {self}: port out of range 0-65535")
        if not 0 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"real server {self}: weight {self.weight} out of range 0-{MAX_WEIGHT}")
        if self.u_threshold < 0 or self.l_threshold < 0:
            raise ValueError(f"real server {self}: thresholds must not be negative")
        if self.l_threshold > self.u_threshold:
            raise ValueError(f"real server {self}: lower threshold {self.l_threshold} is above the upper "
                             f"threshold {self.u_threshold} (the kernel refuses it)")
        if service is None:
            return
        if self.family != service.family and self.forwarding != "tunnel":
            raise ValueError(f"real server {self}: an IPv{self.family} real server of an IPv{service.family} "
                             "service needs tunnel forwarding")
        if (not service.fwmark and self.forwarding in ("route", "tunnel") and self.port != service.port):
            raise ValueError(f"real server {self}: with {self.forwarding} forwarding the port must be the "
                             f"virtual port {service.port} (packets are not rewritten)")

    def __str__(self) -> str:
        return _hostport(self.address, self.port)

    def ipvsadm_args(self) -> str:
        text = f"-r {self} {IPVSADM_SWITCH[self.forwarding]} -w {self.weight}"
        if self.u_threshold:
            text += f" -x {self.u_threshold}"
        if self.l_threshold:
            text += f" -y {self.l_threshold}"
        if self.forwarding == "tunnel" and self.tunnel_type != "ipip":
            text += f" --tun-type {self.tunnel_type}"
            if self.tunnel_port:
                text += f" --tun-port {self.tunnel_port}"
        return text

    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {
            "address": self.address, "port": self.port, "weight": self.weight, "forwarding": self.forwarding,
            "u_threshold": self.u_threshold, "l_threshold": self.l_threshold,
            "active_connections": self.active_connections, "inactive_connections": self.inactive_connections,
            "persistent_connections": self.persistent_connections,
        }
        if self.forwarding == "tunnel":
            out.update(tunnel_type=self.tunnel_type, tunnel_port=self.tunnel_port, tunnel_flags=self.tunnel_flags)
        return out


def virtual_server(protocol: str = "tcp", address: str = "", port: int = 0, fwmark: int = 0,
                   family: Union[int, str, None] = None, scheduler: str = IPVS_DEFAULT_SCHEDULER,
                   scheduler_flags: Sequence[str] = (), persistence_timeout: int = 0,
                   persistence_netmask: Union[str, int, None] = None, one_packet: bool = False,
                   pe_name: str = "") -> VirtualServer:
    """A :class:`VirtualServer` from option-like values: persistence is on
    when ``persistence_timeout`` > 0; flags from names; ``family`` 4/6 or
    "ipv4"/"ipv6" (fwmark services; otherwise from the address)."""
    if isinstance(family, str):
        family = int(family.lower().replace("ipv", ""))
    if not fwmark:
        fam = ip_family(address)
        if family and family != fam:
            raise ValueError(f"address {address} is not IPv{family}")
        family = fam
    family = family or 4
    flags = scheduler_flag_bits(scheduler_flags, scheduler)
    if persistence_timeout:
        flags |= IP_VS_SVC_F_PERSISTENT
    if one_packet:
        flags |= IP_VS_SVC_F_ONEPACKET
    vs = VirtualServer(address=address, port=port or 0, protocol=protocol or "TCP", fwmark=fwmark or 0,
                       family=family, scheduler=scheduler, flags=flags, timeout=persistence_timeout or 0,
                       netmask=parse_netmask(persistence_netmask, family), pe_name=pe_name or "")
    vs.validate()
    return vs


@dataclass(frozen=True)
class ServiceState:
    """A virtual server and its real servers."""

    virtual: VirtualServer
    real_servers: Tuple[RealServer, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "real_servers", tuple(self.real_servers))

    @property
    def key(self) -> ServiceKey:
        return self.virtual.key

    def real_server(self, key: DestKey) -> Optional[RealServer]:
        for rs in self.real_servers:
            if rs.key == key:
                return rs
        return None

    def validate(self) -> None:
        self.virtual.validate()
        seen = set()
        for rs in self.real_servers:
            if rs.key in seen:
                raise ValueError(f"{self.virtual}: real server {rs} is listed twice")
            seen.add(rs.key)
            rs.validate(self.virtual)

    def as_dicts(self) -> Tuple[Dict[str, object], List[Dict[str, object]]]:
        return self.virtual.as_dict(), [rs.as_dict() for rs in sort_real_servers(self.real_servers)]


def _ip_sort_key(family: int, address: str) -> Tuple[int, bytes]:
    return (family, _packed(address)[1] if address else b"")


def sort_real_servers(real_servers: Iterable[RealServer]) -> List[RealServer]:
    return sorted(real_servers, key=lambda rs: (*_ip_sort_key(rs.family, rs.address), rs.port))


def sort_services(services: Iterable[ServiceState]) -> List[ServiceState]:
    def key(s: ServiceState) -> Tuple[object, ...]:
        vs = s.virtual
        return (vs.fwmark > 0, vs.fwmark, *_ip_sort_key(vs.family, vs.address), vs.port, vs.protocol)
    return sorted(services, key=key)


# --------------------------------------------------------------------------
# operations and planning


@dataclass(frozen=True)
class Op:
    """One change: ``kind`` is one of :data:`OP_KINDS`; ``real_server`` is
    set for the *-dest kinds."""

    kind: str
    virtual: VirtualServer
    real_server: Optional[RealServer] = None

    def __str__(self) -> str:
        vs, rs = self.virtual, self.real_server
        if self.kind in (ADD_SERVICE, EDIT_SERVICE):
            text = f"{'-A' if self.kind == ADD_SERVICE else '-E'} {vs.ipvsadm_args()} -s {vs.scheduler}"
            if vs.scheduler_flags:
                text += f" -b {','.join(vs.scheduler_flags)}"
            if vs.persistent:
                text += f" -p {vs.timeout}"
                if vs.netmask != (128 if vs.family == 6 else 32):
                    text += f" -M {netmask_text(vs.netmask, vs.family)}"
            if vs.flags & IP_VS_SVC_F_ONEPACKET:
                text += " -o"
            return text
        if self.kind == DELETE_SERVICE:
            return f"-D {vs.ipvsadm_args()}"
        if rs is None:
            return f"{self.kind} {vs.ipvsadm_args()} (no real server)"
        if self.kind == DELETE_DEST:
            return f"-d {vs.ipvsadm_args()} -r {rs}"
        return f"{'-a' if self.kind == ADD_DEST else '-e'} {vs.ipvsadm_args()} {rs.ipvsadm_args()}"


@dataclass(frozen=True)
class Graceful:
    """How real servers are removed gracefully.

    A real server that has to go is first set to weight 0 (no new
    connections) and deleted once it has no active or inactive connections,
    or, if ``timeout`` is set, once that many seconds have passed since it
    was set to weight 0 (``None``: wait as long as it takes, like upstream).
    Real servers of services whose protocol is in ``immediate`` are deleted
    at once (upstream: UDP and SCTP, whose stale entries the kernel drops on
    the next packet with ``expire_nodest_conn``).
    """

    timeout: Optional[float] = None
    immediate: Tuple[str, ...] = ("UDP", "SCTP")


@dataclass
class Plan:
    """What :func:`plan` decided: the operations, in order, and the pending
    graceful removals to pass to the next call (key -> time when the real
    server was set to weight 0)."""

    ops: List[Op] = field(default_factory=list)
    pending: Dict[PendingKey, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.ops

    def __str__(self) -> str:
        return "\n".join(str(op) for op in self.ops)


def _removal(vs: VirtualServer, rs: RealServer, graceful: Optional[Graceful], started: Optional[float],
             now: float) -> Tuple[Optional[Op], Optional[float]]:
    """(operation, pending since) for a real server that has to go."""
    if graceful is None or vs.protocol in graceful.immediate or rs.connections == 0:
        return Op(DELETE_DEST, vs, rs), None
    since = now if started is None else started
    if graceful.timeout is not None and now - since >= graceful.timeout:
        return Op(DELETE_DEST, vs, rs), None
    if rs.weight != 0:
        return Op(EDIT_DEST, vs, replace(rs, weight=0)), since
    return None, since


def _delete_services(value: Union[bool, Callable[[VirtualServer], bool]], vs: VirtualServer) -> bool:
    return value(vs) if callable(value) else bool(value)


def plan(current: Iterable[ServiceState], desired: Iterable[ServiceState], *,
         delete_services: Union[bool, Callable[[VirtualServer], bool]] = True,
         purge_real_servers: bool = True, graceful: Optional[Graceful] = None,
         pending: Optional[Mapping[PendingKey, float]] = None, now: float = 0.0) -> Plan:
    """The operations that turn ``current`` (as listed from the kernel, with
    connection counts) into ``desired``. Pure: no I/O, no clock (``now`` is
    the caller's monotonic time, used with ``graceful`` and ``pending``).

    * A desired service that is missing is added with its real servers; one
      that differs in settings is edited; its real servers are added or
      edited as needed.
    * Real servers not desired are removed when ``purge_real_servers`` (else
      left alone): deleted at once without ``graceful``, otherwise see
      :class:`Graceful`. The returned :attr:`Plan.pending` is the state for
      the next call: real servers at weight 0 waiting for their connections.
      A pending real server that is desired again leaves the list (and gets
      its weight back through the normal edit); one that disappeared from
      the kernel leaves it too. Pending removals are processed for every
      current service, also those not in ``desired`` (partial syncs).
    * Current services not desired are deleted when ``delete_services`` is
      True or returns True for them (e.g. only services on our addresses).

    Order: service deletes, then per service (sorted): add/edit service,
    real server deletes, edits, adds.
    """
    pending = dict(pending or {})
    cur: Dict[ServiceKey, ServiceState] = {}
    for s in current:
        cur[s.key] = s
    want: Dict[ServiceKey, ServiceState] = {}
    for s in desired:
        if s.key in want:
            raise ValueError(f"virtual service {s.virtual} is desired twice")
        want[s.key] = s
    out = Plan()
    for s in sort_services(cur.values()):
        if s.key not in want and _delete_services(delete_services, s.virtual):
            out.ops.append(Op(DELETE_SERVICE, s.virtual))
    for s in sort_services(list(want.values()) + [c for k, c in cur.items() if k not in want]):
        have = cur.get(s.key)
        if s.key not in want:
            if _delete_services(delete_services, s.virtual):
                continue
            _process_pending(have, pending, graceful, now, out)
            continue
        target = want[s.key]
        if have is None:
            out.ops.append(Op(ADD_SERVICE, target.virtual))
            out.ops.extend(Op(ADD_DEST, target.virtual, rs) for rs in sort_real_servers(target.real_servers))
            continue
        if not target.virtual.same_config(have.virtual):
            out.ops.append(Op(EDIT_SERVICE, target.virtual))
        elif set(have.real_servers) == set(target.real_servers):
            continue  # every real server as wanted (the common case of a full sync): nothing to do
        wanted = {rs.key: rs for rs in target.real_servers}
        existing = {rs.key: rs for rs in have.real_servers}
        deletes: List[Op] = []
        edits: List[Op] = []
        adds: List[Op] = []
        for rs in sort_real_servers(have.real_servers):
            if rs.key in wanted:
                continue
            pkey = (s.key, rs.key)
            if not purge_real_servers and pkey not in pending:
                continue
            op, since = _removal(target.virtual, rs, graceful, pending.get(pkey), now)
            if op is not None:
                (deletes if op.kind == DELETE_DEST else edits).append(op)
            if since is not None:
                out.pending[pkey] = since
        for rs in sort_real_servers(target.real_servers):
            old = existing.get(rs.key)
            if old is None:
                adds.append(Op(ADD_DEST, target.virtual, rs))
            elif not rs.same_config(old):
                edits.append(Op(EDIT_DEST, target.virtual, rs))
        out.ops.extend(deletes + edits + adds)
    return out


def _process_pending(have: Optional[ServiceState], pending: Mapping[PendingKey, float],
                     graceful: Optional[Graceful], now: float, out: Plan) -> None:
    """Pending removals of a service the plan does not otherwise touch."""
    if have is None:
        return
    for rs in sort_real_servers(have.real_servers):
        pkey = (have.key, rs.key)
        if pkey not in pending:
            continue
        op, since = _removal(have.virtual, rs, graceful, pending[pkey], now)
        if op is not None:
            out.ops.append(op)
        if since is not None:
            out.pending[pkey] = since


def predict(current: Optional[ServiceState], ops: Iterable[Op]) -> Optional[ServiceState]:
    """The state of one service after ``ops`` (for check mode): real servers
    that stay keep their connection counts."""
    state = current
    for op in ops:
        if op.kind == DELETE_SERVICE:
            state = None
        elif op.kind == ADD_SERVICE:
            state = ServiceState(op.virtual, ())
        elif op.kind == EDIT_SERVICE and state is not None:
            state = ServiceState(op.virtual, state.real_servers)
        elif state is not None and op.real_server is not None:
            rs = op.real_server
            kept = [r for r in state.real_servers if r.key != rs.key]
            if op.kind != DELETE_DEST:
                old = state.real_server(rs.key)
                if old is not None:
                    rs = replace(rs, active_connections=old.active_connections,
                                 inactive_connections=old.inactive_connections,
                                 persistent_connections=old.persistent_connections)
                kept.append(rs)
            state = ServiceState(state.virtual, tuple(kept))
    return state


# --------------------------------------------------------------------------
# ipvsadm-like text

IPVSADM_TITLE = ("Prot LocalAddress:Port Scheduler Flags\n"
                 "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n")
IPVSADM_TITLE_NO_COUNTERS = ("Prot LocalAddress:Port Scheduler Flags\n"
                             "  -> RemoteAddress:Port           Forward Weight\n")


def format_service(state: ServiceState, counters: bool = True) -> str:
    """One service as ``ipvsadm -Ln`` prints it (real servers sorted), or
    without the connection counters (``counters=False``, for diffs)."""
    vs = state.virtual
    if vs.fwmark:
        line = f"FWM  {vs.fwmark}" + (" IPv6" if vs.family == 6 else "")
    else:
        line = f"{vs.protocol:<4} {_hostport(vs.address, vs.port)}"  # "TCP  10.0.0.1:80", "SCTP 10..."
    line += f" {vs.scheduler}"
    if vs.flags & SCHED_FLAGS_MASK:
        line += f" ({','.join(vs.scheduler_flags)})"
    if vs.persistent:
        line += f" persistent {vs.timeout}"
        if vs.netmask != (128 if vs.family == 6 else 32):
            line += f" mask {netmask_text(vs.netmask, vs.family)}"
        if vs.pe_name:
            line += f" pe {vs.pe_name}"
    if vs.flags & IP_VS_SVC_F_ONEPACKET:
        line += " ops"
    lines = [line]
    for rs in sort_real_servers(state.real_servers):
        forward = IPVSADM_FORWARD[rs.forwarding]
        if counters:
            lines.append(f"  -> {str(rs):<28} {forward:<7} {rs.weight:<6} {rs.active_connections:<10} "
                         f"{rs.inactive_connections:<10}".rstrip())
        else:
            lines.append(f"  -> {str(rs):<28} {forward:<7} {rs.weight}")
    return "\n".join(lines) + "\n"


def format_table(services: Iterable[ServiceState], counters: bool = True) -> str:
    """Services (sorted) under ipvsadm's column titles."""
    title = IPVSADM_TITLE if counters else IPVSADM_TITLE_NO_COUNTERS
    return title + "".join(format_service(s, counters) for s in sort_services(services))


# --------------------------------------------------------------------------
# kernel values <-> model


def _service_wire(vs: VirtualServer) -> Dict[str, object]:
    return {"family": vs.family, "fwmark": vs.fwmark, "protocol": PROTOCOLS.get(vs.protocol, 0),
            "address": vs.address, "port": vs.port, "scheduler": vs.scheduler, "flags": vs.flags,
            "timeout": vs.timeout, "netmask": vs.netmask, "pe_name": vs.pe_name}


def _dest_wire(rs: RealServer) -> Dict[str, object]:
    tunnel = rs.forwarding == "tunnel"
    return {"family": rs.family, "address": rs.address, "port": rs.port,
            "fwd_method": FORWARDING[rs.forwarding], "weight": rs.weight,
            "u_thresh": rs.u_threshold, "l_thresh": rs.l_threshold,
            "tun_type": TUNNEL_TYPES[rs.tunnel_type] if tunnel else 0,
            "tun_port": rs.tunnel_port if tunnel else 0, "tun_flags": rs.tunnel_flags if tunnel else 0}


def _trusted(cls: type, values: Dict[str, object]) -> object:
    """An instance of a frozen model class from values already in canonical form (read
    from the kernel: inet_ntop text, known names), without ``__post_init__``'s parsing,
    which was most of a 5,000-service listing's time under emulation. Equality and hashing
    are the dataclass's own, on the same fields."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def service_from_wire(values: Mapping[str, object]) -> VirtualServer:
    """A :class:`VirtualServer` from :func:`.ipvs_netlink.decode_service` values."""
    v: Dict[str, object] = dict(values)
    fwmark = _int(v["fwmark"])
    family = _int(v["family"])
    if family not in FAMILIES or not fwmark and not v["address"]:
        # not what a kernel sends: take the validating path (it raises with a reason)
        return VirtualServer(address=str(v["address"]), port=_int(v["port"]),
                             protocol=PROTOCOL_NAMES.get(_int(v["protocol"]), "TCP"), fwmark=fwmark,
                             family=family, scheduler=str(v["scheduler"]), flags=_int(v["flags"]),
                             timeout=_int(v["timeout"]), netmask=_int(v["netmask"]), pe_name=str(v["pe_name"]))
    return _trusted(VirtualServer, {  # type: ignore[return-value]
        "address": "" if fwmark else str(v["address"]), "port": 0 if fwmark else _int(v["port"]),
        "protocol": "" if fwmark else PROTOCOL_NAMES.get(_int(v["protocol"]), "TCP"), "fwmark": fwmark,
        "family": family, "scheduler": str(v["scheduler"]), "flags": _int(v["flags"]) & ~IP_VS_SVC_F_HASHED,
        "timeout": _int(v["timeout"]), "netmask": _int(v["netmask"]), "pe_name": str(v["pe_name"])})


def _service_from_attrs(attrs: Dict[int, bytes]) -> VirtualServer:
    """:func:`service_from_wire` of :func:`.ipvs_netlink.decode_service` in one step for
    the common case (an address service as the kernel sends it); the listing's hot path."""
    af, proto, addr, port, sched = (attrs.get(nl.IPVS_SVC_ATTR_AF), attrs.get(nl.IPVS_SVC_ATTR_PROTOCOL),
                                    attrs.get(nl.IPVS_SVC_ATTR_ADDR), attrs.get(nl.IPVS_SVC_ATTR_PORT),
                                    attrs.get(nl.IPVS_SVC_ATTR_SCHED_NAME))
    flags, timeout, mask = (attrs.get(nl.IPVS_SVC_ATTR_FLAGS), attrs.get(nl.IPVS_SVC_ATTR_TIMEOUT),
                            attrs.get(nl.IPVS_SVC_ATTR_NETMASK))
    if (nl.IPVS_SVC_ATTR_FWMARK in attrs or af is None or len(af) < 2 or proto is None or len(proto) < 2
            or addr is None or port is None or len(port) < 2 or sched is None or flags is None
            or len(flags) < 8 or timeout is None or len(timeout) < 4 or mask is None or len(mask) < 4):
        return service_from_wire(nl.decode_service(attrs))
    family = _AF_FAMILY.get(int.from_bytes(af[:2], sys.byteorder))
    protocol = PROTOCOL_NAMES.get(int.from_bytes(proto[:2], sys.byteorder))
    if family is None or protocol is None:
        return service_from_wire(nl.decode_service(attrs))
    if family == 4:
        address = socket.inet_ntoa(addr[:4])
        netmask = 32 - (~int.from_bytes(mask[:4], "big") & 0xFFFFFFFF).bit_length()
    else:
        address = socket.inet_ntop(socket.AF_INET6, addr[:16])
        netmask = int.from_bytes(mask[:4], sys.byteorder)
    pe_name = attrs.get(nl.IPVS_SVC_ATTR_PE_NAME)
    return _trusted(VirtualServer, {  # type: ignore[return-value]
        "address": address, "port": port[0] << 8 | port[1], "protocol": protocol, "fwmark": 0, "family": family,
        "scheduler": sched.split(b"\0", 1)[0].decode("ascii", "replace"),
        "flags": int.from_bytes(flags[:4], sys.byteorder) & ~IP_VS_SVC_F_HASHED,
        "timeout": int.from_bytes(timeout[:4], sys.byteorder), "netmask": netmask,
        "pe_name": pe_name.split(b"\0", 1)[0].decode("ascii", "replace") if pe_name else ""})


_AF_FAMILY = {socket.AF_INET: 4, socket.AF_INET6: 6}


def _real_server(family: int, address: str, port: int, fwd_method: int, weight: int, u_thresh: int,
                 l_thresh: int, active: int, inactive: int, persistent: int, tun_type: int = 0, tun_port: int = 0,
                 tun_flags: int = 0) -> RealServer:
    """A :class:`RealServer` from kernel values (``address`` as inet_ntop wrote it)."""
    return _trusted(RealServer, {  # type: ignore[return-value]
        "address": address, "port": port, "weight": weight,
        "forwarding": FORWARDING_NAMES.get(fwd_method & IP_VS_CONN_F_FWD_MASK, "masquerade"),
        "u_threshold": u_thresh, "l_threshold": l_thresh, "tunnel_type": TUNNEL_NAMES.get(tun_type, "ipip"),
        "tunnel_port": tun_port, "tunnel_flags": tun_flags, "family": family, "active_connections": active,
        "inactive_connections": inactive, "persistent_connections": persistent})


def dest_from_wire(values: Mapping[str, object]) -> RealServer:
    """A :class:`RealServer` from :func:`.ipvs_netlink.decode_dest` values."""
    v: Dict[str, object] = dict(values)
    if _int(v["family"]) not in FAMILIES or not v["address"]:
        raise ValueError(f"IPVS destination without a usable address: {v!r}")
    return _real_server(_int(v["family"]), str(v["address"]), _int(v["port"]), _int(v["fwd_method"]),
                        _int(v["weight"]), _int(v["u_thresh"]), _int(v["l_thresh"]), _int(v["active_conns"]),
                        _int(v["inact_conns"]), _int(v["persist_conns"]), _int(v.get("tun_type", 0)),
                        _int(v.get("tun_port", 0)), _int(v.get("tun_flags", 0)))


def _int(value: object) -> int:
    return int(value)  # type: ignore[call-overload]


def op_payload(op: Op) -> bytes:
    """The generic netlink payload (command + attributes) of an operation."""
    svc = _service_wire(op.virtual)
    if op.kind == ADD_SERVICE:
        return nl.genl_payload(nl.IPVS_CMD_NEW_SERVICE, nl.service_attrs(svc, full=True))
    if op.kind == EDIT_SERVICE:
        return nl.genl_payload(nl.IPVS_CMD_SET_SERVICE, nl.service_attrs(svc, full=True))
    if op.kind == DELETE_SERVICE:
        return nl.genl_payload(nl.IPVS_CMD_DEL_SERVICE, nl.service_attrs(svc, full=False))
    if op.real_server is None:
        raise ValueError(f"{op.kind} needs a real server")
    dest = _dest_wire(op.real_server)
    cmd = {ADD_DEST: nl.IPVS_CMD_NEW_DEST, EDIT_DEST: nl.IPVS_CMD_SET_DEST, DELETE_DEST: nl.IPVS_CMD_DEL_DEST}
    if op.kind not in cmd:
        raise ValueError(f"unknown operation {op.kind!r}")
    return nl.genl_payload(cmd[op.kind], nl.service_attrs(svc, full=False)
                           + nl.dest_attrs(dest, full=op.kind != DELETE_DEST))


def explain(op: Op, code: int) -> IPVSError:
    """An :class:`IPVSError` for an operation the kernel refused with ``code``."""
    vs, rs = op.virtual, op.real_server
    if op.kind in (ADD_SERVICE, EDIT_SERVICE) and code == errno.ENOENT:
        return SchedulerUnavailable(vs.scheduler, vs.pe_name)
    messages = {
        (ADD_SERVICE, errno.EEXIST): f"virtual service {vs} already exists",
        (EDIT_SERVICE, errno.ESRCH): f"virtual service {vs} does not exist",
        (DELETE_SERVICE, errno.ESRCH): f"virtual service {vs} does not exist",
        (ADD_DEST, errno.ESRCH): f"virtual service {vs} does not exist",
        (EDIT_DEST, errno.ESRCH): f"virtual service {vs} does not exist",
        (DELETE_DEST, errno.ESRCH): f"virtual service {vs} does not exist",
        (ADD_DEST, errno.EEXIST): f"real server {rs} of {vs} already exists",
        (EDIT_DEST, errno.ENOENT): f"real server {rs} of {vs} does not exist",
        (DELETE_DEST, errno.ENOENT): f"real server {rs} of {vs} does not exist",
        (ADD_DEST, errno.EINVAL): f"real server {rs} of {vs}: invalid (the kernel takes only unicast or local "
                                  "real server addresses; in a network namespace with no address at all, "
                                  "not even lo up, every address counts as broadcast)",
        (ADD_DEST, errno.ERANGE): f"real server {rs} of {vs}: weight or thresholds out of range",
        (EDIT_DEST, errno.ERANGE): f"real server {rs} of {vs}: weight or thresholds out of range",
    }
    detail = messages.get((op.kind, code))
    if detail is None:
        detail = os.strerror(code)
        if code == errno.EPERM:
            detail += " (IPVS needs CAP_NET_ADMIN)"
        detail = f"ipvsadm {op}: {detail}"
    return IPVSError(detail, code)


@dataclass
class ApplyResult:
    """Outcome of :meth:`IPVSKernel.apply`: operations done, and the failed
    ones with their errors (later operations still ran)."""

    applied: int = 0
    errors: List[Tuple[Op, IPVSError]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0][1]


class IPVSKernel:
    """IPVS in one network namespace ("" = this process's), over generic
    netlink. Opens its socket on first use; :meth:`close` (or ``with``)
    closes it. One thread at a time.

    Raises :class:`IPVSUnavailable` when the kernel has no IPVS ("kernel has
    no IPVS (modprobe ip_vs)"), the namespace does not exist, or pyroute2 is
    missing for a namespace; :class:`IPVSError` for refused operations
    (:class:`SchedulerUnavailable` for a scheduler the kernel lacks).
    """

    def __init__(self, netns: str = "", timeout: float = nl.DEFAULT_TIMEOUT,
                 batch_size: int = nl.DEFAULT_BATCH) -> None:
        self.netns = netns
        self.timeout = timeout
        self.batch_size = batch_size
        self._conn: Optional[nl.GenlConnection] = None
        self._sockopt: Optional[ipvs_sockopt.SockoptReader] = None
        self._sockopt_failed = False  # tried once and it cannot work here: netlink alone

    def __enter__(self) -> IPVSKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._close_sockopt()

    def _close_sockopt(self) -> None:
        if self._sockopt is not None:
            self._sockopt.sock.close()
            self._sockopt = None

    def _where(self) -> str:
        return f" in network namespace {self.netns}" if self.netns else ""

    @property
    def conn(self) -> nl.GenlConnection:
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _open(self) -> nl.GenlConnection:
        try:
            return nl.GenlConnection(self.netns, self.timeout)
        except nl.Pyroute2Missing as exc:
            raise IPVSUnavailable(str(exc)) from exc
        except nl.NetlinkError as exc:
            if exc.errno == errno.ENOENT:
                raise IPVSUnavailable(f"kernel has no IPVS (modprobe ip_vs){self._where()}",
                                      exc.errno) from exc
            raise IPVSUnavailable(f"cannot reach IPVS{self._where()}: {exc}", exc.errno or 0) from exc
        except FileNotFoundError as exc:
            raise IPVSUnavailable(f"network namespace {self.netns!r} does not exist", errno.ENOENT) from exc
        except OSError as exc:
            raise IPVSUnavailable(f"cannot open a generic netlink socket{self._where()}: {exc}",
                                  exc.errno or 0) from exc

    def _dump(self, cmd: int, attrs: bytes = b"") -> List[Dict[int, bytes]]:
        try:
            return self.conn.dump(cmd, attrs)
        except nl.NetlinkError as exc:
            raise IPVSError(f"listing IPVS{self._where()} failed: {exc}", exc.errno or 0) from exc

    # -- reading

    def virtual_servers(self) -> List[VirtualServer]:
        """Every virtual service (without real servers)."""
        out = []
        for attrs in self._dump(nl.IPVS_CMD_GET_SERVICE):
            raw = attrs.get(nl.IPVS_CMD_ATTR_SERVICE)
            if raw is not None:
                out.append(_service_from_attrs(nl.parse_attrs(raw)))
        return out

    def real_servers(self, vs: VirtualServer) -> List[RealServer]:
        """The real servers of one virtual service, with connection counts
        (empty if the service does not exist)."""
        attrs = nl.service_attrs(_service_wire(vs), full=False)
        out = []
        for answer in self._dump(nl.IPVS_CMD_GET_DEST, attrs):
            raw = answer.get(nl.IPVS_CMD_ATTR_DEST)
            if raw is not None:
                out.append(dest_from_wire(nl.decode_dest(nl.parse_attrs(raw), vs.family)))
        return out

    def services(self) -> List[ServiceState]:
        """Everything: every virtual service with its real servers. The services come from
        one netlink dump; the real servers of IPv4 services from one ``getsockopt`` each
        (see :mod:`.ipvs_sockopt`: netlink needs a dump per service, three system calls
        and ~0.3 ms of kernel time each under emulation); IPv6 services, tunnel real
        servers, mixed-family pools and anything that changed in between are read over
        netlink, per service, as :meth:`services_each` reads all of them."""
        vss = self.virtual_servers()
        fast = self._ipv4_real_servers(vss)
        return [ServiceState(vs, fast[vs.key]) if vs.key in fast else ServiceState(vs, tuple(self.real_servers(vs)))
                for vs in vss]

    def services_each(self) -> List[ServiceState]:
        """:meth:`services` over netlink alone: one GET_DEST dump per service (the slow
        path; kept for comparison and as the reference the fast listing must equal)."""
        return [ServiceState(vs, tuple(self.real_servers(vs))) for vs in self.virtual_servers()]

    def _sockopt_reader(self) -> Optional[ipvs_sockopt.SockoptReader]:
        if self._sockopt is None and not self._sockopt_failed:
            sock = None
            try:
                sock = ipvs_sockopt.open_socket(self.netns)
                self._sockopt = ipvs_sockopt.SockoptReader(sock)
            except (OSError, ImportError):  # SockoptUnavailable is an OSError
                self._sockopt_failed = True
                if sock is not None:
                    sock.close()
        return self._sockopt

    def _ipv4_real_servers(self, vss: Sequence[VirtualServer]) -> Dict[ServiceKey, Tuple[RealServer, ...]]:
        """Real servers of the IPv4 services the getsockopt interface shows exactly: the
        number it returns equals the service's destination count (one spare slot shows a
        destination added since the count), and none tunnels (no tunnel parameters
        there). Services left out are read over netlink."""
        out: Dict[ServiceKey, Tuple[RealServer, ...]] = {}
        if not any(vs.family == 4 for vs in vss):
            return out
        reader = self._sockopt_reader()
        if reader is None:
            return out
        zero_addr, zero_port = b"\0" * 4, b"\0\0"
        new, ntoa = object.__new__, socket.inet_ntoa
        try:
            counts = reader.service_counts(reader.info()[2] + 16)  # slack for services added meanwhile
            for vs in vss:
                if vs.family != 4:
                    continue
                if vs.fwmark:
                    key = (0, zero_addr, zero_port, vs.fwmark)
                else:
                    key = (PROTOCOLS[vs.protocol], socket.inet_aton(vs.address), vs.port.to_bytes(2, "big"), 0)
                count = counts.get(key)
                if count is None:
                    continue
                entries = reader.dests(*key, capacity=count + 1)
                if entries is None or len(entries) != count:
                    continue
                reals = []
                for addr, port, flags, weight, u_th, l_th, active, inactive, persistent in entries:
                    method = flags & IP_VS_CONN_F_FWD_MASK
                    if method == IP_VS_CONN_F_TUNNEL:
                        break  # tunnel parameters are not in this interface: netlink
                    obj = new(RealServer)
                    obj.__dict__.update({  # as _real_server(), inlined: 15,000 calls at 5,000 services
                        "address": ntoa(addr), "port": port[0] << 8 | port[1], "weight": weight,
                        "forwarding": FORWARDING_NAMES.get(method, "masquerade"), "u_threshold": u_th,
                        "l_threshold": l_th, "tunnel_type": "ipip", "tunnel_port": 0, "tunnel_flags": 0,
                        "family": 4, "active_connections": active, "inactive_connections": inactive,
                        "persistent_connections": persistent})
                    reals.append(obj)
                else:
                    out[vs.key] = tuple(reals)
        except OSError:
            self._close_sockopt()  # what was read stays good; the rest goes over netlink
            self._sockopt_failed = True
        return out

    def get(self, vs: VirtualServer) -> Optional[ServiceState]:
        """One virtual service (looked up by its key) with its real servers,
        or None."""
        try:
            attrs = self.conn.get(nl.IPVS_CMD_GET_SERVICE, nl.service_attrs(_service_wire(vs), full=False))
        except nl.NetlinkError as exc:
            if exc.errno == errno.ESRCH:
                return None
            raise IPVSError(f"reading {vs}{self._where()} failed: {exc}", exc.errno or 0) from exc
        raw = attrs.get(nl.IPVS_CMD_ATTR_SERVICE)
        if raw is None:
            return None
        found = service_from_wire(nl.decode_service(nl.parse_attrs(raw)))
        return ServiceState(found, tuple(self.real_servers(found)))

    def info(self) -> Tuple[str, int]:
        """(IPVS version "1.2.1", connection table size)."""
        attrs = self.conn.get(nl.IPVS_CMD_GET_INFO)
        version = nl._u32(attrs.get(nl.IPVS_INFO_ATTR_VERSION))
        size = nl._u32(attrs.get(nl.IPVS_INFO_ATTR_CONN_TAB_SIZE))
        return f"{version >> 16}.{(version >> 8) & 0xFF}.{version & 0xFF}", size

    def timeouts(self) -> Tuple[int, int, int]:
        """The connection timeouts (tcp, tcpfin, udp) in seconds (``ipvsadm -L --timeout``)."""
        try:
            attrs = self.conn.get(nl.IPVS_CMD_GET_CONFIG)
        except nl.NetlinkError as exc:
            raise IPVSError(f"reading IPVS timeouts{self._where()} failed: {exc}", exc.errno or 0) from exc
        return nl.decode_timeouts(attrs)

    # -- writing

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        """Set the connection timeouts in seconds (``ipvsadm --set TCP TCPFIN UDP``, over
        netlink: IPVS_CMD_SET_CONFIG); 0 keeps that timeout's value."""
        values = (int(tcp), int(tcp_fin), int(udp))
        if any(v < 0 or v > 0xFFFFFFFF for v in values):  # the kernel checks the rest (INT_MAX / HZ)
            raise ValueError(f"IPVS timeouts out of range: {values}")
        try:
            codes = self.conn.request_batch([nl.genl_payload(nl.IPVS_CMD_SET_CONFIG, nl.timeout_attrs(*values))])
        except nl.NetlinkError as exc:
            raise IPVSError(f"setting IPVS timeouts{self._where()} failed: {exc}", exc.errno or 0) from exc
        if codes[0]:
            raise IPVSError(f"setting IPVS timeouts {values}{self._where()} failed: {os.strerror(codes[0])}",
                            codes[0])

    def apply(self, ops: Sequence[Op]) -> ApplyResult:
        """Apply operations in order, batched (one datagram per
        ``batch_size`` operations, one ack each). Never raises for refused
        operations: they are in :attr:`ApplyResult.errors` and the following
        operations still run (an ``add-dest`` after a failed ``add-service``
        then fails too). Raises :class:`IPVSError` if the kernel cannot be
        reached."""
        result = ApplyResult()
        if not ops:
            return result
        payloads = [op_payload(op) for op in ops]
        try:
            codes = self.conn.request_batch(payloads, self.batch_size)
        except nl.NetlinkError as exc:
            raise IPVSError(f"IPVS{self._where()}: {exc}", exc.errno or 0) from exc
        except OSError as exc:
            self.close()  # the socket's state is unknown now
            raise IPVSError(f"IPVS{self._where()}: netlink I/O failed: {exc}", exc.errno or 0) from exc
        for op, code in zip(ops, codes):
            if code:
                result.errors.append((op, explain(op, code)))
            else:
                result.applied += 1
        return result

    def _one(self, op: Op) -> None:
        self.apply([op]).raise_first()

    def add_service(self, vs: VirtualServer) -> None:
        self._one(Op(ADD_SERVICE, vs))

    def edit_service(self, vs: VirtualServer) -> None:
        self._one(Op(EDIT_SERVICE, vs))

    def delete_service(self, vs: VirtualServer) -> None:
        self._one(Op(DELETE_SERVICE, vs))

    def add_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        self._one(Op(ADD_DEST, vs, rs))

    def edit_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        self._one(Op(EDIT_DEST, vs, rs))

    def delete_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        self._one(Op(DELETE_DEST, vs, rs))

    def flush(self) -> None:
        """Delete every virtual service (``ipvsadm -C``)."""
        try:
            codes = self.conn.request_batch([nl.genl_payload(nl.IPVS_CMD_FLUSH)])
        except nl.NetlinkError as exc:
            raise IPVSError(f"flushing IPVS{self._where()} failed: {exc}", exc.errno or 0) from exc
        if codes[0]:
            raise IPVSError(f"flushing IPVS{self._where()} failed: {os.strerror(codes[0])}", codes[0])

    def sync(self, desired: Iterable[ServiceState], *,
             delete_services: Union[bool, Callable[[VirtualServer], bool]] = True,
             purge_real_servers: bool = True, graceful: Optional[Graceful] = None,
             pending: Optional[Mapping[PendingKey, float]] = None, now: float = 0.0,
             current: Optional[Iterable[ServiceState]] = None) -> Tuple[Plan, ApplyResult]:
        """List (unless ``current`` is given), :func:`plan` and :meth:`apply`.
        Keep ``plan.pending`` for the next call when using ``graceful``."""
        cur = self.services() if current is None else list(current)
        p = plan(cur, desired, delete_services=delete_services, purge_real_servers=purge_real_servers,
                 graceful=graceful, pending=pending, now=now)
        return p, self.apply(p.ops)


__all__ = [
    "ADD_DEST", "ADD_SERVICE", "DELETE_DEST", "DELETE_SERVICE", "EDIT_DEST", "EDIT_SERVICE", "FORWARDING",
    "IP_VS_CONN_F_DROUTE", "IP_VS_CONN_F_MASQ", "IP_VS_CONN_F_TUNNEL", "IP_VS_SVC_F_ONEPACKET",
    "IP_VS_SVC_F_PERSISTENT", "SCHEDULERS", "SCHEDULER_FLAGS", "ApplyResult", "Graceful", "IPVSError",
    "IPVSKernel", "IPVSUnavailable", "Op", "Plan", "RealServer", "SchedulerUnavailable", "ServiceState",
    "VirtualServer", "format_service", "format_table", "forwarding_name", "forwarding_value", "netmask_text",
    "op_payload", "parse_netmask", "plan", "predict", "protocol_name", "scheduler_flag_bits",
    "scheduler_available", "scheduler_flag_names", "sort_real_servers", "sort_services", "virtual_server",
]
