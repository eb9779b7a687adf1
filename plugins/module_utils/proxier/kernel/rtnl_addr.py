# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A link's addresses over raw rtnetlink (linux/if_addr.h, linux/rtnetlink.h): one
RTM_GETADDR dump lists them, and RTM_NEWADDR/RTM_DELADDR requests go many to a
datagram, each with its own ack matched by sequence number.

Why not pyroute2's ``IPRoute.get_addr``/``addr``: IPVS mode binds every service VIP to
``kube-ipvs0``, 5,000 addresses at 5,000 services, and pyroute2 (0.9.7) decodes every
attribute of every dumped message into objects and makes one round trip per change
through its asyncio core: listing and binding them took 41-113 s of a full sync in the
VM lab (benchmarks/results/ipvs_scale.txt). Here a dump reads only the fixed header and
the address attribute, and a batch of changes costs one send and one receive loop.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .ipvs_netlink import (
    DEFAULT_TIMEOUT,
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NetlinkError,
    SeqSocket,
    nla,
    nlmsg,
    open_socket,
    parse_attrs,
    split_messages,
)

NETLINK_ROUTE = 0
RTM_NEWLINK = 16
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_DELADDR = 21
RTM_GETADDR = 22
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
IFA_ADDRESS = 1
IFA_LOCAL = 2
IFLA_IFNAME = 3

IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
FAMILIES = {socket.AF_INET: 32, socket.AF_INET6: 128}  # family -> host prefix length
DEFAULT_BATCH = 128  # requests per datagram (their acks must fit the receive buffer)
SO_RCVBUF_SIZE = 1 << 22  # room for a dump's and a batch's answers queued at once


def _text(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw)
    return str(ipaddress.IPv6Address(raw))  # as ipaddress spells it (what callers compare with)


def address_request(index: int, ip: str) -> bytes:
    """The RTM_NEWADDR/RTM_DELADDR body binding ``ip`` as a host address (/32, /128),
    scope global, as ``ip addr add IP dev LINK`` sends it."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    raw = socket.inet_pton(family, ip)
    return IFADDRMSG.pack(family, FAMILIES[family], 0, 0, index) + nla(IFA_LOCAL, raw) + nla(IFA_ADDRESS, raw)


class RtnlAddresses(SeqSocket):
    """One NETLINK_ROUTE socket (in ``netns`` if given). Not thread-safe."""

    def __init__(self, netns: str = "", timeout: float = DEFAULT_TIMEOUT) -> None:
        self.sock = open_socket(netns, NETLINK_ROUTE)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SO_RCVBUF_SIZE)
        except OSError:
            pass  # the default buffer still works with DEFAULT_BATCH
        self.sock.settimeout(timeout)
        self.seq = 0

    def link_index(self, name: str) -> Optional[int]:
        """The link's ifindex, None if there is no such link (one RTM_GETLINK request)."""
        seq = self._next_seq()
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + nla(IFLA_IFNAME, name.encode() + b"\0")
        self.sock.send(nlmsg(RTM_GETLINK, NLM_F_REQUEST, seq, body))
        while True:
            for kind, _flags, rseq, payload in split_messages(self._recv()):
                if rseq != seq:
                    continue
                if kind == RTM_NEWLINK:
                    return IFINFOMSG.unpack_from(payload)[2]
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code in (errno.ENODEV, errno.ENOENT):
                        return None
                    raise NetlinkError(code, f"link {name}")

    def addresses(self, index: int) -> Set[str]:
        """Every address on link ``index`` (IFA_LOCAL, else IFA_ADDRESS), both families,
        from one dump of all addresses (filtered here on the fixed header)."""
        seq = self._next_seq()
        self.sock.send(nlmsg(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq,
                             IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)))
        out: Set[str] = set()
        unpack = IFADDRMSG.unpack_from
        while True:
            for kind, _flags, rseq, payload in split_messages(self._recv()):
                if rseq != seq:
                    continue
                if kind == RTM_NEWADDR:
                    family, _plen, _aflags, _scope, idx = unpack(payload)
                    if idx != index:
                        continue
                    attrs = parse_attrs(payload, IFADDRMSG.size)
                    raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
                    if raw:
                        out.add(_text(family, raw))
                elif kind in (NLMSG_DONE, NLMSG_ERROR):
                    code = -struct.unpack_from("=i", payload)[0] if len(payload) >= 4 else 0
                    if code:
                        raise NetlinkError(code, "address dump")
                    return out

    def change(self, add: bool, index: int, addresses: Sequence[str],
               batch_size: int = DEFAULT_BATCH) -> List[Tuple[str, int]]:
        """Bind (``add``) or unbind ``addresses`` on link ``index``, ``batch_size``
        requests per datagram; (address, errno) of each in order, 0 = done. Binding an
        address already there answers EEXIST (NLM_F_EXCL), as ``ip addr add`` does."""
        kind, flags = ((RTM_NEWADDR, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL) if add
                       else (RTM_DELADDR, NLM_F_REQUEST | NLM_F_ACK))
        out: List[Tuple[str, int]] = []
        for start in range(0, len(addresses), batch_size):
            chunk = addresses[start:start + batch_size]
            seqs = [self._next_seq() for _ip in chunk]
            self.sock.send(b"".join(nlmsg(kind, flags, seq, address_request(index, ip))
                                    for seq, ip in zip(seqs, chunk)))
            pending: Dict[int, int] = {seq: i for i, seq in enumerate(seqs)}
            codes = [0] * len(chunk)
            while pending:
                for rkind, _flags, seq, payload in split_messages(self._recv()):
                    if rkind == NLMSG_ERROR and seq in pending:
                        codes[pending.pop(seq)] = -struct.unpack_from("=i", payload)[0]
            out.extend(zip(chunk, codes))
        return out
