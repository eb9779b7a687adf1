"""The daemon (sync thread, canary check, periodic sync) on the real kernel with real TCP
traffic: rules flushed or deleted behind its back are repaired, and a held xtables lock
(iptables-legacy, a private lock file) delays changes only until it is released."""
from __future__ import annotations

import fcntl
import os
import time
from collections import Counter

import pytest
from proxyctl import NODE_NAME, eps, poll, save, svc, tcp

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon, Hooks
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import IptablesKernel
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import IptablesProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}
CANARY = "KUBE-PROXY-CANARY"


class Recorder(Hooks):
    def __init__(self):
        self.results = []
        self.errors = []

    def synced(self, result, latencies):
        self.results.append((time.monotonic(), result))

    def sync_failed(self, error):
        self.errors.append((time.monotonic(), error))


def start(lab, sync_period, binary="iptables", diff_max_chains=None, wait_seconds=5):
    """The daemon in this process, programming the lab node: service web -> be1, be2."""
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    kernel = IptablesKernel(netns=lab.ns("node"), binary=binary, wait_seconds=wait_seconds)
    if diff_max_chains is not None:
        kernel.diff_max_chains = diff_max_chains  # the path a node with thousands of services takes
    state = ProxyState(NODE_NAME)
    proxier = IptablesProxier(state, IptablesConfig(local_cidrs=("10.244.0.0/16",), node_ips=(lab.node_ip,)), kernel)
    rec = Recorder()
    logs = []
    daemon = Daemon(proxier, state, 0.1, sync_period, logs.append, rec)
    daemon.on_relist("Service", [svc("web", "10.96.0.10", HTTP)])
    daemon.on_relist("EndpointSlice", [eps("web", PODS.values(), HTTP_EP)])
    daemon.start()
    lab.daemon, lab.rec, lab.logs, lab.kernel = daemon, rec, logs, kernel
    assert poll(lambda: set(backends(lab, 10)) == {"be1", "be2"}, 10)
    assert poll(lambda: rec.results, 5)  # the first sync is over (its canaries written too)
    return daemon


@pytest.fixture
def node(lab):
    yield lab
    daemon = getattr(lab, "daemon", None)
    if daemon is not None:
        daemon.stop()


def backends(lab, count=5, timeout=0.5):
    replies = lab.request_many("client", "10.96.0.10", 80, count=count, timeout=timeout)
    return Counter(r.backend if r.ok else r.outcome for r in replies)


def serving(lab):
    return set(backends(lab)) == {"be1", "be2"}


def canaries(lab, binary="iptables"):
    return {t for t in ("mangle", "nat", "filter")
            if lab.exec("node", [binary, "-w", "5", "-t", t, "-S", CANARY], check=False).returncode == 0}


def test_canaries_are_created_and_cleanup_removes_them(node):
    lab = node
    start(lab, 30)
    assert poll(lambda: canaries(lab) == {"mangle", "nat", "filter"}, 2)  # right after the first sync
    lab.daemon.stop()
    lab.daemon = None
    removed = IptablesProxier(ProxyState(NODE_NAME), IptablesConfig(), lab.kernel).cleanup()
    assert removed > 0 and canaries(lab) == set()
    assert "KUBE-" not in save(lab.ns("node"), "nat") + save(lab.ns("node"), "filter")


@pytest.mark.parametrize("flush", ["services-and-canaries", "whole-nat-table"])
def test_flush_that_deletes_the_canary_is_repaired_at_once(node, flush):
    """syncPeriod 30 s: only the every-second canary check can bring traffic back in time."""
    lab = node
    start(lab, 30)
    time.sleep(0.5)
    if flush == "services-and-canaries":
        lab.exec("node", ["iptables", "-t", "nat", "-F", "KUBE-SERVICES"])
        for table in ("mangle", "nat", "filter"):
            lab.exec("node", ["iptables", "-t", table, "-X", CANARY], check=False)  # main has none
    else:  # a firewall reload
        lab.exec("node", ["iptables", "-t", "nat", "-F"])
        lab.exec("node", ["iptables", "-t", "nat", "-X"])
    broken = time.monotonic()
    assert lab.request("client", "10.96.0.10", 80, timeout=0.3).outcome == "timeout"
    assert poll(lambda: serving(lab), 5), "not repaired within 5 s"
    assert time.monotonic() - broken < 5
    assert poll(lambda: canaries(lab) == {"mangle", "nat", "filter"}, 2)
    assert any("KUBE-PROXY-CANARY missing" in line and "repairing now" in line for line in lab.logs), lab.logs
    assert any(r.repair.startswith("canary KUBE-PROXY-CANARY missing") for _t, r in lab.rec.results)


def test_flushed_kube_services_with_canaries_intact_is_repaired_within_sync_period(node):
    """A large table (thresholds lowered) is not read rule by rule: the periodic sync's
    dispatch check must notice the empty KUBE-SERVICES."""
    lab = node
    start(lab, 2, diff_max_chains=0)
    before = len(lab.rec.results)
    lab.exec("node", ["iptables", "-t", "nat", "-F", "KUBE-SERVICES"])
    broken = time.monotonic()
    assert lab.request("client", "10.96.0.10", 80, timeout=0.3).outcome == "timeout"
    assert poll(lambda: serving(lab), 2 + 2), "not repaired within syncPeriod (+ margin)"
    assert time.monotonic() - broken < 4
    assert canaries(lab) == {"mangle", "nat", "filter"}  # the canary check played no part
    repair = [r for _t, r in lab.rec.results[before:] if r.repair]
    assert repair and repair[0].repair == "nat KUBE-SERVICES is empty"
    # Only the node-wide chains were rewritten: the service's own chains were trusted.
    assert not any("KUBE-SVC-" in c or "KUBE-SEP-" in c for c in repair[0].changes), repair[0].changes


def test_held_xtables_lock_delays_a_change_only_until_release(node, tmp_path, monkeypatch):
    lab = node
    lockfile = tmp_path / "xtables.lock"
    lockfile.touch()
    monkeypatch.setenv("XTABLES_LOCKFILE", str(lockfile))  # never the host's /run/xtables.lock
    start(lab, 30, binary="iptables-legacy", wait_seconds=2)
    with open(lockfile, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        held = time.monotonic()
        lab.daemon.on_event("EndpointSlice", "MODIFIED", eps("web", [PODS["be2"]], HTTP_EP))
        # Long enough for attempts to time out on the lock (2 s each; the canary check waits 1 s).
        time.sleep(5.0)
        assert set(backends(lab)) == {"be1", "be2"}, "a change got through the held lock"
        fcntl.flock(f, fcntl.LOCK_UN)
        released = time.monotonic()
    assert poll(lambda: backends(lab) == Counter({"be2": 5}), 5), "not caught up within 5 s of the release"
    caught = next((t, r) for t, r in lab.rec.results if t >= released)
    assert caught[0] - released < 1.0, f"caught up {caught[0] - released:.2f} s after the release"
    # Nothing was applied by the refused attempts: the catch-up is the partial sync of the change.
    assert not caught[1].full and caught[1].changed == {"default/web"}
    failed = [e for t, e in lab.rec.errors if held <= t < released]
    assert failed and all("xtables lock" in str(e) for e in failed)
    assert os.environ["XTABLES_LOCKFILE"] == str(lockfile)


def test_held_xtables_lock_during_a_large_table_periodic_check_repairs_nothing(node, tmp_path, monkeypatch):
    """On the large-table path the periodic check reads the built-in chains; a read refused
    for the lock is undecided, not a missing chain: no repair runs, the sync is retried soon."""
    lab = node
    lockfile = tmp_path / "xtables.lock"
    lockfile.touch()
    monkeypatch.setenv("XTABLES_LOCKFILE", str(lockfile))
    start(lab, 1, binary="iptables-legacy", diff_max_chains=0, wait_seconds=1)
    before = len(lab.rec.results)
    with open(lockfile, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        held = time.monotonic()
        time.sleep(3.5)  # several periodic checks (syncPeriod 1 s) time out on the lock
        fcntl.flock(f, fcntl.LOCK_UN)
        released = time.monotonic()
    assert poll(lambda: any(t >= released for t, _r in lab.rec.results), 5)
    failed = [e for t, e in lab.rec.errors if held <= t < released]
    assert failed and all("xtables lock" in str(e) for e in failed), failed
    repairs = [r.repair for _t, r in lab.rec.results[before:] if r.repair]
    assert not repairs, f"a held lock was taken for missing rules: {repairs}"
    assert serving(lab)
