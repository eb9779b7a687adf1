"""kubenode-proxy against a list/watch API server (tests/integration/fake_apiserver.py),
driven through the real `kubernetes` client, with real traffic in the namespace lab.

The daemon runs in the test's own network namespace (where the API server listens on
127.0.0.1) and programs the lab's node namespace with --netns.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest
from fake_apiserver import FakeApiServer
from proxyctl import BIN, eps, save, svc, tcp, wait_for

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2", "be3": "10.244.1.3"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def cluster(lab, tmp_path):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    api = FakeApiServer(bookmark_interval=0.5).start()
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"},
                "spec": {"podCIDRs": ["10.244.1.0/24"]}})
    api.create(svc("web", "10.96.0.10", HTTP))
    api.create(eps("web", [PODS["be1"], PODS["be2"]], HTTP_EP))
    healthz, metrics = free_port(), free_port()
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(BIN), "--record-dir", str(lab.record_dir), "--kubeconfig", str(kubeconfig),
         "--netns", lab.ns("node"),
         "--hostname-override", "node1", "--cluster-cidr", "10.244.0.0/16", "--iptables-min-sync-period", "100ms",
         "--healthz-bind-address", f"127.0.0.1:{healthz}", "--metrics-bind-address", f"127.0.0.1:{metrics}"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    lab.api, lab.proc = api, proc
    lab.healthz = f"http://127.0.0.1:{healthz}"
    lab.metrics = f"http://127.0.0.1:{metrics}/metrics"
    lab.log = tmp_path / "daemon.log"
    try:
        yield lab
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        api.stop()


def backends(lab, ip, count=12):
    replies = lab.request_many("client", ip, 80, count=count, timeout=1.0)
    return Counter(r.backend if r.ok else r.outcome for r in replies)


def serving(lab, ip, expected):
    return wait_for(lambda: set(backends(lab, ip)) == set(expected), what=f"{ip} served by {expected}")


def test_create_change_delete_follow_the_api(cluster):
    lab, api = cluster, cluster.api
    serving(lab, "10.96.0.10", {"be1", "be2"})
    api.create(svc("api", "10.96.0.11", HTTP))
    api.create(eps("api", [PODS["be3"]], HTTP_EP))
    serving(lab, "10.96.0.11", {"be3"})
    api.update(eps("web", [PODS["be2"]], HTTP_EP))
    serving(lab, "10.96.0.10", {"be2"})
    api.delete("EndpointSlice", "default", "api-abc")
    wait_for(lambda: backends(lab, "10.96.0.11", 3) == Counter({"refused": 3}), what="api rejects")
    api.delete("Service", "default", "api")
    wait_for(lambda: "10.96.0.11" not in save(lab.ns("node")), what="api rules gone")
    status, body = get(lab.healthz + "/healthz")
    assert status == 200 and '"nodeEligible":true' in body


def test_catches_up_after_dropped_connections_and_410(cluster):
    lab, api = cluster, cluster.api
    serving(lab, "10.96.0.10", {"be1", "be2"})
    assert api.wait_for_watches(3, timeout=10)
    watches = api.request_count("EndpointSlice", "watch")
    api.drop_watches()
    api.update(eps("web", [PODS["be3"]], HTTP_EP))  # happens while nobody watches
    serving(lab, "10.96.0.10", {"be3"})
    assert api.request_count("EndpointSlice", "watch") > watches

    lists = api.request_count("EndpointSlice", "list")
    assert api.wait_for_watches(3, timeout=10)
    api.drop_watches()
    api.update(eps("web", [PODS["be1"]], HTTP_EP))
    api.compact()  # the daemon's resourceVersion is now too old: it must relist
    serving(lab, "10.96.0.10", {"be1"})
    assert api.request_count("EndpointSlice", "list") > lists


def test_api_errors_are_retried(cluster):
    lab, api = cluster, cluster.api
    serving(lab, "10.96.0.10", {"be1", "be2"})
    assert api.wait_for_watches(3, timeout=10)
    api.fail_next(3, status=500)
    api.drop_watches()
    api.update(eps("web", [PODS["be2"], PODS["be3"]], HTTP_EP))
    serving(lab, "10.96.0.10", {"be2", "be3"})


def test_malformed_object_is_logged_and_others_keep_working(cluster):
    lab, api = cluster, cluster.api
    serving(lab, "10.96.0.10", {"be1", "be2"})
    api.create(svc("bad", "10.96.0.12", [{"name": "http", "port": "eighty", "protocol": "TCP"}]))
    api.create(svc("good", "10.96.0.13", HTTP))
    api.create(eps("good", [PODS["be3"]], HTTP_EP))
    serving(lab, "10.96.0.13", {"be3"})
    assert set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"}
    wait_for(lambda: "Service default/bad: spec.ports[0].port" in lab.log.read_text(), what="rejection logged")
    # A later bad update of a good service keeps its last good version.
    api.update(svc("good", "10.96.0.13", [{"name": "http", "port": -1, "protocol": "TCP"}]))
    wait_for(lambda: "Service default/good: spec.ports[0].port" in lab.log.read_text(), what="update rejected")
    assert set(backends(lab, "10.96.0.13", 5)) == {"be3"}


def test_metrics_move_with_changes(cluster):
    lab, api = cluster, cluster.api
    serving(lab, "10.96.0.10", {"be1", "be2"})

    def value(name):
        text = get(lab.metrics)[1]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))

    before = value("kubeproxy_sync_proxy_rules_endpoint_changes_total")
    syncs = value("kubeproxy_sync_proxy_rules_duration_seconds_count")
    api.update(eps("web", [PODS["be3"]], HTTP_EP))
    serving(lab, "10.96.0.10", {"be3"})
    wait_for(lambda: value("kubeproxy_sync_proxy_rules_endpoint_changes_total") > before, what="change counted")
    assert value("kubeproxy_sync_proxy_rules_duration_seconds_count") > syncs
    assert value("kubeproxy_network_programming_duration_seconds_count") >= 1
    assert value("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > time.time() - 60


def test_health_check_node_port_follows_local_endpoints(cluster):
    lab, api = cluster, cluster.api
    serving(lab, "10.96.0.10", {"be1", "be2"})
    hc = free_port()
    lb = svc("lbl", "10.96.0.20", [tcp(80, "http", node_port=30020)], type="LoadBalancer",
             externalTrafficPolicy="Local", healthCheckNodePort=hc,
             status={"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}]}})
    api.create(lb)
    api.create(eps("lbl", [PODS["be1"], PODS["be2"]], HTTP_EP, node="node1"))
    url = f"http://127.0.0.1:{hc}/"
    wait_for(lambda: _quiet_get(url)[0] == 200, what="health check 200")
    status, body = get(url)
    assert '"localEndpoints": 2' in body and '"name": "lbl"' in body
    api.update(eps("lbl", [PODS["be1"]], HTTP_EP, node="node2"))  # no local endpoint left
    wait_for(lambda: _quiet_get(url)[0] == 503, what="health check 503")
    assert '"localEndpoints": 0' in get(url)[1]
    api.delete("Service", "default", "lbl")
    wait_for(lambda: _quiet_get(url)[0] == 0, what="health check port closed")


def _quiet_get(url):
    try:
        return get(url)
    except OSError:
        return 0, ""
