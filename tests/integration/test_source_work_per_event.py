"""The API source works on deltas at 10,000 Services: after the initial list, one watch
event costs one object's parse on the sync thread, no relist and no reparse of the others
(the real `kubernetes` client against the list/watch server, the daemon's real intake)."""
from __future__ import annotations

import threading
import time

from fake_apiserver import FakeApiServer
from proxyctl import eps, svc, tcp

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import daemon as daemon_mod
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.kubernetes import (
    KubernetesSource,
    load_client,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

N = 10000
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_one_watch_event_at_10000_services_costs_one_parse(tmp_path, monkeypatch):
    api = FakeApiServer(bookmark_interval=None).start()
    source = None
    try:
        for i in range(N):
            ip = f"10.{96 + i // 65536}.{i // 256 % 256}.{i % 256}"
            api.create(svc(f"svc{i}", ip, [tcp(80)], ns=f"ns{i % 50}"))
            api.create(eps(f"svc{i}", [f"10.128.{i // 256 % 256}.{i % 256}"], HTTP_EP, ns=f"ns{i % 50}"))
        state = ProxyState("node1")
        daemon = Daemon(proxier=None, state=state, min_period=0.0, sync_period=3600, log=lambda m: None)
        relists, parses = [], []
        lock = threading.Lock()

        def on_relist(kind, objs):
            with lock:
                relists.append((kind, len(objs)))
            daemon.on_relist(kind, objs)

        client = load_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        source = KubernetesSource(client, "node1", daemon.on_event, on_relist)
        source.start()
        assert source.wait_synced(120)
        daemon._drain()
        assert len(state.services) == N and len(state.slices) == N
        assert sorted(relists) == [("EndpointSlice", N), ("Node", 0), ("Service", N)]
        relists.clear()
        state.take_changes()
        real_parse = daemon_mod.parse_endpoint_slice
        monkeypatch.setattr(daemon_mod, "parse_endpoint_slice",
                            lambda *a, **k: (parses.append(a), real_parse(*a, **k))[1])
        monkeypatch.setattr(daemon_mod, "parse_service", lambda *a, **k: parses.append(a))  # must not be called
        api.update(eps("svc7", ["10.250.0.7"], HTTP_EP, ns="ns7"))
        wait_for(daemon.has_pending, 30)
        daemon._drain()
        assert len(parses) == 1 and relists == []
        assert state.take_changes() == {"ns7/svc7"}
        assert state.slices["ns7/svc7-abc"].endpoints[0].addresses[0] == "10.250.0.7"
        assert len(state.services) == N
    finally:
        if source is not None:
            source.stop()
        api.stop()
