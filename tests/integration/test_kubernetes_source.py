"""KubernetesSource in-process against the list/watch server, with the real client:
resume from the last resourceVersion, bookmarks, 410 relist, reconnect with backoff."""
from __future__ import annotations

import threading
import time

from fake_apiserver import FakeApiServer
from proxyctl import eps, svc, tcp

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.kubernetes import (
    KubernetesSource,
    load_client,
)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    raise AssertionError("timed out")


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.events = []
        self.relists = []

    def event(self, kind, etype, obj):
        with self.lock:
            self.events.append((kind, etype, obj["metadata"]["name"]))

    def relist(self, kind, objs):
        with self.lock:
            self.relists.append((kind, sorted(o["metadata"]["name"] for o in objs)))


def test_list_watch_bookmarks_410_and_reconnect(tmp_path):
    with FakeApiServer(bookmark_interval=0.2) as api:
        api.create(svc("a", "10.96.0.1", [tcp()]))
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"}})
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node2"}})
        rec = Recorder()
        client = load_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        source = KubernetesSource(client, "node1", rec.event, rec.relist, backoff_initial=0.05, backoff_max=0.2)
        source.start()
        try:
            assert source.wait_synced(10)
            assert ("Service", ["a"]) in rec.relists and ("Node", ["node1"]) in rec.relists  # field selector
            api.create(svc("b", "10.96.0.2", [tcp()]))
            api.create(eps("b", ["10.244.0.1"], [{"name": "http", "port": 80, "protocol": "TCP"}]))
            wait_for(lambda: {("Service", "ADDED", "b"), ("EndpointSlice", "ADDED", "b-abc")} <= set(rec.events))
            wait_for(lambda: source.stats()["Service"].bookmarks >= 2)

            # Dropped connection: the watch resumes from the last resourceVersion, no relist.
            lists = api.request_count("Service", "list")
            api.drop_watches(kind="Service")
            api.delete("Service", "default", "a")
            wait_for(lambda: ("Service", "DELETED", "a") in rec.events)
            assert api.request_count("Service", "list") == lists
            assert rec.events.count(("Service", "ADDED", "b")) == 1  # nothing replayed

            # History compacted while disconnected: 410, then a relist with the current state.
            assert api.wait_for_watches(3)
            api.drop_watches(kind="Service")
            api.create(svc("c", "10.96.0.3", [tcp()]))
            api.compact()
            wait_for(lambda: ("Service", ["b", "c"]) in rec.relists)
            assert source.stats()["Service"].gone >= 1

            # API errors: retried with backoff until the server answers again.
            assert api.wait_for_watches(3)
            api.fail_next(3, status=500, kinds=["Service"])
            api.drop_watches(kind="Service")
            api.create(svc("d", "10.96.0.4", [tcp()]))
            wait_for(lambda: ("Service", "ADDED", "d") in rec.events or ("Service", ["b", "c", "d"]) in rec.relists)
            assert source.stats()["Service"].errors >= 1
        finally:
            source.stop()
