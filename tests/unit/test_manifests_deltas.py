"""The manifests source follows a directory by per-file fingerprints and hands over object
deltas: a file is read again only when its name, size, mtime or inode changed, and a
change to a small file costs the same beside 10 or 10,000 other Services (parse calls
counted, in the watcher and in the daemon's intake)."""
from __future__ import annotations

import json
import os
import time

import pytest
import yaml

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import daemon as daemon_mod
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon, Hooks, ManifestsWatcher
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import SyncResult
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources import manifests
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.manifests import DirectoryTracker
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port


def svc(name, ip, ns="default", p=80):
    return service(ns, name, ip, [port("http", p)])


def write(path, objs, mtime_ago=1.0):
    """Write a file and date it in the past, so that it is not 'racy' (read again once)."""
    path.write_text(yaml.safe_dump_all(objs))
    t = time.time_ns() - int(mtime_ago * 1e9)
    os.utime(path, ns=(t, t))


def names(changes):
    return sorted((kind, etype, f"{o['metadata'].get('namespace', '')}/{o['metadata']['name']}")
                  for kind, etype, o in changes.events)


@pytest.fixture
def tracker(tmp_path):
    logs = []
    tr = DirectoryTracker(str(tmp_path), logs.append)
    tr.logs = logs
    return tr


def test_added_modified_deleted_per_file(tmp_path, tracker):
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.10"), svc("api", "10.96.0.11")])
    write(tmp_path / "b.yaml", [svc("db", "10.96.0.12")])
    assert names(tracker.poll()) == [("Service", "ADDED", "default/api"), ("Service", "ADDED", "default/db"),
                                     ("Service", "ADDED", "default/web")]
    assert tracker.poll().events == []  # nothing changed: nothing read
    assert tracker.poll().parsed == []
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.20"), svc("new", "10.96.0.13")], mtime_ago=0.5)
    changes = tracker.poll()
    assert changes.parsed == [str(tmp_path / "a.yaml")]
    assert names(changes) == [("Service", "ADDED", "default/new"), ("Service", "DELETED", "default/api"),
                              ("Service", "MODIFIED", "default/web")]
    (tmp_path / "b.yaml").unlink()
    changes = tracker.poll()
    assert names(changes) == [("Service", "DELETED", "default/db")] and changes.parsed == []


def test_trigger_time_is_the_files_mtime(tmp_path, tracker):
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.10")])
    tracker.poll()
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.11")], mtime_ago=3.0)
    changes = tracker.poll()
    assert changes.triggers == [os.stat(tmp_path / "a.yaml").st_mtime_ns / 1e9]


def test_rename_and_a_move_between_files_change_nothing(tmp_path, tracker):
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.10"), svc("api", "10.96.0.11")])
    tracker.poll()
    os.rename(tmp_path / "a.yaml", tmp_path / "renamed.yaml")
    changes = tracker.poll()
    assert changes.events == [] and changes.parsed == [str(tmp_path / "renamed.yaml")]
    # api moves to its own file, unchanged: no event; web moves and changes: one MODIFIED.
    write(tmp_path / "renamed.yaml", [svc("web", "10.96.0.10")], mtime_ago=0.5)
    write(tmp_path / "z.yaml", [svc("api", "10.96.0.11")])
    assert tracker.poll().events == []
    write(tmp_path / "renamed.yaml", [], mtime_ago=0.4)
    write(tmp_path / "z.yaml", [svc("api", "10.96.0.11"), svc("web", "10.96.0.99")], mtime_ago=0.4)
    assert names(tracker.poll()) == [("Service", "MODIFIED", "default/web")]


def test_a_file_that_stops_parsing_keeps_its_objects_and_is_logged_once(tmp_path, tracker):
    f = tmp_path / "a.yaml"
    write(f, [svc("web", "10.96.0.10"), svc("api", "10.96.0.11")])
    tracker.poll()
    good = f.read_text()
    f.write_text(good.replace("---\n", "", 1))  # two documents run together: duplicate keys
    os.utime(f, ns=(time.time_ns() - 900_000_000,) * 2)
    assert tracker.poll().events == []
    assert sum("cannot parse" in m for m in tracker.logs) == 1
    assert any(str(f) in m and "keeping its last good version" in m for m in tracker.logs), tracker.logs
    f.write_text(good.replace("---\n", "", 1) + "\n")  # still broken, the same way
    os.utime(f, ns=(time.time_ns() - 800_000_000,) * 2)
    assert tracker.poll().events == []
    assert sum("cannot parse" in m for m in tracker.logs) == 1  # once, not per poll or per edit
    assert tracker.poll().parsed == []  # a broken file is not re-read while it stays the same
    # Fixed with one change: the delta is against the last good objects.
    write(f, [svc("web", "10.96.0.10"), svc("api", "10.96.0.12")], mtime_ago=0.5)
    assert names(tracker.poll()) == [("Service", "MODIFIED", "default/api")]


def test_a_new_file_that_never_parsed_is_skipped_by_name(tmp_path, tracker):
    (tmp_path / "bad.yaml").write_text("kind: Service\n  metadata: [\n")
    write(tmp_path / "ok.yaml", [svc("web", "10.96.0.10")])
    assert names(tracker.poll()) == [("Service", "ADDED", "default/web")]
    assert any(f"{tmp_path / 'bad.yaml'}: cannot parse" in m and m.endswith("skipped") for m in tracker.logs)


def test_duplicate_object_in_two_files_the_later_file_wins(tmp_path, tracker):
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.10")])
    write(tmp_path / "b.yaml", [svc("web", "10.96.0.20")])
    changes = tracker.poll()
    assert len(changes.events) == 1 and changes.events[0][2]["spec"]["clusterIP"] == "10.96.0.20"
    overlap = [m for m in tracker.logs if "defined in 2 files" in m]
    assert len(overlap) == 1 and overlap[0].endswith(f"using {tmp_path / 'b.yaml'} (the last in load order)")
    # Editing the losing file changes nothing on the node.
    write(tmp_path / "a.yaml", [svc("web", "10.96.0.30")], mtime_ago=0.5)
    assert tracker.poll().events == []
    assert len([m for m in tracker.logs if "defined in 2 files" in m]) == 1
    # The winner goes: the other file's version takes over; then that goes too.
    (tmp_path / "b.yaml").unlink()
    changes = tracker.poll()
    assert [(e[1], e[2]["spec"]["clusterIP"]) for e in changes.events] == [("MODIFIED", "10.96.0.30")]
    (tmp_path / "a.yaml").unlink()
    assert names(tracker.poll()) == [("Service", "DELETED", "default/web")]


def test_subdirectory_files_come_after_their_parents_files(tmp_path, tracker):
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "x.yaml", [svc("web", "10.96.0.20")])
    write(tmp_path / "z.yaml", [svc("web", "10.96.0.10")])
    assert tracker.poll().events[0][2]["spec"]["clusterIP"] == "10.96.0.20"  # as os.walk: z.yaml, then a/x.yaml
    assert list(manifests.scan(str(tmp_path))) == manifests.manifest_files(str(tmp_path))


def test_racy_rewrite_in_the_same_timestamp_tick_is_not_missed(tmp_path, tracker):
    """A rewrite with the same size and the same (coarse) mtime right after a read would look
    unchanged: a file read within 100 ms of its mtime is read once more at the next scan."""
    f = tmp_path / "a.yaml"
    f.write_text(yaml.safe_dump_all([svc("web", "10.96.0.10")]))
    st = os.stat(f)
    assert len(tracker.poll().events) == 1
    f.write_text(yaml.safe_dump_all([svc("web", "10.96.0.11")]))  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same tick
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_ino == st.st_ino
    changes = tracker.poll()
    assert [(e[1], e[2]["spec"]["clusterIP"]) for e in changes.events] == [("MODIFIED", "10.96.0.11")]


def test_bad_and_unnamed_objects_are_handed_over_once_and_not_mixed_up(tmp_path, tracker):
    write(tmp_path / "a.yaml", [{"kind": "Service", "metadata": ["x"]}, {"kind": "Service", "metadata": "y"},
                                {"kind": "ConfigMap", "metadata": {"name": "c"}}, svc("web", "10.96.0.10")])
    events = tracker.poll().events
    assert len(events) == 3  # both unnamed ones (keyed by position, not merged), not the ConfigMap
    write(tmp_path / "a.yaml", [{"kind": "Service", "metadata": ["x"]}, {"kind": "Service", "metadata": "y"},
                                svc("web", "10.96.0.11")], mtime_ago=0.5)
    assert [(e[1], e[2]["metadata"]) for e in tracker.poll().events] == [("MODIFIED", {"name": "web",
                                                                                       "namespace": "default"})]


def test_node_events_of_other_nodes_do_not_clear_this_node(tmp_path):
    state = ProxyState("node1")
    d = Daemon(proxier=None, state=state, min_period=0.0, sync_period=60.0, log=lambda m: None)
    node = {"kind": "Node", "metadata": {"name": "node1"}, "spec": {"podCIDR": "10.244.1.0/24"}}
    other = {"kind": "Node", "metadata": {"name": "node2"}, "spec": {"podCIDR": "10.244.2.0/24"}}
    d.on_batch([("Node", "ADDED", node)], [])
    d._drain()
    d.on_batch([("Node", "ADDED", other)], [])
    d._drain()
    assert state.node is not None and state.node.name == "node1"
    d.on_batch([("Node", "DELETED", node)], [])
    d._drain()
    assert state.node is None


# --- the daemon with the watcher: work per change, trigger times ---------------------------

def many(n):
    objs = []
    for i in range(n):
        objs.append(service(f"ns{i % 50}", f"svc{i}", f"10.{96 + i // 65536}.{i // 256 % 256}.{i % 256}",
                            [port("http", 80)]))
        objs.append(endpoint_slice(f"ns{i % 50}", f"svc{i}", [endpoint(f"10.128.{i // 256 % 256}.{i % 256}")],
                                   [slice_port("http", 8080)]))
    return objs


def test_one_small_file_change_at_10000_services_reparses_only_that_file(tmp_path, monkeypatch):
    """Counted in both places the old code did O(N) work per change: files read by the
    watcher, and objects parsed (validated) by the daemon's intake on the sync thread."""
    big = tmp_path / "big.json"
    big.write_text("\n---\n".join(json.dumps(o) for o in many(10000)))  # JSON: YAML's subset, quick to write
    old = time.time_ns() - 10**9
    os.utime(big, ns=(old, old))
    small = tmp_path / "small.yaml"
    web = svc("web", "10.200.0.10")
    write(small, [web, endpoint_slice("default", "web", [endpoint("10.250.0.1")], [slice_port("http", 8080)])])
    state = ProxyState("node1")
    d = Daemon(proxier=None, state=state, min_period=0.0, sync_period=60.0, log=lambda m: None)
    handed = []  # how many objects each callback carried (relists in the old code, deltas now)

    def hand_over(*args):  # (kind, objects) relists before this change, (deltas, trigger times) now
        handed.append(args)
        (d.on_relist if isinstance(args[0], str) else d.on_batch)(*args)

    watcher = ManifestsWatcher(str(tmp_path), hand_over, lambda m: None)
    watcher.poll()
    d._drain()
    assert len(state.services) == 10001 and len(state.slices) == 10001
    reads, parses = [], []
    real_read, real_parse = manifests.read_file_checked, daemon_mod.parse_endpoint_slice
    monkeypatch.setattr(manifests, "read_file_checked", lambda p, *a: (reads.append(p), real_read(p, *a))[1])
    monkeypatch.setattr(daemon_mod, "parse_endpoint_slice", lambda *a, **k: (parses.append(a), real_parse(*a, **k))[1])
    handed.clear()
    write(small, [web, endpoint_slice("default", "web", [endpoint("10.250.0.2")], [slice_port("http", 8080)])],
          mtime_ago=0.5)
    watcher.poll()
    d._drain()
    assert reads == [str(small)]
    assert sum(len(x) for a in handed for x in a if isinstance(x, list) and x and not isinstance(x[0], float)) == 1
    assert len(parses) == 1
    assert state.slices["default/web-1"].endpoints[0].addresses[0] == "10.250.0.2"
    assert state.take_changes() >= {"default/web"} and len(state.services) == 10001


class _Proxier:
    def sync(self, force_full=False):
        return SyncResult(full=False, services=0, endpoints=0, rules=0, rules_written=0)


class _Latencies(Hooks):
    def __init__(self):
        self.values = []

    def synced(self, result, latencies):
        self.values.extend(latencies)


def test_programming_latency_counts_from_the_files_mtime(tmp_path):
    hooks = _Latencies()
    d = Daemon(_Proxier(), ProxyState("node1"), 0.0, 60.0, lambda m: None, hooks)
    f = tmp_path / "a.yaml"
    write(f, [svc("web", "10.96.0.10")], mtime_ago=60)  # before the daemon started: not a latency
    watcher = ManifestsWatcher(str(tmp_path), d.on_batch, lambda m: None)
    watcher.poll()
    d._sync(False)
    assert hooks.values == []
    time.sleep(0.3)
    write(f, [svc("web", "10.96.0.11")], mtime_ago=0.2)
    watcher.poll()
    d._sync(False)
    assert len(hooks.values) == 1 and 0.2 <= hooks.values[0] < 1.0, hooks.values


def test_a_fifo_named_like_a_manifest_is_named_and_does_not_hang_the_reader(tmp_path, tracker):
    import threading

    os.mkfifo(tmp_path / "pipe.yaml")
    write(tmp_path / "ok.yaml", [svc("web", "10.96.0.10")])
    result = []
    t = threading.Thread(target=lambda: result.append(tracker.poll()), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the reader blocked opening a FIFO"
    assert names(result[0]) == [("Service", "ADDED", "default/web")]
    assert any(f"{tmp_path / 'pipe.yaml'}: cannot parse: not a regular file" in m for m in tracker.logs)
