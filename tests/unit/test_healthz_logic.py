"""The proxy health decision (upstream's ProxyHealthServer), with a fake clock and no sockets."""
import json

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.healthcheck import _body
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.healthz import (
    ProxyHealthServer,
    health_timeout,
    node_is_eligible,
    rfc3339,
    split_host_port,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.metrics import ProxyMetrics

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class FakeClock:
    def __init__(self, now=T0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def hs(clock):
    return ProxyHealthServer("127.0.0.1:0", health_timeout(30), clock=clock)


def body(hs, path):
    status, headers, raw = hs.handle("GET", path)
    return status, dict(headers), json.loads(raw), raw


def test_health_timeout_is_twice_the_sync_period():
    assert health_timeout(30) == 60


def test_healthy_while_starting_up(hs):
    assert hs.is_healthy()
    status, headers, doc, raw = body(hs, "/healthz")
    assert status == 200
    assert headers == {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}
    # Go's json.Marshal: compact, struct field order, empty status left out, lastUpdated = now when healthy.
    assert raw == (b'{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:13:20Z",'
                   b'"nodeEligible":true,"healthy":true}')
    assert doc == {"lastUpdated": "2023-11-14T22:13:20Z", "currentTime": "2023-11-14T22:13:20Z",
                   "nodeEligible": True, "healthy": True}


def test_overdue_queued_update_makes_it_unhealthy_until_updated(hs, clock):
    hs.updated()  # as upstream's SyncLoop does before the first sync
    clock.advance(5)
    hs.queued_update()
    clock.advance(59.999)
    assert hs.is_healthy()  # queued, not late yet
    clock.advance(0.001)
    assert not hs.is_healthy()  # waited health_timeout (>=): late
    status, _unused, doc, _unused = body(hs, "/healthz")
    assert status == 503
    assert doc == {"lastUpdated": rfc3339(T0), "currentTime": rfc3339(T0 + 65), "nodeEligible": True,
                   "healthy": False, "status": {"IPv4": {"lastUpdated": rfc3339(T0), "healthy": False}}}
    assert body(hs, "/livez")[0] == 503
    hs.updated()
    assert hs.is_healthy()
    status, _unused, doc, _unused = body(hs, "/healthz")
    assert status == 200
    assert doc["status"] == {"IPv4": {"lastUpdated": rfc3339(T0 + 65), "healthy": True}}


def test_queued_update_keeps_the_oldest(hs, clock):
    hs.updated()
    hs.queued_update()
    clock.advance(40)
    hs.queued_update()  # does not restart the wait
    clock.advance(20)
    assert not hs.is_healthy()


def test_regular_syncs_without_changes_stay_healthy(hs, clock):
    hs.updated()
    for _unused in range(10):
        clock.advance(30)
        hs.updated()
    clock.advance(1000)  # nothing queued: no sync is overdue
    assert hs.is_healthy()


def test_family_never_updated_is_not_checked(hs, clock):
    # Upstream only looks at families present in lastUpdatedMap.
    hs.queued_update("IPv6")
    clock.advance(3600)
    assert hs.is_healthy()


def test_dual_stack_one_late_family(hs, clock):
    hs.updated("IPv4")
    hs.updated("IPv6")
    hs.queued_update("IPv6")
    clock.advance(61)
    hs.updated("IPv4")
    h = hs.health()
    assert not h.healthy
    assert h.last_updated == T0 + 61  # newest of the families
    assert {f: (s.healthy, s.last_updated) for f, s in h.status.items()} == {
        "IPv4": (True, T0 + 61), "IPv6": (False, T0)}
    status, _unused, doc, _unused = body(hs, "/livez")
    assert status == 503 and list(doc["status"]) == ["IPv4", "IPv6"]


def test_node_being_deleted_fails_healthz_not_livez(hs, clock):
    hs.updated()
    hs.node_deleting(True)
    status, _unused, doc, _unused = body(hs, "/healthz")
    assert status == 503
    assert doc["nodeEligible"] is False and doc["healthy"] is True
    assert doc["lastUpdated"] == rfc3339(T0)  # not replaced by "now" on a 503
    status, _unused, doc, _unused = body(hs, "/livez")
    assert status == 200 and "nodeEligible" not in doc
    assert hs.is_healthy()  # what the service health checks read: the node is not part of it
    hs.node_deleting(False)
    assert body(hs, "/healthz")[0] == 200


@pytest.mark.parametrize("node, eligible", [
    (None, True),
    ({"metadata": {"name": "n1"}, "spec": {}}, True),
    ({"metadata": {"name": "n1", "deletionTimestamp": "2024-01-01T00:00:00Z"}}, False),
    ({"metadata": {"name": "n1"},
      "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}, False),
    ({"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}}, True),
])
def test_sync_node(hs, node, eligible):
    assert node_is_eligible(node) is eligible
    hs.sync_node(node)
    assert hs.node_eligible() is eligible


def test_probes_are_counted(clock):
    m = ProxyMetrics(clock=clock, process=False)
    hs = ProxyHealthServer("127.0.0.1:0", 60, clock=clock, metrics=m)
    hs.handle("GET", "/healthz")
    hs.node_deleting(True)
    hs.handle("GET", "/healthz")
    hs.handle("GET", "/livez")
    assert m.proxy_healthz_total.labels("200").get() == 1
    assert m.proxy_healthz_total.labels("503").get() == 1
    assert m.proxy_livez_total.labels("200").get() == 1


def test_unknown_path(hs):
    status, headers, raw = hs.handle("GET", "/healthz/extra")
    assert status == 404 and raw == b"404 page not found\n"


def test_rfc3339():
    assert rfc3339(None) == "0001-01-01T00:00:00Z"
    assert rfc3339(T0) == "2023-11-14T22:13:20Z"
    assert rfc3339(T0 + 0.5) == "2023-11-14T22:13:20.5Z"
    assert rfc3339(T0 + 0.000123) == "2023-11-14T22:13:20.000123Z"


@pytest.mark.parametrize("address, expected", [
    ("127.0.0.1:10256", ("127.0.0.1", 10256)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:10249", ("::1", 10249)),
    (":10256", ("", 10256)),
])
def test_split_host_port(address, expected):
    assert split_host_port(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1", "::1:80", "h:99999", "h:x"])
def test_split_host_port_rejects(address):
    with pytest.raises(ValueError):
        split_host_port(address)


def test_service_health_body_is_upstreams_text():
    raw = _body(("default", "web"), 2, True)
    assert raw == (b'{\n\t"service": {\n\t\t"namespace": "default",\n\t\t"name": "web"\n\t},\n'
                   b'\t"localEndpoints": 2,\n\t"serviceProxyHealthy": true\n}')
    assert json.loads(raw) == {"service": {"namespace": "default", "name": "web"}, "localEndpoints": 2,
                               "serviceProxyHealthy": True}
