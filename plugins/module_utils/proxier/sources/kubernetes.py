# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The Kubernetes API source: list, then watch, Services, EndpointSlices and this Node.

One thread per resource. Each keeps the last resourceVersion it saw (from objects and
BOOKMARK events) and resumes the watch from it; a 410 Gone (history compacted) means a
relist; a dropped connection or an API error means a reconnect after a capped,
jittered backoff. Objects are handed over as plain dicts (no model deserialisation: at
10,000 services that is most of the client's CPU time), through callbacks that must not
block (the daemon only queues them).
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..errors import SourceError

# (kind, event type, object) for watch events; (kind, objects) for a full relist.
EventFn = Callable[[str, str, Dict[str, Any]], None]
RelistFn = Callable[[str, List[Dict[str, Any]]], None]
LogFn = Callable[[str], None]

WATCH_TIMEOUT_SECONDS = 300  # the server ends each watch; we resume from the last resourceVersion


@dataclass
class WatchStats:
    lists: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    gone: int = 0
    errors: int = 0
    last_error: str = ""
    synced: threading.Event = field(default_factory=threading.Event)


def load_client(kubeconfig: str = "", master: str = ""):
    """An ApiClient from a kubeconfig file, or in-cluster credentials when none is given."""
    from kubernetes import client, config

    if kubeconfig:
        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            cfg = client.Configuration()
            config.load_kube_config(client_configuration=cfg)
    if master:
        cfg.host = master
    return client.ApiClient(cfg)


class _Resource:
    def __init__(self, kind: str, list_fn: Callable[..., Any], selector: Dict[str, str]) -> None:
        self.kind = kind
        self.list_fn = list_fn
        self.selector = selector
        self.stats = WatchStats()
        self.rv: Optional[str] = None  # last resourceVersion seen; survives a dropped stream


class KubernetesSource:
    def __init__(self, api_client: Any, node_name: str, on_event: EventFn, on_relist: RelistFn,
                 log: LogFn = lambda msg: None, backoff_initial: float = 0.5, backoff_max: float = 30.0,
                 watch_timeout: int = WATCH_TIMEOUT_SECONDS) -> None:
        from kubernetes import client

        core = client.CoreV1Api(api_client)
        discovery = client.DiscoveryV1Api(api_client)
        self.resources = [
            _Resource("Service", core.list_service_for_all_namespaces,
                      # Upstream's selectors: skip services of another proxy and headless ones.
                      {"label_selector": "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"}),
            _Resource("EndpointSlice", discovery.list_endpoint_slice_for_all_namespaces,
                      {"label_selector": "!service.kubernetes.io/headless,kubernetes.io/service-name"}),
            _Resource("Node", core.list_node, {"field_selector": f"metadata.name={node_name}"}),
        ]
        self.on_event = on_event
        self.on_relist = on_relist
        self.log = log
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.watch_timeout = watch_timeout
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._watches: Dict[str, Any] = {}

    def start(self) -> None:
        for res in self.resources:
            t = threading.Thread(target=self._run, args=(res,), name=f"watch-{res.kind}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for w in list(self._watches.values()):
            try:
                w.stop()
                resp = getattr(w, "_resp", None)
                if resp is not None:
                    resp.close()  # unblock a read in progress
            except Exception as e:  # pragma: no cover - best effort on shutdown, but say so
                self.log(f"stopping a watch: {e}")
        for t in self._threads:
            t.join(timeout)

    def wait_synced(self, timeout: Optional[float] = None) -> bool:
        """True once every resource has been listed at least once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for res in self.resources:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not res.stats.synced.wait(left):
                return False
        return True

    def stats(self) -> Dict[str, WatchStats]:
        return {r.kind: r.stats for r in self.resources}

    # --- one resource -----------------------------------------------------------------

    def _run(self, res: _Resource) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if res.rv is None:
                    res.rv = self._list(res)
                self._watch(res)
                failures = 0  # a watch that ended normally (server timeout): resume at once
            except _Gone:
                self._gone(res)
            except Exception as e:  # connection dropped, API error, bad response
                if self._stop.is_set():
                    break
                from kubernetes.client.exceptions import ApiException

                if isinstance(e, ApiException) and e.status == 410:
                    self._gone(res)
                    continue
                failures += 1
                res.stats.errors += 1
                res.stats.last_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                delay = min(self.backoff_max, self.backoff_initial * (2 ** (failures - 1)))
                delay *= random.uniform(0.8, 1.2)
                self.log(f"{res.kind} watch failed ({res.stats.last_error}); retrying in {delay:.1f}s")
                self._stop.wait(delay)

    def _gone(self, res: _Resource) -> None:
        res.stats.gone += 1
        self.log(f"{res.kind} watch: resourceVersion {res.rv} is too old (410 Gone), relisting")
        res.rv = None

    def _list(self, res: _Resource) -> str:
        resp = res.list_fn(_preload_content=False, **res.selector)
        try:
            data = json.loads(resp.data)
        finally:
            resp.release_conn()
        if not isinstance(data, dict):
            raise ValueError(f"{res.kind} list: expected a JSON object, got {type(data).__name__}")
        items = data.get("items") or []
        if not isinstance(items, list):
            raise ValueError(f"{res.kind} list: items is not a list")
        good = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                # One malformed item must not block the whole list (the parsers name
                # malformed objects; this one has nothing to name it by).
                self.log(f"rejected {res.kind} list item {i}: not an object")
                continue
            # Lists omit kind on items; the parsers key on it.
            item.setdefault("kind", res.kind)
            good.append(item)
        items = good
        res.stats.lists += 1
        self.on_relist(res.kind, items)
        res.stats.synced.set()
        meta = data.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return rv if isinstance(rv, str) else ""

    def _watch(self, res: _Resource) -> None:
        w = _raw_watch()
        self._watches[res.kind] = w
        res.stats.watches += 1
        try:
            for event in w.stream(res.list_fn, resource_version=res.rv, allow_watch_bookmarks=True,
                                  timeout_seconds=int(self.watch_timeout), **res.selector):
                if self._stop.is_set():
                    break
                etype = event.get("type") if isinstance(event, dict) else None
                obj = event.get("object") if isinstance(event, dict) else None
                if not isinstance(obj, dict):
                    # Nothing to resume from or to name: skip it rather than fail the watch
                    # (a reconnect from the same resourceVersion would meet it again).
                    self.log(f"rejected {res.kind} watch event: its object is not an object")
                    continue
                meta = obj.get("metadata")
                rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
                new_rv = rv if isinstance(rv, str) else ""
                if etype == "BOOKMARK":
                    res.stats.bookmarks += 1
                elif etype in ("ADDED", "MODIFIED", "DELETED"):
                    obj.setdefault("kind", res.kind)
                    res.stats.events += 1
                    self.on_event(res.kind, etype, obj)
                elif etype == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise RuntimeError(f"watch error: {obj.get('reason')}: {obj.get('message')}")
                if new_rv:
                    res.rv = new_rv
        finally:
            self._watches.pop(res.kind, None)


class _Gone(SourceError):
    pass


def _raw_watch():
    """A Watch whose events carry plain dicts.

    With ``deserialize=False`` the client mishandles ERROR events (it looks for a
    ``raw_object`` key it never set, so a 410 surfaces as KeyError, not ApiException),
    and typed models reject a whole stream for one malformed object. Without a return
    type the client keeps its own ERROR/410 handling and hands objects over as dicts.
    """
    from kubernetes import watch

    class RawWatch(watch.Watch):
        def get_return_type(self, func):
            return None

    return RawWatch()
