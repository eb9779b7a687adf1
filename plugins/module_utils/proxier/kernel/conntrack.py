# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Conntrack cleanup for UDP and SCTP services, the way kube-proxy does it.

A UDP "connection" lives in the conntrack table as long as datagrams keep
coming, and NAT rules are only consulted for the first packet of a flow. So
when a service's endpoints change, a client that keeps sending from the same
address and port stays DNATed to the old (maybe deleted) endpoint, and a
client that sent to a service IP before the service had endpoints keeps its
un-NATed entry, and never reaches the new endpoints. TCP does not need this:
a dead backend resets or times out and the client reconnects.

After a sync the proxier calls :meth:`ConntrackCleaner.cleanup` with the
current state of every service port (:class:`ServiceTarget`). Like upstream
kube-proxy's ``pkg/proxy/conntrack/cleanup.go`` (``CleanStaleEntries``), it
is one reconciling pass, not a diff of changes: list the flows, then delete
every flow whose *original* destination is a service frontend IP:port (cluster
IP, external IPs, load-balancer IPs) or whose original destination port is a
service's nodePort, and whose *reply* source (the DNAT target) is not a
currently serving endpoint IP:port of that service port. This covers

* an endpoint removed or replaced: its flows go, flows to remaining endpoints stay;
* a nodePort flow whose endpoint went away;
* a service port going from no endpoints to some: flows to the service
  IP:port that were never DNATed (reply source = the service IP itself,
  e.g. sent before the rules existed) go, so the next datagram is NATed.

As upstream: ``endpoints`` must be the *serving* endpoints (ready, or
terminating but still serving), regardless of traffic policies and topology;
a service port with no serving endpoint is left alone (its flows are cleaned
once it has endpoints again; pass ``clear_without_endpoints=True`` to delete
them at once instead). Differences to upstream, both deliberate: SCTP service
ports are handled like UDP (upstream handles UDP only; older kube-proxy did
both), and a flow whose original destination is a known frontend IP:port is
judged by that frontend alone, not also by a nodePort that happens to have
the same number (upstream may delete such a flow twice over).

:func:`stale_flows` is the pure decision; :class:`ConntrackCleaner` dumps and
deletes through netlink. Dumping uses pyroute2's ``Conntrack`` with the
protocol filter applied in the kernel (Linux >= 5.8; older kernels fall back
to a full dump filtered here). Deleting sends ``IPCTNL_MSG_CT_DELETE``
messages, batched, on one netlink socket (opened inside the namespace with
pyroute2's netns helper): pyroute2 needs ~0.6 ms to encode each message,
which makes thousands of deletes take seconds, while batching takes a few
milliseconds. Each delete names the exact original tuple, zone and conntrack
id, so it hits the dumped entry only. (The kernel derives the id from the
entry's address and tuple, so an entry recreated with the same tuple can get
the old id back when it reuses the memory; deleting it is harmless, the next
packet is NATed afresh.) A flow that vanished meanwhile (ENOENT) is counted as
``vanished``, not reported as an error.

pyroute2 is imported only when the kernel is used, so this module (and
:func:`stale_flows`) works without it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ..errors import KernelError, Unavailable

PROTO_NUMBERS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": 132}
PROTO_NAMES = {number: name for name, number in PROTO_NUMBERS.items()}
CLEANUP_PROTOCOLS = ("UDP", "SCTP")  # the service protocols whose flows are cleaned
FAMILIES = (4, 6)

# netlink / ctnetlink constants (include/uapi/linux/netlink.h, netfilter/nfnetlink*.h)
NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLA_F_NESTED = 0x8000
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_DELETE = 2
CTA_TUPLE_ORIG = 1
CTA_ID = 12
CTA_ZONE = 18
CTA_TUPLE_IP = 1
CTA_TUPLE_PROTO = 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, seq, pid
NLMSGERR = struct.Struct("=i")
DELETE_BATCH = 128  # delete requests per datagram
ACK_TIMEOUT = 5.0  # seconds to wait for the kernel's acks of one batch
FILTER_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP)

Endpoint = Tuple[str, int]
FrontendKey = Tuple[str, str, int]  # (protocol, IP, port)
NodePortKey = Tuple[str, int]  # (protocol, nodePort)


class ConntrackError(KernelError):
    """The conntrack table could not be read or changed."""


class ConntrackUnavailable(ConntrackError, Unavailable):
    """pyroute2, which reads the conntrack table, is not installed."""


@dataclass(frozen=True)
class Flow:
    """One conntrack entry, as far as cleanup cares.

    ``proto`` is "UDP", "TCP", "SCTP" or the protocol number as a string.
    Addresses are in canonical text form (as the kernel dump gives them).
    ``reply_src``/``reply_sport`` is where replies come from, i.e. the DNAT
    target; ``zone`` and ``ct_id`` identify the entry for deletion.
    """

    proto: str
    orig_src: str
    orig_dst: str
    orig_dport: int
    reply_src: str
    reply_sport: int
    orig_sport: int = 0
    reply_dst: str = ""
    reply_dport: int = 0
    zone: int = 0
    ct_id: Optional[int] = None

    @property
    def family(self) -> int:
        return 6 if ":" in self.orig_src else 4

    def __str__(self) -> str:
        return (f"{self.proto} {_hostport(self.orig_src, self.orig_sport)} -> "
                f"{_hostport(self.orig_dst, self.orig_dport)} (reply from "
                f"{_hostport(self.reply_src, self.reply_sport)})")


@dataclass
class ServiceTarget:
    """The current state of one service port, for cleanup.

    ``ips``: the frontend IPs (cluster IP, external IPs, load-balancer IPs);
    ``port``: the service port; ``node_port``: 0 for none; ``endpoints``: the
    serving endpoints as (IP, port) - ready or terminating-but-serving, no
    matter the traffic policy. TCP targets are accepted and ignored.
    """

    proto: str
    ips: Iterable[str]
    port: int
    node_port: int = 0
    endpoints: Iterable[Endpoint] = field(default_factory=frozenset)


@dataclass
class CleanupResult:
    """What one cleanup (or delete) did; ``errors`` are human-readable, one per failure."""

    deleted: int = 0
    seconds: float = 0.0
    errors: List[str] = field(default_factory=list)
    vanished: int = 0  # stale flows that were gone when deleted (ENOENT)
    scanned: int = 0  # flows dumped and examined

    def add(self, other: CleanupResult) -> None:
        self.deleted += other.deleted
        self.vanished += other.vanished
        self.errors.extend(other.errors)


# --------------------------------------------------------------------------
# the decision (pure)


def proto_name(proto: Any) -> str:
    """"UDP" for "udp", "UDP" or 17; unknown numbers stay numbers (as text)."""
    if isinstance(proto, int):
        return PROTO_NAMES.get(proto, str(proto))
    return str(proto).upper()


def canonical_ip(ip: str) -> str:
    return ipaddress.ip_address(ip).compressed


def ip_family(ip: str) -> int:
    return ipaddress.ip_address(ip).version


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass
class _Index:
    frontends: Dict[FrontendKey, Set[Endpoint]]
    node_ports: Dict[NodePortKey, Set[Endpoint]]

    def __bool__(self) -> bool:
        return bool(self.frontends or self.node_ports)

    def families(self) -> Set[int]:
        found = {ip_family(ip) for _unused, ip, _unused in self.frontends}
        for endpoints in self.node_ports.values():
            found |= {ip_family(ip) for ip, _unused in endpoints}
        return found or set(FAMILIES)


def _index(services: Iterable[ServiceTarget], protocols: Sequence[str],
           clear_without_endpoints: bool) -> _Index:
    """Frontend IP:port and nodePort -> serving endpoints (union over duplicates)."""
    index = _Index({}, {})
    for svc in services:
        proto = proto_name(svc.proto)
        if proto not in protocols:
            continue
        endpoints = {(canonical_ip(ip), int(port)) for ip, port in svc.endpoints}
        if not endpoints and not clear_without_endpoints:
            continue  # upstream: a service without endpoints keeps its flows
        for ip in [svc.ips] if isinstance(svc.ips, str) else svc.ips:
            index.frontends.setdefault((proto, canonical_ip(ip), int(svc.port)), set()).update(endpoints)
        if svc.node_port:
            index.node_ports.setdefault((proto, int(svc.node_port)), set()).update(endpoints)
    return index


def _is_stale(flow: Flow, index: _Index) -> bool:
    backend = (flow.reply_src, flow.reply_sport)
    active = index.frontends.get((flow.proto, flow.orig_dst, flow.orig_dport))
    if active is not None:
        return backend not in active
    active = index.node_ports.get((flow.proto, flow.orig_dport))
    return active is not None and backend not in active


def stale_flows(flows: Iterable[Flow], services: Iterable[ServiceTarget], *,
                protocols: Sequence[str] = CLEANUP_PROTOCOLS,
                clear_without_endpoints: bool = False) -> List[Flow]:
    """The flows to delete: UDP/SCTP flows to a frontend or nodePort of ``services``
    whose reply source is not a serving endpoint of that service port.

    Pure. TCP flows and flows to anything else are never returned.
    """
    protocols = tuple(proto_name(p) for p in protocols)
    index = _index(services, protocols, clear_without_endpoints)
    if not index:
        return []
    return [flow for flow in flows if flow.proto in protocols and _is_stale(flow, index)]


# --------------------------------------------------------------------------
# reading the table (pyroute2)


def _pyroute2() -> Tuple[Any, Any, Any]:
    try:
        from pyroute2 import Conntrack
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple
    except ImportError as exc:
        raise ConntrackUnavailable(
            f"conntrack cleanup needs the Python package pyroute2 (pip install pyroute2): {exc}") from exc
    return Conntrack, NFCTAttrTuple, NetlinkError


def _address_family(family: int) -> int:
    return socket.AF_INET6 if family == 6 else socket.AF_INET


def _open_conntrack(netns: str, family: int) -> Any:
    conntrack_class = _pyroute2()[0]
    kwargs: Dict[str, Any] = {"nfgen_family": _address_family(family)}
    if netns:
        kwargs.update(netns=netns, flags=0)  # flags=0: never create a missing namespace
    return conntrack_class(**kwargs)


def _tuple_fields(tup: Any, family: int) -> Tuple[str, str, int, int, int]:
    ip = tup.get_attr("CTA_TUPLE_IP")
    proto = tup.get_attr("CTA_TUPLE_PROTO")
    src, dst = ("CTA_IP_V6_SRC", "CTA_IP_V6_DST") if family == 6 else ("CTA_IP_V4_SRC", "CTA_IP_V4_DST")
    return (ip.get_attr(src), ip.get_attr(dst), proto.get_attr("CTA_PROTO_NUM"),
            proto.get_attr("CTA_PROTO_SRC_PORT") or 0, proto.get_attr("CTA_PROTO_DST_PORT") or 0)


def flow_from_message(msg: Any) -> Optional[Flow]:
    """A :class:`Flow` from one pyroute2 ctnetlink dump message (None if unusable).

    Reads the port attributes itself: pyroute2's ``NFCTAttrTuple.from_netlink``
    only decodes ports for TCP and UDP, not SCTP.
    """
    family = 6 if msg["nfgen_family"] == socket.AF_INET6 else 4
    orig, reply = msg.get_attr("CTA_TUPLE_ORIG"), msg.get_attr("CTA_TUPLE_REPLY")
    if orig is None or reply is None:
        return None
    o_src, o_dst, number, o_sport, o_dport = _tuple_fields(orig, family)
    r_src, r_dst, _unused, r_sport, r_dport = _tuple_fields(reply, family)
    if family == 6:
        o_src, o_dst, r_src, r_dst = (canonical_ip(ip) for ip in (o_src, o_dst, r_src, r_dst))
    return Flow(proto=proto_name(number), orig_src=o_src, orig_dst=o_dst, orig_dport=o_dport,
                reply_src=r_src, reply_sport=r_sport, orig_sport=o_sport, reply_dst=r_dst,
                reply_dport=r_dport, zone=msg.get_attr("CTA_ZONE") or 0, ct_id=msg.get_attr("CTA_ID"))


def _dump_messages(ct: Any, family: int, proto: str, daddr: Optional[str], dport: Optional[int]) -> List[Any]:
    """Dump with the kernel-side filter, or everything if the kernel cannot filter."""
    _unused, attr_tuple, netlink_error = _pyroute2()
    number = PROTO_NUMBERS.get(proto)
    if number is None:
        return list(ct.dump())
    tuple_filter = attr_tuple(family=_address_family(family), proto=number, daddr=daddr, dport=dport)
    try:
        return list(ct.dump(tuple_orig=tuple_filter))  # materialise before anything else
    except netlink_error as exc:
        if exc.code not in FILTER_UNSUPPORTED:
            raise
        return list(ct.dump())


def _matches(flow: Flow, proto: str, daddr: Optional[str], dport: Optional[int]) -> bool:
    return (flow.proto == proto and (daddr is None or flow.orig_dst == daddr)
            and (dport is None or flow.orig_dport == dport))


def _dump_family(netns: str, family: int, protocols: Sequence[str], daddr: Optional[str] = None,
                 dport: Optional[int] = None) -> List[Flow]:
    netlink_error = _pyroute2()[2]
    try:
        ct = _open_conntrack(netns, family)
    except (OSError, netlink_error) as exc:
        raise ConntrackError(f"cannot open conntrack{_where(netns)}: {exc}") from exc
    flows: List[Flow] = []
    try:
        for proto in protocols:
            messages = _dump_messages(ct, family, proto, daddr, dport)
            flows.extend(f for f in map(flow_from_message, messages) if f and _matches(f, proto, daddr, dport))
    except (OSError, netlink_error) as exc:
        raise ConntrackError(f"cannot dump conntrack{_where(netns)} (IPv{family}): {exc}") from exc
    finally:
        ct.close()
    return flows


def _where(netns: str) -> str:
    return f" in netns {netns}" if netns else ""


def list_flows(netns: str = "", protocols: Sequence[str] = CLEANUP_PROTOCOLS,
               families: Iterable[int] = FAMILIES) -> List[Flow]:
    """Every flow of ``protocols`` ("UDP", "TCP", "SCTP", ...) in ``netns`` (""
    = this process's namespace). Raises :class:`ConntrackError`."""
    protos = [proto_name(p) for p in protocols]
    return [flow for family in families for flow in _dump_family(netns, family, protos)]


# --------------------------------------------------------------------------
# deleting (batched netlink requests)


def _nla(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _tuple_attr(flow: Flow) -> bytes:
    family = _address_family(flow.family)
    src_kind, dst_kind = (CTA_IP_V6_SRC, CTA_IP_V6_DST) if flow.family == 6 else (CTA_IP_V4_SRC, CTA_IP_V4_DST)
    ips = (_nla(src_kind, socket.inet_pton(family, flow.orig_src))
           + _nla(dst_kind, socket.inet_pton(family, flow.orig_dst)))
    ports = (_nla(CTA_PROTO_NUM, bytes([PROTO_NUMBERS[flow.proto]]))
             + _nla(CTA_PROTO_SRC_PORT, struct.pack("!H", flow.orig_sport))
             + _nla(CTA_PROTO_DST_PORT, struct.pack("!H", flow.orig_dport)))
    return _nla(CTA_TUPLE_ORIG | NLA_F_NESTED,
                _nla(CTA_TUPLE_IP | NLA_F_NESTED, ips) + _nla(CTA_TUPLE_PROTO | NLA_F_NESTED, ports))


def delete_message(flow: Flow, seq: int) -> bytes:
    """One ``IPCTNL_MSG_CT_DELETE`` request for exactly this entry.

    It always carries the full original tuple (without a tuple the kernel
    would flush the whole table), plus the zone and, if known, the conntrack
    id, so that another entry with the same tuple is (normally) not deleted.
    """
    if flow.proto not in PROTO_NUMBERS:
        raise ValueError(f"cannot delete {flow}: only TCP, UDP and SCTP flows are supported")
    body = struct.pack("=BBH", _address_family(flow.family), 0, 0) + _tuple_attr(flow)
    if flow.zone:
        body += _nla(CTA_ZONE, struct.pack("!H", flow.zone))
    if flow.ct_id is not None:
        body += _nla(CTA_ID, struct.pack("!I", flow.ct_id))
    kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def _netlink_socket(netns: str) -> socket.socket:
    if netns:
        try:
            from pyroute2.netns import create_socket
        except ImportError:
            _pyroute2()  # raises ConntrackUnavailable
            raise
        sock = create_socket(netns, family=socket.AF_NETLINK, socket_type=socket.SOCK_RAW,
                             proto=NETLINK_NETFILTER, flags=0)
    else:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)  # error acks without the request
    except OSError:
        pass
    sock.settimeout(ACK_TIMEOUT)
    sock.bind((0, 0))
    return sock


def _acks(data: bytes) -> Iterable[Tuple[int, int]]:
    """(sequence number, errno) of each ack in one netlink datagram."""
    offset = 0
    while offset + NLMSGHDR.size <= len(data):
        length, kind, _unused, seq, _unused = NLMSGHDR.unpack_from(data, offset)
        if length < NLMSGHDR.size:
            break
        if kind == NLMSG_ERROR:
            yield seq, -NLMSGERR.unpack_from(data, offset + NLMSGHDR.size)[0]
        offset += (length + 3) & ~3


def _delete_batch(sock: socket.socket, batch: Sequence[Flow], first_seq: int, result: CleanupResult) -> None:
    pending = {first_seq + i: flow for i, flow in enumerate(batch)}
    sock.send(b"".join(delete_message(flow, seq) for seq, flow in pending.items()))
    while pending:
        for seq, code in _acks(sock.recv(65536)):
            flow = pending.pop(seq, None)
            if flow is None:
                continue
            if code == 0:
                result.deleted += 1
            elif code == errno.ENOENT:
                result.vanished += 1
            else:
                result.errors.append(f"delete {flow}: {os.strerror(code)}")


def _delete(netns: str, flows: Sequence[Flow], batch_size: int = DELETE_BATCH) -> CleanupResult:
    result = CleanupResult()
    flows = [f for f in flows if f.proto in PROTO_NUMBERS]
    if not flows:
        return result
    try:
        sock = _netlink_socket(netns)
    except OSError as exc:
        result.errors.append(f"cannot open a netfilter netlink socket{_where(netns)}: {exc}")
        return result
    try:
        for start in range(0, len(flows), batch_size):
            _delete_batch(sock, flows[start:start + batch_size], start + 1, result)
    except OSError as exc:  # includes socket.timeout
        result.errors.append(f"deleting conntrack entries{_where(netns)} failed: {exc!r}")
    finally:
        sock.close()
    return result


def delete_flows(netns: str, proto: Any = None, orig_dst: Optional[str] = None,
                 orig_dport: Optional[int] = None, reply_src: Optional[str] = None) -> int:
    """Delete every TCP/UDP/SCTP flow in ``netns`` matching all given filters.

    ``proto`` ("UDP", "tcp", 132, ...; None = TCP, UDP and SCTP), ``orig_dst``
    and ``orig_dport`` match the original direction, ``reply_src`` the reply
    direction (the DNAT target). At least one filter is required (this is
    not a flush). Returns the number deleted; flows that vanished meanwhile
    are not counted. Raises :class:`ConntrackError` if anything failed.
    """
    if proto is None and orig_dst is None and orig_dport is None and reply_src is None:
        raise ValueError("delete_flows needs at least one filter")
    protocols = [proto_name(proto)] if proto is not None else list(PROTO_NUMBERS)
    unknown = [p for p in protocols if p not in PROTO_NUMBERS]
    if unknown:
        raise ValueError(f"unsupported protocol {unknown[0]!r}: TCP, UDP or SCTP")
    daddr = canonical_ip(orig_dst) if orig_dst is not None else None
    rsrc = canonical_ip(reply_src) if reply_src is not None else None
    known = [ip_family(ip) for ip in (daddr, rsrc) if ip is not None]
    families = known[:1] if known else list(FAMILIES)
    flows = [flow for family in families
             for flow in _dump_family(netns, family, protocols, daddr, orig_dport)
             if rsrc is None or flow.reply_src == rsrc]
    result = _delete(netns, flows)
    if result.errors:
        raise ConntrackError(f"{len(result.errors)} of {len(flows)} deletes failed{_where(netns)}; "
                             f"first: {result.errors[0]}")
    return result.deleted


# --------------------------------------------------------------------------


class ConntrackCleaner:
    """Deletes stale UDP/SCTP service flows in one network namespace ("" = own).

    Opens its netlink sockets per call, so one instance may be used from any
    thread (one call at a time).
    """

    def __init__(self, netns: str = "", protocols: Sequence[str] = CLEANUP_PROTOCOLS,
                 clear_without_endpoints: bool = False, batch_size: int = DELETE_BATCH) -> None:
        self.netns = netns
        self.protocols: Tuple[str, ...] = tuple(proto_name(p) for p in protocols)
        self.clear_without_endpoints = clear_without_endpoints
        self.batch_size = batch_size

    def list_flows(self, families: Iterable[int] = FAMILIES) -> List[Flow]:
        return list_flows(self.netns, self.protocols, families)

    def delete(self, flows: Sequence[Flow]) -> CleanupResult:
        """Delete exactly these flows (ENOENT counts as ``vanished``)."""
        start = time.monotonic()
        result = _delete(self.netns, flows, self.batch_size)
        result.seconds = time.monotonic() - start
        return result

    def cleanup(self, targets: Sequence[ServiceTarget]) -> CleanupResult:
        """Dump, decide (:func:`stale_flows`) and delete; never raises on kernel
        errors (they are in ``errors``), only :class:`ConntrackUnavailable`."""
        start = time.monotonic()
        result = CleanupResult()
        index = _index(targets, self.protocols, self.clear_without_endpoints)
        if index:
            self._cleanup(index, result)
        result.seconds = time.monotonic() - start
        return result

    def _cleanup(self, index: _Index, result: CleanupResult) -> None:
        _pyroute2()  # a missing pyroute2 is a setup problem: raise, do not report per sync
        flows: List[Flow] = []
        for family in sorted(index.families()):
            try:
                flows.extend(_dump_family(self.netns, family, self.protocols))
            except ConntrackError as exc:
                result.errors.append(str(exc))
        result.scanned = len(flows)
        stale = [flow for flow in flows if _is_stale(flow, index)]
        result.add(_delete(self.netns, stale, self.batch_size))


__all__ = [
    "CLEANUP_PROTOCOLS", "CleanupResult", "ConntrackCleaner", "ConntrackError", "ConntrackUnavailable",
    "Flow", "ServiceTarget", "delete_flows", "delete_message", "flow_from_message", "list_flows",
    "stale_flows",
]
