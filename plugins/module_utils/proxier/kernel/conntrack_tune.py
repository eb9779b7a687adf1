# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Conntrack tuning the way kube-proxy does it at start-up, and deleting entries by filter.

Upstream (``cmd/kube-proxy/app/conntrack.go``, ``server_linux.go``) sets, from the
``conntrack`` section of KubeProxyConfiguration:

* ``nf_conntrack_max`` = max(maxPerCore x CPUs, min) (:func:`conntrack_max`; maxPerCore 0
  leaves it alone), and raises the hash table size to max/4 when it is smaller - never
  lowers it (:func:`hashsize_target`);
* ``nf_conntrack_tcp_timeout_established`` / ``_close_wait`` (a 0 duration leaves them
  alone), ``nf_conntrack_tcp_be_liberal`` (only to 1), ``nf_conntrack_udp_timeout`` and
  ``_udp_timeout_stream``.

Which keys live where (Linux 4.x-6.x):

* the timeouts and ``tcp_be_liberal`` are per network namespace
  (``/proc/sys/net/netfilter/``), writable from inside the namespace;
* ``nf_conntrack_max`` is one global value; it appears in every namespace, but outside
  the initial one with mode 0444 (the kernel refuses writes). In the initial namespace it
  is also ``/proc/sys/net/nf_conntrack_max``;
* the hash table size is the ``nf_conntrack`` module parameter ``hashsize``
  (``/sys/module/nf_conntrack/parameters/hashsize``): global, and the kernel refuses to
  set it (EOPNOTSUPP) from any other namespace. The kernel rounds the size up to whole
  pages of bucket pointers (:func:`round_hashsize`), so targets are rounded the same way.

Pure parts: :func:`conntrack_max`, :func:`hashsize_target`, :func:`round_hashsize`,
:func:`parse_seconds`, :func:`wanted_sysctls`, :func:`plan_changes`, the renderers and
:class:`FlowFilter`. I/O: :class:`LiveConntrack` (this process's namespace) and
:func:`find_flows` / :func:`delete_flows` (netlink through ``kernel/conntrack.py``).
"""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..durations import parse_duration
from ..errors import ConfigError, InvalidInput
from . import conntrack as ct
from . import sysctl

KEYS: Dict[str, str] = {  # module option -> sysctl name
    "max": "net.netfilter.nf_conntrack_max",
    "tcp_timeout_established": "net.netfilter.nf_conntrack_tcp_timeout_established",
    "tcp_timeout_close_wait": "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
    "tcp_be_liberal": "net.netfilter.nf_conntrack_tcp_be_liberal",
    "udp_timeout": "net.netfilter.nf_conntrack_udp_timeout",
    "udp_timeout_stream": "net.netfilter.nf_conntrack_udp_timeout_stream",
}
TIMEOUT_OPTIONS = ("tcp_timeout_established", "tcp_timeout_close_wait", "udp_timeout", "udp_timeout_stream")
MAX_KEY = KEYS["max"]
MAX_ALIAS = "net.nf_conntrack_max"  # the same global, initial namespace only
BUCKETS_KEY = "net.netfilter.nf_conntrack_buckets"  # the hash table size, read-only view here
HASHSIZE_KEY = "nf_conntrack.hashsize"  # module parameter, as on the kernel command line
HASHSIZE_PATH = "/sys/module/nf_conntrack/parameters/hashsize"
GLOBAL_KEYS = frozenset({MAX_KEY, HASHSIZE_KEY})
ALL_KEYS: Tuple[str, ...] = (*KEYS.values(), HASHSIZE_KEY)
MANAGED_BY = "kubenode.proxy.conntrack_tune"

NOT_LOADED = ("the nf_conntrack kernel module is not loaded ({path} does not exist): load it first, "
              "e.g. with `modprobe nf_conntrack` or the community.general.modprobe module, and list it in "
              "/etc/modules-load.d/ so that it is loaded at boot")
GLOBAL_REASON = ("global (one value for the whole host): writable only from the initial network namespace, "
                 "and this runs in another one (a container, a pod or `ip netns exec`); run this on the host, "
                 "or use skip_readonly=true to skip such keys")
READ_ONLY_REASON = "{path} is not writable here (is /proc/sys or /sys mounted read-only, e.g. in a container?)"


class TuneError(InvalidInput):
    """A parameter is invalid; the message names it."""


# --------------------------------------------------------------------------
# the values (pure)


def conntrack_max(max_per_core: int, cpus: int, minimum: Optional[int] = None) -> int:
    """Upstream's getConntrackMax: max(max_per_core x cpus, minimum); 0 = leave alone
    (max_per_core <= 0; ``minimum`` applies only together with max_per_core)."""
    if max_per_core <= 0:
        return 0
    return max(max_per_core * cpus, minimum or 0)


def hashsize_granularity(page_size: Optional[int] = None, pointer_size: Optional[int] = None) -> int:
    """Buckets per page: the kernel allocates the conntrack hash table in whole pages of
    bucket heads (one pointer each) and rounds a requested size up to that (512 on x86-64)."""
    page = page_size or (os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096)
    return max(1, page // (pointer_size or struct.calcsize("P")))


def round_hashsize(size: int, granularity: int) -> int:
    """``size`` rounded up to a multiple of ``granularity`` (what the kernel will use)."""
    return -(-size // granularity) * granularity


def hashsize_target(explicit: Optional[int], max_value: Optional[int], live: Optional[int],
                    granularity: int = 1) -> Optional[int]:
    """The hash table size to set, or None to leave it alone.

    ``explicit`` (the ``hashsize`` option): None = upstream's rule, 0 = never touch it,
    N = exactly N (rounded up as the kernel does; may lower it). Upstream's rule applies
    only when nf_conntrack_max is managed (``max_value``): raise the size to max/4 when
    the ``live`` size is smaller (or unknown), never lower it.
    """
    if explicit is not None:
        return round_hashsize(explicit, granularity) if explicit > 0 else None
    if not max_value:
        return None
    want = round_hashsize(max(max_value // 4, 1), granularity)
    if live is not None and live >= want:
        return None
    return want


def parse_seconds(value: Any, name: str) -> Optional[int]:
    """Seconds from an int, a digit string or a Go duration (``24h0m0s``, ``1h``, ``90s``).

    None and "" are None. Negative values and fractions of a second are refused
    (the kernel takes whole seconds).
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise TuneError(f"{name}: expected seconds or a duration like '1h0m0s', got {value!r}")
    if isinstance(value, int):
        seconds: float = value
    elif isinstance(value, float) and value.is_integer():
        seconds = value
    elif isinstance(value, str) and value.strip().isdigit():
        seconds = int(value.strip())
    elif isinstance(value, str):
        try:
            seconds = parse_duration(value.strip(), name)
        except ConfigError:
            raise TuneError(f"{name}: {value!r} is neither seconds nor a duration "
                            "(examples: 86400, '24h0m0s', '1h', '90s')") from None
    else:
        raise TuneError(f"{name}: expected seconds or a duration like '1h0m0s', got {value!r}")
    if seconds < 0:
        raise TuneError(f"{name}: must not be negative, got {value!r}")
    if seconds != int(seconds):
        raise TuneError(f"{name}: the kernel takes whole seconds, got {value!r} ({seconds} s)")
    return int(seconds)


def wanted_sysctls(params: Mapping[str, Any], cpus: int) -> Dict[str, int]:
    """The sysctl values the options ask for, ``{name: int}``.

    ``max`` (N > 0), or ``max_per_core`` + ``min`` (upstream's rule; 0 leaves it alone);
    timeouts in seconds or durations (0 leaves them alone, as upstream); ``tcp_be_liberal``
    true/false sets 1/0 (None leaves it alone). Raises :class:`TuneError`.
    """
    out: Dict[str, int] = {}
    max_value = params.get("max")
    if max_value is not None and params.get("max_per_core") is not None:
        raise TuneError("max and max_per_core are mutually exclusive")
    if params.get("min") is not None and params.get("max_per_core") is None:
        raise TuneError("min is only used with max_per_core (nf_conntrack_max = max(max_per_core x CPUs, min))")
    for name in ("max", "max_per_core", "min"):
        if params.get(name) is not None and (isinstance(params[name], bool) or int(params[name]) < 0):
            raise TuneError(f"{name}: must be a non-negative integer, got {params[name]!r}")
    if max_value is None and params.get("max_per_core") is not None:
        if cpus < 1:
            raise TuneError(f"cannot compute nf_conntrack_max from max_per_core with {cpus} CPUs")
        max_value = conntrack_max(int(params["max_per_core"]), cpus, params.get("min"))
    if max_value:
        out[MAX_KEY] = int(max_value)
    for option in TIMEOUT_OPTIONS:
        seconds = parse_seconds(params.get(option), option)
        if seconds:
            out[KEYS[option]] = seconds
    if params.get("tcp_be_liberal") is not None:
        out[KEYS["tcp_be_liberal"]] = 1 if params["tcp_be_liberal"] else 0
    return out


@dataclass(frozen=True)
class Change:
    key: str
    before: Optional[int]
    after: int


def plan_changes(wanted: Mapping[str, int], current: Mapping[str, Optional[int]]) -> List[Change]:
    """The keys whose live value differs, in the order to apply them: the hash table
    first (grow it before allowing more entries), then by name."""
    order = sorted(wanted, key=lambda k: (k != HASHSIZE_KEY, k))
    return [Change(k, current.get(k), wanted[k]) for k in order if current.get(k) != wanted[k]]


def render_values(values: Mapping[str, Optional[int]], keys: Optional[Iterable[str]] = None) -> str:
    """``key = value`` lines (``keys`` order, default sorted); a missing value shows as ``(absent)``."""
    names = list(keys) if keys is not None else sorted(values)
    return sysctl.render_lines((k, "(absent)" if values.get(k) is None else values[k]) for k in names)


def render_sysctl_file(values: Mapping[str, int]) -> str:
    """The ``sysctl.d`` file for the sysctls (not the hash size, which is a module parameter)."""
    header = (f"Managed by {MANAGED_BY}: conntrack settings for the Kubernetes service proxy.\n"
              "Local changes are overwritten.")
    return sysctl.render_sysctl_conf({k: v for k, v in values.items() if k != HASHSIZE_KEY}, header)


def render_modprobe_file(hashsize: int) -> str:
    """The ``modprobe.d`` file giving nf_conntrack its hash table size when it is loaded."""
    return (f"# Managed by {MANAGED_BY}: conntrack hash table size for the Kubernetes service proxy.\n"
            "# Local changes are overwritten. If nf_conntrack is built into the kernel, use the\n"
            f"# kernel command line instead: nf_conntrack.hashsize={hashsize}\n"
            f"options nf_conntrack hashsize={hashsize}\n")


# --------------------------------------------------------------------------
# the live values (this process's network namespace)


class LiveConntrack:
    """Reads and writes the conntrack sysctls and the hash table size.

    ``proc_sys`` and ``hashsize_path`` default to the real files (tests pass a tree).
    """

    def __init__(self, proc_sys: Optional[str] = None, hashsize_path: Optional[str] = None) -> None:
        self.proc_sys = proc_sys or sysctl.PROC_SYS
        self.hashsize_path = hashsize_path or HASHSIZE_PATH

    def path(self, key: str) -> str:
        return self.hashsize_path if key == HASHSIZE_KEY else sysctl.key_path(key, self.proc_sys)

    def loaded(self) -> bool:
        return os.path.exists(self.path(MAX_KEY))

    def not_loaded_message(self) -> str:
        return NOT_LOADED.format(path=self.path(MAX_KEY))

    def read(self, keys: Iterable[str] = ALL_KEYS) -> Dict[str, Optional[int]]:
        """``{key: value}``, None for a key that does not exist. Raises :class:`sysctl.SysctlError`."""
        out: Dict[str, Optional[int]] = {}
        for key in keys:
            value = sysctl.read_int(self.path(key))
            if value is None and key in (MAX_KEY, HASHSIZE_KEY):  # e.g. /sys not mounted
                alias = MAX_ALIAS if key == MAX_KEY else BUCKETS_KEY
                value = sysctl.read_int(sysctl.key_path(alias, self.proc_sys))
            out[key] = value
        return out

    def initial_netns(self) -> bool:
        """Whether this is the initial network namespace: only there does the kernel
        register nf_conntrack_max writable (elsewhere mode 0444)."""
        return sysctl.mode_allows_write(self.path(MAX_KEY))

    def readonly_reason(self, key: str) -> Optional[str]:
        """Why ``key`` cannot be written here, or None if it can (as far as can be told
        without writing)."""
        if key in GLOBAL_KEYS and not self.initial_netns():
            return GLOBAL_REASON
        path = self.path(key)
        if os.path.exists(path) and not sysctl.writable(path):
            return READ_ONLY_REASON.format(path=path)
        return None

    def write(self, key: str, value: int) -> None:
        """Raises :class:`sysctl.ReadOnlyError` (with the reason) or :class:`sysctl.SysctlError`."""
        path = self.path(key)
        if not os.path.exists(path):
            raise sysctl.SysctlError(f"{key}: {path} does not exist in this kernel")
        try:
            sysctl.write_value(path, value, key)
        except sysctl.ReadOnlyError as exc:
            reason = GLOBAL_REASON if key in GLOBAL_KEYS else exc.reason
            raise sysctl.ReadOnlyError(key, reason) from exc


# --------------------------------------------------------------------------
# deleting entries by filter


PORT_FIELDS = ("orig_src_port", "orig_dst_port", "reply_src_port")
ADDRESS_FIELDS = ("orig_src", "orig_dst", "reply_src")


@dataclass(frozen=True)
class FlowFilter:
    """Conntrack entries to delete: all given fields must match (None = any).

    ``orig_*`` is the original direction (client -> service IP), ``reply_src`` where
    replies come from (the DNAT target, i.e. the endpoint).
    """

    protocol: Optional[str] = None  # "TCP", "UDP", "SCTP"
    orig_src: Optional[str] = None
    orig_dst: Optional[str] = None
    orig_src_port: Optional[int] = None
    orig_dst_port: Optional[int] = None
    reply_src: Optional[str] = None
    reply_src_port: Optional[int] = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any], name: str = "delete") -> FlowFilter:
        """Validated and canonical (upper-case protocol, compressed IPs). Raises :class:`TuneError`."""
        unknown = sorted(set(params) - {"protocol", *ADDRESS_FIELDS, *PORT_FIELDS})
        if unknown:
            raise TuneError(f"{name}: unknown field {unknown[0]!r}")
        values: Dict[str, Any] = {}
        if params.get("protocol") not in (None, ""):
            proto = ct.proto_name(params["protocol"])
            if proto not in ct.PROTO_NUMBERS:
                raise TuneError(f"{name}.protocol: {params['protocol']!r} is not tcp, udp or sctp")
            values["protocol"] = proto
        for field_name in ADDRESS_FIELDS:
            if params.get(field_name) not in (None, ""):
                try:
                    values[field_name] = ipaddress.ip_address(str(params[field_name]).strip()).compressed
                except ValueError:
                    raise TuneError(f"{name}.{field_name}: {params[field_name]!r} is not an IP address") from None
        for field_name in PORT_FIELDS:
            if params.get(field_name) is not None:
                port = params[field_name]
                if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                    raise TuneError(f"{name}.{field_name}: {port!r} is not a port (1-65535)")
                values[field_name] = port
        if not values:
            raise TuneError(f"{name}: give at least one of protocol, {', '.join(ADDRESS_FIELDS + PORT_FIELDS)} "
                            "(an empty filter would delete every entry)")
        result = cls(**values)
        if len(result._address_families()) > 1:
            raise TuneError(f"{name}: mixes IPv4 and IPv6 addresses, so it can match nothing")
        return result

    def _address_families(self) -> Set[int]:
        return {ipaddress.ip_address(getattr(self, f)).version for f in ADDRESS_FIELDS if getattr(self, f)}

    def families(self) -> Set[int]:
        """The address families (4, 6) the filter can match."""
        return self._address_families() or set(ct.FAMILIES)

    def protocols(self) -> Tuple[str, ...]:
        return (self.protocol,) if self.protocol else tuple(ct.PROTO_NUMBERS)

    def matches(self, flow: ct.Flow) -> bool:
        return ((self.protocol is None or flow.proto == self.protocol)
                and (self.orig_src is None or flow.orig_src == self.orig_src)
                and (self.orig_dst is None or flow.orig_dst == self.orig_dst)
                and (self.orig_src_port is None or flow.orig_sport == self.orig_src_port)
                and (self.orig_dst_port is None or flow.orig_dport == self.orig_dst_port)
                and (self.reply_src is None or flow.reply_src == self.reply_src)
                and (self.reply_src_port is None or flow.reply_sport == self.reply_src_port))

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in vars(self).items() if v is not None)


def select_flows(flows: Iterable[ct.Flow], filters: Sequence[FlowFilter]) -> List[ct.Flow]:
    """The flows matched by any of ``filters`` (each once, in dump order). Pure."""
    return [flow for flow in flows if any(f.matches(flow) for f in filters)]


Lister = Callable[[str, Sequence[str], Iterable[int]], List[ct.Flow]]


def find_flows(filters: Sequence[FlowFilter], netns: str = "", lister: Optional[Lister] = None) -> List[ct.Flow]:
    """Dump (only the protocols and address families the filters can match) and select.

    Raises :class:`conntrack.ConntrackUnavailable` without pyroute2 and
    :class:`conntrack.ConntrackError` if the table cannot be read.
    """
    if not filters:
        return []
    protocols = sorted({p for f in filters for p in f.protocols()})
    families = sorted({fam for f in filters for fam in f.families()})
    flows = (lister or ct.list_flows)(netns, protocols, families)
    return select_flows(flows, filters)


def delete_flows(flows: Sequence[ct.Flow], netns: str = "") -> ct.CleanupResult:
    """Delete exactly these entries over netlink, batched (entries gone meanwhile count
    as ``vanished``; failures are in ``errors``)."""
    return ct.ConntrackCleaner(netns).delete(flows)


__all__ = [
    "ALL_KEYS", "GLOBAL_KEYS", "HASHSIZE_KEY", "HASHSIZE_PATH", "KEYS", "MAX_KEY", "Change", "FlowFilter",
    "LiveConntrack", "TuneError", "conntrack_max", "delete_flows", "find_flows", "hashsize_granularity",
    "hashsize_target", "parse_seconds", "plan_changes", "render_modprobe_file", "render_sysctl_file",
    "render_values", "round_hashsize", "select_flows", "wanted_sysctls",
]
