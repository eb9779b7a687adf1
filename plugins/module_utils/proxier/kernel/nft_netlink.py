# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""How many rules one nftables chain holds, asked of the kernel over netlink.

``nft list chain`` fetches a cache of the whole table first (0.5-0.7 s at 10,000 services,
docs/nftables-mode.md); a rule dump request that names the table and the chain makes the kernel
look the chain up by name and dump only its rules, so the cost does not grow with the
table. The nftables mode's every-second check uses it to see a flushed table or chain.
Imports nothing above kernel/.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import KernelError, Unavailable

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWTABLE = 0
NFT_MSG_GETTABLE = 1
NFTA_TABLE_NAME = 1
NLM_F_ACK = 0x4
NFT_MSG_NEWRULE = 6
NFT_MSG_GETRULE = 7
NFTA_RULE_TABLE = 1
NFTA_RULE_CHAIN = 2
NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY = 1
NFTA_SET_ELEM_EXPIRATION = 5
NFTA_DATA_VALUE = 1
NLA_TYPE_MASK = 0x3FFF
NLA_F_NESTED = 0x8000
NFT_MSG_DELSETELEM = 14
NFTA_SET_ELEM_DATA = 2
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11
NLM_F_CREATE = 0x400
# (verb "add"/"delete", set name, [(key bytes, data bytes or b"" for a set or a delete)])
ElementOps = List[Tuple[str, str, List[Tuple[bytes, bytes]]]]
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
FAMILIES = {"ip": 2, "ip6": 10, "inet": 1}
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid


# Elements per NEWSETELEM/DELSETELEM message: the element list is one attribute with a
# 16-bit length (an IPv4 map element ~31 bytes, IPv6 ~44: 2,100 / 1,490 would overflow it).
ELEMENTS_PER_MESSAGE = 500
# A batch is one send(): above this it may exceed the socket's send buffer (212,992 bytes by
# default), and such a change (thousands of endpoints at once) goes to nft -f instead.
MAX_BATCH_BYTES = 128 * 1024


class NetlinkError(KernelError):
    """The kernel refused the dump or the socket failed."""


def _replies(sock: socket.socket) -> Iterator[Tuple[int, int, bytes]]:
    """(type, sequence number, payload) of every netlink message the socket receives, one
    receive at a time, until the caller stops (the socket's timeout bounds each wait)."""
    while True:
        data = sock.recv(1 << 16)
        offset = 0
        while offset + _HDR.size <= len(data):
            length, mtype, _flags, mseq, _pid = _HDR.unpack_from(data, offset)
            if length < _HDR.size:
                raise NetlinkError("malformed netlink message")
            yield mtype, mseq, data[offset + _HDR.size:offset + length]
            offset += (length + 3) & ~3


def _attr(kind: int, value: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(value), kind) + value
    return data + b"\0" * (-len(data) % 4)


def _attrs(data: bytes, start: int = 0, end: Optional[int] = None) -> Iterator[Tuple[int, bytes]]:
    """(type, payload) of the netlink attributes in ``data[start:end]``."""
    end = len(data) if end is None else end
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, start)
        if length < 4:
            break
        yield kind & NLA_TYPE_MASK, data[start + 4:start + length]
        start += (length + 3) & ~3


def _elements(payload: bytes) -> List[Tuple[bytes, Optional[int]]]:
    """(key, milliseconds until expiry or None) of one NEWSETELEM message body."""
    out: List[Tuple[bytes, Optional[int]]] = []
    for kind, value in _attrs(payload, 4):  # after the nfgenmsg header
        if kind != NFTA_SET_ELEM_LIST_ELEMENTS:
            continue
        for ekind, elem in _attrs(value):
            if ekind != NFTA_LIST_ELEM:
                continue
            key = b""
            expires: Optional[int] = None
            for akind, attr in _attrs(elem):
                if akind == NFTA_SET_ELEM_KEY:
                    key = next((v for k, v in _attrs(attr) if k == NFTA_DATA_VALUE), b"")
                elif akind == NFTA_SET_ELEM_EXPIRATION and len(attr) == 8:
                    (expires,) = struct.unpack(">Q", attr)
            if key:
                out.append((key, expires))
    return out


def _nested(kind: int, value: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, value)


def _element_message(family: str, table: str, name: str, elems: List[Tuple[bytes, bytes]]) -> bytes:
    body = b""
    for key, data in elems:
        attrs = _nested(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, key))
        if data:
            attrs += _nested(NFTA_SET_ELEM_DATA, _attr(NFTA_DATA_VALUE, data))
        body += _nested(NFTA_LIST_ELEM, attrs)
    return (struct.pack("=BBH", FAMILIES[family], 0, 0) + _attr(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0")
            + _attr(NFTA_SET_ELEM_LIST_SET, name.encode() + b"\0") + _nested(NFTA_SET_ELEM_LIST_ELEMENTS, body))


def open_socket(netns: str = "") -> socket.socket:
    """A NETLINK_NETFILTER socket, in ``netns`` (a name under /run/netns) if given."""
    if netns:
        try:
            from pyroute2.netns import create_socket
        except ImportError as exc:
            raise Unavailable(f"a network namespace needs pyroute2: {exc}") from exc
        return create_socket(netns, family=socket.AF_NETLINK, socket_type=socket.SOCK_RAW,
                             proto=NETLINK_NETFILTER, flags=0)
    return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)


class RuleCounter:
    """Counts a chain's rules; one socket, opened on first use and kept."""

    def __init__(self, netns: str = "", timeout: float = 5.0) -> None:
        self.netns = netns
        self.timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._seq = 0
        self._lock = threading.Lock()

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = open_socket(self.netns)
            sock.settimeout(self.timeout)
            sock.bind((0, 0))
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def rule_count(self, family: str, table: str, chain: str) -> Optional[int]:
        """The number of rules of ``chain`` (0 when the chain is not there), None when the
        kernel says the table is not there."""
        with self._lock:
            try:
                return self._dump(family, table, chain)
            except OSError as e:
                self.close()  # a timed-out socket may still get the old answer: start afresh
                raise NetlinkError(f"nftables rule dump of {family} {table} {chain} failed: {e}") from None

    def table_exists(self, family: str, table: str) -> bool:
        """Whether the kernel has the table: one GETTABLE request naming it. ``nft list
        tables`` fetches every rule of every table first: 7-9 s of system time beside
        iptables-nft's 110,000 rules at 10,000 services, at every start of the other modes."""
        with self._lock:
            try:
                return self._get_table(family, table)
            except OSError as e:
                self.close()
                raise NetlinkError(f"nftables table lookup of {family} {table} failed: {e}") from None

    def set_elements(self, family: str, table: str, name: str) -> Optional[List[Tuple[bytes, Optional[int]]]]:
        """The elements of one set as (key bytes, milliseconds until the entry expires or
        None): one element dump naming the set, so the cost is that set's, not the table's.
        None when the kernel has no such set (or table)."""
        body = struct.pack("=BBH", FAMILIES[family], 0, 0)
        body += _attr(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0")
        body += _attr(NFTA_SET_ELEM_LIST_SET, name.encode() + b"\0")
        found: List[Tuple[bytes, Optional[int]]] = []
        with self._lock:
            try:
                n = self._exchange(NFT_MSG_GETSETELEM, NLM_F_DUMP, body, NFT_MSG_NEWSETELEM,
                                   f"nftables element dump of {family} {table} {name}",
                                   lambda payload: found.extend(_elements(payload)))
            except OSError as e:
                self.close()
                raise NetlinkError(f"nftables element dump of {family} {table} {name} failed: {e}") from None
        return None if n is None else found

    def element_batch(self, family: str, table: str, ops: ElementOps) -> bool:
        """Add and delete set/map elements in one nfnetlink batch: one transaction, all or
        nothing, as ``nft -f`` (which first fetches every chain of the table: 35-70 ms at
        10,000 services). False, with nothing sent, when the batch is too large for one
        send; raises NetlinkError naming the refused set."""
        msgs: List[bytes] = []
        names: Dict[int, str] = {}
        with self._lock:
            try:
                sock = self._socket()
            except OSError as e:  # no nfnetlink here
                raise NetlinkError(f"nftables element batch: {e}") from None
            self._seq += 1
            msgs.append(_HDR.pack(_HDR.size + 4, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, self._seq, 0)
                        + struct.pack("=BBH", 0, 0, socket.htons(NFNL_SUBSYS_NFTABLES)))
            first = self._seq
            for verb, name, elems in ops:
                kind = (NFNL_SUBSYS_NFTABLES << 8) | (NFT_MSG_NEWSETELEM if verb == "add" else NFT_MSG_DELSETELEM)
                flags = NLM_F_REQUEST | NLM_F_ACK | (NLM_F_CREATE if verb == "add" else 0)
                # An attribute's length is 16 bits: at most ELEMENTS_PER_MESSAGE elements a message.
                for start in range(0, len(elems), ELEMENTS_PER_MESSAGE):
                    self._seq += 1
                    body = _element_message(family, table, name, elems[start:start + ELEMENTS_PER_MESSAGE])
                    msgs.append(_HDR.pack(_HDR.size + len(body), kind, flags, self._seq, 0) + body)
                    names[self._seq] = f"{verb} element {family} {table} {name}"
            self._seq += 1
            msgs.append(_HDR.pack(_HDR.size + 4, NFNL_MSG_BATCH_END, NLM_F_REQUEST, self._seq, 0)
                        + struct.pack("=BBH", 0, 0, socket.htons(NFNL_SUBSYS_NFTABLES)))
            if not names:
                return True
            batch = b"".join(msgs)
            if len(batch) > MAX_BATCH_BYTES:  # beyond the socket's send buffer: nft -f takes it
                return False
            try:
                sock.send(batch)
                self._acks(sock, names, first, self._seq)
                return True
            except OSError as e:
                self.close()
                raise NetlinkError(f"nftables element batch failed: {e}") from None
            except NetlinkError:
                self.close()  # the kernel may still answer the batch's other messages
                raise

    def _acks(self, sock: socket.socket, names: Dict[int, str], first: int, last: int) -> None:
        """Wait for the kernel's answer to every message of the batch (NLM_F_ACK): an ack
        when the batch was committed, the refused message's error when not. An error on the
        batch's begin or end message is the batch's own: a failed commit (the kernel sends it
        before the messages' acks, which then still read 0) or a refused batch (no acks)."""
        waiting = set(names)
        for mtype, mseq, payload in _replies(sock):
            if mtype == NLMSG_ERROR and first <= mseq <= last:
                (code,) = struct.unpack_from("=i", payload)
                if code != 0:
                    raise NetlinkError(f"{names.get(mseq, 'nftables element batch')}: "
                                       f"{errno.errorcode.get(-code, -code)} ({os.strerror(-code)})")
                waiting.discard(mseq)
                if not waiting:
                    return

    def _get_table(self, family: str, table: str) -> bool:
        body = struct.pack("=BBH", FAMILIES[family], 0, 0) + _attr(NFTA_TABLE_NAME, table.encode() + b"\0")
        return bool(self._exchange(NFT_MSG_GETTABLE, NLM_F_ACK, body, NFT_MSG_NEWTABLE,
                                   f"nftables table lookup of {family} {table}"))

    def _dump(self, family: str, table: str, chain: str) -> Optional[int]:
        body = struct.pack("=BBH", FAMILIES[family], 0, 0)
        body += _attr(NFTA_RULE_TABLE, table.encode() + b"\0") + _attr(NFTA_RULE_CHAIN, chain.encode() + b"\0")
        return self._exchange(NFT_MSG_GETRULE, NLM_F_DUMP, body, NFT_MSG_NEWRULE,
                              f"nftables rule dump of {family} {table} {chain}")

    def _exchange(self, request: int, flags: int, body: bytes, counted: int, what: str,
                  each: Optional[Callable[[bytes], object]] = None) -> Optional[int]:
        """Send one nftables request; the number of ``counted`` messages answering it (at the
        dump's end or the kernel's ack), None when the kernel says ENOENT. ``each`` gets the
        body of every counted message."""
        sock = self._socket()
        self._seq += 1
        seq = self._seq
        kind = (NFNL_SUBSYS_NFTABLES << 8) | request
        sock.send(_HDR.pack(_HDR.size + len(body), kind, NLM_F_REQUEST | flags, seq, 0) + body)
        count = 0
        for mtype, mseq, payload in _replies(sock):
            if mseq != seq:
                continue
            if mtype == NLMSG_DONE:
                return count
            if mtype == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", payload)
                if code == 0:
                    return count
                if -code == errno.ENOENT:
                    return None
                raise NetlinkError(f"{what}: {errno.errorcode.get(-code, -code)}")
            if mtype == (NFNL_SUBSYS_NFTABLES << 8) | counted:
                count += 1
                if each is not None:
                    each(payload)
        return count  # not reached: _replies ends only by raising
