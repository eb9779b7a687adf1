# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one contract every proxy mode implements (upstream's ``pkg/proxy`` Provider).

The daemon, the command line and the app talk to :class:`Proxier` only; which class is
behind it is decided by the mode registry (``modes/__init__.py``). :class:`ProxierBase`
holds what is the same in every mode: the full-sync flag that a failure sets, the
requeue of the changes a failed sync did not apply, the pending repair named by
``check()``, and the bookkeeping of services the compiler refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Set, TypeVar

from .model import ValidationError
from .state import ProxyState

T = TypeVar("T")


# Where a clean shutdown records the rules it left for the next start (modes that record:
# iptables); ``--record-dir`` overrides it. Under /run: a reboot, which empties the tables,
# clears the record too.
RECORD_DIR = "/run/kubenode-proxy"


@dataclass
class SyncResult:
    full: bool
    services: int
    endpoints: int
    rules: int  # rules we own in the kernel after the sync
    rules_written: int
    changes: List[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    apply_seconds: float = 0.0
    total_seconds: float = 0.0
    no_endpoint_ports: int = 0
    changed: Set[str] = field(default_factory=set)  # services ("ns/name") this sync covered
    partial_failed: bool = False
    # Services the compiler refused (a field that cannot be written into kernel text):
    # "ns/name" -> message naming the field. They keep their last good rules, if any.
    rejected: Dict[str, str] = field(default_factory=dict)
    repair: str = ""  # why this sync repaired the kernel ("" when it did not)
    restart: str = ""  # first sync after a start with a record: adopted, or why not

    def summary(self) -> str:
        kind = "full" if self.full else "partial"
        kind = f"repair ({self.repair}):" if self.repair else kind
        return (f"{kind} sync: {self.services} services, {self.endpoints} endpoints, {self.rules} rules "
                f"({self.rules_written} written, {len(self.changes)} changes) in {self.total_seconds * 1000:.0f} ms "
                f"(compile {self.compile_seconds * 1000:.0f} ms, apply {self.apply_seconds * 1000:.0f} ms)"
                + (f"; restart: {self.restart}" if self.restart else ""))


class Proxier(Protocol):
    """What the daemon, the app and the command line need from a mode."""

    name: str  # the mode's name, as in the configuration (``mode: ipvs``)
    state: ProxyState
    cfg: Any  # the mode's compiler configuration (IptablesConfig, IpvsConfig, ...)
    need_full: bool  # the next sync must be a full one (set after any failure)
    last_attempt_full: bool  # whether the last sync attempted was a full one (metrics)
    pending_repair: str  # set by check(): why the next sync repairs ("" when it does not)
    rejected: Dict[str, str]  # service key -> why the compiler refused it

    def sync(self, force_full: bool = False) -> SyncResult:
        """Apply what changed since the last sync (or everything: a full sync). Raises on
        failure; the changes stay queued and the next sync is a full one."""

    def check(self) -> bool:
        """The every-second canary: True when a full repair is needed now."""

    def cleanup(self) -> int:
        """Remove what this mode creates in the kernel; returns how many objects went."""

    def rule_counts(self) -> Dict[str, int]:
        """Rules this mode owns per table (the ``iptables_rules_total`` style metrics)."""

    def close(self) -> None:
        """Release kernel handles (netlink sockets)."""


class ProxierBase:
    """What every mode does the same way. Subclasses set ``name`` and implement the sync."""

    name = ""

    def __init__(self, state: ProxyState, cfg: Any) -> None:
        self.state = state
        self.cfg = cfg
        self.need_full = True
        self.last_attempt_full = True
        self.pending_repair = ""  # set by check(): the next sync repairs, whatever it was asked for
        self.rejected: Dict[str, str] = {}  # service key -> why the compiler refused it

    @classmethod
    def create(cls, state: ProxyState, cfg: Any, ctx: Any) -> ProxierBase:
        """Built by the mode registry (``ctx`` is a modes.Context); modes needing more than
        the namespace override this."""
        return cls(state, cfg, netns=ctx.netns)  # type: ignore[call-arg]

    def _begin(self, force_full: bool) -> bool:
        """Whether this sync is a full one (asked, due after a failure, or a repair)."""
        full = force_full or self.need_full or bool(self.pending_repair)
        self.last_attempt_full = full
        return full

    def _requeue(self, changed: Set[str], full_needed: bool = True) -> None:
        """After a failed sync: keep its changes for the retry and, unless nothing was
        applied (``full_needed=False``), trust nothing we remember."""
        self.state.requeue(changed)
        if full_needed:
            self.need_full = True

    def _done(self, result: SyncResult, changed: Set[str]) -> SyncResult:
        """After a successful sync: clear the full/repair flags and fill in the result."""
        self.need_full = False
        self.pending_repair = ""
        result.changed = changed
        result.rejected = dict(self.rejected)
        return result

    def _forget_gone_rejections(self) -> None:
        """Rejections of services that no longer exist (a full sync starts from these)."""
        self.rejected = {k: v for k, v in self.rejected.items() if k in self.state.services}

    def _compile_checked(self, key: str, compile_fn: Callable[[], T], last_good: Optional[T]) -> Optional[T]:
        """One service compiled; a service the compiler refuses is named in ``rejected`` and
        keeps ``last_good`` (what the kernel has for it, or nothing): one bad object never
        fails the sync of the others. A service that is gone compiles to None."""
        if key not in self.state.services:
            self.rejected.pop(key, None)
            return None
        try:
            result = compile_fn()
        except ValidationError as e:
            self.rejected[key] = str(e)
            return last_good
        self.rejected.pop(key, None)
        return result

    def close(self) -> None:
        """Nothing to release unless a mode holds kernel handles."""
