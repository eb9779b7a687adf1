# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``kube-ipvs0`` dummy link of IPVS mode, over rtnetlink: the link made and deleted
with pyroute2 ``IPRoute``, its addresses listed and changed in batches over a raw
socket (:mod:`.rtnl_addr`; pyroute2 took a minute for 5,000 addresses).

IPVS only sees packets the kernel delivers locally, so every service VIP must be a
local address: upstream binds them (as /32 or /128) to a dummy link it creates and
leaves down. Addresses on a down link still get their ``local`` routes in the local
table, which is all IPVS needs, and a down link never answers ARP for them.

pyroute2 is imported when a link is first used, so importing this module (and the
Ansible sanity ``import`` test) works without it.
"""

from __future__ import annotations

import errno
import importlib.util
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple

from ..errors import KernelError, Unavailable
from ..names import DUMMY_DEVICE
from .ipvs_netlink import NetlinkError
from .rtnl_addr import RtnlAddresses


class LinkError(KernelError):
    """kube-ipvs0 could not be read or changed."""


class LinkUnavailable(LinkError, Unavailable):
    """pyroute2 is not installed (IPVS mode cannot have run: it needs pyroute2)."""


def _default_iproute(netns: str) -> Any:
    try:
        from pyroute2 import IPRoute
    except ImportError:
        raise LinkUnavailable("IPVS mode needs the pyroute2 Python package (pip install pyroute2)") from None
    if netns:
        # flags=0: never create the namespace (a typo must fail, not make a new one).
        try:
            return IPRoute(netns=netns, flags=0)
        except FileNotFoundError:
            raise LinkError(f"network namespace {netns!r} does not exist") from None
    return IPRoute()


def _default_rtnl(netns: str) -> Any:
    if importlib.util.find_spec("pyroute2") is None:  # IPVS mode needs it (as the IPRoute side)
        raise LinkUnavailable("IPVS mode needs the pyroute2 Python package (pip install pyroute2)")
    try:
        return RtnlAddresses(netns)
    except OSError as e:
        if netns and e.errno == errno.ENOENT:
            raise LinkError(f"network namespace {netns!r} does not exist") from None
        raise LinkError(f"cannot open a netlink socket: {e}") from None


def _code(exc: BaseException) -> Optional[int]:
    code = getattr(exc, "code", None)
    if code is None and exc.args and isinstance(exc.args[0], int):
        code = exc.args[0]
    return code


class DummyLink:
    """Create/inspect/delete ``kube-ipvs0`` and keep exactly a given set of addresses on it.

    ``iproute_factory(netns)`` returns an IPRoute-like object, ``rtnl_factory(netns)`` an
    :class:`~.rtnl_addr.RtnlAddresses`-like one."""

    def __init__(self, netns: str = "", name: str = DUMMY_DEVICE,
                 iproute_factory: Callable[[str], Any] = _default_iproute,
                 rtnl_factory: Callable[[str], Any] = _default_rtnl) -> None:
        self.netns = netns
        self.name = name
        self._factory = iproute_factory
        self._rtnl_factory = rtnl_factory
        self._ipr: Any = None
        self._raw: Any = None

    # --- plumbing -----------------------------------------------------------------

    def _iproute(self) -> Any:
        if self._ipr is None:
            self._ipr = self._factory(self.netns)
        return self._ipr

    def _rtnl(self) -> Any:
        if self._raw is None:
            self._raw = self._rtnl_factory(self.netns)
        return self._raw

    def close(self) -> None:
        try:
            if self._raw is not None:
                self._raw.close()
        finally:
            self._raw = None
            if self._ipr is not None:
                try:
                    self._ipr.close()
                finally:
                    self._ipr = None

    def __enter__(self) -> DummyLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def index(self) -> Optional[int]:
        try:
            return self._rtnl().link_index(self.name)
        except NetlinkError as e:
            raise LinkError(f"cannot look up link {self.name}: {e}") from None

    # --- the link -----------------------------------------------------------------

    def ensure(self) -> bool:
        """Make sure the dummy link exists (left down, as upstream). True if it was created."""
        if self.index() is not None:
            return False
        try:
            self._iproute().link("add", ifname=self.name, kind="dummy")
        except Exception as e:  # NetlinkError
            if _code(e) == errno.EEXIST:
                return False
            if _code(e) == errno.EOPNOTSUPP:
                raise LinkError(f"cannot create dummy link {self.name}: this kernel has no dummy "
                                f"link support (CONFIG_DUMMY)") from None
            raise LinkError(f"cannot create dummy link {self.name}: {e}") from None
        if self.index() is None:
            raise LinkError(f"dummy link {self.name} was created but cannot be found")
        return True

    def delete(self) -> bool:
        """Remove the link (and with it every address). True if it existed."""
        idx = self.index()
        if idx is None:
            return False
        try:
            self._iproute().link("del", index=idx)
        except Exception as e:
            if _code(e) in (errno.ENODEV, errno.ENOENT):
                return False
            raise LinkError(f"cannot delete {self.name}: {e}") from None
        return True

    # --- addresses ------------------------------------------------------------------

    def addresses(self) -> Set[str]:
        """The addresses bound to the link (empty if the link does not exist)."""
        idx = self.index()
        if idx is None:
            return set()
        try:
            return self._rtnl().addresses(idx)
        except NetlinkError as e:
            raise LinkError(f"cannot list the addresses of {self.name}: {e}") from None

    def add(self, addresses: Iterable[str]) -> List[str]:
        """Bind addresses (already bound ones are fine). Returns those newly added; the
        first failure (in sorted order) is raised after the whole batch was tried."""
        idx = self._require()
        return self._change(True, idx, addresses, (errno.EEXIST,), "bind {ip} to")

    def remove(self, addresses: Iterable[str]) -> List[str]:
        """Unbind addresses (missing ones are fine). Returns those removed."""
        idx = self.index()
        if idx is None:
            return []
        return self._change(False, idx, addresses, (errno.EADDRNOTAVAIL, errno.ENXIO, errno.ENOENT),
                            "unbind {ip} from")

    def _change(self, add: bool, idx: int, addresses: Iterable[str], fine: Tuple[int, ...], what: str) -> List[str]:
        ips = sorted(addresses)
        if not ips:
            return []
        try:
            results = self._rtnl().change(add, idx, ips)
        except NetlinkError as e:
            raise LinkError(f"cannot {what.format(ip=f'{len(ips)} addresses')} {self.name}: {e}") from None
        done = []
        for ip, code in results:
            if code == 0:
                done.append(ip)
            elif code not in fine:
                raise LinkError(f"cannot {what.format(ip=ip)} {self.name}: {NetlinkError(code)}")
        return done

    def sync(self, desired: Iterable[str], current: Optional[Set[str]] = None) -> Tuple[List[str], List[str]]:
        """Make the link hold exactly ``desired``; ``current`` (what it holds) is read when
        not given. Returns (added, removed)."""
        want = set(desired)
        have = self.addresses() if current is None else set(current)
        added = self.add(want - have)
        removed = self.remove(have - want)
        return added, removed

    def _require(self) -> int:
        idx = self.index()
        if idx is None:
            raise LinkError(f"link {self.name} does not exist")
        return idx
