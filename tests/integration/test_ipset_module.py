"""ipset_entry through ansible-playbook against the lab's node namespace (the module runs
with a Python wrapped in `ip netns exec`): present, idempotence, check mode, diff,
exclusive swap under a live iptables rule with real traffic, absent."""
from __future__ import annotations

from collections import Counter

import pytest
from playbook import python_in, run_tasks

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import parse_save

MODULE = "kubenode.proxy.ipset_entry"
BACKEND = "10.244.1.1"


@pytest.fixture
def node(lab, tmp_path):
    lab.add_pod("be1", BACKEND)
    lab.add_client("client", "10.244.2.10")
    lab.wrapper = python_in(lab, "node", tmp_path)
    lab.tmp = tmp_path
    return lab


def play(lab, tasks, *flags):
    """Run module tasks (args dicts; a "_task" key holds extra task keywords) and return
    each task's registered result."""
    body = []
    for args in tasks:
        args = dict(args)
        extra = args.pop("_task", {})
        body.append({MODULE: args, **extra})
    return run_tasks(lab.wrapper, lab.tmp, body, *flags)


def kernel_sets(lab):
    return parse_save(lab.exec("node", ["ipset", "save"]).stdout)


SVC = dict(name="KN-SVC", type="hash:ip,port", comment="web",
           entries=["10.96.0.10,80", "10.96.0.10,UDP:53", "10.96.0.11,tcp:443"])


def test_check_mode_present_idempotent_and_diff(node):
    (r,) = play(node, [SVC], "--check", "--diff")
    assert r["changed"] and r["action"] == "create"
    assert r["added"] == ["10.96.0.10,udp:53", "10.96.0.10,tcp:80", "10.96.0.11,tcp:443"]
    assert r["diff"]["before"] == "" and 'add KN-SVC 10.96.0.10,tcp:80 comment "web"' in r["diff"]["after"]
    assert "KN-SVC" not in kernel_sets(node)  # check mode wrote nothing

    r1, r2 = play(node, [SVC, SVC], "--diff")
    assert r1["changed"] and r1["entries"] == r["added"]
    s = kernel_sets(node)["KN-SVC"]
    assert s.comment and {e: o.get("comment") for e, o in s.entries.items()} == {e: "web" for e in r["added"]}
    assert not r2["changed"] and r2["action"] == "none" and r2["restore_input"] == ""
    assert r2["diff"]["before"] == r2["diff"]["after"] == r1["diff"]["after"]

    # one more entry, not exclusive: only that one is added; check mode first
    more = {**SVC, "entries": ["10.96.0.12,tcp:8443"]}
    (r,) = play(node, [more], "--check", "--diff")
    assert r["changed"] and r["added"] == ["10.96.0.12,tcp:8443"] and r["removed"] == []
    assert "10.96.0.12,tcp:8443" not in kernel_sets(node)["KN-SVC"].entries
    gone = set(r["diff"]["after"].splitlines()) - set(r["diff"]["before"].splitlines())
    assert gone == {'add KN-SVC 10.96.0.12,tcp:8443 comment "web"'}
    (r,) = play(node, [more])
    assert r["changed"] and len(kernel_sets(node)["KN-SVC"].entries) == 4

    # a timeout the set does not support: rebuilt (swap), entries kept
    (r,) = play(node, [{**more, "timeout": 0}])
    assert r["changed"] and r["action"] == "swap"
    s = kernel_sets(node)["KN-SVC"]
    assert s.timeout == 0 and len(s.entries) == 4 and "KN-SVC-tmp" not in kernel_sets(node)
    (r,) = play(node, [{**more, "timeout": 0}])
    assert not r["changed"]


def test_bitmap_port_and_bad_input(node):
    ports = dict(name="KN-NODE-PORT-TCP", type="bitmap:port", range="30000-32767", entries=["30080", "30443"])
    r1, r2, r3, r4 = play(node, [
        ports, ports,
        {**ports, "entries": ["80"], "_task": {"ignore_errors": True}},
        {"name": "KN-X", "type": "hash:ip,port", "entries": ["10.0.0.1,tcp:99999"], "_task": {"ignore_errors": True}},
    ])
    assert r1["changed"] and r1["entries"] == ["30080", "30443"] and not r2["changed"]
    assert r3["failed"] and "out of the set's range 30000-32767" in r3["msg"] and r3["entry"] == "80"
    assert r4["failed"] and "bad entry '10.0.0.1,tcp:99999'" in r4["msg"]
    sets = kernel_sets(node)
    assert sets["KN-NODE-PORT-TCP"].range == "30000-32767" and "KN-X" not in sets


def test_exclusive_swap_under_a_live_rule_then_absent(node):
    blocked = dict(name="KN-BLOCK", type="hash:ip,port", entries=[f"{BACKEND},tcp:8080"])
    (r,) = play(node, [blocked])
    assert r["changed"]
    node.iptables_restore("*filter\n-A FORWARD -m set --match-set KN-BLOCK dst,dst -j REJECT\nCOMMIT\n")

    def probe():
        return Counter(r.backend if r.ok else r.outcome
                       for r in node.request_many("client", BACKEND, 8080, count=3, timeout=1, concurrency=3))

    assert probe() == {"refused": 3}

    exclusive = {**blocked, "entries": [f"{BACKEND},tcp:9090", "10.96.0.1,tcp:443"], "exclusive": True}
    (r,) = play(node, [exclusive], "--check", "--diff")
    assert r["changed"] and r["action"] == "swap" and probe() == {"refused": 3}  # check mode: still blocked
    r1, r2 = play(node, [exclusive, exclusive], "--diff")
    assert r1["action"] == "swap" and r1["removed"] == [f"{BACKEND},tcp:8080"]
    assert sorted(r1["added"]) == sorted([f"{BACKEND},tcp:9090", "10.96.0.1,tcp:443"])
    assert "swap KN-BLOCK-tmp KN-BLOCK" in r1["restore_input"]
    assert r1["diff"]["after"].splitlines()[1:] == [
        "add KN-BLOCK 10.96.0.1,tcp:443", f"add KN-BLOCK {BACKEND},tcp:9090"]
    assert not r2["changed"]
    assert probe() == {"be1": 3}  # the live rule now sees the swapped-in set
    assert "References: 1" in node.exec("node", ["ipset", "list", "KN-BLOCK", "-t"]).stdout

    # absent entries, absent set (refused while the rule uses it), then really gone
    r1, r2, r3 = play(node, [
        {"name": "KN-BLOCK", "state": "absent", "entries": ["10.96.0.1,443", "10.9.9.9,tcp:1"]},
        {"name": "KN-BLOCK", "state": "absent", "entries": ["10.96.0.1,443"]},
        {"name": "KN-BLOCK", "state": "absent", "_task": {"ignore_errors": True}},
    ])
    assert r1["changed"] and r1["removed"] == ["10.96.0.1,tcp:443"] and r1["entries"] == [f"{BACKEND},tcp:9090"]
    assert not r2["changed"]
    assert r3["failed"] and "in use by a kernel component" in r3["msg"] and "--match-set KN-BLOCK" in r3["msg"]
    node.iptables_restore("*filter\n-F FORWARD\nCOMMIT\n")
    r1, r2 = play(node, [{"name": "KN-BLOCK", "state": "absent"}] * 2, "--diff")
    assert r1["changed"] and r1["action"] == "destroy" and r1["diff"]["after"] == ""
    assert r1["removed"] == [f"{BACKEND},tcp:9090"]
    assert not r2["changed"] and "KN-BLOCK" not in kernel_sets(node)
