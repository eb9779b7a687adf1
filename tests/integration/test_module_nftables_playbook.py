"""k8s_service_nftables through ansible-playbook against the lab's node namespace: present,
absent, idempotence, check mode, diff, other services left alone, and real traffic through
the service IP after the module ran."""
from __future__ import annotations

import subprocess

import pytest
from playbook import DB, PODS, WEB, backends, module_node, run_tasks

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.service import parse_table, view

MODULE = "kubenode.proxy.k8s_service_nftables"


@pytest.fixture
def node(lab, tmp_path):
    return module_node(lab, tmp_path)


def play(lab, tasks, *flags):
    return run_tasks(lab.wrapper, lab.tmp, [{MODULE: args} for args in tasks], *flags)


def table(lab) -> str:
    proc = subprocess.run(["ip", "netns", "exec", lab.ns("node"), "nft", "list", "table", "ip", "kube-proxy"],
                          capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def test_check_mode_changes_nothing_and_reports_the_change(node):
    (r,) = play(node, [WEB], "--check", "--diff")
    assert r["changed"] and "service-ips" in r["nft_input"] and r["diff"]["before"] == ""
    assert '10.96.0.10 . tcp . 80 comment "shop/web" : goto service-' in r["diff"]["after"]
    assert table(node) == ""
    assert node.request("client", "10.96.0.10", 80, timeout=1).outcome != "ok"


def test_present_idempotent_absent_with_traffic(node):
    (r,) = play(node, [WEB], "--diff")
    assert r["changed"] and any(c.startswith("service-") for c in r["chains"]), r
    assert len([c for c in r["chains"] if c.startswith("endpoint-")]) == 2
    assert r["elements"] == {"cluster-ips": 1, "service-ips": 1}
    assert backends(node, "10.96.0.10", 80) == {"be1", "be2"}

    (r,) = play(node, [WEB], "--diff")
    assert not r["changed"] and r["nft_input"] == "", r["changes"]
    assert r["diff"]["before"] == r["diff"]["after"]

    # Check mode of a change: reported, checked by nft -c, not applied.
    one = {**WEB, "endpoints": [dict(address=PODS["be1"])]}
    (r,) = play(node, [one], "--check", "--diff")
    assert r["changed"] and backends(node, "10.96.0.10", 80) == {"be1", "be2"}

    (r,) = play(node, [one], "--diff")
    assert r["changed"]
    gone = set(r["diff"]["before"].splitlines()) - set(r["diff"]["after"].splitlines())
    assert any("10.244.1.2" in line for line in gone), gone
    assert backends(node, "10.96.0.10", 80) == {"be1"}

    (r,) = play(node, [dict(name="web", namespace="shop", state="absent")], "--diff")
    assert r["changed"] and r["chains"] == [] and r["elements"] == {}
    assert "shop/web" not in table(node) and "canary" in table(node)
    (r,) = play(node, [dict(name="web", namespace="shop", state="absent")])
    assert not r["changed"]
    assert node.request("client", "10.96.0.10", 80, timeout=1).outcome != "ok"


def test_other_services_are_left_alone(node):
    play(node, [WEB, DB])
    db = view(parse_table(table(node)), "shop", "db")
    assert db.chains and db.elements and backends(node, "10.96.0.11", 5432, count=3) == {"be2"}
    (r,) = play(node, [dict(name="web", namespace="shop", state="absent")])
    assert r["changed"]
    assert view(parse_table(table(node)), "shop", "db") == db
    assert backends(node, "10.96.0.11", 5432, count=3) == {"be2"}
    assert node.request("client", "10.96.0.10", 80, timeout=1).outcome != "ok"


def test_session_affinity_nodeport_and_no_endpoints(node):
    svc = {**WEB, "type": "NodePort", "session_affinity": "ClientIP", "session_affinity_timeout": 600,
           "ports": [dict(name="http", port=80, target_port=8080, node_port=30080)]}
    (r,) = play(node, [svc])
    assert r["changed"] and len(r["sets"]) == 2 and r["elements"]["service-nodeports"] == 1
    assert len(backends(node, "10.96.0.10", 80)) == 1  # sticky
    (r,) = play(node, [svc])
    assert not r["changed"], r["changes"]  # runtime affinity entries are not a difference
    # A new timeout re-creates the sets (and rewrites the chains that use them).
    (r,) = play(node, [{**svc, "session_affinity_timeout": 60}])
    assert r["changed"] and any(c.startswith("~set affinity-") for c in r["changes"])
    assert len(backends(node, "10.96.0.10", 80)) == 1
    # No endpoints: rejected (no-endpoint-services), not dropped or timed out.
    (r,) = play(node, [{**WEB, "endpoints": []}])
    assert r["changed"] and r["elements"].get("no-endpoint-services") == 1 and r["chains"] == []
    assert node.request("client", "10.96.0.10", 80, timeout=2).outcome == "refused"


def test_a_key_held_by_another_service_fails_naming_it(node):
    play(node, [DB])
    twin = {**WEB, "cluster_ip": "10.96.0.11", "ports": [dict(name="pg", port=5432, target_port=8080)]}
    before = table(node)
    proc_results = None
    try:
        proc_results = play(node, [twin])
    except AssertionError as e:  # ansible-playbook failed: the message names the holder
        assert "is held by shop/db" in str(e)
    assert proc_results is None
    assert table(node) == before
