"""The daemon's intake (both sources feed it): a bad object is named and skipped, a bad update
keeps the last good version, objects of the other IP family are ignored without a word of
rejection, and malformed identities (metadata of the wrong type) never break the drain."""
import copy

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port


def make():
    logs = []
    state = ProxyState("node1")
    daemon = Daemon(proxier=None, state=state, min_period=0.0, sync_period=60.0, log=logs.append)
    return daemon, state, logs


GOOD = service("shop", "web", "10.96.0.10", [port("http", 80)])
SLICE = endpoint_slice("shop", "web", [endpoint("10.244.0.1")], [slice_port("http", 8080)])


def bad_update():
    svc = copy.deepcopy(GOOD)
    svc["spec"]["ports"][0]["port"] = 0
    return svc


def test_bad_update_event_keeps_the_last_good_version():
    daemon, state, logs = make()
    daemon.on_event("Service", "ADDED", GOOD)
    daemon._drain()
    daemon.on_event("Service", "MODIFIED", bad_update())
    daemon._drain()
    assert state.services["shop/web"].ports[0].port == 80
    assert any("spec.ports[0].port" in m and "keeping its last good version" in m for m in logs), logs
    assert daemon.rejected


def test_bad_update_in_a_relist_keeps_the_last_good_version_and_others_are_served():
    daemon, state, logs = make()
    other = service("shop", "api", "10.96.0.11", [port("http", 80)])
    daemon.on_relist("Service", [GOOD, other])
    daemon._drain()
    newcomer = service("shop", "Web_Service", "10.96.0.12", [port("http", 80)])
    daemon.on_relist("Service", [bad_update(), other, newcomer])
    daemon._drain()
    assert set(state.services) == {"shop/web", "shop/api"}
    assert state.services["shop/web"].ports[0].port == 80
    assert any("Service shop/Web_Service: metadata.name" in m and "skipped" in m for m in logs), logs


def test_other_family_is_ignored_not_rejected_and_dual_stack_keeps_its_ipv4_half():
    daemon, state, logs = make()
    v6 = service("shop", "v6", "fd00::10", [port("http", 80)], ipFamilies=["IPv6"])
    ds = service("shop", "ds", "fd00::11", [port("http", 80)], clusterIPs=["fd00::11", "10.96.0.11"],
                 ipFamilies=["IPv6", "IPv4"], ipFamilyPolicy="RequireDualStack")
    v6_slice = endpoint_slice("shop", "v6", [endpoint("fd00::1")], [slice_port("http", 8080)],
                              address_type="IPv6")
    daemon.on_relist("Service", [GOOD, v6, ds])
    daemon.on_relist("EndpointSlice", [SLICE, v6_slice])
    daemon._drain()
    assert set(state.services) == {"shop/web", "shop/ds"}
    assert state.services["shop/ds"].ports[0].cluster_ip == "10.96.0.11"
    assert set(state.slices) == {"shop/web-1"}
    assert not daemon.rejected and not logs


def test_a_service_that_becomes_ipv6_only_is_dropped():
    daemon, state, _logs = make()
    daemon.on_event("Service", "ADDED", GOOD)
    daemon._drain()
    v6 = copy.deepcopy(GOOD)
    v6["spec"]["clusterIP"] = "fd00::10"
    daemon.on_event("Service", "MODIFIED", v6)
    daemon._drain()
    assert state.services == {}


def test_malformed_identities_do_not_break_the_drain():
    daemon, state, logs = make()
    hostile = [
        {"kind": "Service", "metadata": ["x"]},
        {"kind": "Service", "metadata": {"name": ["x"], "namespace": 5}},
        {"kind": "Service", "metadata": {"name": "x", "annotations": "y"}, "spec": "z"},
    ]
    for obj in hostile:
        daemon.on_event("Service", "ADDED", obj)
        daemon.on_event("Service", "DELETED", obj)
    daemon.on_relist("Service", hostile + [GOOD])
    daemon.on_relist("Node", [{"kind": "Node", "metadata": "node1"}, {"kind": "Node", "metadata": {"name": 1}}])
    daemon._drain()
    assert set(state.services) == {"shop/web"}
    assert all("\n" not in m for m in logs)
