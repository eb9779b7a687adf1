# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The IPVS generic netlink protocol on the wire (linux/ip_vs.h), and a small
client for it: family lookup, dumps, and batched requests with one ack each.

This is the I/O half of :mod:`.ipvs`; it knows nothing of the model there and
works with plain values (``dict`` of attribute values, ``bytes`` addresses).

Why not pyroute2's ``IPVS``/``IPVSService``/``IPVSDest`` (0.9.7): its
``update`` command sends ``IPVS_CMD_DEL_SERVICE``; the persistence netmask is
typed as an IPv4 address (IPv6 services take a prefix length there); the
tunnel port is sent in host byte order (the kernel reads big endian); a
destination's address is decoded through ``IPVS_DEST_ATTR_ADDR_FAMILY``,
which the kernel sends after the address and older kernels not at all; and
every request is a separate round trip through its asyncio core (~0.5 ms
each, measured), with no way to batch thousands of changes. So messages are
packed here with :mod:`struct` and sent in batches on one ``NETLINK_GENERIC``
socket, each request acked separately (the kernel processes every message of
a datagram, in order, and acks each one). pyroute2 is used where it is good
and needed: opening that socket inside another network namespace
(``pyroute2.netns.create_socket``). Without ``netns`` nothing here needs
pyroute2. The unit tests check this codec against pyroute2's own IPVS message
parser and encoder.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import KernelError, Unavailable

NETLINK_GENERIC = 16
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10

NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF

GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2

IPVS_GENL_NAME = "IPVS"
IPVS_GENL_VERSION = 1

# commands
IPVS_CMD_NEW_SERVICE = 1
IPVS_CMD_SET_SERVICE = 2
IPVS_CMD_DEL_SERVICE = 3
IPVS_CMD_GET_SERVICE = 4
IPVS_CMD_NEW_DEST = 5
IPVS_CMD_SET_DEST = 6
IPVS_CMD_DEL_DEST = 7
IPVS_CMD_GET_DEST = 8
IPVS_CMD_SET_CONFIG = 12
IPVS_CMD_GET_CONFIG = 13
IPVS_CMD_GET_INFO = 15
IPVS_CMD_FLUSH = 17

# top-level attributes
IPVS_CMD_ATTR_SERVICE = 1
IPVS_CMD_ATTR_DEST = 2
IPVS_CMD_ATTR_TIMEOUT_TCP = 4  # u32 seconds; in SET_CONFIG requests and GET_CONFIG replies
IPVS_CMD_ATTR_TIMEOUT_TCP_FIN = 5
IPVS_CMD_ATTR_TIMEOUT_UDP = 6
IPVS_INFO_ATTR_VERSION = 1  # in IPVS_CMD_GET_INFO replies
IPVS_INFO_ATTR_CONN_TAB_SIZE = 2

# service attributes
IPVS_SVC_ATTR_AF = 1
IPVS_SVC_ATTR_PROTOCOL = 2
IPVS_SVC_ATTR_ADDR = 3
IPVS_SVC_ATTR_PORT = 4
IPVS_SVC_ATTR_FWMARK = 5
IPVS_SVC_ATTR_SCHED_NAME = 6
IPVS_SVC_ATTR_FLAGS = 7
IPVS_SVC_ATTR_TIMEOUT = 8
IPVS_SVC_ATTR_NETMASK = 9
IPVS_SVC_ATTR_STATS = 10
IPVS_SVC_ATTR_PE_NAME = 11

# destination attributes
IPVS_DEST_ATTR_ADDR = 1
IPVS_DEST_ATTR_PORT = 2
IPVS_DEST_ATTR_FWD_METHOD = 3
IPVS_DEST_ATTR_WEIGHT = 4
IPVS_DEST_ATTR_U_THRESH = 5
IPVS_DEST_ATTR_L_THRESH = 6
IPVS_DEST_ATTR_ACTIVE_CONNS = 7
IPVS_DEST_ATTR_INACT_CONNS = 8
IPVS_DEST_ATTR_PERSIST_CONNS = 9
IPVS_DEST_ATTR_ADDR_FAMILY = 11
IPVS_DEST_ATTR_TUN_TYPE = 13
IPVS_DEST_ATTR_TUN_PORT = 14
IPVS_DEST_ATTR_TUN_FLAGS = 15

NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, seq, pid
GENLMSGHDR = struct.Struct("=BBH")  # cmd, version, reserved
NLATTR = struct.Struct("=HH")  # length, type
SVC_FLAGS = struct.Struct("=II")  # struct ip_vs_flags { __u32 flags; __u32 mask; }

ADDRESS_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}
FAMILY_OF_AF = {socket.AF_INET: 4, socket.AF_INET6: 6}

DEFAULT_TIMEOUT = 5.0  # seconds to wait for the kernel's answer
DEFAULT_BATCH = 128  # requests per datagram
RECV_BUFFER = 1 << 17


class NetlinkError(OSError, KernelError):
    """The kernel answered a request with an error (``errno`` is set)."""

    def __init__(self, code: int, what: str = "") -> None:
        super().__init__(code, os.strerror(code))
        self.what = what

    def __str__(self) -> str:
        return f"{self.what}: {self.strerror}" if self.what else str(self.strerror)


class Pyroute2Missing(Unavailable, ImportError):
    """A network namespace was asked for and pyroute2 is not installed."""


# --------------------------------------------------------------------------
# encoding


def nla(kind: int, payload: bytes) -> bytes:
    length = NLATTR.size + len(payload)
    return NLATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def nla_nested(kind: int, payload: bytes) -> bytes:
    return nla(kind | NLA_F_NESTED, payload)


def nla_u8(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("=B", value))


def nla_u16(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("=H", value))


def nla_be16(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("!H", value))


def nla_u32(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("=I", value))


def nla_string(kind: int, value: str) -> bytes:
    return nla(kind, value.encode("ascii") + b"\0")


def address_bytes(family: int, address: str) -> bytes:
    return socket.inet_pton(ADDRESS_FAMILIES[family], address)


def netmask_bytes(family: int, prefix: int) -> bytes:
    """IPVS_SVC_ATTR_NETMASK: the kernel reads 4 raw bytes (``nla_get_be32``).
    IPv4: the mask in network order; IPv6: the prefix length as a host-order
    u32 (what ipvsadm sends, and what the kernel checks against 1..128)."""
    if family == 6:
        return struct.pack("=I", prefix)
    return struct.pack("!I", (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF)


def service_key_attrs(svc: Dict[str, Any]) -> bytes:
    """The attributes that identify a virtual service: AF + fwmark, or AF +
    protocol + address + port. ``svc`` keys: family (4/6), fwmark, protocol
    (number), address (text), port."""
    out = nla_u16(IPVS_SVC_ATTR_AF, ADDRESS_FAMILIES[svc["family"]])
    if svc.get("fwmark"):
        return out + nla_u32(IPVS_SVC_ATTR_FWMARK, svc["fwmark"])
    return (out + nla_u16(IPVS_SVC_ATTR_PROTOCOL, svc["protocol"])
            + nla(IPVS_SVC_ATTR_ADDR, address_bytes(svc["family"], svc["address"]))
            + nla_be16(IPVS_SVC_ATTR_PORT, svc["port"]))


def service_attrs(svc: Dict[str, Any], full: bool) -> bytes:
    """IPVS_CMD_ATTR_SERVICE. ``full`` adds what NEW/SET need: scheduler,
    flags (all bits: mask ~0), persistence timeout and netmask, and the
    persistence engine if any."""
    body = service_key_attrs(svc)
    if full:
        body += (nla_string(IPVS_SVC_ATTR_SCHED_NAME, svc["scheduler"])
                 + nla(IPVS_SVC_ATTR_FLAGS, SVC_FLAGS.pack(svc["flags"], 0xFFFFFFFF))
                 + nla_u32(IPVS_SVC_ATTR_TIMEOUT, svc["timeout"])
                 + nla(IPVS_SVC_ATTR_NETMASK, netmask_bytes(svc["family"], svc["netmask"])))
        if svc.get("pe_name"):
            body += nla_string(IPVS_SVC_ATTR_PE_NAME, svc["pe_name"])
    return nla_nested(IPVS_CMD_ATTR_SERVICE, body)


def dest_attrs(dest: Dict[str, Any], full: bool) -> bytes:
    """IPVS_CMD_ATTR_DEST. ``dest`` keys: family, address, port, and with
    ``full`` fwd_method, weight, u_thresh, l_thresh, tun_type, tun_port,
    tun_flags (the tunnel attributes are only sent when set, so that kernels
    older than 5.2 never see them)."""
    body = (nla(IPVS_DEST_ATTR_ADDR, address_bytes(dest["family"], dest["address"]))
            + nla_be16(IPVS_DEST_ATTR_PORT, dest["port"])
            + nla_u16(IPVS_DEST_ATTR_ADDR_FAMILY, ADDRESS_FAMILIES[dest["family"]]))
    if full:
        body += (nla_u32(IPVS_DEST_ATTR_FWD_METHOD, dest["fwd_method"])
                 + nla_u32(IPVS_DEST_ATTR_WEIGHT, dest["weight"])
                 + nla_u32(IPVS_DEST_ATTR_U_THRESH, dest["u_thresh"])
                 + nla_u32(IPVS_DEST_ATTR_L_THRESH, dest["l_thresh"]))
        if dest.get("tun_type") or dest.get("tun_port") or dest.get("tun_flags"):
            body += (nla_u8(IPVS_DEST_ATTR_TUN_TYPE, dest.get("tun_type", 0))
                     + nla_be16(IPVS_DEST_ATTR_TUN_PORT, dest.get("tun_port", 0))
                     + nla_u16(IPVS_DEST_ATTR_TUN_FLAGS, dest.get("tun_flags", 0)))
    return nla_nested(IPVS_CMD_ATTR_DEST, body)


def timeout_attrs(tcp: int, tcp_fin: int, udp: int) -> bytes:
    """IPVS_CMD_SET_CONFIG attributes. The kernel keeps a timeout whose value
    is 0 (``ip_vs_set_timeout`` only writes non-zero ones), as ``ipvsadm --set``."""
    return (nla_u32(IPVS_CMD_ATTR_TIMEOUT_TCP, tcp) + nla_u32(IPVS_CMD_ATTR_TIMEOUT_TCP_FIN, tcp_fin)
            + nla_u32(IPVS_CMD_ATTR_TIMEOUT_UDP, udp))


def decode_timeouts(attrs: Dict[int, bytes]) -> Tuple[int, int, int]:
    """(tcp, tcp_fin, udp) seconds from IPVS_CMD_GET_CONFIG's reply attributes."""
    return (_u32(attrs.get(IPVS_CMD_ATTR_TIMEOUT_TCP)), _u32(attrs.get(IPVS_CMD_ATTR_TIMEOUT_TCP_FIN)),
            _u32(attrs.get(IPVS_CMD_ATTR_TIMEOUT_UDP)))


def genl_payload(cmd: int, attrs: bytes = b"", version: int = IPVS_GENL_VERSION) -> bytes:
    return GENLMSGHDR.pack(cmd, version, 0) + attrs


def nlmsg(kind: int, flags: int, seq: int, payload: bytes) -> bytes:
    """One netlink message, padded so that the next one starts aligned."""
    length = NLMSGHDR.size + len(payload)
    return NLMSGHDR.pack(length, kind, flags, seq, 0) + payload + b"\0" * (-length % 4)


# --------------------------------------------------------------------------
# decoding


def parse_attrs(data: bytes, offset: int = 0, end: Optional[int] = None) -> Dict[int, bytes]:
    """Netlink attributes in ``data[offset:end]`` as {type: payload}."""
    end = len(data) if end is None else end
    attrs: Dict[int, bytes] = {}
    while offset + NLATTR.size <= end:
        length, kind = NLATTR.unpack_from(data, offset)
        if length < NLATTR.size or offset + length > end:
            break
        attrs[kind & NLA_TYPE_MASK] = bytes(data[offset + NLATTR.size:offset + length])
        offset += (length + 3) & ~3
    return attrs


def _u8(raw: Optional[bytes], default: int = 0) -> int:
    return raw[0] if raw else default


def _u16(raw: Optional[bytes], default: int = 0) -> int:
    return struct.unpack_from("=H", raw)[0] if raw and len(raw) >= 2 else default


def _be16(raw: Optional[bytes], default: int = 0) -> int:
    return struct.unpack_from("!H", raw)[0] if raw and len(raw) >= 2 else default


def _u32(raw: Optional[bytes], default: int = 0) -> int:
    return struct.unpack_from("=I", raw)[0] if raw and len(raw) >= 4 else default


def _string(raw: Optional[bytes]) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", "replace") if raw else ""


def _address(family: int, raw: Optional[bytes]) -> str:
    if not raw:
        return ""
    size = 16 if family == 6 else 4
    return socket.inet_ntop(ADDRESS_FAMILIES[family], raw[:size].ljust(size, b"\0"))


def _netmask(family: int, raw: Optional[bytes]) -> int:
    if not raw or len(raw) < 4:
        return 128 if family == 6 else 32
    if family == 6:
        return struct.unpack_from("=I", raw)[0]
    mask = struct.unpack_from("!I", raw)[0]
    return 32 - ((~mask & 0xFFFFFFFF).bit_length())  # leading one bits


def decode_service(attrs: Dict[int, bytes]) -> Dict[str, Any]:
    """One IPVS_CMD_ATTR_SERVICE payload (already split) as plain values."""
    af = _u16(attrs.get(IPVS_SVC_ATTR_AF), socket.AF_INET)
    family = FAMILY_OF_AF.get(af, 0)
    flags, _unused = SVC_FLAGS.unpack_from(attrs[IPVS_SVC_ATTR_FLAGS]) if len(
        attrs.get(IPVS_SVC_ATTR_FLAGS, b"")) >= SVC_FLAGS.size else (0, 0)
    fwmark = _u32(attrs.get(IPVS_SVC_ATTR_FWMARK))
    return {
        "family": family,
        "fwmark": fwmark,
        "protocol": 0 if fwmark else _u16(attrs.get(IPVS_SVC_ATTR_PROTOCOL)),
        "address": "" if fwmark or not family else _address(family, attrs.get(IPVS_SVC_ATTR_ADDR)),
        "port": 0 if fwmark else _be16(attrs.get(IPVS_SVC_ATTR_PORT)),
        "scheduler": _string(attrs.get(IPVS_SVC_ATTR_SCHED_NAME)),
        "flags": flags,
        "timeout": _u32(attrs.get(IPVS_SVC_ATTR_TIMEOUT)),
        "netmask": _netmask(family, attrs.get(IPVS_SVC_ATTR_NETMASK)),
        "pe_name": _string(attrs.get(IPVS_SVC_ATTR_PE_NAME)),
    }


def decode_dest(attrs: Dict[int, bytes], service_family: int) -> Dict[str, Any]:
    """One IPVS_CMD_ATTR_DEST payload. Kernels before 4.19 send no address
    family: the destination then has the service's."""
    af = _u16(attrs.get(IPVS_DEST_ATTR_ADDR_FAMILY), 0)
    family = FAMILY_OF_AF.get(af, service_family)
    return {
        "family": family,
        "address": _address(family, attrs.get(IPVS_DEST_ATTR_ADDR)),
        "port": _be16(attrs.get(IPVS_DEST_ATTR_PORT)),
        "fwd_method": _u32(attrs.get(IPVS_DEST_ATTR_FWD_METHOD)),
        "weight": _u32(attrs.get(IPVS_DEST_ATTR_WEIGHT)),
        "u_thresh": _u32(attrs.get(IPVS_DEST_ATTR_U_THRESH)),
        "l_thresh": _u32(attrs.get(IPVS_DEST_ATTR_L_THRESH)),
        "active_conns": _u32(attrs.get(IPVS_DEST_ATTR_ACTIVE_CONNS)),
        "inact_conns": _u32(attrs.get(IPVS_DEST_ATTR_INACT_CONNS)),
        "persist_conns": _u32(attrs.get(IPVS_DEST_ATTR_PERSIST_CONNS)),
        "tun_type": _u8(attrs.get(IPVS_DEST_ATTR_TUN_TYPE)),
        "tun_port": _be16(attrs.get(IPVS_DEST_ATTR_TUN_PORT)),
        "tun_flags": _u16(attrs.get(IPVS_DEST_ATTR_TUN_FLAGS)),
    }


def split_messages(data: bytes) -> Iterable[Tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) of each netlink message in a datagram."""
    offset = 0
    while offset + NLMSGHDR.size <= len(data):
        length, kind, flags, seq, _unused = NLMSGHDR.unpack_from(data, offset)
        if length < NLMSGHDR.size or offset + length > len(data):
            break
        yield kind, flags, seq, bytes(data[offset + NLMSGHDR.size:offset + length])
        offset += (length + 3) & ~3


def genl_attrs(payload: bytes) -> Tuple[int, Dict[int, bytes]]:
    """(command, top-level attributes) of a generic netlink payload."""
    cmd = payload[0] if payload else 0
    return cmd, parse_attrs(payload, GENLMSGHDR.size)


# --------------------------------------------------------------------------
# the socket


def open_socket(netns: str = "", proto: int = NETLINK_GENERIC) -> socket.socket:
    """A raw netlink socket (NETLINK_GENERIC unless ``proto`` says otherwise), in
    network namespace ``netns`` if given (through pyroute2; ``flags=0``: never
    create a missing namespace)."""
    if netns:
        try:
            from pyroute2.netns import create_socket
        except ImportError as exc:
            raise Pyroute2Missing(f"a network namespace needs the Python package pyroute2: {exc}") from exc
        sock = create_socket(netns, family=socket.AF_NETLINK, socket_type=socket.SOCK_RAW,
                             proto=proto, flags=0)
    else:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, proto)
    try:
        sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)  # error acks without the request echoed
    except OSError:
        pass
    sock.bind((0, 0))
    return sock


class SeqSocket:
    """A netlink socket with the sequence numbers and bounded receive every connection here
    uses (IPVS over generic netlink, kube-ipvs0 addresses over rtnetlink)."""

    sock: socket.socket
    seq: int

    def close(self) -> None:
        self.sock.close()

    def _next_seq(self) -> int:
        self.seq = (self.seq % 0x7FFFFFFF) + 1
        return self.seq

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(RECV_BUFFER)
        except TimeoutError as exc:
            raise NetlinkError(errno.ETIMEDOUT, "no answer from the kernel") from exc


class GenlConnection(SeqSocket):
    """One NETLINK_GENERIC socket talking to the IPVS family.

    Not thread-safe: use one per thread (or serialise calls). ``timeout``
    bounds each wait for the kernel's answer (``socket.timeout`` is raised as
    ``NetlinkError(ETIMEDOUT)``).
    """

    def __init__(self, netns: str = "", timeout: float = DEFAULT_TIMEOUT,
                 family_name: str = IPVS_GENL_NAME) -> None:
        self.sock = open_socket(netns)
        self.sock.settimeout(timeout)
        self.seq = 0
        try:
            self.family_id = self.resolve_family(family_name)
        except BaseException:
            self.sock.close()
            raise

    def _exchange(self, msg_type: int, flags: int, payload: bytes, what: str) -> List[Tuple[int, bytes]]:
        """Send one request; return the (type, body) answers to it (matched by sequence
        number) up to its acknowledgement or the end of the dump. An error code in the
        ack or the end marker raises NetlinkError(code, what)."""
        seq = self._next_seq()
        self.sock.send(nlmsg(msg_type, flags, seq, payload))
        out: List[Tuple[int, bytes]] = []
        while True:
            for kind, _flags, rseq, body in split_messages(self._recv()):
                if rseq != seq:
                    continue
                if kind in (NLMSG_ERROR, NLMSG_DONE):
                    code = -struct.unpack_from("=i", body)[0] if len(body) >= 4 else 0
                    if code:
                        raise NetlinkError(code, what)
                    return out
                out.append((kind, body))

    def resolve_family(self, name: str) -> int:
        """The generic netlink family id (ENOENT: no such family: for IPVS,
        the kernel has no ip_vs module; the lookup itself asks the kernel to
        load it)."""
        what = f"generic netlink family {name}"
        payload = genl_payload(CTRL_CMD_GETFAMILY, nla_string(CTRL_ATTR_FAMILY_NAME, name), version=1)
        for kind, body in self._exchange(GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK, payload, what):
            family_id = _u16(genl_attrs(body)[1].get(CTRL_ATTR_FAMILY_ID)) if kind == GENL_ID_CTRL else None
            if family_id:
                return family_id
        raise NetlinkError(errno.ENOENT, what)

    def dump(self, cmd: int, attrs: bytes = b"") -> List[Dict[int, bytes]]:
        """A dump request; the top-level attributes of every answer."""
        answers = self._exchange(self.family_id, NLM_F_REQUEST | NLM_F_DUMP, genl_payload(cmd, attrs), "dump")
        return [genl_attrs(body)[1] for kind, body in answers if kind == self.family_id]

    def get(self, cmd: int, attrs: bytes = b"") -> Dict[int, bytes]:
        """A single-answer request (GET_SERVICE, GET_INFO): its attributes."""
        answers = self._exchange(self.family_id, NLM_F_REQUEST | NLM_F_ACK, genl_payload(cmd, attrs), "")
        found = [genl_attrs(body)[1] for kind, body in answers if kind == self.family_id]
        return found[-1] if found else {}

    def request_batch(self, payloads: Sequence[bytes], batch_size: int = DEFAULT_BATCH) -> List[int]:
        """Send generic netlink payloads (each a request wanting an ack),
        ``batch_size`` per datagram; the errno of each (0 = done), in order.
        The kernel handles a datagram's messages one after the other, so a
        request may depend on an earlier one (a service before its dests)."""
        codes: List[int] = []
        for start in range(0, len(payloads), batch_size):
            codes.extend(self._batch(payloads[start:start + batch_size]))
        return codes

    def _batch(self, payloads: Sequence[bytes]) -> List[int]:
        seqs = [self._next_seq() for _unused in payloads]
        self.sock.send(b"".join(nlmsg(self.family_id, NLM_F_REQUEST | NLM_F_ACK, seq, payload)
                                for seq, payload in zip(seqs, payloads)))
        pending = {seq: i for i, seq in enumerate(seqs)}
        codes = [0] * len(payloads)
        while pending:
            for kind, _flags, seq, body in split_messages(self._recv()):
                if kind != NLMSG_ERROR or seq not in pending:
                    continue
                codes[pending.pop(seq)] = -struct.unpack_from("=i", body)[0]
        return codes


__all__ = [
    "DEFAULT_BATCH", "DEFAULT_TIMEOUT", "GenlConnection", "NetlinkError", "Pyroute2Missing",
    "decode_dest", "decode_service", "decode_timeouts", "dest_attrs", "genl_payload", "nlmsg", "parse_attrs",
    "service_attrs", "service_key_attrs", "split_messages", "timeout_attrs",
]
