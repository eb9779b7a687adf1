# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Kernel I/O for nftables mode: ``nft -f -`` (one transaction: the kernel applies the
whole input or nothing), and the few cheap reads the proxier needs. Imports nothing
above kernel/.

``nft`` rather than libnftables (python3-nftables): the binding is not installed on
these nodes, and the cost of a large load is the kernel's and nft's parser either way
(docs/nftables-mode.md).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..errors import KernelError, Unavailable
from .nft_netlink import ElementOps, RuleCounter


class NftError(KernelError):
    """nft refused its input or could not run; nothing of that input was applied."""


class NftKernel:
    """Runs ``nft``, optionally inside a network namespace (``ip netns exec``)."""

    def __init__(self, netns: str = "", binary: str = "nft", runner: Callable = subprocess.run,
                 timeout: float = 300.0) -> None:
        self.prefix: List[str] = ["ip", "netns", "exec", netns] if netns else []
        self.netns = netns
        self._counter: Optional[RuleCounter] = None
        self.binary = binary
        self._run = runner
        self.timeout = timeout

    def _argv(self, *args: str) -> List[str]:
        return self.prefix + [self.binary, *args]

    def apply(self, script: str, check_only: bool = False) -> None:
        """One ``nft -f -`` transaction (``-c``: parse and check against the kernel, apply
        nothing). Raises NftError with nft's message."""
        argv = self._argv(*(["-c"] if check_only else []), "-f", "-")
        try:
            proc = self._run(argv, input=script, capture_output=True, text=True, check=False, timeout=self.timeout)
        except (OSError, subprocess.SubprocessError) as e:
            raise NftError(f"nft -f failed to run: {e}") from None
        if proc.returncode != 0:
            raise NftError(f"nft -f failed ({proc.returncode}): {_first_lines(proc.stderr)}")

    def apply_elements(self, family: str, table: str, ops: ElementOps) -> bool:
        """Element additions and deletions as one nfnetlink batch (one transaction, as
        ``nft -f``, without nft's fetch of every chain first). Raises Unavailable when
        netlink cannot be used here (the caller writes the same change with ``nft -f``),
        KernelError when the kernel refuses it (nothing applied); False when the batch is too
        large for one send (nothing sent: ``nft -f`` writes this one)."""
        if self._run is not subprocess.run:  # a test's runner stands in for nft: nft it is
            raise Unavailable("nft runner replaced")
        if self._counter is None:
            self._counter = RuleCounter(self.netns)
        return self._counter.element_batch(family, table, ops)

    def table_exists(self, family: str, table: str) -> bool:
        """Asked over netlink (kernel/nft_netlink.py): constant cost, where ``nft list tables``
        reads every table's rules first (seconds beside iptables-nft's tables at scale)."""
        if self._run is subprocess.run:  # a test's runner stands in for nft: ask it
            if self._counter is None:
                self._counter = RuleCounter(self.netns)
            try:
                return self._counter.table_exists(family, table)
            except (Unavailable, KernelError):  # no pyroute2 for a named netns, no nfnetlink: ask nft
                pass
        try:
            proc = self._run(self._argv("list", "tables", family), capture_output=True, text=True, check=False)
        except FileNotFoundError as e:
            raise Unavailable(f"nft is not installed: {e}") from None
        return proc.returncode == 0 and f"table {family} {table}" in proc.stdout.splitlines()

    def set_elements(self, family: str, table: str, name: str) -> Optional[List[str]]:
        """The elements of one small set as nft prints them, or None when the set (or the
        table) is not there. nft fetches only that set: milliseconds at any table size."""
        proc = self._run(self._argv("-n", "list", "set", family, table, name), capture_output=True, text=True,
                         check=False)
        if proc.returncode != 0:
            return None
        out: List[str] = []
        for line in proc.stdout.splitlines():
            line = line.strip()
            if line.startswith("elements = {"):
                out.extend(e.strip() for e in line[len("elements = {"):].rstrip("}").split(",") if e.strip())
        return out

    def expiring_entries(self, family: str, table: str, names: Iterable[str]) -> Dict[str, List[Tuple[str, int]]]:
        """Per set of ``names`` (address sets with timeouts, as the affinity sets): its
        entries as (address, milliseconds until expiry). Sets (or a table) that are not
        there are left out. Over netlink one element dump per set (the set's cost, not the
        table's); ``nft -j list set`` per set when netlink cannot be used."""
        names = list(names)
        if self._run is subprocess.run:  # a test's runner stands in for nft: ask it
            if self._counter is None:
                self._counter = RuleCounter(self.netns)
            try:
                return self._expiring_netlink(family, table, names)
            except (Unavailable, KernelError):
                pass
        out: Dict[str, List[Tuple[str, int]]] = {}
        for name in names:
            proc = self._run(self._argv("-j", "list", "set", family, table, name), capture_output=True, text=True,
                             check=False)
            if proc.returncode != 0:
                continue
            try:
                doc = json.loads(proc.stdout)
            except ValueError:
                continue
            entries: List[Tuple[str, int]] = []
            for obj in doc.get("nftables", []):
                for e in (obj.get("set") or {}).get("elem", []):
                    elem = e.get("elem") if isinstance(e, dict) else None
                    if isinstance(elem, dict) and isinstance(elem.get("val"), str) and elem.get("expires"):
                        try:  # the address goes back into nft text: only a parsed one
                            entries.append((str(ipaddress.ip_address(elem["val"])), int(elem["expires"]) * 1000))
                        except ValueError:
                            continue
            out[name] = entries
        return out

    def _expiring_netlink(self, family: str, table: str, names: List[str]) -> Dict[str, List[Tuple[str, int]]]:
        out: Dict[str, List[Tuple[str, int]]] = {}
        if self._counter is None or not self._counter.table_exists(family, table):
            return out
        for name in names:
            found = self._counter.set_elements(family, table, name)
            if found is None:
                continue
            out[name] = [(str(ipaddress.ip_address(key)), ms) for key, ms in found
                         if ms and len(key) in (4, 16)]
        return out

    def rule_counts(self, family: str, table: str, chains: Iterable[str]) -> Dict[str, int]:
        """Rules per chain over netlink (kernel/nft_netlink.py): about 0.1 ms a chain at any
        table size, where ``nft list chain`` costs 0.5-0.7 s at 10,000 services. A chain (or
        table) that is not there counts 0."""
        if self._counter is None:
            self._counter = RuleCounter(self.netns)
        return {c: self._counter.rule_count(family, table, c) or 0 for c in chains}

    def list_table(self, family: str, table: str) -> Optional[str]:
        """``nft list table`` (the whole table: costs seconds at 10,000 services), or None
        when there is no such table."""
        try:
            proc = self._run(self._argv("list", "table", family, table), capture_output=True, text=True,
                             check=False, timeout=self.timeout)
        except (OSError, subprocess.SubprocessError) as e:
            raise NftError(f"nft list table failed to run: {e}") from None
        if proc.returncode == 0:
            return proc.stdout
        if "No such file or directory" in proc.stderr:
            return None
        raise NftError(f"nft list table failed ({proc.returncode}): {_first_lines(proc.stderr)}")

    def scratch_listing(self, script: str, family: str, table: str) -> str:
        """Load ``script`` into a new, empty network namespace (``unshare --net``, gone when
        nft exits) and list ``table`` there: how this nft prints what ``script`` creates,
        without touching the host's tables."""
        argv = ["unshare", "--net", "sh", "-c", '"$1" -f - && "$1" list table "$2" "$3"', "sh",
                self.binary, family, table]
        try:
            proc = self._run(self.prefix + argv, input=script, capture_output=True, text=True, check=False,
                             timeout=self.timeout)
        except (OSError, subprocess.SubprocessError) as e:
            raise NftError(f"unshare --net nft failed to run: {e}") from None
        if proc.returncode != 0:
            raise NftError(f"nft -f (scratch namespace) failed ({proc.returncode}): {_first_lines(proc.stderr)}")
        return proc.stdout


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:n]) + (f"\n(+{len(lines) - n} more lines)" if len(lines) > n else "")
