# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""IPVS's older ``getsockopt`` interface (``IP_VS_SO_GET_*``, linux/ip_vs.h),
read-only, for listing the real servers of many IPv4 services fast.

Why: generic netlink has no "every destination" dump. ``IPVS_CMD_GET_DEST``
is a dump per service, a socket runs one dump at a time (a second dump
request in the same datagram is answered ``EBUSY``: ``__netlink_dump_start``
refuses while ``cb_running``), and ``ip_vs_genl_dump_dests`` always ends a
dump in a second callback, so each service costs a ``send`` and two ``recv``
(measured in the VM lab: 0.33 ms a service in the kernel alone, 1.7 s at
5,000 services). ``IP_VS_SO_GET_DESTS`` answers the same question in one
``getsockopt`` (~0.01-0.03 ms there), and ``IP_VS_SO_GET_SERVICES`` gives
every IPv4 service's destination count in one call.

Its limits (net/netfilter/ipvs/ip_vs_ctl.c), and how :mod:`.ipvs` handles
them: IPv4 services only (``__ip_vs_get_service_entries`` skips others);
destinations of another address family are skipped ("Cannot expose
heterogeneous members via sockopt interface"), so a count below the
service's ``num_dests`` means "ask netlink"; no tunnel type/port/flags (a
tunnel destination means "ask netlink"); the request must state its exact
buffer size, so the count comes from the services listing and one spare slot
shows a destination added in between. Everything else of a destination is
there: address, port, forwarding method, weight, thresholds, connection
counts.

Python's ``socket.getsockopt`` cannot send input in the buffer (these calls
need the service key and the count there), so libc's ``getsockopt`` is
called through :mod:`ctypes`. Any failure here (no libc, EPERM, ENOPROTOOPT)
raises :class:`SockoptUnavailable` and the caller uses netlink alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple

IP_VS_BASE_CTL = 64 + 1024 + 64
IP_VS_SO_GET_INFO = IP_VS_BASE_CTL + 1
IP_VS_SO_GET_SERVICES = IP_VS_BASE_CTL + 2
IP_VS_SO_GET_DESTS = IP_VS_BASE_CTL + 4
IP_VS_SCHEDNAME_MAXLEN = 16


class _StatsUser(ctypes.Structure):  # struct ip_vs_stats_user
    _fields_ = [("conns", ctypes.c_uint32), ("inpkts", ctypes.c_uint32), ("outpkts", ctypes.c_uint32),
                ("inbytes", ctypes.c_uint64), ("outbytes", ctypes.c_uint64), ("cps", ctypes.c_uint32),
                ("inpps", ctypes.c_uint32), ("outpps", ctypes.c_uint32), ("inbps", ctypes.c_uint32),
                ("outbps", ctypes.c_uint32)]


class _ServiceEntry(ctypes.Structure):  # struct ip_vs_service_entry
    _fields_ = [("protocol", ctypes.c_uint16), ("addr", ctypes.c_uint32), ("port", ctypes.c_uint16),
                ("fwmark", ctypes.c_uint32), ("sched_name", ctypes.c_char * IP_VS_SCHEDNAME_MAXLEN),
                ("flags", ctypes.c_uint), ("timeout", ctypes.c_uint), ("netmask", ctypes.c_uint32),
                ("num_dests", ctypes.c_uint), ("stats", _StatsUser)]


class _GetServices(ctypes.Structure):  # struct ip_vs_get_services (entrytable[] follows)
    _fields_ = [("num_services", ctypes.c_uint), ("entrytable", _ServiceEntry * 0)]


class _DestEntry(ctypes.Structure):  # struct ip_vs_dest_entry
    _fields_ = [("addr", ctypes.c_uint32), ("port", ctypes.c_uint16), ("conn_flags", ctypes.c_uint),
                ("weight", ctypes.c_int), ("u_threshold", ctypes.c_uint32), ("l_threshold", ctypes.c_uint32),
                ("activeconns", ctypes.c_uint32), ("inactconns", ctypes.c_uint32),
                ("persistconns", ctypes.c_uint32), ("stats", _StatsUser)]


class _GetDests(ctypes.Structure):  # struct ip_vs_get_dests (entrytable[] follows)
    _fields_ = [("protocol", ctypes.c_uint16), ("addr", ctypes.c_uint32), ("port", ctypes.c_uint16),
                ("fwmark", ctypes.c_uint32), ("num_dests", ctypes.c_uint), ("entrytable", _DestEntry * 0)]


def _layout(packed: struct.Struct, struct_type: Any, offsets: Dict[str, int]) -> struct.Struct:
    """A struct format for fast decoding, checked against the C layout ctypes computes for
    this machine (the format encodes the usual Linux ABI; on another, every entry would be
    misread: refuse instead)."""
    found = {name: getattr(struct_type, name).offset for name in offsets}
    last = max(offsets, key=lambda name: offsets[name])
    end = found[last] + getattr(struct_type, last).size
    if found != offsets or packed.size != end:
        raise SockoptUnavailable(f"unexpected layout of {struct_type.__name__} on this machine")
    return packed


class SockoptUnavailable(OSError):
    """The getsockopt interface cannot be used here (the caller falls back to netlink)."""


# Decoders: network-order fields (addresses, ports, netmask) stay raw bytes / '!' parts.
_SERVICE = struct.Struct("=H2x4s2sxxI16sII4sI")  # up to num_dests; stats follow
_DEST = struct.Struct("=4s2sxxIiIIIII")  # up to persistconns; stats follow
_GET_INFO = struct.Struct("=III")  # version, size, num_services
_GET_DESTS_HEAD = struct.Struct("=H2x4s2sxxII")  # protocol, addr, port, fwmark, num_dests


_libc: Optional[Any] = None


def _getsockopt_fn() -> Any:
    global _libc  # loaded once: CDLL lookups are slow under emulation
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fn = lib.getsockopt
        except (OSError, AttributeError) as exc:
            raise SockoptUnavailable(f"libc getsockopt not reachable: {exc}") from exc
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
        fn.restype = ctypes.c_int
        _libc = fn
    return _libc


def open_socket(netns: str = "") -> socket.socket:
    """A raw IPv4 socket (the sockopt interface's handle), in ``netns`` if given."""
    if netns:
        try:
            from pyroute2.netns import create_socket
        except ImportError as exc:
            raise SockoptUnavailable(f"a network namespace needs pyroute2: {exc}") from exc
        return create_socket(netns, family=socket.AF_INET, socket_type=socket.SOCK_RAW,
                             proto=socket.IPPROTO_RAW, flags=0)
    return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)


class SockoptReader:
    """Reads IPv4 services' destination counts and destinations on one raw socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.getsockopt = _getsockopt_fn()
        self.service_size = ctypes.sizeof(_ServiceEntry)
        self.dest_size = ctypes.sizeof(_DestEntry)
        self.services_head = _GetServices.entrytable.offset
        self.dests_head = _GetDests.entrytable.offset
        self.service_fmt = _layout(_SERVICE, _ServiceEntry, {
            "protocol": 0, "addr": 4, "port": 8, "fwmark": 12, "sched_name": 16, "flags": 32, "timeout": 36,
            "netmask": 40, "num_dests": 44})
        self.dest_fmt = _layout(_DEST, _DestEntry, {
            "addr": 0, "port": 4, "conn_flags": 8, "weight": 12, "u_threshold": 16, "l_threshold": 20,
            "activeconns": 24, "inactconns": 28, "persistconns": 32})
        self._buf = ctypes.create_string_buffer(self.dests_head + 64 * self.dest_size)
        if _GET_DESTS_HEAD.size > self.dests_head:
            raise SockoptUnavailable("unexpected layout of ip_vs_get_dests on this machine")

    def _call(self, opt: int, buf: Any, size: int) -> int:
        """getsockopt(IPPROTO_IP, opt) on ``buf``; 0 or the errno."""
        length = ctypes.c_uint32(size)
        if self.getsockopt(self.sock.fileno(), socket.IPPROTO_IP, opt, buf, ctypes.byref(length)) == 0:
            return 0
        return ctypes.get_errno() or -1

    def info(self) -> Tuple[int, int, int]:
        """(version, connection table size, number of services of every family)."""
        return _GET_INFO.unpack(self.sock.getsockopt(socket.IPPROTO_IP, IP_VS_SO_GET_INFO, _GET_INFO.size))

    def service_counts(self, capacity: int) -> Dict[Tuple[int, bytes, bytes, int], int]:
        """{(protocol, addr, port, fwmark): num_dests} of up to ``capacity`` IPv4 services
        (raw network-order addr/port; fwmark services have addr/port zero)."""
        size = self.services_head + capacity * self.service_size
        buf = ctypes.create_string_buffer(size)
        struct.pack_into("=I", buf, 0, capacity)
        code = self._call(IP_VS_SO_GET_SERVICES, buf, size)
        if code:
            raise SockoptUnavailable(code, f"IP_VS_SO_GET_SERVICES: errno {code}")
        out = {}
        raw = buf.raw
        unpack = self.service_fmt.unpack_from
        for i in range(capacity):
            protocol, addr, port, fwmark, _sched, _flags, _timeout, _mask, num = unpack(
                raw, self.services_head + i * self.service_size)
            if not protocol and not fwmark:
                break  # entries are filled from the start; the rest is the zeroed buffer
            if fwmark:
                out[(0, b"\0" * 4, b"\0\0", fwmark)] = num
            else:
                out[(protocol, addr, port, 0)] = num
        return out

    def dests(self, protocol: int, addr: bytes, port: bytes, fwmark: int,
              capacity: int) -> Optional[List[Tuple[Any, ...]]]:
        """Up to ``capacity`` destinations of one IPv4 service as tuples (addr bytes, port
        bytes, conn_flags, weight, u_threshold, l_threshold, activeconns, inactconns,
        persistconns); None if the service is gone (ESRCH)."""
        size = self.dests_head + capacity * self.dest_size
        if len(self._buf) < size:  # one buffer, reused: allocation showed in the profile
            self._buf = ctypes.create_string_buffer(max(size, 2 * len(self._buf)))
        buf = self._buf
        ctypes.memset(buf, 0, size)
        _GET_DESTS_HEAD.pack_into(buf, 0, protocol, addr, port, fwmark, capacity)
        code = self._call(IP_VS_SO_GET_DESTS, buf, size)
        if code == errno.ESRCH:  # the service went away since the services were listed
            return None
        if code:
            raise SockoptUnavailable(code, f"IP_VS_SO_GET_DESTS: errno {code}")
        unpack = self.dest_fmt.unpack_from
        out = []
        for offset in range(self.dests_head, size, self.dest_size):
            entry = unpack(buf, offset)
            if entry[0] == b"\0\0\0\0":
                break  # never a destination address (the kernel takes unicast or local ones only)
            out.append(entry)
        return out


__all__ = ["SockoptReader", "SockoptUnavailable", "open_socket"]
