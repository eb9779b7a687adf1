# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure planner: (rules the kernel has, rules we want) -> the smallest iptables-restore
input that turns one into the other, plus a readable list of what it changes.

Three kinds of chain:
- built-in chains (INPUT, PREROUTING, ...): other software owns them; we only make sure
  our jump rules are present (inserted at the top, as upstream does);
- shared chains (KUBE-SERVICES, KUBE-NODEPORTS, ...): every service adds rules; in
  ``merge`` mode they are diffed rule by rule (``-D`` the rules that went, ``-I``/``-A``
  the new ones) so a one-service change does not rewrite 10,000 rules; in ``full`` mode
  a chain that differs is rewritten whole;
- owned chains (KUBE-SVC-..., KUBE-SEP-..., KUBE-MARK-MASQ, ...): rewritten whole
  (flush and refill) when they differ: rule order matters inside them.
Stale per-service chains are flushed and deleted after every reference to them is gone,
in the same transaction.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set

from ...names import TABLES
from .compile import (
    BUILTIN_CHAINS,
    KUBE_SERVICES,
    NAT,
    NODEPORTS_TAIL_COMMENT,
    SERVICE_CHAIN_PREFIXES,
    SHARED_CHAINS,
    ChainKey,
)

Rules = Dict[ChainKey, List[str]]


@dataclass
class Plan:
    lines: Dict[str, List[str]] = field(default_factory=lambda: {t: [] for t in TABLES})
    changes: List[str] = field(default_factory=list)
    rules_written: int = 0

    @property
    def empty(self) -> bool:
        return not any(self.lines.values())

    def text(self) -> str:
        out: List[str] = []
        for table in TABLES:
            if self.lines[table]:
                out.append(f"*{table}")
                out.extend(self.lines[table])
                out.append("COMMIT")
        return "\n".join(out) + "\n" if out else ""


def _is_tail(text: str) -> bool:
    return NODEPORTS_TAIL_COMMENT in text


def plan(
    current: Rules,
    desired: Rules,
    *,
    merge: bool,
    existing: Optional[Set[ChainKey]] = None,
    collect_stale: bool = True,
) -> Plan:
    """Plan the restore input.

    ``current`` holds what the kernel has for the chains in scope (the whole of them in
    full mode; in merge mode a shared chain's entry is only the in-scope rules).
    ``existing`` lists the chains that exist in the kernel (defaults to ``current``'s keys).
    """
    exists = set(current) if existing is None else existing | set(current)
    p = Plan()
    decl: Dict[str, List[str]] = {t: [] for t in TABLES}
    body: Dict[str, List[str]] = {t: [] for t in TABLES}
    tail_deletes: Dict[str, List[str]] = {t: [] for t in TABLES}

    def declare(table: str, chain: str) -> None:
        decl[table].append(f":{chain} - [0:0]")

    def fill(table: str, chain: str, rules: Iterable[str]) -> None:
        for r in rules:
            body[table].append(f"-A {chain} {r}")
            p.rules_written += 1

    keys = set(desired)
    if merge:
        # In-scope rules of a shared chain the desired side no longer mentions must go.
        keys |= {k for k in current if k[1] in SHARED_CHAINS}
    for key in sorted(keys):
        table, chain = key
        want = desired.get(key, [])
        have = current.get(key)
        if chain in BUILTIN_CHAINS:
            have_set = set(have or ())
            for r in want:
                if r not in have_set:
                    body[table].append(f"-I {chain} 1 {r}")
                    p.rules_written += 1
                    p.changes.append(f"+ {table} {chain}: {r}")
            continue
        if chain in SHARED_CHAINS:
            if key not in exists:
                declare(table, chain)
                fill(table, chain, _tail_last(want))
                p.changes.append(f"+ {table} chain {chain} ({len(want)} rules)")
                continue
            have = have or []
            if merge:
                gone = Counter(have) - Counter(want)
                new = Counter(want) - Counter(have)
                for r in sorted(gone.elements()):
                    body[table].append(f"-D {chain} {r}")
                    p.changes.append(f"- {table} {chain}: {r}")
                for r in _tail_last(sorted(new.elements())):
                    # Service rules go before the NodePort tail, which must stay last.
                    top = chain == KUBE_SERVICES and table == NAT and not _is_tail(r)
                    verb = f"-I {chain} 1" if top else f"-A {chain}"
                    body[table].append(f"{verb} {r}")
                    p.rules_written += 1
                    p.changes.append(f"+ {table} {chain}: {r}")
                continue
            ordered = _tail_last(want)
            tail_ok = not (table == NAT and chain == KUBE_SERVICES) or _tail_at_end(have, ordered)
            if Counter(have) != Counter(want) or not tail_ok:
                declare(table, chain)
                fill(table, chain, ordered)
                p.changes.append(_chain_change(table, chain, have, want))
            continue
        if have != want:
            declare(table, chain)
            fill(table, chain, want)
            p.changes.append(_chain_change(table, chain, have if key in exists else None, want))

    if collect_stale:
        # A full plan owns every service chain that exists (a large table's full sync reads
        # only chain names); a merge plan only the chains in its scope.
        for key in sorted(current if merge else exists):
            table, chain = key
            if key in desired or not chain.startswith(SERVICE_CHAIN_PREFIXES):
                continue
            declare(table, chain)  # flush first: stale chains may jump to each other
            tail_deletes[table].append(f"-X {chain}")
            count = f"{len(current[key])} rules" if key in current else "rules not read"
            p.changes.append(f"- {table} chain {chain} ({count})")

    for table in TABLES:
        p.lines[table] = decl[table] + body[table] + tail_deletes[table]
    return p


def _tail_last(rules: List[str]) -> List[str]:
    return [r for r in rules if not _is_tail(r)] + [r for r in rules if _is_tail(r)]


def _tail_at_end(have: List[str], ordered: List[str]) -> bool:
    tails = [r for r in ordered if _is_tail(r)]
    return not tails or have[len(have) - len(tails):] == tails


def _chain_change(table: str, chain: str, have: Optional[List[str]], want: List[str]) -> str:
    if have is None:
        return f"+ {table} chain {chain} ({len(want)} rules)"
    return f"~ {table} chain {chain} ({len(have)} -> {len(want)} rules)"


def render(rules: Rules, include_builtin: bool = False) -> str:
    """A ruleset as iptables-save prints it (chains sorted, rules grouped by chain)."""
    out: List[str] = []
    for table in TABLES:
        keys = sorted(c for (t, c) in rules if t == table and (include_builtin or c not in BUILTIN_CHAINS))
        if not keys:
            continue
        out.append(f"*{table}")
        out.extend(f":{c} - [0:0]" for c in keys if c not in BUILTIN_CHAINS)
        for c in keys:
            out.extend(f"-A {c} {r}" for r in _tail_last(rules[(table, c)]))
        out.append("COMMIT")
    return "\n".join(out) + "\n"
