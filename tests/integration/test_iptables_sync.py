"""Partial and full syncs of the in-process proxier on the real kernel, with traffic:
partial syncs touch only what changed, a failed apply leaves the previous rules, and
the next (full) sync repairs."""
from __future__ import annotations

import shlex
from collections import Counter

import pytest
from proxyctl import NODE_NAME, eps, save, svc, tcp

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (
    IptablesKernel,
    KernelError,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (
    LISTING_EVERY,
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}


@pytest.fixture
def proxy(lab):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    state = ProxyState(NODE_NAME)
    cfg = IptablesConfig(local_cidrs=("10.244.0.0/16",), node_ips=(lab.node_ip,))
    proxier = IptablesProxier(state, cfg, IptablesKernel(netns=lab.ns("node")))
    return lab, state, proxier


def put(state, *objects):
    for obj in objects:
        if obj["kind"] == "Service":
            state.set_service(parse_service(obj))
        else:
            state.set_slice(parse_endpoint_slice(obj))


def answered(lab, ip, count=20):
    replies = lab.request_many("client", ip, 80, count=count)
    assert all(r.ok for r in replies), Counter(r.outcome for r in replies)
    return Counter(r.backend for r in replies)


def test_partial_sync_rewrites_only_the_changed_service(proxy):
    lab, state, proxier = proxy
    put(state, svc("a", "10.96.0.1", HTTP), eps("a", PODS.values(), HTTP_EP),
        svc("b", "10.96.0.2", HTTP), eps("b", [PODS["be2"]], HTTP_EP))
    assert proxier.sync().full
    assert set(answered(lab, "10.96.0.1")) == {"be1", "be2"}

    put(state, eps("a", [PODS["be1"]], HTTP_EP))
    result = proxier.sync()
    assert not result.full
    # One SVC chain rewritten, one SEP chain deleted; KUBE-SERVICES and service b untouched.
    assert len(result.changes) == 2 and all("default/b" not in c for c in result.changes), result.changes
    assert not any("KUBE-SERVICES" in c for c in result.changes)
    assert answered(lab, "10.96.0.1") == Counter({"be1": 20})
    assert answered(lab, "10.96.0.2", 5) == Counter({"be2": 5})

    # A new service and a deleted one: their KUBE-SERVICES rules are added and removed one by one.
    put(state, svc("c", "10.96.0.3", HTTP), eps("c", [PODS["be2"]], HTTP_EP))
    state.delete_service("default", "b")
    result = proxier.sync()
    assert not result.full
    assert answered(lab, "10.96.0.3", 5) == Counter({"be2": 5})
    assert lab.request("client", "10.96.0.2", 80, timeout=1).outcome == "timeout"
    assert "10.96.0.2/32" not in save(lab.ns("node"), "nat")

    # The in-memory view and the kernel agree: a full sync finds nothing to do.
    assert proxier.sync(force_full=True).rules_written == 0


def test_failed_apply_keeps_previous_rules_and_next_sync_repairs(proxy):
    lab, state, proxier = proxy
    node = lab.ns("node")
    put(state, svc("a", "10.96.0.1", HTTP), eps("a", PODS.values(), HTTP_EP),
        svc("b", "10.96.0.2", HTTP), eps("b", [PODS["be2"]], HTTP_EP))
    proxier.sync()
    # Someone removes a rule behind our back: the next partial sync's "-D" of it fails...
    line = next(r for r in save(node, "nat").splitlines() if "10.96.0.1/32" in r and "-A KUBE-SERVICES" in r)
    lab.exec("node", ["iptables", "-t", "nat", "-D", *shlex.split(line)[1:]])
    before = save(node)
    put(state, svc("a", "10.96.0.1", [tcp(81, "http")]), svc("b", "10.96.0.2", HTTP),
        eps("b", [PODS["be1"]], HTTP_EP))
    with pytest.raises(KernelError, match="previous rules left in place"):
        proxier.sync()
    # ...and nothing of that transaction was applied, not even service b's change.
    strip = [x for x in before.splitlines() if not x.startswith("#")]
    assert [x for x in save(node).splitlines() if not x.startswith("#")] == strip
    assert answered(lab, "10.96.0.2", 5) == Counter({"be2": 5})
    # The retry is a full sync, which reads the kernel and converges.
    result = proxier.sync()
    assert result.full
    assert answered(lab, "10.96.0.2", 5) == Counter({"be1": 5})
    replies = lab.request_many("client", "10.96.0.1", 81, count=10)
    assert {r.backend for r in replies if r.ok} == {"be1", "be2"}


def test_full_sync_restores_a_deleted_service_chain(proxy):
    lab, state, proxier = proxy
    put(state, svc("a", "10.96.0.1", HTTP), eps("a", PODS.values(), HTTP_EP))
    proxier.sync()
    chain = next(c for c in save(lab.ns("node"), "nat").split() if c.startswith(":KUBE-SVC-"))[1:]
    lab.exec("node", ["iptables", "-t", "nat", "-F", chain])
    assert lab.request("client", "10.96.0.1", 80, timeout=1).outcome != "ok"
    result = proxier.sync(force_full=True)
    assert any(chain in c for c in result.changes)
    assert set(answered(lab, "10.96.0.1")) == {"be1", "be2"}


FOREIGN = """*nat
:OTHER-NAT - [0:0]
-A PREROUTING -p tcp -m tcp --dport 2222 -j DNAT --to-destination 192.0.2.10:22
-A OTHER-NAT -s 192.0.2.0/24 -j RETURN
COMMIT
*filter
:OTHER-FILTER - [0:0]
-A INPUT -j OTHER-FILTER
-A OTHER-FILTER -s 198.51.100.7/32 -j DROP
COMMIT
"""


def foreign_lines(text):
    return sorted(line for line in text.splitlines() if "OTHER" in line or "2222" in line)


def test_large_table_path_rewrites_without_reading_rules_and_keeps_foreign_rules(proxy):
    """The path a 10,000-service node takes (thresholds lowered so a few services use it):
    ``-Z`` bulk restores, full syncs that read chain names only and rewrite our chains."""
    lab, state, proxier = proxy
    proxier.kernel.bulk_chains = 1
    proxier.kernel.diff_max_chains = 0
    lab.iptables_restore(FOREIGN)
    before = foreign_lines(save(lab.ns("node"), "nat") + save(lab.ns("node"), "filter"))
    assert len(before) == 6
    put(state, svc("a", "10.96.0.1", HTTP), eps("a", PODS.values(), HTTP_EP),
        svc("b", "10.96.0.2", HTTP), eps("b", [PODS["be2"]], HTTP_EP))
    assert proxier.kernel.snapshot_for_full_sync().complete is False
    first = proxier.sync()
    assert first.full and first.rules_written >= first.rules
    assert set(answered(lab, "10.96.0.1")) == {"be1", "be2"}
    assert set(answered(lab, "10.96.0.2")) == {"be2"}

    # A periodic resync of an intact large table only lists chains: nothing is written.
    quiet = proxier.sync(force_full=True)
    assert not quiet.full and quiet.rules_written == 0
    # A stray chain of ours changes the chain listing, which one periodic check in
    # LISTING_EVERY reads (the others read the built-in and shared chains only): that one
    # rewrites.
    svc_a = next(line.split()[0][1:] for line in save(lab.ns("node"), "nat").splitlines()
                 if line.startswith(":KUBE-SEP-"))
    lab.exec("node", ["iptables", "-t", "nat", "-N", "KUBE-SEP-STRAYSTRAYSTRAY"])
    checks = [proxier.sync(force_full=True) for _check in range(LISTING_EVERY)]
    assert [c.full for c in checks].count(True) == 1
    assert "KUBE-SEP-STRAYSTRAYSTRAY" not in save(lab.ns("node"), "nat")
    assert f":{svc_a} " in save(lab.ns("node"), "nat")

    # Drift inside a chain is invisible to the listing: the hourly rewrite repairs it.
    proxier.rewrite_period = 0
    sep = next(line.split()[1] for line in save(lab.ns("node"), "nat").splitlines() if line.startswith("-A KUBE-SEP-"))
    lab.exec("node", ["iptables", "-t", "nat", "-F", sep])
    state.delete_service("default", "b")
    state.take_changes()  # forget it: only the full sync's chain listing can find b's chains
    proxier.compiled.pop("default/b", None)
    again = proxier.sync(force_full=True)
    assert again.full
    nat = save(lab.ns("node"), "nat")
    assert f"-A {sep} " in nat, "the full sync did not repair the flushed chain"
    # b's chains were stale: found through the chain listing and deleted.
    assert "10.96.0.2/32" not in nat
    assert len([line for line in nat.splitlines() if line.startswith(":KUBE-SVC-")]) == 1
    assert set(answered(lab, "10.96.0.1")) == {"be1", "be2"}
    assert foreign_lines(save(lab.ns("node"), "nat") + save(lab.ns("node"), "filter")) == before


def test_restart_of_a_large_table_adopts_the_record_and_writes_only_the_change(proxy, tmp_path):
    """A clean shutdown records what it left; the next process (thresholds lowered so a few
    services take the large-table path) checks the kernel cheaply, writes only the change
    made while it was down, and the result is exactly what a rule-by-rule diff wants."""
    lab, state, proxier = proxy
    proxier.kernel.bulk_chains = 1
    proxier.kernel.diff_max_chains = 0
    put(state, svc("a", "10.96.0.1", HTTP), eps("a", PODS.values(), HTTP_EP),
        svc("b", "10.96.0.2", HTTP), eps("b", [PODS["be2"]], HTTP_EP))
    assert proxier.sync().full
    path = str(tmp_path / "applied.json")
    assert proxier.save_record(path).startswith("recorded the ")
    assert "kubenode-proxy-applied:" in save(lab.ns("node"), "nat")  # the token, in nat's canary chain

    def restarted(*changes):
        """A new process's state and proxier, with ``changes`` made while the daemon was down."""
        new_state = ProxyState(NODE_NAME)
        put(new_state, svc("a", "10.96.0.1", HTTP), eps("a", PODS.values(), HTTP_EP),
            svc("b", "10.96.0.2", HTTP), eps("b", [PODS["be2"]], HTTP_EP), *changes)
        kernel = IptablesKernel(netns=lab.ns("node"), bulk_chains=1, diff_max_chains=0)
        new = IptablesProxier(new_state, proxier.cfg, kernel)
        assert new.load_record(path).startswith("found the record")
        return new_state, new

    new_state, new = restarted(eps("b", [PODS["be1"]], HTTP_EP))
    first = new.sync()
    assert first.restart.startswith("adopted"), first.restart
    assert first.rules_written <= 4, first.changes  # b's service chain and its one endpoint chain
    assert set(answered(lab, "10.96.0.2")) == {"be1"}
    assert set(answered(lab, "10.96.0.1")) == {"be1", "be2"}
    assert "kubenode-proxy-applied:" not in save(lab.ns("node"), "nat")
    # A process that reads every rule (small-table path) finds nothing left to write.
    check = IptablesProxier(new_state, proxier.cfg, IptablesKernel(netns=lab.ns("node")))
    assert check.sync().rules_written == 0

    # Recorded again; then a service chain is flushed while down (the first endpoint chain
    # in name order: one the restart samples): the token survives, the sampled first rule
    # does not match, and the restart rewrites everything.
    assert new.save_record(path).startswith("recorded the ")
    sep = min(line.split()[1] for line in save(lab.ns("node"), "nat").splitlines() if line.startswith("-A KUBE-SEP-"))
    lab.exec("node", ["iptables", "-t", "nat", "-F", sep])
    _state, again = restarted(eps("b", [PODS["be1"]], HTTP_EP))
    second = again.sync()
    assert "not used" in second.restart and second.rules_written >= second.rules, second.restart
    assert f"-A {sep} " in save(lab.ns("node"), "nat")
    assert set(answered(lab, "10.96.0.1")) == {"be1", "be2"}
