# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Kernel I/O for iptables mode: read with iptables-save, write with one
iptables-restore --noflush transaction.

iptables-restore applies a whole input or nothing, so a failed write leaves the
previous rules in place; the caller then retries with a full sync.

Two measured iptables-nft 1.8.x costs shape this module (see docs/iptables-mode.md):

* ``iptables-restore --noflush`` keeps a sorted list of the chain names the input
  mentions, inserting each by a linear walk: quadratic in the number of chains of one
  transaction (26 s for 10,000 services). A command that names no chain switches it to
  a whole-table cache instead; ``-Z`` (zero the table's counters) is the only such
  command that changes no rule, so sections declaring at least ``BULK_CHAINS`` chains
  get one (5 s for the same input, still one atomic transaction).
* ``iptables-save`` is quadratic in the table's chain count (23 s at 40,000 chains), so
  above ``DIFF_MAX_CHAINS`` a full sync reads only the chain names (``nft -j list
  chains``) and the built-in chains (``iptables -S CHAIN``) and rewrites every chain it
  owns, as upstream's full sync does, instead of diffing rule by rule.

Checks that cost the same at 1 or 10,000 services: ``iptables -S KUBE-PROXY-CANARY`` in
mangle, nat and filter (upstream's canary chains: a firewall reload or ``iptables -F/-X``
removes them), about 4 ms each. ``first_rule`` of a chain costs what reading that chain
costs (iptables-nft fetches the whole chain: 0.14 s for nat KUBE-SERVICES at 10,000).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from ..errors import KernelError, LockBusy, RestoreError  # noqa: F401 pylint: disable=unused-import
from ..names import BUILTIN_CHAINS, OWN_STATIC_CHAINS, SERVICE_CHAIN_PREFIXES, TABLES, ChainKey

BULK_CHAINS = 1000  # chain declarations in one table section that make a restore "bulk"
DIFF_MAX_CHAINS = 5000  # above this many chains a full sync rewrites instead of diffing
BUILTIN_BY_TABLE = {"filter": ("INPUT", "FORWARD", "OUTPUT"),
                    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")}


CANARY_CHAIN = "KUBE-PROXY-CANARY"
CANARY_TABLES = ("mangle", "nat", "filter")
# The comment of the one rule a clean shutdown leaves in nat KUBE-PROXY-CANARY: it ties the
# record of what was applied (a file under /run) to this kernel state; any full sync clears it.
APPLIED_MARK = "kubenode-proxy-applied:"
RESOURCE_PROBLEM = 4  # iptables' exit status when it could not even try, e.g. the xtables lock is held


@dataclass
class Snapshot:
    rules: Dict[ChainKey, List[str]]  # KUBE-* chains and the built-in chains
    chains: Set[ChainKey]  # every chain that exists in the scanned tables
    complete: bool = True  # False: only the built-in chains' rules were read
    listed: bool = True  # False: ``chains`` was not read either (builtin_snapshot())


class IptablesKernel:
    """Runs iptables tools, optionally inside a network namespace (``ip netns exec``)."""

    def __init__(self, netns: str = "", binary: str = "iptables", wait_seconds: int = 5,
                 runner=subprocess.run, bulk_chains: int = BULK_CHAINS,
                 diff_max_chains: int = DIFF_MAX_CHAINS, check_wait_seconds: int = 1, family: int = 4) -> None:
        self.prefix: List[str] = ["ip", "netns", "exec", netns] if netns else []
        self.netns = netns
        self.family = family  # 6: the ip6tables tools and nft's ip6 family
        self.binary = binary
        self.wait_seconds = wait_seconds
        self._run = runner
        self._nft: Optional[bool] = None
        self.bulk_chains = bulk_chains
        self.diff_max_chains = diff_max_chains
        # Checks run every second in the sync thread: waiting long for a held lock would
        # only delay the syncs behind them, and an undecided check is simply retried.
        self.check_wait_seconds = check_wait_seconds

    def for_family(self, family: int) -> IptablesKernel:
        """The same tools for the other IP family: ``ip6tables`` (``ip6tables-nft``,
        ``ip6tables-legacy``) for 6, as upstream's dual-stack proxier runs one per family."""
        if family == self.family:
            return self
        head, sep, name = self.binary.rpartition("/")
        if name.startswith("ip6tables"):
            name = "iptables" + name[len("ip6tables"):]
        if family == 6 and name.startswith("iptables"):
            name = "ip6tables" + name[len("iptables"):]
        binary = head + sep + name
        return IptablesKernel(netns=self.netns, binary=binary, wait_seconds=self.wait_seconds, runner=self._run,
                              bulk_chains=self.bulk_chains, diff_max_chains=self.diff_max_chains,
                              check_wait_seconds=self.check_wait_seconds, family=family)

    def _argv(self, tool: str, *args: str) -> List[str]:
        return self.prefix + [f"{self.binary}{tool}", *args]

    def save(self, table: str) -> str:
        proc = self._run(self._argv("-save", "-t", table), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelError(f"{self.binary}-save -t {table} failed: {proc.stderr.strip()}")
        return proc.stdout

    def snapshot(self, tables: Sequence[str] = TABLES) -> Snapshot:
        rules: Dict[ChainKey, List[str]] = {}
        chains: Set[ChainKey] = set()
        for table in tables:
            r, c = parse_save(self.save(table), table)
            rules.update(r)
            chains |= c
        return Snapshot(rules, chains)

    def nft_backend(self) -> bool:
        """True when ``iptables`` is iptables-nft (the costs above apply only there)."""
        if self._nft is None:
            proc = self._run(self._argv("", "--version"), capture_output=True, text=True, check=False)
            self._nft = "nf_tables" in proc.stdout
        return self._nft

    def list_chains(self, tables: Sequence[str] = TABLES) -> Optional[Set[ChainKey]]:
        """Chain names only, cheaply (nft's JSON listing: 0.3 s at 40,000 chains), or None
        when that is not available (legacy backend, no ``nft``): then use ``snapshot()``."""
        if not self.nft_backend() or shutil.which("nft") is None:
            return None
        proc = self._run(self.prefix + ["nft", "-j", "list", "chains", "ip6" if self.family == 6 else "ip"],
                         capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return None
        out: Set[ChainKey] = set()
        for item in json.loads(proc.stdout or "{}").get("nftables", []):
            chain = item.get("chain")
            if chain and chain.get("table") in tables:
                out.add((chain["table"], chain["name"]))
        return out

    def snapshot_for_full_sync(self, tables: Sequence[str] = TABLES) -> Snapshot:
        """What a full sync needs: everything while the tables are small enough to read
        whole; above ``DIFF_MAX_CHAINS`` the chain names and the built-in chains only."""
        large = self.large_table_snapshot(tables)
        return large if large is not None else self.snapshot(tables)

    def large_table_snapshot(self, tables: Sequence[str] = TABLES) -> Optional[Snapshot]:
        """The chain names and the built-in chains' rules when the tables are too large to
        read whole (above ``DIFF_MAX_CHAINS``, iptables-nft); None otherwise (small, or no
        cheap listing: legacy), without reading any rule then."""
        chains = self.list_chains(tables)
        if chains is None or len(chains) <= self.diff_max_chains:
            return None
        rules: Dict[ChainKey, List[str]] = {}
        for table in tables:
            for chain in BUILTIN_BY_TABLE[table]:
                if (table, chain) in chains:
                    rules[(table, chain)] = self.list_rules(table, chain)
        return Snapshot(rules, chains, complete=False)

    def builtin_snapshot(self, tables: Sequence[str] = TABLES) -> Snapshot:
        """The built-in chains' rules only, without listing the chains (0.4-0.6 s at 40,000
        chains): what a periodic check of a large table reads most of the time. A built-in
        chain that cannot be read is left out (the caller's check then fails)."""
        rules: Dict[ChainKey, List[str]] = {}
        for table in tables:
            for chain in BUILTIN_BY_TABLE[table]:
                try:
                    rules[(table, chain)] = self.list_rules(table, chain)
                except LockBusy:
                    raise  # undecided, not missing: the sync is retried soon, nothing repaired
                except KernelError:
                    continue
        return Snapshot(rules, set(), complete=False, listed=False)

    def _list(self, table: str, chain: str, *extra: str) -> Tuple[int, str, str]:
        proc = self._run(self._argv("", "-w", str(self.check_wait_seconds), "-t", table, "-S", chain, *extra),
                         capture_output=True, text=True, check=False)
        return proc.returncode, proc.stdout, proc.stderr

    def chain_exists(self, table: str, chain: str) -> Optional[bool]:
        """True/False, or None when iptables could not tell (lock held: exit status 4)."""
        rc, _out, err = self._list(table, chain)
        if rc == 0:
            return True
        if rc == 1:  # legacy: "No chain/target/match by that name"; nft: "... incompatible"
            return False
        if rc == RESOURCE_PROBLEM:
            return None
        raise KernelError(f"{self.binary} -t {table} -S {chain} failed: {err.strip()[:200]}")

    def missing_canaries(self, tables: Sequence[str] = CANARY_TABLES) -> Optional[List[str]]:
        """The tables whose ``KUBE-PROXY-CANARY`` chain is gone; None when undecided."""
        missing = []
        for table in tables:
            exists = self.chain_exists(table, CANARY_CHAIN)
            if exists is None:
                return None
            if not exists:
                missing.append(table)
        return missing

    def create_canaries(self, tables: Sequence[str]) -> None:
        if tables:
            self.restore("".join(f"*{t}\n:{CANARY_CHAIN} - [0:0]\nCOMMIT\n" for t in tables))

    def mark_applied(self, token: str) -> None:
        """Leave ``token`` in nat's canary chain (a rule no packet reaches: nothing jumps to
        the canary), in one transaction that recreates the chain if it is gone."""
        self.restore(f"*nat\n:{CANARY_CHAIN} - [0:0]\n"
                     f"-A {CANARY_CHAIN} -m comment --comment {APPLIED_MARK}{token}\nCOMMIT\n")

    def netns_id(self) -> str:
        """The network namespace the rules live in, as its nsfs inode ("" when unknown): the
        record of what was applied is kept per namespace (labs share one /run)."""
        path = f"/run/netns/{self.prefix[3]}" if self.prefix else "/proc/self/ns/net"
        try:
            return str(os.stat(path).st_ino)
        except OSError:
            return ""

    def first_rule(self, table: str, chain: str) -> Optional[str]:
        """The first rule of ``chain`` without ``-A CHAIN`` ("" for an empty chain), or None
        when the chain does not exist or iptables could not tell."""
        rc, out, err = self._list(table, chain, "1")
        if rc in (1, RESOURCE_PROBLEM):
            return None
        if rc != 0:
            raise KernelError(f"{self.binary} -t {table} -S {chain} 1 failed: {err.strip()[:200]}")
        prefix = f"-A {chain} "
        return next((line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)), "")

    def list_rules(self, table: str, chain: str) -> List[str]:
        """One chain's rules in save form (``iptables -S CHAIN``), without the ``-A CHAIN``."""
        proc = self._run(self._argv("", "-w", str(self.wait_seconds), "-t", table, "-S", chain),
                         capture_output=True, text=True, check=False)
        if proc.returncode == RESOURCE_PROBLEM:
            raise LockBusy(f"{self.binary} -t {table} -S {chain}: the xtables lock was held: "
                           f"{proc.stderr.strip()[:200]}")
        if proc.returncode != 0:
            raise KernelError(f"{self.binary} -t {table} -S {chain} failed: {proc.stderr.strip()[:200]}")
        prefix = f"-A {chain} "
        return [line[len(prefix):] for line in proc.stdout.splitlines() if line.startswith(prefix)]

    def restore(self, text: str) -> float:
        """Apply ``text`` atomically; return the seconds it took."""
        if self.nft_backend():
            text = bulk_restore_text(text, self.bulk_chains)
        # --wait: the xtables lock serialises us with other iptables users (legacy backend).
        argv = self._argv("-restore", "--noflush", "--wait", str(self.wait_seconds))
        start = time.monotonic()
        proc = self._run(argv, input=text, capture_output=True, text=True, check=False)
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            if is_lock_busy(proc.returncode, proc.stderr):
                raise LockBusy(f"{self.binary}-restore: another program held the xtables lock for "
                               f"{self.wait_seconds} s; nothing applied: {proc.stderr.strip()[:200]}")
            raise RestoreError(_restore_error(proc.stderr, text))
        return elapsed


def is_lock_busy(returncode: int, stderr: str) -> bool:
    """iptables-legacy's "Another app is currently holding the xtables lock" (exit status 4)."""
    return returncode == RESOURCE_PROBLEM and "xtables lock" in stderr


def bulk_restore_text(text: str, threshold: int = BULK_CHAINS) -> str:
    """Add ``-Z`` to each table section that names ``threshold`` chains or more (declared,
    or as the target of a rule: a rewrite of KUBE-SERVICES alone names every service
    chain), so iptables-nft uses its whole-table cache (see the module docstring). It
    zeroes that table's packet counters; smaller sections, i.e. partial syncs, are left
    as they are."""
    lines = text.split("\n")
    out: List[str] = []
    start = 0
    for line in lines:
        if line.startswith("*"):
            start = len(out)
        elif line == "COMMIT":
            if _chains_named(out[start + 1:]) >= threshold:
                out.insert(start + 1, "-Z")
        out.append(line)
    return "\n".join(out)


def _chains_named(section: List[str]) -> int:
    names = set()
    for line in section:
        if line.startswith(":"):
            names.add(line[1:].split(" ", 1)[0])
        elif " -j KUBE-" in line:
            names.add(line.rsplit(" -j ", 1)[1].split(" ", 1)[0])
    return len(names)


def parse_save(text: str, table: str) -> Tuple[Dict[ChainKey, List[str]], Set[ChainKey]]:
    """Our chains' and the built-in chains' rules from one table of iptables-save output."""
    rules: Dict[ChainKey, List[str]] = {}
    chains: Set[ChainKey] = set()
    for line in text.splitlines():
        if line.startswith(":"):
            name = line[1:].split(" ", 1)[0]
            chains.add((table, name))
            if name.startswith("KUBE-") or name in BUILTIN_CHAINS:
                rules.setdefault((table, name), [])
        elif line.startswith("-A "):
            _verb, chain, *rest = line.split(" ", 2)
            if chain.startswith("KUBE-") or chain in BUILTIN_CHAINS:
                rules.setdefault((table, chain), []).append(rest[0] if rest else "")
    return rules, chains


def _restore_error(stderr: str, text: str) -> str:
    msg = stderr.strip()
    lines = text.splitlines()
    for word in msg.replace(":", " ").split():
        if word.isdigit() and 0 < int(word) <= len(lines) and "line" in msg:
            msg += f" (input line {word}: {lines[int(word) - 1][:200]})"
            break
    return f"iptables-restore failed, previous rules left in place: {msg}"


def jump_targets(rules: Dict[ChainKey, List[str]], chain: ChainKey) -> List[str]:
    out = []
    for r in rules.get(chain, []):
        if " -j " in f" {r}":
            target = f" {r}".split(" -j ", 1)[1].split(" ", 1)[0]
            out.append(target)
    return out


def cleanup_text(snapshot: Snapshot) -> str:
    """Restore input that removes every jump to a KUBE- chain from the built-in chains and
    every KUBE- chain, the canaries included (what ``--cleanup`` does)."""
    out: List[str] = []
    for table in ("mangle",) + TABLES:
        lines: List[str] = []
        for (t, chain), rules in sorted(snapshot.rules.items()):
            if t != table or chain not in BUILTIN_CHAINS:
                continue
            for r in rules:
                target = f" {r}".split(" -j ", 1)[1].split(" ", 1)[0] if " -j " in f" {r}" else ""
                if target in OWN_STATIC_CHAINS:
                    lines.append(f"-D {chain} {r}")
        ours = [c for (t, c) in sorted(snapshot.chains)
                if t == table and (c in OWN_STATIC_CHAINS or c == CANARY_CHAIN or c.startswith(SERVICE_CHAIN_PREFIXES))]
        lines = [f":{c} - [0:0]" for c in ours] + lines + [f"-X {c}" for c in ours]
        if lines:
            out += [f"*{table}"] + lines + ["COMMIT"]
    return "\n".join(out) + "\n" if out else ""
