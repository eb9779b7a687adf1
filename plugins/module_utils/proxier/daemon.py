# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The long-running proxy: sources -> intake queue -> (sync thread) state -> proxier.

Sources (the Kubernetes API watch, or a manifests directory being followed) only
append to the intake queue and poke the runner, so they never wait for a sync. The
sync thread alone touches the state and the kernel: it drains the queue (parsing each
object; a bad one is logged by name and field and skipped, or for an update the last
good version is kept), syncs, then updates health, metrics, the health check node port
servers, and removes stale UDP/SCTP conntrack entries.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .model import Skipped, ValidationError, parse_endpoint_slice, parse_node, parse_service
from .provider import Proxier, SyncResult
from .state import ProxyState
from .sync import BoundedFrequencyRunner
from .validation import object_identity, object_key

TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"

LogFn = Callable[[str], None]


@dataclass
class _Item:
    op: str  # "event", "relist" or "batch"
    kind: str
    etype: str
    obj: Any  # a dict for events, a list of dicts for a relist, of (kind, etype, dict) for a batch
    seen: Any  # wall clock when the change was seen (or its trigger time); a list for a batch


def _trigger_time(obj: Any, default: float) -> float:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    anns = meta.get("annotations") if isinstance(meta, dict) else None
    ann = anns.get(TRIGGER_TIME_ANNOTATION) if isinstance(anns, dict) else None
    if not ann or not isinstance(ann, str) or len(ann) > 64:
        return default
    try:
        return datetime.fromisoformat(ann.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return default


class Daemon:
    def __init__(self, proxier: Optional[Proxier], state: ProxyState, min_period: float, sync_period: float,
                 log: LogFn, hooks: Optional[Hooks] = None, family: int = 4,
                 states: Optional[Dict[int, ProxyState]] = None) -> None:
        self.proxier = proxier
        self.family = family  # the (primary) IP family the proxier serves
        # Per IP family, the state its proxier syncs (dual-stack: two, parsed for each
        # family); objects of a family no state serves are ignored.
        self.states: Dict[int, ProxyState] = dict(states) if states else {family: state}
        self.state = self.states.get(family, state)
        self.log = log
        self.hooks = hooks or Hooks()
        self._queue: Deque[_Item] = collections.deque()
        check = getattr(proxier, "check", None)  # the canary check (iptables mode)
        self.runner = BoundedFrequencyRunner(self._sync, min_period, sync_period, on_error=self._sync_failed,
                                             check=self._check if check else None,
                                             on_check_error=lambda e: self.log(f"canary check failed: {e}"))
        self.rejected: Dict[str, str] = {}  # object key -> error, while it stays bad
        self._refused: Dict[str, str] = {}  # service key -> why the compiler refused it (last sync)
        self.last_result: Optional[SyncResult] = None
        self.last_synced = False  # a sync completed: the first one's log line says what preceded it
        self.sync_failures = 0
        self._thread: Optional[threading.Thread] = None
        # As upstream's change tracker: trigger times from before the proxy started (an
        # old annotation, a manifests file written last week) are not programming latency.
        self._started = time.time()

    # --- intake (any thread, never blocks on a sync) --------------------------------

    def on_event(self, kind: str, etype: str, obj: Dict[str, Any]) -> None:
        self._queue.append(_Item("event", kind, etype, obj, _trigger_time(obj, time.time())))
        self.hooks.queued(kind, 1)
        self.runner.request()

    def on_relist(self, kind: str, objects: List[Dict[str, Any]]) -> None:
        self._queue.append(_Item("relist", kind, "", objects, time.time()))
        self.hooks.queued(kind, len(objects))
        self.runner.request()

    def on_batch(self, events: List[Tuple[str, str, Dict[str, Any]]], triggers: List[float]) -> None:
        """Deltas (kind, ADDED/MODIFIED/DELETED, object) applied together, in one sync:
        ``triggers`` are when the changes were made (a manifests file's mtime), one
        programming-latency observation each. Same intake rules as on_event."""
        if not events:
            return
        self._queue.append(_Item("batch", "", "", list(events), list(triggers)))
        counts: Dict[str, int] = {}
        for kind, _etype, _obj in events:
            counts[kind] = counts.get(kind, 0) + 1
        for kind, count in counts.items():
            self.hooks.queued(kind, count)
        self.runner.request()

    def has_pending(self) -> bool:
        return bool(self._queue)

    # --- the sync thread ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.runner.loop, name="sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the sync thread; False when it is still running (a sync outlasted ``timeout``)."""
        self.runner.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def drain(self) -> Tuple[List[float], bool]:
        """Apply what was queued to the state without syncing (``--once`` loads this way)."""
        return self._drain()

    def _drain(self) -> Tuple[List[float], bool]:
        """Apply queued changes to the state; returns their seen-times and whether the
        node changed (which can change the compiler's configuration)."""
        seen: List[float] = []
        node_changed = False
        while self._queue:
            item = self._queue.popleft()
            if item.op == "batch":
                seen.extend(item.seen)
                for kind, etype, obj in item.obj:
                    one = _Item("event", kind, etype, obj, 0.0)
                    if kind == "Node":
                        node_changed = self._apply_node(one) or node_changed
                    else:
                        self._apply_event(one)
                continue
            seen.append(item.seen)
            if item.kind == "Node":
                node_changed = self._apply_node(item) or node_changed
            elif item.op == "relist":
                self._apply_relist(item)
            else:
                self._apply_event(item)
        return seen, node_changed

    def _key(self, kind: str, obj: Any) -> str:
        return f"{kind} {object_key(obj, kind)}"

    def _parse(self, kind: str, obj: Any):
        """Per family, the parsed object (None: that family ignores it), or "invalid"."""
        key = self._key(kind, obj)
        parse = parse_service if kind == "Service" else parse_endpoint_slice
        parsed: Dict[int, Any] = {}
        try:
            for family in self.states:
                try:
                    parsed[family] = parse(obj, family=family)
                except Skipped:
                    parsed[family] = None
        except ValidationError as e:
            if self.rejected.get(key) != str(e):
                self.log(f"rejected {e}; {'keeping its last good version' if self._known(kind, obj) else 'skipped'}")
            self.rejected[key] = str(e)
            return "invalid"
        self.rejected.pop(key, None)
        return parsed

    def _known(self, kind: str, obj: Any) -> bool:
        key = object_key(obj, kind)
        return any(key in (st.services if kind == "Service" else st.slices) for st in self.states.values())

    def _apply_event(self, item: _Item) -> None:
        ns, name = object_identity(item.obj, item.kind)
        parsed: Any = {}
        if item.etype == "DELETED":
            self.rejected.pop(self._key(item.kind, item.obj), None)
        else:
            parsed = self._parse(item.kind, item.obj)
            if parsed == "invalid":
                return  # keep whatever good version the states have
        for family, state in self.states.items():
            one = parsed.get(family)
            if one is None:  # deleted, or ignored by this family now (e.g. became headless)
                if item.kind == "Service":
                    state.delete_service(ns, name)
                else:
                    state.delete_slice(ns, name)
            elif item.kind == "Service":
                state.set_service(one)
            else:
                state.set_slice(one)

    def _apply_relist(self, item: _Item) -> None:
        good: Dict[int, List[Any]] = {family: [] for family in self.states}
        for obj in item.obj:
            parsed = self._parse(item.kind, obj)
            for family, state in self.states.items():
                if parsed == "invalid":
                    old = (state.services if item.kind == "Service" else state.slices).get(object_key(obj, item.kind))
                    if old is not None:
                        good[family].append(old)
                elif parsed.get(family) is not None:
                    good[family].append(parsed[family])
        for family, state in self.states.items():
            if item.kind == "Service":
                state.replace_services(good[family])
            else:
                state.replace_slices(good[family])

    def _apply_node(self, item: _Item) -> bool:
        if item.op != "relist" and object_identity(item.obj, "Node", namespaced=False)[1] != self.state.hostname:
            return False  # another node's event (a manifests directory may hold several)
        objs = item.obj if item.op == "relist" else ([] if item.etype == "DELETED" else [item.obj])
        node = None
        for obj in objs:
            if object_identity(obj, "Node", namespaced=False)[1] != self.state.hostname:
                continue
            try:
                node = parse_node(obj)
            except ValidationError as e:
                self.log(f"rejected {e}")
                return False
            self.hooks.node_seen(obj)
        changed = node != self.state.node
        for state in self.states.values():
            state.node = node
        return changed and self.hooks.node_changed(node)

    def _sync(self, full: bool) -> None:
        t0, cpu0 = time.monotonic(), time.thread_time()
        seen, node_changed = self._drain()
        drained, drained_cpu = time.monotonic() - t0, time.thread_time() - cpu0
        try:
            result = self.proxier.sync(force_full=full or node_changed)
        except Exception as e:
            # Dual-stack: one family failed, the other's rules are in. Its health check node
            # ports and stale flows follow now; healthz and the metrics wait for a whole sync.
            partial = getattr(e, "partial_result", None)
            partly_synced = getattr(self.hooks, "partly_synced", None)
            if partial is not None and partly_synced is not None:
                partly_synced(partial)
            raise
        now = time.time()
        self.last_result = result
        self.hooks.synced(result, [now - t for t in seen if t >= self._started])
        refused = getattr(result, "rejected", {})
        for key in sorted(refused):  # named once per new reason, like a rejected object
            if self._refused.get(key) != refused[key]:
                self.log(f"rejected {refused[key]}; keeping its last rules, if any")
        self._refused = dict(refused)
        if result.full or result.changes:
            names = sorted(result.changed)
            what = f"; services changed: {', '.join(names[:5])}" + (f" (+{len(names) - 5} more)" if len(names) > 5
                                                                    else "") if names else ""
            count = len(self.rejected) + len(refused)
            first = "" if self.last_synced else _first_sync_note(drained, drained_cpu)
            self.log(result.summary() + what + (f"; {count} objects rejected" if count else "") + first)
        self.last_synced = True

    def _check(self) -> bool:
        needed = self.proxier.check()
        if needed:
            self.log(f"{self.proxier.pending_repair}: our rules were flushed or deleted, repairing now")
        return needed

    def _sync_failed(self, error: BaseException) -> None:
        self.sync_failures += 1
        self.hooks.sync_failed(error)
        if getattr(error, "retry_soon", False):
            self.log(f"sync failed, retrying soon: {error}")
        else:
            self.log(f"sync failed, retrying with a full sync: {error}")


def _first_sync_note(drained: float, drained_cpu: float) -> str:
    """What preceded the first sync, for the log: the intake's parse, and the CPU time this
    process and the tools it ran (iptables-restore, nft) used since its start - the work a
    start costs, which unlike the wall time does not grow with the machine's load."""
    t = os.times()
    return (f"; queued objects parsed in {drained * 1000:.0f} ms (CPU {drained_cpu * 1000:.0f} ms) before it; "
            f"CPU since the start {t.user + t.system:.1f} s, with the tools it ran "
            f"{t.user + t.system + t.children_user + t.children_system:.1f} s")


class Hooks:
    """What the daemon tells the rest of the node about (metrics, health, ...)."""

    def queued(self, kind: str, count: int) -> None:
        pass

    def synced(self, result: SyncResult, latencies: List[float]) -> None:
        pass

    def sync_failed(self, error: BaseException) -> None:
        pass

    def node_seen(self, obj: Dict[str, Any]) -> None:
        """This node's object as the API has it (deletion, taints)."""

    def node_changed(self, node: Any) -> bool:
        """Return True when the change needs a full sync (e.g. new pod CIDRs)."""
        return False


class ManifestsWatcher:
    """Follows a manifests directory on its own thread: every ``interval`` it stats the
    files (a directory of a few files: well under a millisecond), re-reads only those whose
    name, size, mtime or inode changed, and hands the daemon the object deltas
    (sources.manifests.DirectoryTracker) as one batch whose trigger times are the
    changed files' mtimes. Parsing never runs on the sync thread, and the daemon's
    intake only queues the batch."""

    def __init__(self, directory: str, on_batch: Callable[[List[Tuple[str, str, Dict[str, Any]]], List[float]], None],
                 log: LogFn, interval: float = 0.2, max_file_bytes: Optional[int] = None) -> None:
        from .sources.manifests import DirectoryTracker

        self.directory = directory
        self.tracker = DirectoryTracker(directory, log, max_file_bytes)
        self.on_batch = on_batch
        self.log = log
        self.interval = interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> bool:
        """One scan; True when it handed over changes."""
        changes = self.tracker.poll()
        if changes.events:
            self.on_batch(changes.events, changes.triggers)
        return bool(changes.events)

    def start(self) -> None:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="manifests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_error = ""
        while not self._stop.wait(self.interval):
            try:
                self.poll()
                last_error = ""
            except Exception as e:  # e.g. the directory vanished: keep the last state, say so once
                if str(e) != last_error:
                    self.log(f"manifests: {e}")
                last_error = str(e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
