"""kubenode-proxy as a daemon inside the node namespace, following a manifests directory:
traffic follows edits, a malformed object is logged and skipped, SIGTERM leaves rules."""
from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter

import pytest
import yaml
from proxyctl import BIN, eps, save, svc, tcp, wait_for, write_manifests

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}


def backends(lab, ip, count=10):
    replies = lab.request_many("client", ip, 80, count=count, timeout=1.0)
    return Counter(r.backend if r.ok else r.outcome for r in replies)


@pytest.fixture
def daemon(lab, tmp_path):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    manifests = tmp_path / "manifests"
    write_manifests(manifests, [svc("web", "10.96.0.10", HTTP), eps("web", PODS.values(), HTTP_EP)])
    proc = lab.spawn("node", [sys.executable, str(BIN), "--manifests", str(manifests), "--hostname-override", "node1",
                              "--cluster-cidr", "10.244.0.0/16", "--iptables-min-sync-period", "100ms",
                              "--healthz-bind-address", "127.0.0.1:10256",
                              "--metrics-bind-address", "127.0.0.1:10249"], stdout=tmp_path / "daemon.log")
    lab.daemon = proc
    lab.log = tmp_path / "daemon.log"
    lab.manifests = manifests
    yield lab
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_daemon_follows_manifest_edits(daemon):
    lab = daemon
    wait_for(lambda: set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"})
    write_manifests(lab.manifests, [svc("web", "10.96.0.10", HTTP), eps("web", [PODS["be2"]], HTTP_EP),
                                    svc("api", "10.96.0.11", HTTP), eps("api", [PODS["be1"]], HTTP_EP)])
    wait_for(lambda: backends(lab, "10.96.0.10") == Counter({"be2": 10}))
    assert backends(lab, "10.96.0.11", 5) == Counter({"be1": 5})
    write_manifests(lab.manifests, [svc("api", "10.96.0.11", HTTP), eps("api", [PODS["be1"]], HTTP_EP)])
    wait_for(lambda: "10.96.0.10/32" not in save(lab.ns("node"), "nat"))
    assert backends(lab, "10.96.0.11", 5) == Counter({"be1": 5})


def test_malformed_object_is_skipped_and_others_keep_working(daemon):
    lab = daemon
    wait_for(lambda: set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"})
    bad = svc("bad", "10.96.0.12", [{"name": "http", "port": "eighty", "protocol": "TCP"}])
    write_manifests(lab.manifests, [svc("web", "10.96.0.10", HTTP), eps("web", PODS.values(), HTTP_EP), bad,
                                    svc("api", "10.96.0.11", HTTP), eps("api", [PODS["be1"]], HTTP_EP)])
    wait_for(lambda: backends(lab, "10.96.0.11", 3) == Counter({"be1": 3}))
    assert set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"}
    assert "10.96.0.12" not in save(lab.ns("node"), "nat")


def test_unparseable_file_keeps_its_last_good_objects(daemon):
    """A file that stops parsing (here two documents run together: a repeated ``kind``, which
    PyYAML alone would load as one mixed object) is rejected by name and its services keep
    their rules; the fixed file is followed again."""
    lab = daemon
    wait_for(lambda: set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"})
    api = lab.manifests / "api.yaml"
    api.write_text(yaml.safe_dump_all([svc("api", "10.96.0.11", HTTP), eps("api", [PODS["be1"]], HTTP_EP)]))
    wait_for(lambda: backends(lab, "10.96.0.11", 3) == Counter({"be1": 3}))
    good = api.read_text()
    api.write_text(good.replace("---\n", "", 1))  # the separator lost: one mapping, keys repeated
    wait_for(lambda: "found duplicate key" in lab.log.read_text())
    log = lab.log.read_text()
    assert f"rejected {api}: cannot parse:" in log and "keeping its last good version" in log, log
    time.sleep(1.5)  # a manifests poll interval and a sync later the rules are still there
    assert backends(lab, "10.96.0.11", 5) == Counter({"be1": 5})
    assert set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"}
    api.write_text(yaml.safe_dump_all([svc("api", "10.96.0.11", HTTP), eps("api", [PODS["be2"]], HTTP_EP)]))
    wait_for(lambda: backends(lab, "10.96.0.11", 5) == Counter({"be2": 5}))


def test_sigterm_leaves_rules_in_place(daemon):
    lab = daemon
    wait_for(lambda: set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"})
    lab.daemon.send_signal(signal.SIGTERM)
    assert lab.daemon.wait(10) == 0
    assert set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"}
    assert "KUBE-SERVICES" in save(lab.ns("node"), "nat")
    # The record of what was left goes to the lab's --record-dir, never to /run/kubenode-proxy.
    inode = os.stat(f"/run/netns/{lab.ns('node')}").st_ino
    assert [p.name for p in lab.record_dir.iterdir()] == [f"iptables-applied-iptables-netns{inode}.json"]
    assert f" chains written in {lab.record_dir}/" in lab.log.read_text()


def http(lab, url):
    """(status, body) of a GET made inside the node namespace."""
    out = lab.exec("node", ["curl", "-s", "-m", "3", "-w", "\n%{http_code}", url], check=False).stdout
    body, _unused, code = out.rpartition("\n")
    return int(code or 0), body


def metric(text, name):
    """Sum of a metric's samples (all label sets) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_healthz_and_metrics_follow_sync_failures(lab, tmp_path):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    manifests = tmp_path / "m"
    write_manifests(manifests, [svc("web", "10.96.0.10", HTTP), eps("web", PODS.values(), HTTP_EP)])
    proc = lab.spawn("node", [sys.executable, str(BIN), "--manifests", str(manifests), "--hostname-override", "node1",
                              "--cluster-cidr", "10.244.0.0/16", "--iptables-min-sync-period", "100ms",
                              "--iptables-sync-period", "1s"])
    try:
        # /healthz answers 200 before the first sync too (nothing is late yet, as upstream):
        # wait for the first sync in the metrics, then read both.
        wait_for(lambda: metric(http(lab, "http://127.0.0.1:10249/metrics")[1],
                                "kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1)
        code, body = http(lab, "http://127.0.0.1:10256/healthz")
        assert code == 200 and '"nodeEligible":true' in body and '"lastUpdated"' in body
        assert http(lab, "http://127.0.0.1:10256/livez")[0] == 200
        text = http(lab, "http://127.0.0.1:10249/metrics")[1]
        assert metric(text, 'kubeproxy_sync_proxy_rules_iptables_total{table="nat"}') > 0
        # Another program jumps to one of our endpoint chains: deleting that chain now fails
        # ("busy") on every attempt, so syncs keep failing until the foreign rule is gone.
        nat = save(lab.ns("node"), "nat")
        sep = next(line.split()[-1] for line in nat.splitlines()
                   if line.startswith("-A KUBE-SVC-") and "10.244.1.2:8080" in line)
        lab.iptables_restore(f"*nat\n-A OUTPUT -d 10.9.9.9/32 -j {sep}\nCOMMIT\n")
        write_manifests(manifests, [svc("web", "10.96.0.10", HTTP), eps("web", [PODS["be1"]], HTTP_EP)])
        wait_for(lambda: http(lab, "http://127.0.0.1:10256/healthz")[0] == 503, timeout=15)
        text = http(lab, "http://127.0.0.1:10249/metrics")[1]
        assert metric(text, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total") >= 1
        # Traffic still uses the last good rules meanwhile.
        assert set(backends(lab, "10.96.0.10", 20)) == {"be1", "be2"}
        lab.exec("node", ["iptables", "-t", "nat", "-D", "OUTPUT", "-d", "10.9.9.9/32", "-j", sep])
        wait_for(lambda: http(lab, "http://127.0.0.1:10256/healthz")[0] == 200, timeout=15)
        wait_for(lambda: backends(lab, "10.96.0.10") == Counter({"be1": 10}))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_stale_udp_flow_is_removed_when_its_endpoint_goes(daemon):
    from test_conntrack_cleanup import send  # one datagram from a fixed source port

    lab = daemon
    dns = [{"name": "dns", "port": 53, "protocol": "UDP"}]
    dns_ep = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
    write_manifests(lab.manifests, [svc("dns", "10.96.0.53", dns), eps("dns", [PODS["be1"]], dns_ep)])
    wait_for(lambda: send(lab, "client", "10.96.0.53", 53, sport=41001, timeout=0.5) == "be1")
    assert send(lab, "client", "10.96.0.53", 53, sport=41053) == "be1"  # the long-lived flow
    write_manifests(lab.manifests, [svc("dns", "10.96.0.53", dns), eps("dns", [PODS["be2"]], dns_ep)])
    wait_for(lambda: send(lab, "client", "10.96.0.53", 53, sport=41002, timeout=0.5) == "be2")
    # The old 5-tuple would stick to be1 (still running) if its conntrack entry had stayed.
    assert send(lab, "client", "10.96.0.53", 53, sport=41053) == "be2"
