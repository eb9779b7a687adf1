# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Dual-stack: one proxier per IP family behind the one Proxier contract (upstream's
``pkg/proxy/metaproxier``).

Each family's proxier keeps its own state (the daemon parses every object once per
family: a Service's ``clusterIPs``/``ipFamilies`` and an EndpointSlice's ``addressType``
decide what each family sees), its own ruleset and its own full-sync and repair flags.
A sync runs every family, primary first, even when one fails: a broken IPv6 ruleset
must not stop IPv4 syncs (upstream stops at the first error; we do not, for that
reason). The failure is raised after the others ran; each family keeps its own
need-full flag, and the runner's retry is a full sync.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set

from .provider import Proxier, SyncResult
from .state import ProxyState


def family_name(family: int) -> str:
    return "IPv6" if family == 6 else "IPv4"


def merge_results(results: Sequence[SyncResult]) -> SyncResult:
    """One result for the daemon, metrics and logs: counts add up, flags combine."""
    out = SyncResult(full=any(r.full for r in results), services=0, endpoints=0, rules=0, rules_written=0)
    changed: Set[str] = set()
    for r in results:
        out.services += r.services
        out.endpoints += r.endpoints
        out.rules += r.rules
        out.rules_written += r.rules_written
        out.changes.extend(r.changes)
        out.compile_seconds += r.compile_seconds
        out.apply_seconds += r.apply_seconds
        out.total_seconds += r.total_seconds
        out.no_endpoint_ports += r.no_endpoint_ports
        changed |= r.changed
        out.partial_failed = out.partial_failed or r.partial_failed
        out.rejected.update(r.rejected)
        out.repair = out.repair or r.repair
        out.restart = out.restart or r.restart
    out.changed = changed
    return out


class MetaProxier:
    """The Proxier of a dual-stack node: ``proxiers`` maps family (4, 6) to that family's
    proxier, the primary family first."""

    def __init__(self, proxiers: Dict[int, Proxier]) -> None:
        if not proxiers:
            raise ValueError("a meta-proxier needs at least one family's proxier")
        self.proxiers = dict(proxiers)
        self.primary = next(iter(self.proxiers))
        self.name = self.proxiers[self.primary].name
        self.results: Dict[int, SyncResult] = {}  # each family's last successful sync

    # The contract's attributes, read from (or spread over) the families.

    @property
    def state(self) -> ProxyState:
        return self.proxiers[self.primary].state

    @property
    def states(self) -> Dict[int, ProxyState]:
        return {family: p.state for family, p in self.proxiers.items()}

    @property
    def cfg(self) -> Any:
        return self.proxiers[self.primary].cfg

    @property
    def need_full(self) -> bool:
        return any(p.need_full for p in self.proxiers.values())

    @need_full.setter
    def need_full(self, value: bool) -> None:
        for p in self.proxiers.values():
            p.need_full = value

    @property
    def last_attempt_full(self) -> bool:
        return any(p.last_attempt_full for p in self.proxiers.values())

    @property
    def pending_repair(self) -> str:
        return "; ".join(f"{family_name(f)}: {p.pending_repair}" for f, p in self.proxiers.items()
                         if p.pending_repair)

    @property
    def rejected(self) -> Dict[str, str]:
        out: Dict[str, str] = {}
        for p in self.proxiers.values():
            out.update(p.rejected)
        return out

    def sync(self, force_full: bool = False) -> SyncResult:
        errors: List[BaseException] = []
        done: List[SyncResult] = []
        for family, p in self.proxiers.items():
            try:
                self.results[family] = p.sync(force_full=force_full)
                done.append(self.results[family])
            except Exception as e:  # the other family still syncs; this one retries
                errors.append(e)
        if errors:
            error = _first_error(errors)
            if done:
                # What did sync is in the kernel: the daemon still opens its health check node
                # ports and removes its stale flows (the failed family's wait for its retry).
                try:
                    error.partial_result = merge_results(done)  # type: ignore[attr-defined]
                except AttributeError:  # an exception type without a __dict__
                    pass
            raise error
        return merge_results([self.results[f] for f in self.proxiers])

    def check(self) -> bool:
        needed = False
        for p in self.proxiers.values():
            check = getattr(p, "check", None)
            if check is not None and check():
                needed = True
        return needed

    def cleanup(self) -> int:
        return sum(p.cleanup() for p in self.proxiers.values())

    def rule_counts(self) -> Dict[str, int]:
        """Rules per table over both families (upstream's gauges are per table only)."""
        out: Dict[str, int] = {}
        for p in self.proxiers.values():
            for table, count in p.rule_counts().items():
                out[table] = out.get(table, 0) + count
        return out

    def close(self) -> None:
        errors = []
        for p in self.proxiers.values():
            try:
                p.close()
            except Exception as e:  # every family closes; the first error is raised after
                errors.append(e)
        if errors:
            raise errors[0]

    def proxier(self, family: int) -> Optional[Proxier]:
        return self.proxiers.get(family)


def _first_error(errors: List[BaseException]) -> BaseException:
    """The error the sync runner sees: the first one; "retry soon" (a held lock, nothing
    applied) only when every family's failure was of that kind."""
    first = errors[0]
    if len(errors) > 1 and not all(getattr(e, "retry_soon", False) for e in errors):
        try:
            first.retry_soon = False  # type: ignore[attr-defined]
        except AttributeError:
            pass
    return first
