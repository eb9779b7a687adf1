# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""nftables mode: state -> compile (per service, cached) -> plan -> one ``nft -f``.

A full sync replaces the whole ``kube-proxy`` table in one transaction (packets see the
old table or the new one, never a mix). A partial sync recompiles only the services that
changed and writes the difference against what was applied last: elements of the shared
maps, the changed service chains, new and stale per-service objects. Nothing is listed on
that path. Any failure makes the next sync a full one; the kernel keeps the previous
table.

Repair: ``check()``, run every second by the sync thread, counts the rules of every
node-wide chain over netlink (kernel/nft_netlink.py; about a millisecond at any table size):
a deleted table, a ``flush table`` or a flushed dispatch chain changes a count (the sets
survive a ``flush table``). The one-element ``canary`` set, listed with nft only then,
names the cause (gone: the table was deleted). The next sync is then a full one. A flushed
or edited per-service chain is not seen by it: the hourly rewrite repairs that.
A periodic full sync (``force_full``) rewrites the table only once per ``rewrite_period``
(as upstream's hourly full sync); in between it runs that check and a partial sync.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Set

from ...errors import KernelError, Unavailable
from ...kernel.nft import NftKernel
from ...model import ValidationError
from ...provider import ProxierBase, SyncResult
from ...state import ProxyState
from . import compile as nc
from .plan import Plan, Refs, apply_refs, count_refs, plan_partial


def nftables_config(cfg: Any, ipt_cfg: Any, netns: str, family: str = "ip") -> nc.NftablesConfig:
    """The mode's config (the registry's hook): the shared options every mode resolves
    (``ipt_cfg``: masquerade bit, masqueradeAll, local detection, nodePortAddresses, node
    IPs). Localhost NodePorts are off: upstream's nftables mode does not serve them (no
    route_localnet)."""
    from dataclasses import replace

    if getattr(ipt_cfg, "family", 4) == 6:
        family = "ip6"  # the ``ip6 kube-proxy`` table, as upstream's IPv6 proxier
    return nc.NftablesConfig(base=replace(ipt_cfg, localhost_nodeports=False), family=family)


def cleanup_nftables(ctx: Any) -> int:
    """The registry's cleanup hook: delete the ``kube-proxy`` table. A node without nft
    never ran this mode (nothing to remove) unless it is the configured one."""
    family = "ip6" if getattr(ctx, "family", 4) == 6 else "ip"
    proxier = NftablesProxier(ProxyState(""), nc.NftablesConfig(family=family), NftKernel(ctx.netns))
    try:
        return proxier.cleanup()
    except Unavailable:
        if ctx.leftovers_only:
            return 0
        raise


class NftablesProxier(ProxierBase):
    name = "nftables"

    def __init__(self, state: ProxyState, cfg: nc.NftablesConfig, kernel: NftKernel,
                 refresh: Optional[Callable[[], nc.NftablesConfig]] = None) -> None:
        super().__init__(state, cfg)
        self.kernel = kernel
        self.refresh = refresh
        self.applied: Dict[str, nc.ServiceNft] = {}  # what the kernel has, per service
        self._applied_cfg: Optional[nc.NftablesConfig] = None
        self._counts: Dict[str, int] = {}
        self._refs: Refs = {}  # shared-set elements the kernel has, counted by service
        self._own = nc.Ownership()  # which service holds each map key (conflicts left out)
        # Longest time between two whole-table rewrites (upstream's hourly full sync). A
        # periodic full sync within it checks the canary and, when intact, syncs partially:
        # a rewrite costs seconds at 10,000 services.
        self.rewrite_period = 3600.0
        self._last_rewrite = float("-inf")
        self._expected: Dict[str, int] = {}  # node-wide chain -> rules written (check())
        self._expected_cfg: Optional[nc.NftablesConfig] = None
        self._slots = nc.EndpointSlots()  # endpoints-<proto> map keys per service chain
        self._netlink_elements: Optional[bool] = None  # False: element batches over netlink failed to open

    @property
    def head(self) -> str:
        return nc.table_head(self.cfg)

    def _compile(self, key: str, last_good: Optional[nc.ServiceNft]) -> Optional[nc.ServiceNft]:
        """One service; a refused one is named in ``rejected`` and keeps ``last_good``."""
        if key not in self.state.services:
            self.rejected.pop(key, None)
            return None
        try:
            out = nc.compile_service(self.state.ports_of(key), self.state.endpoints_for(key), self.cfg, self._slots)
        except ValidationError as e:
            self.rejected[key] = str(e)
            return last_good
        self.rejected.pop(key, None)
        return out

    def sync(self, force_full: bool = False) -> SyncResult:
        start = time.monotonic()
        changed = self.state.take_changes()
        if self.cfg != self._applied_cfg:
            self.need_full = True
        if force_full and not self.need_full and not self.pending_repair \
                and time.monotonic() - self._last_rewrite < self.rewrite_period and not self.check():
            force_full = False  # periodic resync: the table is intact, no rewrite is due yet
        full = force_full or self.need_full or bool(self.pending_repair)
        self.last_attempt_full = full
        repair = self.pending_repair
        try:
            result = self._full(changed, start) if full else self._partial(changed, start)
        except Exception:
            # Keep the changes for the retry, and trust nothing we remember.
            self._requeue(changed)
            raise
        self.need_full = False
        self.pending_repair = ""
        result.changed = changed
        result.rejected = {**self._own.conflicts, **self.rejected}
        result.repair = repair
        return result

    def _full(self, changed: Set[str], start: float) -> SyncResult:
        compiled: Dict[str, nc.ServiceNft] = {}
        same_cfg = self.cfg == self._applied_cfg
        # In name order: the endpoint maps' key blocks are handed out in compile order, so
        # the same services give the same table whatever order they arrived in.
        for key in sorted(self.state.services):
            old = self.applied.get(key) if same_cfg else None
            if old is not None and key not in changed and key not in self.rejected:
                compiled[key] = old  # pure compile: unchanged input, unchanged output
                continue
            out = self._compile(key, old)
            if out is not None:
                compiled[key] = out
        resolved = nc.resolve(compiled)
        script = nc.render_full(compiled, self.cfg, resolved) + self._kept_affinity(compiled)
        compile_s = time.monotonic() - start
        t = time.monotonic()
        self.kernel.apply(script)
        apply_s = time.monotonic() - t
        self.applied = compiled
        self._slots.keep_only({c for svc in compiled.values() for c in svc.chains})
        self._refs = count_refs(compiled)
        self._own = resolved[1]
        self._applied_cfg = self.cfg
        self._last_rewrite = time.monotonic()
        self._recount()
        return self._result(True, self._counts.get("rules", 0), ["table replaced"], compile_s, apply_s, start)

    def _kept_affinity(self, compiled: Dict[str, nc.ServiceNft]) -> str:
        """The ClientIP affinity entries the rewrite would lose (the table is deleted and
        made anew), read from the kernel and re-added to the new sets of the same name with
        the time they had left: a client keeps its backend across a full sync (and a
        restart of the proxy). One netlink element dump per affinity set; a failure to read
        costs the entries, not the sync."""
        sets = {name: decl for svc in compiled.values() for name, decl in svc.sets.items()
                if name.startswith("affinity-")}
        if not sets:
            return ""
        try:
            entries = self.kernel.expiring_entries(self.cfg.family, nc.TABLE, sorted(sets))
        except (KernelError, Unavailable, OSError):
            return ""
        return nc.kept_entries_text(self.head, sets, entries)

    def _partial(self, changed: Set[str], start: float) -> SyncResult:
        old: Dict[str, Optional[nc.ServiceNft]] = {}
        new: Dict[str, Optional[nc.ServiceNft]] = {}
        for key in changed:
            before = self.applied.get(key)
            old[key] = before
            new[key] = self._compile(key, before)
        if self._contested(new):
            # Two services claim one map key: only a full sync decides who holds it.
            self.last_attempt_full = True
            return self._full(changed, start)
        p = plan_partial(self.head, old, new, self._refs)
        compile_s = time.monotonic() - start
        t = time.monotonic()
        if p.text and not self._apply_elements(p):
            self.kernel.apply(p.text)
        apply_s = time.monotonic() - t
        apply_refs(self._refs, p.ref_delta)
        self._update_owners(old, new)
        for key, svc in new.items():
            before = old[key]
            if before is not None:
                _count(self._counts, before, -1)
            if svc is None:
                self.applied.pop(key, None)
            else:
                self.applied[key] = svc
                _count(self._counts, svc, 1)
        return self._result(False, p.rules_written, p.changes, compile_s, apply_s, start)

    def _apply_elements(self, p: Plan) -> bool:
        """An element-only plan (an endpoint replaced) written over netlink: True when done.
        False (nft -f then writes the text, same transaction) when the plan has more than
        elements, an element of another set, or netlink cannot be used here."""
        if not p.element_ops or self._netlink_elements is False:
            return False
        ops = []
        for verb, where, elems in p.element_ops:
            encoded = [nc.encode_element(where, e) for e in elems]
            if any(e is None for e in encoded):
                return False
            ops.append((verb, where, [e for e in encoded if e is not None]))
        try:
            return self.kernel.apply_elements(self.cfg.family, nc.TABLE, ops)
        except Unavailable:
            self._netlink_elements = False  # no pyroute2 for a named netns: nft from now on
            return False

    def _contested(self, new: Dict[str, Optional[nc.ServiceNft]]) -> bool:
        """A changed service lost a key to another, holds a key another wants, or now
        wants a key another holds."""
        own = self._own
        if any(key in own.conflicts for key in new):
            return True
        if own.wanted_by_losers and any(own.owners.get(k) in new for k in own.wanted_by_losers):
            return True
        for key, svc in new.items():
            for where, elems in (svc.elements.items() if svc else ()):
                if where in nc.SHARED_ELEMENT_SETS:
                    continue
                for e in elems:
                    owner = own.owners.get((where, nc.element_key(e)))
                    if owner is not None and owner != key:
                        return True
        return False

    def _update_owners(self, old: Dict[str, Optional[nc.ServiceNft]],
                       new: Dict[str, Optional[nc.ServiceNft]]) -> None:
        owners = self._own.owners
        for key, svc in old.items():
            for where, elems in (svc.elements.items() if svc else ()):
                for e in elems:
                    k = (where, nc.element_key(e))
                    if owners.get(k) == key:
                        del owners[k]
        for key, svc in new.items():
            for where, elems in (svc.elements.items() if svc else ()):
                if where not in nc.SHARED_ELEMENT_SETS:
                    for e in elems:
                        owners[(where, nc.element_key(e))] = key

    def _recount(self) -> None:
        self._counts = {}
        for svc in self.applied.values():
            _count(self._counts, svc, 1)

    def _result(self, full: bool, written: int, changes: list, compile_s: float, apply_s: float,
                start: float) -> SyncResult:
        c = self._counts
        return SyncResult(
            full=full, services=len(self.state.services), endpoints=c.get("endpoints", 0),
            rules=c.get("rules", 0) + _infra_rules(self.cfg), rules_written=written, changes=changes,
            compile_seconds=compile_s, apply_seconds=apply_s, total_seconds=time.monotonic() - start,
            no_endpoint_ports=c.get("no_endpoint_ports", 0))

    def check(self) -> bool:
        """The every-second check: True when the next sync must rewrite the table - a
        node-wide chain (the base chains, the ``services`` dispatch, the checks,
        masquerading) holds another number of rules than we wrote (``delete table``,
        ``flush ruleset``, ``flush table``, ``flush chain``, a rule deleted or added). The
        counts come over netlink: ~1 ms for all of them at 10,000 services. The canary set
        (listed with nft, tens of ms) names the cause, or is the check when netlink cannot
        be used."""
        if self.need_full or self._applied_cfg is None:
            return False  # a full sync is due anyway
        expected = self._infra_counts()
        try:
            counts = self.kernel.rule_counts(self.cfg.family, nc.TABLE, expected)
        except (KernelError, Unavailable):
            counts = None  # cannot count: the canary alone decides
        wrong = [c for c, n in expected.items() if counts is not None and counts.get(c) != n]
        if counts is not None and not wrong:
            return False
        elements = self.kernel.set_elements(self.cfg.family, nc.TABLE, nc.CANARY_SET)
        if elements is None or nc.CANARY_ELEMENT not in elements:
            self.pending_repair = (f"set {self.head} {nc.CANARY_SET} is gone (table deleted?)" if elements is None
                                   else f"set {self.head} {nc.CANARY_SET} is empty (set flushed?)")
            return True
        if not wrong:
            return False
        self.pending_repair = (f"chain {self.head} {wrong[0]} has {counts.get(wrong[0])} rule(s), "
                               f"{expected[wrong[0]]} written (table or chain flushed?)")
        return True

    def _infra_counts(self) -> Dict[str, int]:
        if self._expected_cfg is not self.cfg:
            self._expected = {c: len(r) for c, r in nc.infrastructure(self.cfg).rules.items()}
            self._expected_cfg = self.cfg
        return self._expected

    def cleanup(self) -> int:
        """Delete the table (every object we create lives in it). Returns 1 if it existed."""
        existed = self.kernel.table_exists(self.cfg.family, nc.TABLE)
        if existed:  # at every start of another mode: no nft transaction when there is nothing
            self.kernel.apply(nc.cleanup_text(self.cfg))
        self.applied = {}
        self._applied_cfg = None
        self.need_full = True
        return 1 if existed else 0

    def rule_counts(self) -> Dict[str, int]:
        """Rules we own, by table (one table here: ``ip kube-proxy``)."""
        return {self.head: self._counts.get("rules", 0) + _infra_rules(self.cfg)}

    @classmethod
    def create(cls, state: ProxyState, cfg: nc.NftablesConfig, ctx: Any) -> NftablesProxier:
        """Built by the mode registry."""
        return cls(state, cfg, NftKernel(ctx.netns), refresh=ctx.refresh)


def _infra_rules(cfg: nc.NftablesConfig) -> int:
    return sum(len(r) for r in nc.infrastructure(cfg).rules.values())


def _count(counts: Dict[str, int], svc: nc.ServiceNft, sign: int) -> None:
    counts["rules"] = counts.get("rules", 0) + sign * svc.rule_count()
    counts["endpoints"] = counts.get("endpoints", 0) + sign * svc.endpoints
    counts["no_endpoint_ports"] = counts.get("no_endpoint_ports", 0) + sign * svc.no_endpoint_ports
