"""The fake API server (``fake_apiserver.py``) against the real ``kubernetes`` client.

Besides checking the server, these tests pin down how the client (37.x, urllib3 2.x)
reacts to what a real API server does, which code built on ``Watch.stream`` relies on:

* 410 Expired arrives as an ERROR event on an HTTP 200 stream. ``Watch.stream``
  raises ``ApiException(status=410)`` at once when ``timeout_seconds`` is given;
  without it, it first retries silently once from the same resourceVersion (a second
  watch request) and raises on the second 410. With ``deserialize=False`` it raises
  ``KeyError('raw_object')`` instead (a client bug: the ERROR branch reads a key that
  only the deserialising path adds).
* A connection dropped mid-stream raises ``urllib3.exceptions.ProtocolError``
  ("Response ended prematurely") out of the generator, with or without
  ``timeout_seconds``; the client does not reconnect.
* A stream the server ends cleanly (its timeout, or ``timeoutSeconds``) ends the
  ``for`` loop when ``timeout_seconds`` was given; without it the client silently
  re-watches from the last resourceVersion it saw (deserialised objects and
  BOOKMARKs only: with ``deserialize=False`` it re-watches from the resourceVersion
  it was first given, so events are replayed).
* BOOKMARK events are yielded to the caller with ``object`` left a plain dict.
* An HTTP error status (list or watch) raises ``ApiException`` subclasses
  (``ServiceException`` for 5xx, ``NotFoundException``, ...) with ``.status`` set; a
  ``Retry-After`` header on 429/503 makes urllib3 retry by itself first.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import urllib3
from fake_apiserver import FakeApiServer
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

JsonDict = dict[str, Any]


def service(name: str, ns: str = "default", port: Any = 80, labels: Optional[dict[str, str]] = None) -> JsonDict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": dict(labels or {})},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}}


def slice_(name: str, service_name: str, ns: str = "default") -> JsonDict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": service_name}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.1.10"], "conditions": {"ready": True}, "nodeName": "node1"}]}


def node(name: str) -> JsonDict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}


def server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fake-apiserver")]


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    instance = FakeApiServer(bookmark_interval=None).start()
    try:
        yield instance
    finally:
        instance.stop()
    assert server_threads() == []


@pytest.fixture
def api(server: FakeApiServer) -> Iterator[client.ApiClient]:
    configuration = client.Configuration()
    configuration.host = server.url
    with client.ApiClient(configuration) as api_client:
        yield api_client


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


class Consumer(threading.Thread):
    """Runs ``Watch.stream`` in a thread; records events, the exception and when it ended."""

    def __init__(self, func: Any, **kwargs: Any) -> None:
        super().__init__(name="test-watch-consumer", daemon=True)
        self.func = func
        self.kwargs = kwargs
        self.watch = watch.Watch()
        self.events: list[tuple[str, str]] = []  # (type, resourceVersion)
        self.error: Optional[BaseException] = None
        self.got_event = threading.Event()

    def run(self) -> None:
        try:
            for event in self.watch.stream(self.func, **self.kwargs):
                raw = event.get("raw_object", event["object"])
                self.events.append((event["type"], raw["metadata"]["resourceVersion"]))
                self.got_event.set()
        except BaseException as exc:  # recorded for the test to inspect
            self.error = exc

    def finish(self, timeout: float = 2.0) -> None:
        self.join(timeout)
        if self.is_alive():
            self.watch.stop()
            self.join(timeout)
        assert not self.is_alive(), "watch consumer did not end"


def wait_until(predicate: Any, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


# --- list, get, kubeconfig ---------------------------------------------------------------


def test_list_returns_created_objects_with_resource_versions(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    discovery = client.DiscoveryV1Api(api)
    created = server.create(service("web", ns="prod"))
    server.create(service("db"))
    server.create(slice_("web-abc", "web", ns="prod"))
    server.create(node("node1"))

    services = core.list_service_for_all_namespaces()
    assert services.metadata.resource_version == server.resource_version == "5"
    assert [(s.metadata.namespace, s.metadata.name) for s in services.items] == [("default", "db"), ("prod", "web")]
    web = services.items[1]
    assert web.metadata.resource_version == created["metadata"]["resourceVersion"] == "2"
    assert web.metadata.uid == created["metadata"]["uid"]
    assert web.metadata.creation_timestamp is not None
    assert web.spec.ports[0].port == 80

    assert [s.metadata.name for s in core.list_namespaced_service("prod").items] == ["web"]
    slices = discovery.list_endpoint_slice_for_all_namespaces()
    assert [s.metadata.name for s in slices.items] == ["web-abc"]
    assert slices.items[0].endpoints[0].addresses == ["10.244.1.10"]
    assert core.read_node("node1").metadata.labels == {"kubernetes.io/hostname": "node1"}
    with pytest.raises(ApiException) as exc_info:
        core.read_node("node2")
    assert exc_info.value.status == 404

    # As the real API server: no kind/apiVersion on list items.
    raw = core.list_service_for_all_namespaces(_preload_content=False)
    body = json.loads(raw.data)
    assert (body["kind"], body["apiVersion"]) == ("ServiceList", "v1")
    assert all("kind" not in item and "apiVersion" not in item for item in body["items"])
    assert server.counts[("Service", "list")] == 3


def test_update_delete_and_noop_update(server: FakeApiServer) -> None:
    server.create(service("web"))
    same = server.update(service("web"))
    assert same["metadata"]["resourceVersion"] == "2" == server.resource_version  # no change, no new version
    changed = server.apply(service("web", port=81))
    assert changed["metadata"]["resourceVersion"] == "3"
    assert changed["metadata"]["uid"] == same["metadata"]["uid"]
    gone = server.delete("Service", "default", "web")
    assert gone["metadata"]["resourceVersion"] == "4"
    assert server.objects("Service") == []
    with pytest.raises(KeyError):
        server.delete("services", "default", "web")
    with pytest.raises(KeyError):
        server.create(server.create(service("x")))


def test_kubeconfig_helper(server: FakeApiServer, tmp_path: Path) -> None:
    server.create(node("node1"))
    path = server.write_kubeconfig(tmp_path / "kubeconfig")
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    assert configuration.host == server.url
    with client.ApiClient(configuration) as api_client:
        assert [n.metadata.name for n in client.CoreV1Api(api_client).list_node().items] == ["node1"]
    with config.new_client_from_config(config_file=str(path)) as api_client:
        assert client.VersionApi(api_client).get_code().git_version == server.git_version


def test_pagination(server: FakeApiServer, core: client.CoreV1Api) -> None:
    for i in range(5):
        server.create(service(f"s{i}"))
    first = core.list_service_for_all_namespaces(limit=2)
    assert [s.metadata.name for s in first.items] == ["s0", "s1"]
    assert first.metadata.remaining_item_count == 3
    second = core.list_service_for_all_namespaces(limit=2, _continue=first.metadata._continue)
    assert [s.metadata.name for s in second.items] == ["s2", "s3"]
    last = core.list_service_for_all_namespaces(limit=2, _continue=second.metadata._continue)
    assert [s.metadata.name for s in last.items] == ["s4"]
    assert last.metadata._continue is None
    assert last.metadata.resource_version == first.metadata.resource_version


# --- selectors -------------------------------------------------------------------------


def test_label_and_field_selectors(server: FakeApiServer, core: client.CoreV1Api) -> None:
    server.create(service("plain"))
    server.create(service("headless", labels={"service.kubernetes.io/headless": ""}))
    server.create(service("other-proxy", labels={"service.kubernetes.io/service-proxy-name": "x"}))
    server.create(service("tiered", ns="prod", labels={"tier": "web"}))
    server.create(service("backend", ns="prod", labels={"tier": "db"}))
    server.create(node("node1"))
    server.create(node("node2"))

    def names(**kwargs: str) -> list[str]:
        return [s.metadata.name for s in core.list_service_for_all_namespaces(**kwargs).items]

    upstream = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    assert names(label_selector=upstream) == ["plain", "backend", "tiered"]
    assert names(label_selector="tier=web") == ["tiered"]
    assert names(label_selector="tier==web") == ["tiered"]
    assert names(label_selector="tier!=web") == ["headless", "other-proxy", "plain", "backend"]  # absent matches
    assert names(label_selector="tier") == ["backend", "tiered"]
    assert names(label_selector="tier in (db, web)") == ["backend", "tiered"]
    assert names(label_selector="tier notin (web),tier") == ["backend"]
    assert names(field_selector="metadata.name=plain") == ["plain"]
    assert names(field_selector="metadata.namespace=prod,metadata.name!=backend") == ["tiered"]
    assert [n.metadata.name for n in core.list_node(field_selector="metadata.name=node2").items] == ["node2"]
    for bad in ({"field_selector": "spec.clusterIP=10.96.0.10"}, {"label_selector": "tier in (web"}):
        with pytest.raises(ApiException) as exc_info:
            core.list_service_for_all_namespaces(**bad)
        assert exc_info.value.status == 400


def test_watch_with_selector_sees_objects_enter_and_leave(server: FakeApiServer, core: client.CoreV1Api) -> None:
    rv = server.create(service("web"))["metadata"]["resourceVersion"]
    server.update(service("web", labels={"service.kubernetes.io/headless": ""}))  # leaves the selection
    server.update(service("web"))  # comes back
    server.update(service("web", port=81))
    w = watch.Watch()
    seen = []
    for event in w.stream(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5,
                          label_selector="!service.kubernetes.io/headless"):
        seen.append((event["type"], event["object"].metadata.resource_version))
        if len(seen) == 3:
            w.stop()
    assert seen == [("DELETED", "3"), ("ADDED", "4"), ("MODIFIED", "5")]


# --- watch -----------------------------------------------------------------------------


def test_watch_from_list_resource_version_delivers_later_changes_in_order(
        server: FakeApiServer, core: client.CoreV1Api) -> None:
    server.create(service("old"))
    listed = core.list_service_for_all_namespaces()
    rv = listed.metadata.resource_version
    server.create(service("web"))  # before the watch starts: replayed from history
    server.create(node("node1"))  # another kind: not part of this watch

    def later_changes() -> None:
        server.wait_for_watches(1, kind="Service")
        server.update(service("web", port=81))
        server.delete("Service", "default", "web")

    changer = threading.Thread(target=later_changes, name="test-changer")
    changer.start()
    w = watch.Watch()
    seen: list[tuple[str, str, str]] = []
    try:
        for event in w.stream(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5):
            obj = event["object"]
            assert isinstance(obj, client.V1Service)
            assert event["raw_object"]["kind"] == "Service"
            seen.append((event["type"], obj.metadata.name, obj.metadata.resource_version))
            if len(seen) == 3:
                w.stop()
    finally:
        changer.join(2)
    assert seen == [("ADDED", "web", "3"), ("MODIFIED", "web", "5"), ("DELETED", "web", "6")]
    assert w.resource_version == "6"
    watches = [r for r in server.requests() if r.verb == "watch"]
    assert len(watches) == 1
    assert watches[0].query == {"resourceVersion": rv, "timeoutSeconds": "5", "watch": "true"}


def test_watch_without_resource_version_starts_with_synthetic_added(
        server: FakeApiServer, core: client.CoreV1Api) -> None:
    server.create(service("a"))
    server.create(service("b"))
    server.update(service("a", port=81))
    for rv in (None, "0"):
        w = watch.Watch()
        kwargs = {"resource_version": rv} if rv else {}
        seen = []
        for event in w.stream(core.list_service_for_all_namespaces, timeout_seconds=5, **kwargs):
            seen.append((event["type"], event["object"].metadata.name, event["object"].metadata.resource_version))
            if len(seen) == 2:
                w.stop()
        assert seen == [("ADDED", "a", "4"), ("ADDED", "b", "3")]


def test_bookmarks_periodic() -> None:
    with FakeApiServer(bookmark_interval=0.2) as server:
        configuration = client.Configuration()
        configuration.host = server.url
        with client.ApiClient(configuration) as api_client:
            core = client.CoreV1Api(api_client)
            rv = server.create(service("a"))["metadata"]["resourceVersion"]
            server.create(node("n1"))  # bumps the global resourceVersion, not seen by a Service watch
            w = watch.Watch()
            started = time.monotonic()
            events = []
            for event in w.stream(core.list_service_for_all_namespaces, resource_version=rv,
                                  allow_watch_bookmarks=True, timeout_seconds=5):
                events.append(event)
                w.stop()
            assert 0.15 < time.monotonic() - started < 2.0
    assert server_threads() == []
    assert events[0]["type"] == "BOOKMARK"
    # Not deserialised: the object stays a dict.
    assert events[0]["object"] == {"kind": "Service", "apiVersion": "v1", "metadata": {"resourceVersion": "3"}}
    assert w.resource_version == "3"  # the client would resume from the bookmark's resourceVersion


def test_bookmarks_on_demand_only_when_allowed(server: FakeApiServer, core: client.CoreV1Api) -> None:
    rv = server.resource_version
    allowed = Consumer(core.list_service_for_all_namespaces, resource_version=rv, allow_watch_bookmarks=True,
                       timeout_seconds=5)
    plain = Consumer(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5)
    allowed.start()
    plain.start()
    try:
        assert server.wait_for_watches(2)
        server.create(node("n1"))
        assert server.bookmark() == 1
        assert allowed.got_event.wait(2)
    finally:
        server.drop_watches(graceful=True)
        allowed.finish()
        plain.finish()
    assert allowed.events == [("BOOKMARK", "2")] and allowed.error is None
    assert plain.events == [] and plain.error is None


def test_send_initial_events_ends_with_annotated_bookmark(server: FakeApiServer, core: client.CoreV1Api) -> None:
    server.create(service("a"))
    w = watch.Watch()
    events = []
    for event in w.stream(core.list_service_for_all_namespaces, send_initial_events=True,
                          resource_version_match="NotOlderThan", allow_watch_bookmarks=True, timeout_seconds=5):
        events.append(event)
        if len(events) == 2:
            w.stop()
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


# --- 410 Expired -------------------------------------------------------------------------


def test_watch_from_compacted_resource_version_raises_410(server: FakeApiServer, core: client.CoreV1Api) -> None:
    rv = server.create(service("a"))["metadata"]["resourceVersion"]
    server.update(service("a", port=81))
    assert server.compact() == "3" == server.oldest_resource_version

    # With timeout_seconds: raised at once, from a single watch request.
    with pytest.raises(ApiException) as exc_info:
        list(watch.Watch().stream(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5))
    assert exc_info.value.status == 410
    assert exc_info.value.reason == "Expired: too old resource version: 2 (3)"
    assert server.request_count("Service", "watch") == 1

    # Without it: the client retries once from the same resourceVersion, then raises.
    server.reset_counts()
    with pytest.raises(ApiException) as exc_info:
        list(watch.Watch().stream(core.list_service_for_all_namespaces, resource_version=rv))
    assert exc_info.value.status == 410
    assert [r.query.get("resourceVersion") for r in server.requests()] == [rv, rv]

    # The wire format: HTTP 200, one ERROR event with a Status, then the end of the stream.
    raw = core.list_service_for_all_namespaces(watch=True, resource_version=rv, _preload_content=False)
    assert raw.status == 200
    lines = raw.data.decode().splitlines()
    assert [json.loads(line) for line in lines] == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version: 2 (3)", "reason": "Expired", "code": 410}}]


def test_history_limit_expires_old_resource_versions() -> None:
    with FakeApiServer(history_limit=2, bookmark_interval=None) as server:
        configuration = client.Configuration()
        configuration.host = server.url
        with client.ApiClient(configuration) as api_client:
            core = client.CoreV1Api(api_client)
            for port in (80, 81, 82, 83):
                server.apply(service("a", port=port))  # resourceVersions 2..5
            assert server.oldest_resource_version == "3"
            with pytest.raises(ApiException) as exc_info:
                list(watch.Watch().stream(core.list_service_for_all_namespaces, resource_version="2",
                                          timeout_seconds=5))
            assert exc_info.value.status == 410
            w = watch.Watch()
            seen = []
            for event in w.stream(core.list_service_for_all_namespaces, resource_version="3", timeout_seconds=5):
                seen.append(event["object"].spec.ports[0].port)
                if len(seen) == 2:
                    w.stop()
            assert seen == [82, 83]


def test_error_watches_mid_stream(server: FakeApiServer, core: client.CoreV1Api) -> None:
    consumer = Consumer(core.list_service_for_all_namespaces, resource_version=server.resource_version,
                        timeout_seconds=5)
    consumer.start()
    try:
        assert server.wait_for_watches(1)
        assert server.error_watches(410, "too old resource version: 1 (5)") == 1
    finally:
        consumer.finish()
    assert isinstance(consumer.error, ApiException) and consumer.error.status == 410
    assert server.wait_for_watches(0)


def test_deserialize_false_turns_error_events_into_key_error(server: FakeApiServer, core: client.CoreV1Api) -> None:
    """Client pitfall: with deserialize=False an ERROR event raises KeyError('raw_object')."""
    rv = server.create(service("a"))["metadata"]["resourceVersion"]
    server.apply(service("a", port=81))
    server.compact()
    with pytest.raises(KeyError, match="raw_object"):
        list(watch.Watch().stream(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5,
                                  deserialize=False))


# --- dropped connections, timeouts, errors ------------------------------------------------


def test_abrupt_drop_raises_protocol_error(server: FakeApiServer, core: client.CoreV1Api) -> None:
    rv = server.create(service("a"))["metadata"]["resourceVersion"]
    for kwargs in ({"timeout_seconds": 5}, {}):
        server.reset_counts()
        consumer = Consumer(core.list_service_for_all_namespaces, resource_version=rv, **kwargs)
        consumer.start()
        try:
            assert server.wait_for_watches(1)
            assert server.drop_watches() == 1
        finally:
            consumer.finish()
        assert isinstance(consumer.error, urllib3.exceptions.ProtocolError), consumer.error
        assert server.request_count("Service", "watch") == 1  # no reconnection by the client
        assert server.wait_for_watches(0)


def test_graceful_end_finishes_the_loop_or_rewatches(server: FakeApiServer, core: client.CoreV1Api) -> None:
    rv = server.create(service("a"))["metadata"]["resourceVersion"]
    # With timeout_seconds: the for loop just ends.
    consumer = Consumer(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5)
    consumer.start()
    try:
        assert server.wait_for_watches(1)
        assert server.drop_watches(graceful=True) == 1
    finally:
        consumer.finish()
    assert consumer.error is None and consumer.events == []

    # Without: the client re-watches from the last resourceVersion it saw.
    server.reset_counts()
    consumer = Consumer(core.list_service_for_all_namespaces, resource_version=rv)
    consumer.start()
    try:
        assert server.wait_for_watches(1)
        server.apply(service("a", port=81))
        assert consumer.got_event.wait(2)
        assert server.drop_watches(graceful=True) == 1
        assert server.wait_for_watches(1)
        server.apply(service("a", port=82))
        assert wait_until(lambda: len(consumer.events) == 2)
    finally:
        consumer.watch.stop()
        server.drop_watches(graceful=True)
        consumer.finish()
    assert consumer.events == [("MODIFIED", "3"), ("MODIFIED", "4")]
    assert [r.query["resourceVersion"] for r in server.requests()][:2] == [rv, "3"]


def test_timeout_seconds_ends_the_stream(server: FakeApiServer, core: client.CoreV1Api) -> None:
    started = time.monotonic()
    events = list(watch.Watch().stream(core.list_service_for_all_namespaces, resource_version=server.resource_version,
                                       timeout_seconds=1))
    assert events == []
    assert 0.9 < time.monotonic() - started < 3.0
    assert wait_until(lambda: server.active_watches() == 0)


def test_fail_next(server: FakeApiServer, core: client.CoreV1Api) -> None:
    server.create(node("node1"))
    server.fail_next(2, status=500)
    for _unused in range(2):
        with pytest.raises(ApiException) as exc_info:
            core.list_node()
        assert exc_info.value.status == 500
        assert json.loads(exc_info.value.body)["reason"] == "InternalError"
    assert [n.metadata.name for n in core.list_node().items] == ["node1"]

    server.fail_next(1, status=403, verbs=["watch"])
    assert len(core.list_node().items) == 1  # not a watch: not failed
    with pytest.raises(ApiException) as exc_info:
        list(watch.Watch().stream(core.list_node, timeout_seconds=1))
    assert exc_info.value.status == 403

    # Raw lists (_preload_content=False) raise too.
    server.fail_next(1, status=503, kinds=["Node"])
    with pytest.raises(ApiException) as exc_info:
        core.list_node(_preload_content=False)
    assert exc_info.value.status == 503

    # Retry-After on 503: urllib3 retries by itself; the caller never sees the error.
    server.reset_counts()
    server.fail_next(1, status=503, retry_after=0)
    assert len(core.list_node().items) == 1
    assert server.request_count("Node", "list") == 2


def test_malformed_objects_are_served_as_given(server: FakeApiServer, core: client.CoreV1Api) -> None:
    server.create(service("bad", port="eighty"))
    raw = json.loads(core.list_service_for_all_namespaces(_preload_content=False).data)
    assert raw["items"][0]["spec"]["ports"][0]["port"] == "eighty"
    # The typed client rejects the whole list (pydantic), so a proxy must read raw JSON.
    with pytest.raises(ValueError, match="port"):
        core.list_service_for_all_namespaces()
    w = watch.Watch()
    for event in w.stream(core.list_service_for_all_namespaces, timeout_seconds=5, deserialize=False):
        assert (event["type"], event["object"]["spec"]["ports"][0]["port"]) == ("ADDED", "eighty")
        w.stop()
    with pytest.raises(ValueError, match="port"):  # so does a typed watch, from the generator
        list(watch.Watch().stream(core.list_service_for_all_namespaces, timeout_seconds=5))


def test_stop_ends_open_watches_and_threads(tmp_path: Path) -> None:
    server = FakeApiServer(bookmark_interval=None).start()
    configuration = client.Configuration()
    configuration.host = server.url
    with client.ApiClient(configuration) as api_client:
        core = client.CoreV1Api(api_client)
        core.list_node()  # leaves an idle keep-alive connection
        consumer = Consumer(core.list_node, resource_version=server.resource_version, timeout_seconds=5)
        consumer.start()
        try:
            assert server.wait_for_watches(1)
            assert server_threads()
            server.stop()
        finally:
            consumer.finish()
    assert server_threads() == []
    assert isinstance(consumer.error, urllib3.exceptions.ProtocolError)
    server.stop()  # idempotent
