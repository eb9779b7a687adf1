# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``kube-ipvs0`` dummy link of IPVS mode, over rtnetlink (pyroute2 ``IPRoute``).

IPVS only sees packets the kernel delivers locally, so every service VIP must be a
local address: upstream binds them (as /32 or /128) to a dummy link it creates and
leaves down. Addresses on a down link still get their ``local`` routes in the local
table, which is all IPVS needs, and a down link never answers ARP for them.

pyroute2 is imported when a link is first used, so importing this module (and the
Ansible sanity ``import`` test) works without it.
"""

from __future__ import annotations

import errno
import ipaddress
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple

from ..errors import KernelError, Unavailable
from ..names import DUMMY_DEVICE


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


def _code(exc: BaseException) -> Optional[int]:
    code = getattr(exc, "code", None)
    if code is None and exc.args and isinstance(exc.args[0], int):
        code = exc.args[0]
    return code


def _prefixlen(ip: str) -> int:
    return 128 if ipaddress.ip_address(ip).version == 6 else 32


class DummyLink:
    """Create/inspect/delete ``kube-ipvs0`` and keep exactly a given set of addresses on it.

    ``iproute_factory(netns)`` returns an IPRoute-like object (tests pass a fake)."""

    def __init__(self, netns: str = "", name: str = DUMMY_DEVICE,
                 iproute_factory: Callable[[str], Any] = _default_iproute) -> None:
        self.netns = netns
        self.name = name
        self._factory = iproute_factory
        self._ipr: Any = None

    # --- plumbing -----------------------------------------------------------------

    def _iproute(self) -> Any:
        if self._ipr is None:
            self._ipr = self._factory(self.netns)
        return self._ipr

    def close(self) -> None:
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
        found = self._iproute().link_lookup(ifname=self.name)
        return found[0] if found else None

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
        out: Set[str] = set()
        for msg in self._iproute().get_addr(index=idx):
            addr = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
            if addr:
                out.add(str(ipaddress.ip_address(addr)))
        return out

    def add(self, addresses: Iterable[str]) -> List[str]:
        """Bind addresses (already bound ones are fine). Returns those newly added."""
        idx = self._require()
        added = []
        for ip in sorted(addresses):
            try:
                self._iproute().addr("add", index=idx, address=ip, prefixlen=_prefixlen(ip))
            except Exception as e:
                if _code(e) == errno.EEXIST:
                    continue
                raise LinkError(f"cannot bind {ip} to {self.name}: {e}") from None
            added.append(ip)
        return added

    def remove(self, addresses: Iterable[str]) -> List[str]:
        """Unbind addresses (missing ones are fine). Returns those removed."""
        idx = self.index()
        if idx is None:
            return []
        removed = []
        for ip in sorted(addresses):
            try:
                self._iproute().addr("del", index=idx, address=ip, prefixlen=_prefixlen(ip))
            except Exception as e:
                if _code(e) in (errno.EADDRNOTAVAIL, errno.ENXIO, errno.ENOENT):
                    continue
                raise LinkError(f"cannot unbind {ip} from {self.name}: {e}") from None
            removed.append(ip)
        return removed

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
