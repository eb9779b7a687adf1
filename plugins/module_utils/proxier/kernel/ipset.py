# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""ipset: read sets with ``ipset save``, write them with ONE batched ``ipset restore``.

The API is small::

    kernel = IpsetKernel(netns="")                     # "" = this namespace, else `ip netns exec NS`
    current = kernel.save()                            # Dict[str, IPSet]: every set, parsed
    current = kernel.save("KUBE-CLUSTER-IP")           # just that one ({} if it does not exist)
    want = IPSet("KUBE-CLUSTER-IP", "hash:ip,port",
                 entries=entries_of(["10.96.0.10,tcp:80", "10.96.0.10,udp:53"]))
    p = plan(current, [want], exclusive=True, atomic=False)   # pure: no I/O
    p.lines / p.text() / p.empty / p.sets[name].added / .removed / .updated
    kernel.restore(p.lines)                            # one `ipset restore`; returns seconds
    p = kernel.sync([want], exclusive=True, atomic=True, check_mode=False)  # read, plan, apply
    kernel.names() -> List[str]; kernel.current(names) -> Dict[str, IPSet] (+ leftover temp sets)
    kernel.destroy(name); normalize_entry(type, entry, family) -> List[str]; parse_save(text)

``IPSet`` is both what was read and what is wanted. Header options left at ``None``
(``maxelem``, ``timeout``, ``range``) or ``False`` (``comment``) in a *desired* set mean
"don't care" when comparing with an existing set, and ipset's defaults when creating one.
``hashsize`` is only used when a set is created: the kernel grows hashes by itself, so the
current value says nothing about what was asked for.

:func:`plan` (pure) turns current + desired into restore lines:

* a missing set is created and filled;
* ``exclusive=True``: the set holds exactly the desired entries (others are deleted);
  ``exclusive=False``: desired entries are added, other entries stay;
* ``atomic=True``: a set whose content changes is rebuilt in a temporary set
  (:func:`temp_name`, within ipset's 31-character limit), which is then ``swap``-ped
  with the live set and destroyed: rules that use the set see the old content or the new
  one, never a mix. Otherwise entries are added/deleted in place (``-exist``, so a race
  with another writer is harmless). A header change (timeout, comment support, maxelem,
  range, counters, ...) always goes through a swap; a different *type or family* cannot be
  swapped (the kernel refuses), so :func:`plan` raises :class:`PlanError` unless
  ``recreate=True`` (destroy + create: fails if a rule still uses the set);
* ``remove={name: entries}`` deletes those entries if present; ``destroy=[names]``
  destroys sets that exist.

Entries are normalised the way the kernel prints them (:func:`normalize_entry`), so that
comparisons with what ``ipset save`` returns are exact: ``10.96.0.10,80`` ->
``10.96.0.10,tcp:80``; ``UDP:domain`` -> ``udp:53``; ``17:53`` -> ``udp:53``;
``10.0.0.1/32`` in ``hash:net`` -> ``10.0.0.1``; ``10.2.3.4/24`` -> ``10.2.3.0/24``; IPv6
lower-cased and compressed; port ranges (``tcp:80-82``), address ranges and CIDRs in
``hash:ip``-like first components, and net ranges are expanded as ipset does. A bad
entry raises :class:`EntryError` naming the set and the entry, before anything is
written. Per-entry ``timeout`` (it counts down), ``packets`` and ``bytes`` are never
compared; ``comment`` (and ``nomatch``, ``skb*``) are compared only when the desired
entry sets them (an entry whose comment differs is re-added with ``-exist``: "updated").
ICMP entries are compared as given: write them as the kernel prints them
(``icmp:echo-request``).

``ipset restore`` is not a transaction: it stops at the first failing line and keeps
what the earlier lines did. :func:`plan` therefore validates every entry first, and uses
``-exist`` on add/del; a failure raises :class:`IpsetError` with the failing line.

The kube-proxy IPVS-mode set table (upstream names, types, comments and the iptables
matches that use them) is in the sibling module ``ipset_specs``.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import KernelError, Unavailable
from ..names import IPSET_MAXNAMELEN  # 31: the kernel's 32 with the NUL
from . import text as ktext  # the restore-text rules (not a local ``text``)

MAX_TIMEOUT = 2147483  # seconds: the largest timeout ipset accepts (UINT_MAX / 2 ms)
_RANGE_RE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")
MAX_COMMENT = 255
MAX_EXPANSION = 65536  # one entry may expand (ranges, CIDRs) to at most this many elements
DEFAULT_PORT_RANGE = "0-65535"

# Set types and the components of their elements, in order.
TYPE_COMPONENTS: Dict[str, Tuple[str, ...]] = {
    "hash:ip": ("ip",),
    "hash:net": ("net",),
    "hash:ip,port": ("ip", "port"),
    "hash:ip,port,ip": ("ip", "port", "ip2"),
    "hash:ip,port,net": ("ip", "port", "net"),
    "hash:net,port": ("net", "port"),
    "hash:net,net": ("net", "net"),
    "hash:net,port,net": ("net", "port", "net"),
    "hash:ip,mark": ("ip", "other"),
    "hash:net,iface": ("net", "other"),
    "hash:mac": ("other",),
    "hash:ip,mac": ("ip", "other"),
    "bitmap:port": ("bport",),
    "bitmap:ip": ("ip",),
    "bitmap:ip,mac": ("ip", "other"),
}
CREATE_FLAGS = ("counters", "comment", "skbinfo", "forceadd")  # create options without a value
ENTRY_FLAGS = ("nomatch",)
IGNORED_HEADER = ("bucketsize", "initval", "hashsize")  # kernel-chosen or grown: never compared
UNCOMPARED_ENTRY_OPTIONS = ("timeout", "packets", "bytes")
PROTOCOL_NUMBERS = {"1": "icmp", "6": "tcp", "17": "udp", "58": "icmpv6", "132": "sctp", "136": "udplite"}
PORT_PROTOCOLS = ("tcp", "udp", "sctp", "udplite")

EntryOptions = Dict[str, str]  # option -> value ("" for a flag such as nomatch)


class IpsetError(KernelError):
    """An ipset command failed, or the plan cannot be carried out."""


class EntryError(IpsetError, ValueError):
    """An entry ipset would not accept (raised before anything is written)."""

    def __init__(self, set_name: str, entry: str, reason: str) -> None:
        self.set_name = set_name
        self.entry = entry
        self.reason = reason
        where = f"set {set_label(set_name)}: " if set_name else ""
        super().__init__(f"{where}bad entry {entry!r}: {reason}")


class PlanError(IpsetError):
    """The desired state cannot be reached the way the caller allowed."""


# ---------------------------------------------------------------------------- data


@dataclass
class IPSet:
    """One set: header (type and create options) and entries.

    ``entries`` maps the normalised element to its options (``comment``, ``timeout``,
    ``nomatch``...). ``options`` keeps create options not modelled by a field
    (``netmask``, ``markmask``, ``bucketsize``, ``initval``).
    """

    name: str
    type: str
    family: str = ""  # inet / inet6 for hash types ("" = inet); not used by bitmap types
    hashsize: Optional[int] = None
    maxelem: Optional[int] = None
    timeout: Optional[int] = None  # default entry timeout; None = no timeout support
    comment: bool = False
    counters: bool = False
    skbinfo: bool = False
    forceadd: bool = False
    range: Optional[str] = None  # bitmap types
    options: Dict[str, str] = field(default_factory=dict)
    entries: Dict[str, EntryOptions] = field(default_factory=dict)

    @property
    def is_hash(self) -> bool:
        return self.type.startswith("hash:")

    @property
    def effective_family(self) -> str:
        return (self.family or "inet") if self.is_hash else ""

    def header_tokens(self) -> List[str]:
        """Create options in ipset's own order (without bucketsize/initval)."""
        out: List[str] = []
        if self.is_hash:
            out += ["family", self.effective_family]
            if self.hashsize is not None:
                out += ["hashsize", str(self.hashsize)]
            if self.maxelem is not None:
                out += ["maxelem", str(self.maxelem)]
        if self.range is not None:
            out += ["range", self.range]
        for key, value in sorted(self.options.items()):
            if key not in ("bucketsize", "initval"):
                out += [key, value]
        if self.timeout is not None:
            out += ["timeout", str(self.timeout)]
        out += [flag for flag in CREATE_FLAGS if getattr(self, flag)]
        return out

    def create_line(self, name: Optional[str] = None) -> str:
        return " ".join(["create", name or self.name, self.type] + self.header_tokens())

    def header_text(self) -> str:
        """The header without hashsize (for diffs: hashsize grows by itself)."""
        tokens = self.header_tokens()
        if "hashsize" in tokens:
            i = tokens.index("hashsize")
            del tokens[i:i + 2]
        return " ".join([self.name, self.type] + tokens)

    def text(self, entry_options: Sequence[str] = ("comment", "nomatch")) -> str:
        """Stable text: header line, then sorted entries (for diffs)."""
        lines = [f"create {self.header_text()}"]
        for entry in sorted(self.entries, key=entry_sort_key):
            lines.append(f"add {self.name} {format_entry(entry, self.entries[entry], entry_options)}")
        return "\n".join(lines) + "\n"


def entries_of(entries: Iterable[str], comment: Optional[str] = None, **options: str) -> Dict[str, EntryOptions]:
    """Entries (in ipset syntax) as an ``IPSet.entries`` mapping, each with the same options."""
    opts: EntryOptions = dict(options)
    if comment is not None:
        opts["comment"] = comment
    return {e: dict(opts) for e in entries}


def temp_name(name: str, suffix: str = "-tmp") -> str:
    """A temporary set name for ``name`` within ipset's 31-character limit."""
    if len(name) + len(suffix) <= IPSET_MAXNAMELEN:
        return name + suffix
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    keep = IPSET_MAXNAMELEN - len(suffix) - len(digest) - 1
    return f"{name[:keep]}-{digest}{suffix}"


def check_name(name: str, field: str = "name") -> None:
    try:
        ktext.ipset_name(name, field)
    except ktext.UnsafeText as e:
        raise PlanError(f"invalid set name: {e}") from None


def check_header(want: IPSet) -> None:
    """Every header value a create line carries is one restore token (kernel/text.py):
    a newline in ``range`` must not become a second command."""
    try:
        ktext.ipset_name(want.name, "name")
        ktext.ipset_token(want.type, "type")
        if want.family:
            ktext.ipset_token(want.family, "family")
        for attr, hi in (("hashsize", 1 << 31), ("maxelem", (1 << 32) - 1), ("timeout", MAX_TIMEOUT)):
            value = getattr(want, attr)
            if value is not None:
                ktext.number(value, attr, 0 if attr == "timeout" else 1, hi)
        if want.range is not None:
            check_range(want.range, "range")
        for key, value in want.options.items():
            ktext.ipset_token(key, "options")
            ktext.ipset_token(value, f"options.{key}")
    except ktext.UnsafeText as e:
        raise PlanError(f"set {set_label(want.name)}: {e}") from None


def set_label(name: object) -> str:
    """A set name for a message: as it is when valid, else quoted (no raw control characters)."""
    if isinstance(name, str) and ktext._IPSET_NAME.fullmatch(name) and len(name) <= IPSET_MAXNAMELEN:
        return name
    return ktext.shown(name)


def check_range(value: object, field: str = "range") -> str:
    """A bitmap:port range ``lo-hi`` (or one port), 0-65535: ipset's own syntax, nothing else."""
    m = _RANGE_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None or int(m.group(1)) > 65535 or int(m.group(2) or m.group(1)) > 65535 \
            or int(m.group(1)) > int(m.group(2) or m.group(1)):
        raise ktext.UnsafeText(field, value, "not a port range lo-hi within 0-65535")
    return value


# ---------------------------------------------------------------------------- normalising


def _addr(text: str, family: str, what: str) -> Union[ipaddress.IPv4Address, ipaddress.IPv6Address]:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not an IP address") from None
    want = 6 if family == "inet6" else 4
    if addr.version != want:
        raise ValueError(f"{what} {text} is not an IPv{want} address (set family {family or 'inet'})")
    return addr


def _ip_component(text: str, family: str, expand: bool) -> List[str]:
    """One address; with ``expand`` also a CIDR or ``a-b`` range (IPv4), like ipset."""
    if "/" in text:
        base, _sep, plen = text.partition("/")
        addr = _addr(base, family, "address")
        try:
            net = ipaddress.ip_network(f"{addr}/{plen}", strict=False)
        except ValueError:
            raise ValueError(f"bad prefix length /{plen}") from None
        if net.num_addresses == 1:
            return [str(net.network_address)]
        if not expand or net.version == 6:
            raise ValueError(f"a network ({text}) is not allowed here")
        if net.num_addresses > MAX_EXPANSION:
            raise ValueError(f"{text} expands to more than {MAX_EXPANSION} elements")
        return [str(a) for a in net]
    if "-" in text and not text.startswith("["):
        if not expand:
            raise ValueError(f"a range ({text}) is not allowed here")
        first_text, _sep, last_text = text.partition("-")
        first, last = _addr(first_text, family, "address"), _addr(last_text, family, "address")
        if first.version == 6:
            raise ValueError("IP ranges are not supported with IPv6")
        lo, hi = sorted((int(first), int(last)))
        if hi - lo + 1 > MAX_EXPANSION:
            raise ValueError(f"{text} expands to more than {MAX_EXPANSION} elements")
        return [str(ipaddress.IPv4Address(i)) for i in range(lo, hi + 1)]
    return [str(_addr(text, family, "address"))]


def _net_component(text: str, family: str) -> List[str]:
    if "-" in text and "/" not in text:
        first_text, _sep, last_text = text.partition("-")
        first, last = _addr(first_text, family, "address"), _addr(last_text, family, "address")
        if first.version == 6:
            raise ValueError("IP ranges are not supported with IPv6")
        lo, hi = sorted((first, last))
        nets = list(ipaddress.summarize_address_range(lo, hi))
        return [_net_text(n) for n in nets]
    base, _sep, plen = text.partition("/")
    addr = _addr(base, family, "network")
    try:
        net = ipaddress.ip_network(f"{addr}/{plen or addr.max_prefixlen}", strict=False)
    except ValueError:
        raise ValueError(f"bad prefix length /{plen}") from None
    if net.prefixlen == 0:
        raise ValueError("a network with prefix length 0 cannot be stored")
    return [_net_text(net)]


def _net_text(net: Union[ipaddress.IPv4Network, ipaddress.IPv6Network]) -> str:
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(net)


def _port_number(text: str, proto: str) -> int:
    text = text.strip()
    if text.isdigit():
        port = int(text)
        if port > 65535:
            raise ValueError(f"port {port} is out of range 0-65535")
        return port
    try:
        return socket.getservbyname(text.lower(), proto)
    except OSError:
        raise ValueError(f"cannot parse {text!r} as a {proto} port") from None


def _port_range(text: str, proto: str) -> List[int]:
    if "-" in text:
        first, _sep, last = text.partition("-")
        lo, hi = sorted((_port_number(first, proto), _port_number(last, proto)))
        return list(range(lo, hi + 1))
    return [_port_number(text, proto)]


def _port_component(text: str) -> List[str]:
    """``[proto:]port[-port]`` -> ``proto:port`` as the kernel prints it (proto default tcp)."""
    if ":" in text:
        proto, _sep, rest = text.partition(":")
        proto = proto.strip().lower()
        proto = PROTOCOL_NUMBERS.get(proto, proto)
    else:
        proto, rest = "tcp", text
    if not proto or not rest:
        raise ValueError(f"bad port {text!r}")
    if proto in PORT_PROTOCOLS:
        return [f"{proto}:{p}" for p in _port_range(rest, proto)]
    return [f"{proto}:{rest.strip().lower()}"]  # icmp:echo-request, gre:0, ...: as given


def _bitmap_port_component(text: str, port_range: Optional[str]) -> List[str]:
    proto = "tcp"
    if ":" in text:
        proto, _sep, text = text.partition(":")
        proto = PROTOCOL_NUMBERS.get(proto.strip().lower(), proto.strip().lower())
        if proto not in ("tcp", "udp"):
            raise ValueError(f"protocol {proto} is not allowed in bitmap:port (tcp or udp port only)")
    ports = _port_range(text, proto)
    if port_range:
        lo_text, _sep, hi_text = port_range.partition("-")
        lo, hi = sorted((int(lo_text), int(hi_text or lo_text)))
        for p in ports:
            if not lo <= p <= hi:
                raise ValueError(f"port {p} is out of the set's range {port_range}")
    return [str(p) for p in ports]


def normalize_entry(set_type: str, entry: str, family: str = "inet", *, port_range: Optional[str] = None,
                    set_name: str = "") -> List[str]:
    """The element(s) ``entry`` stands for, written the way the kernel prints them.

    A range or CIDR expands to several elements, as ``ipset add`` would. Raises
    :class:`EntryError` for anything ipset would refuse. Types not in ``TYPE_COMPONENTS``
    pass through unchanged.
    """
    if not isinstance(entry, str):
        raise EntryError(set_name, entry, f"expected a string, got {type(entry).__name__}")
    return list(_normalize_entry(set_type, entry, family, port_range, set_name))


# Pure, and a full sync normalises the same entries every time (10,000 at 5,000
# services: seconds in the VM lab): remembered (errors are raised, never cached).
@functools.lru_cache(maxsize=1 << 17)
def _normalize_entry(set_type: str, entry: str, family: str, port_range: Optional[str],
                     set_name: str) -> Tuple[str, ...]:
    return tuple(_normalize_entry_uncached(set_type, entry, family, port_range=port_range, set_name=set_name))


def _normalize_entry_uncached(set_type: str, entry: str, family: str = "inet", *, port_range: Optional[str] = None,
                              set_name: str = "") -> List[str]:
    value = entry.strip()
    if not value or ktext._BARE_TOKEN.fullmatch(value) is None:
        # One restore token (kernel/text.py): no blanks, quotes, controls or non-ASCII.
        raise EntryError(set_name, entry, "empty, or contains blanks, quotes, control or non-ASCII characters")
    components = TYPE_COMPONENTS.get(set_type)
    if components is None:
        return [value]
    parts = value.split(",")
    if len(parts) != len(components):
        want = ",".join(components).replace("bport", "port").replace("ip2", "ip")
        raise EntryError(set_name, entry, f"{set_type} entries have the form {want}")
    choices: List[List[str]] = []
    try:
        for i, (kind, part) in enumerate(zip(components, parts)):
            if kind == "ip":
                choices.append(_ip_component(part, family, expand=(i == 0)))
            elif kind == "ip2":
                choices.append(_ip_component(part, family, expand=False))
            elif kind == "net":
                choices.append(_net_component(part, family))
            elif kind == "port":
                choices.append(_port_component(part))
            elif kind == "bport":
                choices.append(_bitmap_port_component(part, port_range))
            else:
                choices.append([part.strip().lower()])
    except ValueError as exc:
        raise EntryError(set_name, entry, str(exc)) from None
    total = 1
    for c in choices:
        total *= len(c)
    if total > MAX_EXPANSION:
        raise EntryError(set_name, entry, f"expands to more than {MAX_EXPANSION} elements")
    out = [""]
    for c in choices:
        out = [f"{prefix},{item}" if prefix else item for prefix in out for item in c]
    return out


def normalize_set_entries(s: IPSet, port_range: Optional[str] = None) -> Dict[str, EntryOptions]:
    """``s.entries`` normalised (and expanded); options are checked too."""
    out: Dict[str, EntryOptions] = {}
    for entry, opts in s.entries.items():
        check_entry_options(s.name, entry, opts or {})
        for element in normalize_entry(s.type, entry, s.effective_family or "inet",
                                       port_range=port_range or s.range, set_name=s.name):
            out[element] = dict(opts or {})
    return out


def check_entry_options(set_name: str, entry: str, opts: Mapping[str, str]) -> None:
    """Entry options as restore tokens (kernel/text.py): the comment quoted, the rest bare."""
    comment = opts.get("comment")
    if comment is not None:
        try:
            ktext.ipset_comment(comment, "comment")
        except ktext.UnsafeText as e:
            raise EntryError(set_name, entry, str(e)) from None
    timeout = opts.get("timeout")
    if timeout is not None and not (str(timeout).isascii() and str(timeout).isdigit()):
        raise EntryError(set_name, entry, f"timeout {timeout!r} is not a number of seconds")
    for key, value in opts.items():
        if key == "comment":
            continue
        try:
            ktext.ipset_token(key, "option")
            if key not in ENTRY_FLAGS:
                ktext.ipset_token(str(value), key)
        except ktext.UnsafeText as e:
            raise EntryError(set_name, entry, str(e)) from None


def _addr_key(text: str) -> Optional[Tuple[int, int]]:
    """(version, integer) of an address (fast: inet_pton), or None."""
    for family, version in ((socket.AF_INET, 4), (socket.AF_INET6, 6)):
        try:
            return version, int.from_bytes(socket.inet_pton(family, text), "big")
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1 << 17)  # pure; the same entries are sorted at every full sync
def entry_sort_key(entry: str) -> Tuple:
    """Sort entries numerically where they are addresses, networks and ports."""
    key: List[Tuple] = []
    for part in entry.split(","):
        addr, slash, plen = part.partition("/")
        ak = _addr_key(addr)
        if ak is not None:
            key.append((0, ak[0], ak[1], int(plen) if slash and plen.isdigit() else 999, ""))
            continue
        proto, sep, rest = part.partition(":")
        if part.isdigit():
            key.append((1, 0, int(part), 0, ""))
        elif sep and rest.isdigit():
            key.append((1, 1, int(rest), 0, proto))
        else:
            key.append((2, 0, 0, 0, part))
    return tuple(key)


def format_entry(entry: str, opts: Mapping[str, str], keep: Optional[Sequence[str]] = None) -> str:
    """``entry`` with its options in restore syntax (``keep``: only these options)."""
    out = [entry]
    for key, value in opts.items():
        if keep is not None and key not in keep:
            continue
        if key in ENTRY_FLAGS:
            out.append(key)
        elif key == "comment":
            out.append(f'comment "{value}"')
        else:
            out += [key, str(value)]
    return " ".join(out)


# ---------------------------------------------------------------------------- parsing


def parse_save(text: str) -> Dict[str, IPSet]:
    """``ipset save`` (or ``ipset list -o save``) output -> sets by name, in order."""
    sets: Dict[str, IPSet] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tokens = shlex.split(line) if '"' in line or "'" in line else line.split()
        verb = tokens[0]
        if verb == "create" and len(tokens) >= 3:
            s = IPSet(tokens[1], tokens[2])
            _parse_header(s, tokens[3:])
            sets[s.name] = s
        elif verb == "add" and len(tokens) >= 3:
            s = sets.get(tokens[1])
            if s is None:
                raise IpsetError(f"ipset save line {lineno}: entry for unknown set {tokens[1]}")
            s.entries[tokens[2]] = _parse_entry_options(tokens[3:])
        else:
            raise IpsetError(f"ipset save line {lineno}: cannot parse {line[:200]!r}")
    return sets


def _parse_header(s: IPSet, tokens: Sequence[str]) -> None:
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in CREATE_FLAGS:
            setattr(s, key, True)
            i += 1
            continue
        value = tokens[i + 1] if i + 1 < len(tokens) else ""
        i += 2
        if key == "family":
            s.family = value
        elif key in ("hashsize", "maxelem", "timeout"):
            setattr(s, key, int(value))
        elif key == "range":
            s.range = value
        else:
            s.options[key] = value


def _parse_entry_options(tokens: Sequence[str]) -> EntryOptions:
    opts: EntryOptions = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ENTRY_FLAGS:
            opts[key] = ""
            i += 1
        else:
            opts[key] = tokens[i + 1] if i + 1 < len(tokens) else ""
            i += 2
    return opts


# ---------------------------------------------------------------------------- planning


@dataclass
class SetChange:
    """What a plan does to one set."""

    name: str
    action: str = "update"  # create | update | swap | recreate | destroy | none
    added: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    updated: List[str] = field(default_factory=list)  # re-added for a different comment/flag
    header_before: str = ""
    header_after: str = ""
    before: Optional[IPSet] = None
    after: Optional[IPSet] = None  # the expected result (entries normalised)

    @property
    def changed(self) -> bool:
        return self.action in ("create", "swap", "recreate", "destroy") or bool(
            self.added or self.removed or self.updated)


@dataclass
class Plan:
    lines: List[str] = field(default_factory=list)
    sets: Dict[str, SetChange] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.lines

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    @property
    def changes(self) -> List[str]:
        out: List[str] = []
        for c in self.sets.values():
            if not c.changed:
                continue
            if c.action in ("create", "swap", "recreate", "destroy"):
                out.append(f"{c.action} {c.name}" + (f" ({c.header_after})" if c.header_after else ""))
            out += [f"add {c.name} {e}" for e in c.added]
            out += [f"del {c.name} {e}" for e in c.removed]
            out += [f"update {c.name} {e}" for e in c.updated]
        return out


def _header_diff(cur: IPSet, want: IPSet) -> List[str]:
    """Header differences that need a new set (same type and family): what differs."""
    diffs = []
    if want.maxelem is not None and want.maxelem != (cur.maxelem if cur.maxelem is not None else 65536):
        diffs.append(f"maxelem {cur.maxelem} -> {want.maxelem}")
    if want.timeout is not None and want.timeout != cur.timeout:
        diffs.append(f"timeout {cur.timeout} -> {want.timeout}")
    if want.range is not None and want.range != cur.range:
        diffs.append(f"range {cur.range} -> {want.range}")
    for flag in CREATE_FLAGS:
        if getattr(want, flag) and not getattr(cur, flag):
            diffs.append(f"+{flag}")
    for key, value in want.options.items():
        if key not in IGNORED_HEADER and cur.options.get(key) != value:
            diffs.append(f"{key} {cur.options.get(key)} -> {value}")
    return diffs


def _merged_header(cur: Optional[IPSet], want: IPSet) -> IPSet:
    """The header a (re)created set gets: the current one with the wanted options applied."""
    if cur is None or cur.type != want.type or cur.effective_family != want.effective_family:
        maxelem = want.maxelem if want.maxelem is not None or not want.is_hash else 65536
        return IPSet(want.name, want.type, want.family, want.hashsize, maxelem, want.timeout, want.comment,
                     want.counters, want.skbinfo, want.forceadd, want.range,
                     {k: v for k, v in want.options.items() if k not in ("bucketsize", "initval")})
    out = IPSet(cur.name, cur.type, cur.family, cur.hashsize, cur.maxelem, cur.timeout, cur.comment, cur.counters,
                cur.skbinfo, cur.forceadd, cur.range,
                {k: v for k, v in cur.options.items() if k not in ("bucketsize", "initval")})
    if want.hashsize is not None:
        out.hashsize = max(want.hashsize, cur.hashsize or 0)
    for attr in ("maxelem", "timeout", "range"):
        if getattr(want, attr) is not None:
            setattr(out, attr, getattr(want, attr))
    for flag in CREATE_FLAGS:
        setattr(out, flag, getattr(out, flag) or getattr(want, flag))
    out.options.update({k: v for k, v in want.options.items() if k not in ("bucketsize", "initval")})
    return out


def _supported_options(header: IPSet, opts: Mapping[str, str]) -> EntryOptions:
    """Entry options the set can hold (no comment without comment support, ...)."""
    out: EntryOptions = {}
    for key, value in opts.items():
        if key == "comment" and not header.comment:
            continue
        if key == "timeout" and header.timeout is None:
            continue
        if key in ("packets", "bytes"):
            continue
        if key.startswith("skb") and not header.skbinfo:
            continue
        out[key] = value
    return out


def _differs(cur_opts: Mapping[str, str], want_opts: Mapping[str, str]) -> bool:
    for key, value in want_opts.items():
        if key in UNCOMPARED_ENTRY_OPTIONS:
            continue
        if cur_opts.get(key) != value:
            return True
    return False


def _add_line(name: str, entry: str, opts: Mapping[str, str]) -> str:
    return f"add {name} {format_entry(entry, opts)} -exist"


def plan(current: Mapping[str, IPSet], desired: Iterable[IPSet] = (), *, exclusive: bool = True,
         atomic: bool = False, remove: Optional[Mapping[str, Iterable[str]]] = None,
         destroy: Iterable[str] = (), recreate: bool = False) -> Plan:
    """Restore lines that take the ``current`` sets to the ``desired`` ones. Pure.

    See the module docstring for ``exclusive``, ``atomic``, ``remove``, ``destroy`` and
    ``recreate``. Entries of desired sets and of ``remove`` are normalised here;
    ``current`` is taken as the kernel printed it.
    """
    result = Plan()
    remove = dict(remove or {})
    for want in desired:
        check_header(want)
        if want.type not in TYPE_COMPONENTS:
            raise PlanError(f"set {want.name}: unknown or unsupported set type {want.type!r}")
        if want.type.startswith("bitmap:") and want.range is None and current.get(want.name) is None:
            if want.type == "bitmap:port":
                raise PlanError(f"set {want.name}: bitmap:port needs a range (e.g. {DEFAULT_PORT_RANGE})")
            raise PlanError(f"set {want.name}: {want.type} needs a range")
        if want.is_hash and want.family not in ("", "inet", "inet6"):
            raise PlanError(f"set {want.name}: family must be inet or inet6, not {want.family!r}")
        if not want.is_hash and (want.hashsize is not None or want.maxelem is not None):
            raise PlanError(f"set {want.name}: hashsize and maxelem apply to hash types only, not {want.type}")
        if want.range is not None and not want.type.startswith("bitmap:"):
            raise PlanError(f"set {want.name}: range applies to bitmap types only, not {want.type}")
        cur = current.get(want.name)
        entries = normalize_set_entries(want, cur.range if cur is not None and cur.type == want.type else None)
        drop = _normalize_removals(want, remove.pop(want.name, ()))
        _plan_set(result, current.get(want.name), want, entries, drop, current, exclusive, atomic, recreate)
    for name, entries in remove.items():
        check_name(name)
        cur = current.get(name)
        if cur is None:
            result.sets[name] = SetChange(name, action="none")
            continue
        drop = _normalize_removals(cur, entries)
        change = SetChange(name, before=cur, header_before=cur.header_text(), header_after=cur.header_text())
        change.removed = sorted((e for e in drop if e in cur.entries), key=entry_sort_key)
        result.lines += [f"del {name} {e} -exist" for e in change.removed]
        change.after = _copy(cur, {e: o for e, o in cur.entries.items() if e not in drop})
        result.sets[name] = change
    for name in destroy:
        check_name(name)
        cur = current.get(name)
        if cur is None:
            result.sets.setdefault(name, SetChange(name, action="none"))
            continue
        result.lines.append(f"destroy {name}")
        result.sets[name] = SetChange(name, action="destroy", removed=sorted(cur.entries, key=entry_sort_key),
                                      before=cur, header_before=cur.header_text())
    return result


def _normalize_removals(s: IPSet, entries: Iterable[str]) -> List[str]:
    out: List[str] = []
    for e in entries:
        out += normalize_entry(s.type, e, s.effective_family or "inet", port_range=None, set_name=s.name)
    return out


def _copy(s: IPSet, entries: Dict[str, EntryOptions]) -> IPSet:
    return IPSet(s.name, s.type, s.family, s.hashsize, s.maxelem, s.timeout, s.comment, s.counters, s.skbinfo,
                 s.forceadd, s.range, dict(s.options), entries)


def _plan_set(result: Plan, cur: Optional[IPSet], want: IPSet, entries: Dict[str, EntryOptions], drop: List[str],
              current: Mapping[str, IPSet], exclusive: bool, atomic: bool, recreate: bool) -> None:
    name = want.name
    for e in drop:
        entries.pop(e, None)
    header = _merged_header(cur, want)
    change = SetChange(name, before=cur, header_before=cur.header_text() if cur else "",
                       header_after=header.header_text())
    result.sets[name] = change
    lines = result.lines

    if cur is None or cur.type != want.type or cur.effective_family != want.effective_family:
        if cur is not None and not recreate:
            raise PlanError(
                f"set {name} exists as {cur.type} family {cur.effective_family or '-'}, wanted {want.type} "
                f"family {want.effective_family or '-'}: ipset cannot swap sets of different types or families. "
                f"Destroy it first (nothing may reference it), or allow recreating it.")
        order = sorted(entries, key=entry_sort_key)
        final = {e: _supported_options(header, entries[e]) for e in order}
        if cur is not None:
            lines.append(f"destroy {name}")
            change.removed = sorted(cur.entries, key=entry_sort_key)
        change.action = "create" if cur is None else "recreate"
        lines.append(header.create_line())
        lines += [_add_line(name, e, o) for e, o in final.items()]
        change.added = order
        change.after = _copy(header, final)
        return

    # Same type and family: the entries the set should end with.
    final: Dict[str, EntryOptions] = {}
    if not exclusive:
        for e, o in cur.entries.items():
            if e not in drop:
                final[e] = _supported_options(header, o)
    for e, o in entries.items():
        merged = dict(final.get(e, {}))
        merged.update(_supported_options(header, o))
        final[e] = merged
    order = sorted(final, key=entry_sort_key)
    final = {e: final[e] for e in order}
    change.added = [e for e in order if e not in cur.entries]
    change.removed = sorted((e for e in cur.entries if e not in final), key=entry_sort_key)
    change.updated = [e for e in order if e in entries and e in cur.entries and _differs(cur.entries[e], final[e])]
    change.after = _copy(header, final)

    header_changes = _header_diff(cur, want)
    content_changes = bool(change.added or change.removed or change.updated)
    if header_changes or (atomic and content_changes):
        tmp = temp_name(name)
        change.action = "swap"
        if header_changes:
            change.header_after = header.header_text()
        if tmp in current:
            lines.append(f"destroy {tmp}")
        lines.append(header.create_line(tmp))
        lines += [_add_line(tmp, e, o) for e, o in final.items()]
        lines.append(f"swap {tmp} {name}")
        lines.append(f"destroy {tmp}")
        return
    change.action = "update" if content_changes else "none"
    lines += [f"del {name} {e} -exist" for e in change.removed]
    lines += [_add_line(name, e, final[e]) for e in change.added + change.updated]


# ---------------------------------------------------------------------------- kernel I/O

MISSING_TOOL = "the ipset command was not found: install the ipset package on the host"


class IpsetToolMissing(IpsetError, Unavailable):
    """The ipset command is not installed (nothing here can have made a set)."""


class IpsetKernel:
    """Runs ``ipset``, optionally inside a network namespace (``ip netns exec NS``)."""

    def __init__(self, netns: str = "", binary: str = "ipset",
                 runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
        self.netns = netns
        self.prefix: List[str] = ["ip", "netns", "exec", netns] if netns else []
        self.binary = binary
        self._run = runner
        self.calls = 0  # ipset processes started (tests check the batching)

    def _ipset(self, args: Sequence[str], text: Optional[str] = None) -> subprocess.CompletedProcess:
        argv = self.prefix + [self.binary, *args]
        self.calls += 1
        try:
            proc = self._run(argv, input=text, capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            raise IpsetToolMissing(f"cannot run {argv[0]}: {exc}" if self.prefix else MISSING_TOOL) from None
        stderr = proc.stderr or ""
        if proc.returncode != 0 and "exec of" in stderr and "No such file" in stderr:
            raise IpsetToolMissing(MISSING_TOOL)  # `ip netns exec` could not find ipset
        return proc

    def names(self) -> List[str]:
        proc = self._ipset(["list", "-n"])
        if proc.returncode != 0:
            raise IpsetError(explain_error(proc.stderr, []))
        return [line.strip() for line in proc.stdout.splitlines() if line.strip()]

    def save(self, name: Optional[str] = None) -> Dict[str, IPSet]:
        """Every set (``name=None``), or just ``name`` (``{}`` if it does not exist)."""
        proc = self._ipset(["save"] + ([name] if name else []))
        if proc.returncode != 0:
            if name and "does not exist" in proc.stderr:
                return {}
            raise IpsetError(explain_error(proc.stderr, []))
        return parse_save(proc.stdout)

    def get(self, name: str) -> Optional[IPSet]:
        return self.save(name).get(name)

    def restore(self, lines: Union[Sequence[str], str]) -> float:
        """Run ``lines`` through ONE ``ipset restore``; return the seconds it took."""
        if isinstance(lines, str):
            lines = lines.splitlines()
        lines = list(lines)
        if not lines:
            return 0.0
        start = time.monotonic()
        proc = self._ipset(["restore"], "".join(line + "\n" for line in lines))
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            raise IpsetError(explain_error(proc.stderr, lines, restore=True))
        return elapsed

    def destroy(self, name: str) -> None:
        self.restore([f"destroy {name}"])

    def current(self, names: Iterable[str]) -> Dict[str, IPSet]:
        """The sets ``names`` (and their leftover temporary sets) that exist."""
        existing = set(self.names())
        out: Dict[str, IPSet] = {}
        for name in names:
            for n in (name, temp_name(name)):
                if n in existing and n not in out:
                    out.update(self.save(n))
        return out

    def sync(self, desired: Sequence[IPSet] = (), *, exclusive: bool = True, atomic: bool = False,
             remove: Optional[Mapping[str, Iterable[str]]] = None, destroy: Iterable[str] = (),
             recreate: bool = False, check_mode: bool = False) -> Plan:
        """Read the sets involved, :func:`plan`, and apply the plan in one restore."""
        destroy = list(destroy)
        remove = dict(remove or {})
        names = [s.name for s in desired] + list(remove) + destroy
        p = plan(self.current(names), desired, exclusive=exclusive, atomic=atomic, remove=remove,
                 destroy=destroy, recreate=recreate)
        if not check_mode and not p.empty:
            self.restore(p.lines)
        return p


_LINE_RE = re.compile(r"Error in line (\d+):\s*(.*)")


def explain_error(stderr: str, lines: Sequence[str], restore: bool = False) -> str:
    """A clear message for an ipset failure (naming the failing restore line)."""
    msg = (stderr or "").strip()
    msg = re.sub(r"^ipset v[\d.]+:\s*", "", msg)
    line_text = ""
    m = _LINE_RE.search(msg)
    if m and 0 < int(m.group(1)) <= len(lines):
        line_text = lines[int(m.group(1)) - 1]
        msg = m.group(2).strip()
    words = line_text.split()
    hint = ""
    if "in use by a kernel component" in msg:
        name = words[1] if len(words) > 1 else "the set"
        hint = (f"; set {name} is still referenced (an iptables/nftables rule `-m set --match-set {name}` "
                "or a list:set uses it): remove the references first")
    elif "set type not supported" in msg or "set type does not supported" in msg:
        stype = words[2] if len(words) > 2 and words[0] == "create" else "this set type"
        module = "ip_set_" + stype.replace(":", "_").replace(",", "") if ":" in stype else "ip_set_*"
        hint = f"; the kernel does not support {stype} (is the {module} kernel module available?)"
    elif "Cannot open session to kernel" in msg:
        hint = "; the kernel has no ipset support (ip_set module)"
    where = f" at line {m.group(1)} ({line_text[:200]})" if m and line_text else ""
    if restore:
        return (f"ipset restore failed{where}: {msg}{hint}"
                + ("; earlier lines of the batch may have been applied" if where else ""))
    return f"ipset failed: {msg}{hint}"
