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
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from .iptables_proxier import IptablesProxier, SyncResult
from .model import Skipped, ValidationError, parse_endpoint_slice, parse_node, parse_service
from .state import ProxyState
from .sync import BoundedFrequencyRunner
from .validation import object_identity, object_key

TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"

LogFn = Callable[[str], None]


@dataclass
class _Item:
    op: str  # "event" or "relist"
    kind: str
    etype: str
    obj: Any  # a dict for events, a list of dicts for a relist
    seen: float  # wall clock when the change was seen (or its trigger time)


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
    def __init__(self, proxier: IptablesProxier, state: ProxyState, min_period: float, sync_period: float,
                 log: LogFn, hooks: Optional[Hooks] = None, family: int = 4) -> None:
        self.proxier = proxier
        self.family = family  # the IP family the proxier serves: objects of the other are ignored
        self.state = state
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
        self.sync_failures = 0
        self._thread: Optional[threading.Thread] = None

    # --- intake (any thread, never blocks on a sync) --------------------------------

    def on_event(self, kind: str, etype: str, obj: Dict[str, Any]) -> None:
        self._queue.append(_Item("event", kind, etype, obj, _trigger_time(obj, time.time())))
        self.hooks.queued(kind, 1)
        self.runner.request()

    def on_relist(self, kind: str, objects: List[Dict[str, Any]]) -> None:
        self._queue.append(_Item("relist", kind, "", objects, time.time()))
        self.hooks.queued(kind, len(objects))
        self.runner.request()

    def has_pending(self) -> bool:
        return bool(self._queue)

    # --- the sync thread ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.runner.loop, name="sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.runner.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _drain(self) -> Tuple[List[float], bool]:
        """Apply queued changes to the state; returns their seen-times and whether the
        node changed (which can change the compiler's configuration)."""
        seen: List[float] = []
        node_changed = False
        while self._queue:
            item = self._queue.popleft()
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
        key = self._key(kind, obj)
        try:
            if kind == "Service":
                parsed = parse_service(obj, family=self.family)
            else:
                parsed = parse_endpoint_slice(obj, family=self.family)
        except ValidationError as e:
            if self.rejected.get(key) != str(e):
                self.log(f"rejected {e}; {'keeping its last good version' if self._known(kind, obj) else 'skipped'}")
            self.rejected[key] = str(e)
            return "invalid"
        except Skipped:
            self.rejected.pop(key, None)
            return None
        self.rejected.pop(key, None)
        return parsed

    def _known(self, kind: str, obj: Any) -> bool:
        return object_key(obj, kind) in (self.state.services if kind == "Service" else self.state.slices)

    def _apply_event(self, item: _Item) -> None:
        ns, name = object_identity(item.obj, item.kind)
        if item.etype == "DELETED":
            self.rejected.pop(self._key(item.kind, item.obj), None)
            if item.kind == "Service":
                self.state.delete_service(ns, name)
            else:
                self.state.delete_slice(ns, name)
            return
        parsed = self._parse(item.kind, item.obj)
        if parsed == "invalid":
            return  # keep whatever good version the state has
        if parsed is None:  # now skipped (e.g. became headless): drop it
            if item.kind == "Service":
                self.state.delete_service(ns, name)
            else:
                self.state.delete_slice(ns, name)
            return
        if item.kind == "Service":
            self.state.set_service(parsed)
        else:
            self.state.set_slice(parsed)

    def _apply_relist(self, item: _Item) -> None:
        good = []
        for obj in item.obj:
            parsed = self._parse(item.kind, obj)
            if parsed == "invalid":
                old = (self.state.services if item.kind == "Service" else self.state.slices).get(
                    object_key(obj, item.kind))
                if old is not None:
                    good.append(old)
            elif parsed is not None:
                good.append(parsed)
        if item.kind == "Service":
            self.state.replace_services(good)
        else:
            self.state.replace_slices(good)

    def _apply_node(self, item: _Item) -> bool:
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
        self.state.node = node
        return changed and self.hooks.node_changed(node)

    def _sync(self, full: bool) -> None:
        seen, node_changed = self._drain()
        result = self.proxier.sync(force_full=full or node_changed)
        now = time.time()
        self.last_result = result
        self.hooks.synced(result, [now - t for t in seen])
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
            self.log(result.summary() + what + (f"; {count} objects rejected" if count else ""))

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
    """Follows a manifests directory: a change of any file's name, size or mtime makes a
    reload, handed to the daemon as a relist of every kind."""

    def __init__(self, directory: str, on_relist: Callable[[str, List[Dict[str, Any]]], None], log: LogFn,
                 interval: float = 1.0, max_file_bytes: Optional[int] = None) -> None:
        from .sources.manifests import DEFAULT_MAX_FILE_BYTES

        self.directory = directory
        self.max_file_bytes = DEFAULT_MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes
        self.on_relist = on_relist
        self.log = log
        self.interval = interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._fingerprint: Optional[Tuple] = None
        self._file_errors: Set[str] = set()
        self._last_good: Dict[str, List[Tuple[str, Any]]] = {}  # per file: its last parsed documents

    def fingerprint(self) -> Tuple:
        entries = []
        for root, dirs, files in os.walk(self.directory):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                entries.append((root, name, st.st_size, st.st_mtime_ns))
        return tuple(entries)

    def poll(self) -> bool:
        fp = self.fingerprint()
        if fp == self._fingerprint:
            return False
        self._fingerprint = fp
        from .sources.manifests import manifest_files, read_file_checked

        # A file that stops parsing (a typo, an editor's half-written save) keeps the
        # objects it last had: dropping them would delete its services from the node.
        objects: List[Tuple[str, Any]] = []
        errors: List[str] = []
        good: Dict[str, List[Tuple[str, Any]]] = {}
        for path in manifest_files(self.directory):
            try:
                good[path], rejected = read_file_checked(path, self.max_file_bytes)
                errors.extend(rejected)  # documents that are not objects: named, the rest of the file loads
            except Exception as e:
                kept = self._last_good.get(path)
                errors.append(f"{path}: cannot parse: {e}; "
                              + ("keeping its last good version" if kept is not None else "skipped"))
                if kept is not None:
                    good[path] = kept
            objects.extend(good.get(path, ()))
        self._last_good = good
        for err in errors:
            if err not in self._file_errors:
                self.log(f"rejected {err}")
        self._file_errors = set(errors)
        by_kind: Dict[str, List[Dict[str, Any]]] = {"Service": [], "EndpointSlice": [], "Node": []}
        for _origin, obj in objects:
            kind = obj.get("kind") if isinstance(obj, dict) else None
            if kind in by_kind:
                by_kind[kind].append(obj)
        for kind, objs in by_kind.items():
            self.on_relist(kind, objs)
        return True

    def start(self) -> None:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="manifests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # e.g. the directory vanished: keep the last state
                self.log(f"manifests: {e}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
