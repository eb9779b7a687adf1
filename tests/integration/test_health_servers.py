"""Real /healthz, /livez, /metrics and service health check servers on 127.0.0.1, queried with urllib."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.healthcheck import HealthCheckServers
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.healthz import (
    MetricsServer,
    ProxyHealthServer,
    health_timeout,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.metrics import ProxyMetrics

SVC = ("default", "web")
OTHER = ("prod", "api")


class FakeClock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def get(address, path="/", method="GET"):
    """(status, headers, body) of one request; HTTP errors are answers too."""
    req = urllib.request.Request(f"http://{address}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


def refused(address):
    with pytest.raises(urllib.error.URLError) as exc:
        get(address)
    return isinstance(exc.value.reason, ConnectionRefusedError)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def metrics(clock):
    return ProxyMetrics(clock=clock)


@pytest.fixture
def health(clock, metrics):
    hs = ProxyHealthServer("127.0.0.1:0", health_timeout(30), clock=clock, metrics=metrics)
    hs.start()
    try:
        yield hs
    finally:
        hs.stop()


@pytest.fixture
def metrics_server(metrics):
    ms = MetricsServer("127.0.0.1:0", metrics, proxy_mode="iptables")
    ms.start()
    try:
        yield ms
    finally:
        ms.stop()


@pytest.fixture
def logs():
    return []


@pytest.fixture
def checks(health, logs):
    hc = HealthCheckServers("127.0.0.1", health, log=logs.append, hostname="node-1")
    try:
        yield hc
    finally:
        hc.stop()


def test_bound_address_resolves_port_zero(health):
    host, port = health.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_healthz_follows_queued_and_updated(health, clock):
    health.updated()  # the sync loop starts
    status, headers, raw = get(health.address, "/healthz")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "Server" not in headers
    doc = json.loads(raw)
    assert list(doc) == ["lastUpdated", "currentTime", "nodeEligible", "healthy", "status"]
    assert doc["nodeEligible"] is True and doc["healthy"] is True
    assert doc["status"] == {"IPv4": {"lastUpdated": "2023-11-14T22:13:20Z", "healthy": True}}

    health.queued_update()
    clock.advance(61)  # > 2 * syncPeriod without a sync
    status, _unused, raw = get(health.address, "/healthz")
    assert status == 503
    doc = json.loads(raw)
    assert doc["healthy"] is False and doc["lastUpdated"] == "2023-11-14T22:13:20Z"
    assert doc["currentTime"] == "2023-11-14T22:14:21Z"

    health.updated()
    status, _unused, raw = get(health.address, "/healthz")
    assert status == 200 and json.loads(raw)["healthy"] is True


def test_livez_ignores_the_node(health, clock):
    health.updated()
    health.node_deleting(True)
    assert get(health.address, "/healthz")[0] == 503
    status, headers, raw = get(health.address, "/livez")
    assert status == 200 and headers["Content-Type"] == "application/json"
    doc = json.loads(raw)
    assert list(doc) == ["lastUpdated", "currentTime", "healthy", "status"]
    health.queued_update()
    clock.advance(60)
    assert get(health.address, "/livez")[0] == 503


def test_other_paths_and_head(health):
    status, headers, raw = get(health.address, "/nothing")
    assert status == 404 and raw == b"404 page not found\n"
    status, headers, raw = get(health.address, "/healthz?verbose=1", method="HEAD")
    assert status == 200 and raw == b"" and int(headers["Content-Length"]) > 0


def test_metrics_server(metrics_server, metrics, health):
    get(health.address, "/healthz")
    metrics.observe_sync(0.01, full=True)
    status, headers, raw = get(metrics_server.address, "/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = raw.decode()
    assert "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n" in text
    assert 'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.016"} 1\n' in text
    assert 'kubeproxy_proxy_healthz_total{code="200"} 1\n' in text
    assert 'kubenode_proxy_syncs_total{kind="full"} 1\n' in text
    assert "\nprocess_start_time_seconds " in text
    assert get(metrics_server.address, "/healthz")[2] == b"ok"
    assert get(metrics_server.address, "/proxyMode")[2] == b"iptables"
    assert get(metrics_server.address, "/other")[0] == 404


def test_service_health_check(checks, health, clock):
    health.updated()
    assert checks.sync_services({SVC: 0}) == {}
    (address,) = checks.addresses(SVC)

    status, headers, raw = get(address, "/healthz")
    assert status == 503
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "0"
    assert json.loads(raw) == {"service": {"namespace": "default", "name": "web"}, "localEndpoints": 0,
                               "serviceProxyHealthy": True}

    checks.sync_endpoints({SVC: 2, OTHER: 5})  # OTHER has no health check: dropped
    status, headers, raw = get(address, "/any/path?x=1")
    assert status == 200 and headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert raw == (b'{\n\t"service": {\n\t\t"namespace": "default",\n\t\t"name": "web"\n\t},\n'
                   b'\t"localEndpoints": 2,\n\t"serviceProxyHealthy": true\n}')
    assert checks.local_endpoints(OTHER) is None

    health.queued_update()
    clock.advance(60)  # the proxy is late: every service check says 503
    status, _unused, raw = get(address)
    assert status == 503 and json.loads(raw)["serviceProxyHealthy"] is False
    health.updated()
    assert get(address)[0] == 200

    checks.sync_endpoints({})  # not listed: 0
    assert get(address)[0] == 503

    checks.sync_services({})
    assert checks.services() == {}
    assert refused(address)


def test_sync_services_matches_exactly_and_reports_busy_ports(checks, health, logs):
    health.updated()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    try:
        failures = checks.sync_services({SVC: 0, OTHER: busy_port})
        assert list(failures) == [OTHER]
        assert "prod/api" in failures[OTHER] and str(busy_port) in failures[OTHER]
        assert any("prod/api" in line and "failed" in line for line in logs)
        assert set(checks.services()) == {SVC}  # the other one still opened
        (first,) = checks.addresses(SVC)
        assert get(first)[0] == 503

        # Unchanged: kept as is (same listener); OTHER is retried (still busy).
        assert list(checks.sync_services({SVC: 0, OTHER: busy_port})) == [OTHER]
        assert checks.addresses(SVC) == [first]
    finally:
        busy.close()

    # The port is free now: the retry succeeds.
    assert checks.sync_services({SVC: 0, OTHER: busy_port}) == {}
    assert checks.addresses(OTHER) == [f"127.0.0.1:{busy_port}"]
    checks.sync_endpoints({OTHER: 1})
    status, _unused, raw = get(f"127.0.0.1:{busy_port}")
    assert status == 200 and json.loads(raw)["service"] == {"namespace": "prod", "name": "api"}

    # A port change closes the old listener and opens the new one.
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    new_port = free.getsockname()[1]
    free.close()
    assert checks.sync_services({OTHER: new_port}) == {}
    assert refused(first)  # SVC removed
    assert refused(f"127.0.0.1:{busy_port}")
    assert get(f"127.0.0.1:{new_port}")[0] == 503  # reopened: endpoints known at the next sync_endpoints
