# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""iptables mode: state -> compile (per service, cached) -> plan -> one restore.

A full sync re-reads the kernel and reconciles every chain we own; a partial sync
recompiles only the services that changed and diffs them against what we applied last.
Any failure makes the next sync a full one; the kernel keeps the previous rules (a
restore refused because another program held the xtables lock applied nothing: its retry
stays partial).

Repair (see docs/iptables-mode.md): ``check()``, run every second by the sync thread,
looks for the ``KUBE-PROXY-CANARY`` chains (cost independent of the number of services);
a missing one makes the next sync a repair at once. The periodic full sync of a large
table also checks the top-level dispatch (built-in jumps, first rule of each shared
chain). A repair rewrites the node-wide chains and the service chains that are missing,
and trusts the service chains the chain listing shows (a rule edited inside one waits
for the hourly full rewrite).

Restart (see docs/iptables-mode.md): a clean shutdown records what the kernel holds (one
digest per chain, in a root-only file under /run) and leaves a matching token in nat's
canary chain. The first sync after a start, when the table is too large to read rule by
rule, adopts that record once the kernel passes the same cheap checks as a periodic sync
(token, canaries, the chain listing equal to the recorded one, the shared chains' first
rules, a few service chains' first rules), and writes only the chains whose desired
content differs from the record. Anything else (no record, a check failing) is a full
rewrite, as before.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ...gcpause import paused_gc
from ...kernel import sysctl
from ...kernel.iptables import (
    APPLIED_MARK,
    CANARY_CHAIN,
    CANARY_TABLES,
    IptablesKernel,
    LockBusy,
    Snapshot,
    cleanup_text,
)
from ...model import ValidationError
from ...provider import RECORD_DIR, ProxierBase, SyncResult
from ...state import ProxyState
from . import compile as ipt
from .plan import TABLES, Plan, plan

ROUTE_LOCALNET = sysctl.ROUTE_LOCALNET


def localhost_nodeports_on(cfg: ipt.IptablesConfig) -> bool:
    """Upstream's rule: NodePorts answer on 127.0.0.1 when localhostNodePorts is on and the
    NodePort addresses include IPv4 loopback (all addresses, or a range holding 127.0.0.1)."""
    if not cfg.localhost_nodeports:
        return False
    return cfg.node_port_match_all or any(
        ipaddress.ip_address(ip).is_loopback for ip in cfg.node_port_ips if ":" not in ip)


def ensure_route_localnet(cfg: ipt.IptablesConfig, netns: str, log: Callable[[str], None]) -> bool:
    """As upstream's NewProxier: with localhost NodePorts, set route_localnet=1 (without it
    the kernel drops packets to 127.0.0.1 once DNAT sends them off the node) and say so.
    Returns whether the value changed; raises sysctl.SysctlError when it cannot be set."""
    if not localhost_nodeports_on(cfg):
        return False
    log(f"setting {ROUTE_LOCALNET}=1 to allow NodePorts on localhost; to change this, set "
        "iptables.localhostNodePorts to false or nodePortAddresses (--nodeport-addresses) without 127.0.0.1")
    changed = sysctl.ensure({ROUTE_LOCALNET: 1}, netns)
    if changed:
        log(f"sysctl {ROUTE_LOCALNET}: {changed[ROUTE_LOCALNET]}")
    return bool(changed)


class IptablesProxier(ProxierBase):
    name = "iptables"

    def __init__(self, state: ProxyState, cfg: ipt.IptablesConfig, kernel: IptablesKernel) -> None:
        super().__init__(state, cfg)
        self.kernel = kernel
        self.compiled: Dict[str, ipt.ServiceRules] = {}  # what the kernel has, per service
        self._table_rules: Dict[str, int] = {}  # per-service rules by table, kept incrementally
        self._compiled_cfg: Optional[ipt.IptablesConfig] = None  # the config ``compiled`` was built with
        self.rewrite_period = 3600.0  # large tables: longest time between two full rewrites
        self._last_rewrite = float("-inf")
        self._periodic_checks = 0
        self.record: Optional[Dict] = None  # what a clean shutdown recorded (load_record()): first sync only
        self._prefetch: Optional[threading.Thread] = None  # reads the kernel while the sources load
        self._prefetched: Optional[Snapshot] = None
        self._prefetch_s = 0.0

    @classmethod
    def create(cls, state: ProxyState, cfg: ipt.IptablesConfig, ctx: Any) -> IptablesProxier:
        """As upstream's NewProxier: route_localnet for localhost NodePorts first
        (sysctl.SysctlError, a RuntimeError, when it cannot be set)."""
        ensure_route_localnet(cfg, ctx.netns, ctx.log)
        return cls(state, cfg, ctx.iptables)

    def _config(self) -> ipt.IptablesConfig:
        large = self.state.endpoint_count() > ipt.LARGE_CLUSTER_ENDPOINTS
        if large != self.cfg.large_cluster:
            # Crossing the threshold changes every endpoint rule: only a full sync fits.
            self.cfg = _replace(self.cfg, large_cluster=large)
            self.need_full = True
        return self.cfg

    def _compile(self, key: str, cfg: Optional[ipt.IptablesConfig] = None,
                 last_good: Optional[ipt.ServiceRules] = None) -> Optional[ipt.ServiceRules]:
        """One service's rules. A service the compiler refuses is named in ``rejected`` and
        keeps ``last_good`` (what the kernel has for it under this config, or nothing):
        one bad object never fails the sync of the others."""
        return self._compile_checked(key, lambda: ipt.compile_service(
            self.state.ports_of(key), self.state.endpoints_for(key), cfg or self.cfg), last_good)

    def sync(self, force_full: bool = False) -> SyncResult:
        start = time.monotonic()
        changed = self.state.take_changes()
        cfg = self._config()
        full = self._begin(force_full)
        repair = self.pending_repair
        try:
            snap = None
            if full and not self.need_full and self._rewrite_not_due(cfg):
                snap = self._periodic_snapshot()  # read once: a full sync reuses it
            broken = self._large_table_broken(cfg, snap) if snap is not None and not snap.complete else ""
            if snap is not None and not snap.complete and not broken:
                # Large table, periodic resync, nothing known to be wrong: the chain listing
                # and the top-level dispatch agree with what we applied: a partial sync will do.
                result = self._partial_sync(changed, start)
            elif broken:
                # Rewrite what the checks cannot vouch for, not the 10,000 service chains the
                # listing shows intact (5 s at 10,000 services on iptables-nft).
                if not snap.listed:  # the repair needs to know which chains exist
                    snap = self.kernel.snapshot_for_full_sync()
                # `iptables -t nat -F` empties every chain but deletes none: the listing then
                # shows service chains that hold nothing. Trust it only when sampled service
                # chains still start with what we wrote.
                trust = not snap.complete and self._service_chains_hold_rules()
                result = self._full_sync(cfg, start, changed, snap, trust_listed=trust)
                repair = f"{repair}; {broken}" if repair else broken
            elif full:
                result = self._full_sync(cfg, start, changed, snap)
            else:
                result = self._partial_sync(changed, start)
            if full:
                self._ensure_canaries()
        except LockBusy:
            # Nothing was applied: what we remember still matches the kernel.
            self._requeue(changed, full_needed=False)
            raise
        except Exception:
            # Keep the changes for the retry, and trust nothing we remember.
            self._requeue(changed)
            raise
        result.repair = repair
        return self._done(result, changed)

    def check(self) -> bool:
        """The every-second check: True when a canary chain is gone, i.e. something flushed
        or deleted our rules (a firewall reload), and the next sync must repair. Three
        ``iptables -S`` calls, whatever the number of services."""
        if self.need_full or self._compiled_cfg is None:
            return False  # a full sync is due anyway (or none ran yet: no canaries to look at)
        missing = self.kernel.missing_canaries()
        if not missing:  # None: undecided (lock held): look again next time
            return False
        self.pending_repair = f"canary KUBE-PROXY-CANARY missing in {', '.join(missing)}"
        return True

    def _ensure_canaries(self) -> None:
        """After a full sync or repair has written our rules: the canaries mark them."""
        missing = self.kernel.missing_canaries(CANARY_TABLES)
        if missing:
            self.kernel.create_canaries(missing)

    def _large_table_broken(self, cfg: ipt.IptablesConfig, snap: Snapshot) -> str:
        """Why a large table needs repair ("" when the cheap checks find nothing)."""
        if not self._large_table_intact(cfg, snap):
            return "chain listing or built-in jumps differ"
        return self._dispatch_broken()

    def _dispatch_broken(self) -> str:
        """The first rule of each shared chain (KUBE-SERVICES, KUBE-NODEPORTS, ...) that
        should have rules is one of ours: catches a flush of those chains alone. Reading one
        chain costs its length (0.14 s for nat KUBE-SERVICES at 10,000 services)."""
        want: Dict = {}
        for rules in self.compiled.values():
            for key, lines in rules.shared.items():
                want.setdefault(key, []).append(lines)
        tail = ipt.nodeports_tail(self.cfg)
        if tail:
            want.setdefault((ipt.NAT, ipt.KUBE_SERVICES), []).append(tail)
        for (table, chain), parts in sorted(want.items()):
            first = self.kernel.first_rule(table, chain)
            if first is None:
                continue  # gone (the chain listing says so) or undecided (lock held)
            if not any(first in lines for lines in parts):
                return f"{table} {chain} " + (f"starts with a rule not ours: {first[:100]}" if first else "is empty")
        return ""

    def _periodic_snapshot(self) -> Snapshot:
        """What a periodic check reads. For a table too large to diff, listing its 40,000
        chain names costs 0.4-0.6 s of the sync thread while changes wait (most of a periodic
        check): that listing runs every ``LISTING_EVERY``-th check; the others read the
        built-in chains, and the dispatch check reads the shared chains' first rules. The
        canaries, checked every second, catch a flush or a firewall reload in between."""
        self._periodic_checks += 1
        own = sum(len(rules.chains) for rules in self.compiled.values())
        if own > self.kernel.diff_max_chains and self._periodic_checks % LISTING_EVERY:
            return self.kernel.builtin_snapshot()
        return self.kernel.snapshot_for_full_sync()

    def _service_chains_hold_rules(self, samples: int = 3) -> bool:
        """False when one of a few service chains we wrote (first in name order, one per kind
        of chain where there is one) is in the kernel but empty or starting with another rule;
        a chain that is gone or undecided (lock held) says nothing. A few ``iptables -S CHAIN 1``
        of short chains: milliseconds."""
        picked: Dict[str, Tuple[ipt.ChainKey, List[str]]] = {}
        for key in sorted(self.compiled)[:200]:
            for chain_key, lines in self.compiled[key].chains.items():
                kind = chain_key[1][:9]  # KUBE-SVC-, KUBE-SEP-, KUBE-EXT-, ...
                if lines and kind not in picked:
                    picked[kind] = (chain_key, lines)
            if len(picked) >= samples:
                break
        for (table, chain), lines in list(picked.values())[:samples]:
            first = self.kernel.first_rule(table, chain)
            if first is not None and first not in lines:
                return False
        return True

    def _rewrite_not_due(self, cfg: ipt.IptablesConfig) -> bool:
        """A rewrite was done less than ``rewrite_period`` ago under this config."""
        return (bool(self.compiled) and cfg == self._compiled_cfg
                and time.monotonic() - self._last_rewrite < self.rewrite_period)

    def _large_table_intact(self, cfg: ipt.IptablesConfig, snap: Snapshot) -> bool:
        """For tables too large to read rule by rule (``snap`` holds chain names and the
        built-in chains only, see kernel/iptables.py): True when the kernel's chain names
        and built-in jumps are exactly what we applied. Upstream likewise rewrites
        everything only hourly; content edits inside our chains wait for that rewrite."""
        if snap.complete:
            return False  # small enough to diff rule by rule: the full sync does that
        # The chain names and built-in rules of assemble(), without assembling 110,000 rules
        # (0.36 s at 10,000 services, on the sync thread while changes wait): service rules
        # go only to their own chains and to shared chains the node-wide part declares.
        infra = ipt.infrastructure(cfg)
        want = {k for k in infra if k[1] not in ipt.BUILTIN_CHAINS}
        for rules in self.compiled.values():
            want.update(rules.chains)
            want.update(rules.shared)
        if snap.listed and {k for k in snap.chains
                            if k[1].startswith(ipt.SERVICE_CHAIN_PREFIXES) or k in want} != want:
            return False
        for key, rules in infra.items():
            if key[1] in ipt.BUILTIN_CHAINS and not set(rules) <= set(snap.rules.get(key, ())):
                return False
        return True

    def compile_all(self, cfg: ipt.IptablesConfig, changed: Set[str]) -> Tuple[Dict[str, ipt.ServiceRules], Dict]:
        """Every service's rules and the whole desired ruleset (what a full sync computes
        before it reads the kernel). Compiling is pure: a service that did not change since
        it was applied, under the same config, compiles to what we hold already."""
        reuse = self.compiled if cfg == self._compiled_cfg else {}
        compiled = {}
        self._forget_gone_rejections()
        state = self.state
        rejected = self.rejected
        with paused_gc():
            for key in state.service_keys():
                rules = reuse.get(key) if key not in changed else None
                if rules is None:
                    try:
                        rules = ipt.compile_service(state.ports_of(key), state.endpoints_for(key), cfg)
                    except ValidationError as e:  # as _compile(), inline: this loop is the cold compile
                        rejected[key] = str(e)
                        rules = reuse.get(key)
                        if rules is None:
                            continue  # refused, and nothing applied before: left out
                    else:
                        if rejected:
                            rejected.pop(key, None)
                compiled[key] = rules
            return compiled, assemble(compiled, cfg)

    def _full_sync(self, cfg: ipt.IptablesConfig, start: float, changed: Set[str],
                   snap: Optional[Snapshot] = None, trust_listed: bool = False) -> SyncResult:
        t0 = time.monotonic()
        compiled, desired = self.compile_all(cfg, changed)  # the kernel side is still checked
        compile_s = time.monotonic() - t0
        record, self.record = self.record, None  # used once, whatever the outcome
        prefetched = self._take_prefetched() if record is not None and snap is None else None
        t_list = time.monotonic()
        if snap is None:
            snap = prefetched or self.kernel.snapshot_for_full_sync()
        list_s = time.monotonic() - t_list
        current = snap.rules
        restart = ""
        existing = snap.chains
        planned = desired
        if record is not None and not snap.complete and not trust_listed:
            t_check = time.monotonic()
            with paused_gc():
                adopted, trusted, restart = self._recorded_current(record, snap, desired)
            restart += (f"; chain listing {'read while the sources loaded, ' if prefetched else ''}"
                        f"{(self._prefetch_s if prefetched else list_s) * 1000:.0f} ms"
                        + (f" (waited {list_s * 1000:.0f} ms for it)" if prefetched else "")
                        + f", checks and digests {(time.monotonic() - t_check) * 1000:.0f} ms")
            if adopted is not None:
                # Plan only the chains not vouched for: 40,000 chains planned to find a few
                # that differ cost more than the write.
                current = adopted
                planned = {k: v for k, v in desired.items() if k not in trusted}
                existing = snap.chains - trusted
            elif prefetched is not None:
                # A rewrite of every chain plans against the kernel as it is now, not as it
                # was listed while the sources loaded.
                snap = self.kernel.snapshot_for_full_sync()
                current, existing = snap.rules, snap.chains
        elif record is not None:
            restart = "recorded state not needed: the tables were read rule by rule"
        if trust_listed:
            # A service chain the listing shows is taken to hold what we applied to it; the
            # node-wide and shared chains are not read, so the plan rewrites them.
            current = dict(snap.rules)
            for rules in self.compiled.values():
                for key, lines in rules.chains.items():
                    if key in snap.chains:
                        current[key] = lines
        with paused_gc():
            p = plan(current, planned, merge=False, existing=existing)
        if not p.empty:
            # Flush nat's canary in the same transaction: a token a clean shutdown left there
            # no longer describes the kernel once we write (see save_record()).
            p.lines[ipt.NAT].insert(0, f":{CANARY_CHAIN} - [0:0]")
        apply_s = self.kernel.restore(p.text()) if not p.empty else 0.0
        if restart.startswith("adopted"):
            # The hourly rewrite stays on the schedule of the process that recorded.
            age = time.time() - float(record.get("last_rewrite") or 0.0)  # type: ignore[union-attr]
            if 0.0 <= age < self.rewrite_period:
                self._last_rewrite = time.monotonic() - age
        elif not trust_listed:
            self._last_rewrite = time.monotonic()
        self.compiled = compiled
        self._compiled_cfg = cfg
        self._table_rules = {}
        for rules in compiled.values():
            _count(self._table_rules, rules, 1)
        result = self._result(True, p, compile_s, apply_s, start)
        result.restart = restart
        return result

    def _recorded_current(self, record: Dict, snap: Snapshot,
                          desired: Dict) -> Tuple[Optional[Dict], Set[ipt.ChainKey], str]:
        """For a table too large to read rule by rule, once cheap checks vouch for the record:
        (the built-in chains as read, plus a placeholder that differs from any rule for each
        recorded chain whose desired content differs from its digest, so the plan rewrites
        it; the chains that hold what is desired; "adopted ..."). (None, set(), why) when a
        check fails."""
        token = record.get("token")
        first = self.kernel.first_rule(ipt.NAT, CANARY_CHAIN)
        if not token or not first or f"{APPLIED_MARK}{token}" not in first:
            return None, set(), "recorded state not used: its token is not in nat KUBE-PROXY-CANARY"
        if self.kernel.missing_canaries() != []:
            return None, set(), "recorded state not used: a canary chain is missing"
        recorded = {}
        for name, digest in record.get("chains", {}).items():
            table, chain = name.split(" ", 1)
            recorded[(table, chain)] = digest
        ours = {k for k in snap.chains if k[1].startswith(ipt.SERVICE_CHAIN_PREFIXES)
                or (k in recorded or k in desired) and k[1] not in ipt.BUILTIN_CHAINS}
        if ours != recorded.keys():
            return None, set(), (f"recorded state not used: the chain listing differs from the record ("
                                 f"{len(ours - recorded.keys())} chains not recorded, "
                                 f"{len(recorded.keys() - ours)} gone)")
        current: Dict = {k: v for k, v in snap.rules.items() if k[1] in ipt.BUILTIN_CHAINS}
        trusted = set()
        for key, digest in recorded.items():
            lines = desired.get(key)
            if lines is not None and chain_digest(key[1], lines) == digest:
                trusted.add(key)
            else:
                current[key] = [_UNTRUSTED]
        # The shared chains (a flush of KUBE-SERVICES alone keeps the token) and a few
        # service chains (one of each kind) start with what the record says.
        picked: Dict[str, ipt.ChainKey] = {}  # the first chain in name order of each kind
        for key in trusted:
            if key[1] in ipt.SHARED_CHAINS:
                picked[f"{key[0]} {key[1]}"] = key
                continue
            kind = next((p for p in ipt.SERVICE_CHAIN_PREFIXES if key[1].startswith(p)), "")
            if kind and desired[key] and (kind not in picked or key < picked[kind]):
                picked[kind] = key
        for key in picked.values():
            got = self.kernel.first_rule(*key)
            want = desired[key]
            if got is None or (got not in want if want else got != ""):
                return None, set(), f"recorded state not used: {key[0]} {key[1]} does not start as recorded"
        return current, trusted, (f"adopted the rules recorded at shutdown ({len(trusted)} of {len(recorded)} "
                                  "chains unchanged)")

    def prefetch(self) -> bool:
        """With a record loaded: list the kernel's chains on a thread of its own now, while
        the sources load (the manifests parse or the API list: seconds to tens of seconds at
        10,000 services), so that the first sync finds the listing done (1.3-3.4 s of the
        restart's first sync at 40,000 chains, mostly in ``nft``, off this process's CPU).
        Only a large table is listed (chain names and built-in chains: the record vouches
        for the rest, and the token is checked again at the first sync, so a full sync by
        anything else in between still invalidates it); a small table, or iptables-legacy's,
        is read whole at the first sync, as without a record. True when a prefetch started."""
        if self.record is None or self._prefetch is not None:
            return False

        def run() -> None:
            t0 = time.monotonic()
            try:
                snap = self.kernel.large_table_snapshot()  # None: small or legacy, read at the sync
            except Exception:  # the first sync reads the kernel itself, and reports
                return
            self._prefetch_s = time.monotonic() - t0
            self._prefetched = snap

        self._prefetch = threading.Thread(target=run, name="prefetch", daemon=True)
        self._prefetch.start()
        return True

    def _take_prefetched(self) -> Optional[Snapshot]:
        thread, self._prefetch = self._prefetch, None
        if thread is None:
            return None
        thread.join()
        snap, self._prefetched = self._prefetched, None
        return snap

    def record_state(self) -> Optional[Dict]:
        """What the kernel holds, as recorded at a clean shutdown: one digest per chain we
        own (None when we do not know it exactly: a full sync is due or a repair pending)."""
        if self.need_full or self.pending_repair or self._compiled_cfg is None or self.cfg != self._compiled_cfg:
            return None
        desired = assemble(self.compiled, self._compiled_cfg)
        chains = {f"{t} {c}": chain_digest(c, lines) for (t, c), lines in desired.items()
                  if c not in ipt.BUILTIN_CHAINS}
        last = self._last_rewrite
        return {"version": RECORD_VERSION, "chains": chains,
                "last_rewrite": time.time() - (time.monotonic() - last) if last != float("-inf") else 0.0}

    def record_path(self, directory: str = RECORD_DIR) -> str:
        """Where a clean shutdown records the rules it leaves (see save_record())."""
        return record_path(self.kernel, directory)

    def save_record(self, path: str) -> str:
        """At a clean shutdown (the sync thread stopped): write the record, then the token
        that ties it to the kernel. Returns what was done, for the log."""
        _remove(path)
        record = self.record_state()
        if record is None:
            return "no record of the rules written (a full sync was due): the next start rewrites them"
        record["token"] = secrets.token_hex(8)
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, separators=(",", ":"))
        os.replace(tmp, path)
        try:
            self.kernel.mark_applied(record["token"])
        except Exception:
            _remove(path)
            raise
        return f"recorded the {len(record['chains'])} chains written in {path}"

    def load_record(self, path: str) -> str:
        """Take the record a clean shutdown left (and remove it: it describes the kernel
        only until this process writes). Returns what was found, for the log."""
        try:
            st = os.stat(path)
        except OSError:
            return ""
        try:
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                return f"ignored {path}: not a file only this user can read and write"
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            return f"ignored {path}: {e}"
        finally:
            _remove(path)
        if (not isinstance(record, dict) or record.get("version") != RECORD_VERSION
                or not isinstance(record.get("chains"), dict) or not isinstance(record.get("token"), str)
                or not all(isinstance(k, str) and " " in k and isinstance(v, str)
                           for k, v in record["chains"].items())):
            return f"ignored {path}: not a record this version writes"
        self.record = record
        return f"found the record of the rules written before the last shutdown ({len(record['chains'])} chains)"

    def _partial_sync(self, changed: set, start: float) -> SyncResult:
        t0 = time.monotonic()
        before: Dict = {}
        after: Dict = {}
        new_compiled: Dict[str, Optional[ipt.ServiceRules]] = {}
        for key in sorted(changed):
            old = self.compiled.get(key)
            new = self._compile(key, last_good=old)
            new_compiled[key] = new
            if old is not None:
                _merge_into(before, old)
            if new is not None:
                _merge_into(after, new)
        compile_s = time.monotonic() - t0
        p = plan(before, after, merge=True, existing=set(ipt.infrastructure(self.cfg)))
        apply_s = self.kernel.restore(p.text()) if not p.empty else 0.0
        for key, new in new_compiled.items():
            old = self.compiled.pop(key, None)
            if old is not None:
                _count(self._table_rules, old, -1)
            if new is not None:
                self.compiled[key] = new
                _count(self._table_rules, new, 1)
        return self._result(False, p, compile_s, apply_s, start)

    def _result(self, full: bool, p: Plan, compile_s: float, apply_s: float, start: float) -> SyncResult:
        # Totals are kept by _count as services come and go: summing 10,000 services on every
        # one-endpoint sync cost more than planning it.
        t = self._table_rules
        return SyncResult(
            full=full, services=len(self.state.services),
            endpoints=t.get(_ENDPOINTS, 0), rules=sum(v for k, v in t.items() if k in TABLES),
            rules_written=p.rules_written, changes=p.changes,
            compile_seconds=compile_s, apply_seconds=apply_s, total_seconds=time.monotonic() - start,
            no_endpoint_ports=t.get(_NO_ENDPOINT_PORTS, 0),
        )

    def rule_counts(self) -> Dict[str, int]:
        """Rules we own per table (service rules plus the node-wide ones)."""
        counts = {k: v for k, v in self._table_rules.items() if k in TABLES}
        infra = ipt.infrastructure(self.cfg)
        for (table, chain), rules in infra.items():
            if chain not in ipt.BUILTIN_CHAINS:
                counts[table] = counts.get(table, 0) + len(rules)
        return counts

    def cleanup(self) -> int:
        """Remove every chain and jump we create. Returns how many chains went."""
        snap = self.kernel.snapshot(("mangle", "filter", "nat"))  # mangle: the canary
        text = cleanup_text(snap)
        if text:
            self.kernel.restore(text)
        self.compiled = {}
        self.need_full = True
        return text.count("\n-X ")


RECORD_VERSION = 1
_UNTRUSTED = "#not as recorded"  # a placeholder rule: differs from any rule we write


def record_path(kernel: IptablesKernel, directory: str = RECORD_DIR) -> str:
    """Where the record of the rules applied in this kernel's namespace lives."""
    binary = os.path.basename(kernel.binary)
    return os.path.join(directory, f"iptables-applied-{binary}-netns{kernel.netns_id() or 'unknown'}.json")


def chain_digest(chain: str, lines: List[str]) -> str:
    """A chain's content in 16 hex digits; shared chains as the multiset of their rules
    (partial syncs insert and delete in place, so their order is not the compiled one)."""
    text = "\n".join(sorted(lines) if chain in ipt.SHARED_CHAINS else lines)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


LISTING_EVERY = 6  # periodic checks of a large table: one in this many lists the chain names
_ENDPOINTS = "#endpoints"
_NO_ENDPOINT_PORTS = "#no-endpoint-ports"


def _count(counts: Dict[str, int], rules: ipt.ServiceRules, sign: int) -> None:
    """Per-table rule counts, plus endpoint totals under keys that are not table names."""
    for part in (rules.chains, rules.shared):
        for (table, _chain), lines in part.items():
            counts[table] = counts.get(table, 0) + sign * len(lines)
    counts[_ENDPOINTS] = counts.get(_ENDPOINTS, 0) + sign * rules.endpoints
    counts[_NO_ENDPOINT_PORTS] = counts.get(_NO_ENDPOINT_PORTS, 0) + sign * rules.no_endpoint_ports


def _merge_into(target: Dict, rules: ipt.ServiceRules) -> None:
    for key, lines in rules.chains.items():
        target[key] = lines
    for key, lines in rules.shared.items():
        target.setdefault(key, []).extend(lines)


def assemble(compiled: Dict[str, ipt.ServiceRules], cfg: ipt.IptablesConfig) -> Dict:
    """The whole desired ruleset: node-wide chains, then every service's rules."""
    desired = {k: list(v) for k, v in ipt.infrastructure(cfg).items()}
    for key in sorted(compiled):
        _merge_into(desired, compiled[key])
    desired[(ipt.NAT, ipt.KUBE_SERVICES)].extend(ipt.nodeports_tail(cfg))
    return desired


def _replace(cfg: ipt.IptablesConfig, **kw: object) -> ipt.IptablesConfig:
    from dataclasses import replace

    return replace(cfg, **kw)


# --- the mode registry's hooks (modes/__init__.py) ---------------------------------------


def iptables_mode_config(cfg: Any, ipt_cfg: ipt.IptablesConfig, netns: str) -> ipt.IptablesConfig:
    """iptables mode's compiler configuration is the shared iptables options as they are."""
    return ipt_cfg


def cleanup_iptables(ctx: Any) -> int:
    """Remove iptables mode's chains, jumps and canaries; returns how many chains went."""
    return IptablesProxier(ProxyState(""), ipt.IptablesConfig(), ctx.iptables).cleanup()
