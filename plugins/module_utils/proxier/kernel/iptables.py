# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Kernel I/O for iptables mode: read with iptables-save, write with one
iptables-restore --noflush transaction.

iptables-restore applies a whole input or nothing, so a failed write leaves the
previous rules in place; the caller then retries with a full sync.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from ..backends.iptables import BUILTIN_CHAINS, OWN_STATIC_CHAINS, SERVICE_CHAIN_PREFIXES, ChainKey

TABLES = ("filter", "nat")


class KernelError(RuntimeError):
    pass


@dataclass
class Snapshot:
    rules: Dict[ChainKey, List[str]]  # KUBE-* chains and the built-in chains
    chains: Set[ChainKey]  # every chain that exists in the scanned tables


class IptablesKernel:
    """Runs iptables tools, optionally inside a network namespace (``ip netns exec``)."""

    def __init__(self, netns: str = "", binary: str = "iptables", wait_seconds: int = 5,
                 runner=subprocess.run) -> None:
        self.prefix: List[str] = ["ip", "netns", "exec", netns] if netns else []
        self.binary = binary
        self.wait_seconds = wait_seconds
        self._run = runner

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

    def restore(self, text: str) -> float:
        """Apply ``text`` atomically; return the seconds it took."""
        # --wait: the xtables lock serialises us with other iptables users (legacy backend).
        argv = self._argv("-restore", "--noflush", "--wait", str(self.wait_seconds))
        start = time.monotonic()
        proc = self._run(argv, input=text, capture_output=True, text=True, check=False)
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            raise KernelError(_restore_error(proc.stderr, text))
        return elapsed


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
    every KUBE- chain (what ``--cleanup`` does)."""
    out: List[str] = []
    for table in TABLES:
        lines: List[str] = []
        for (t, chain), rules in sorted(snapshot.rules.items()):
            if t != table or chain not in BUILTIN_CHAINS:
                continue
            for r in rules:
                target = f" {r}".split(" -j ", 1)[1].split(" ", 1)[0] if " -j " in f" {r}" else ""
                if target in OWN_STATIC_CHAINS:
                    lines.append(f"-D {chain} {r}")
        ours = [c for (t, c) in sorted(snapshot.chains)
                if t == table and (c in OWN_STATIC_CHAINS or c.startswith(SERVICE_CHAIN_PREFIXES))]
        lines = [f":{c} - [0:0]" for c in ours] + lines + [f"-X {c}" for c in ours]
        if lines:
            out += [f"*{table}"] + lines + ["COMMIT"]
    return "\n".join(out) + "\n" if out else ""
