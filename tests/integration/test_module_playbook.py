"""k8s_service_iptables through ansible-playbook against the lab's node namespace:
present, absent, idempotence, check mode, diff, and real traffic."""
from __future__ import annotations

import pytest
from playbook import DB, PODS, WEB, backends, module_node, run_tasks
from proxyctl import save


@pytest.fixture
def node(lab, tmp_path):
    return module_node(lab, tmp_path)


def play(lab, tasks, *flags):
    """Run tasks (module args list) and return each task's registered result."""
    return run_tasks(lab.wrapper, lab.tmp, [{"kubenode.proxy.k8s_service_iptables": args} for args in tasks], *flags)


def test_check_mode_changes_nothing_and_reports_the_change(node):
    before = save(node.ns("node"))
    (r,) = play(node, [WEB], "--check", "--diff")
    assert r["changed"] and "KUBE-SERVICES" in r["restore_input"]
    assert "10.96.0.10/32" in r["diff"]["after"] and "10.96.0.10/32" not in r["diff"]["before"]
    assert "KUBE-" not in save(node.ns("node")) and "KUBE-" not in before


def test_present_idempotent_absent(node):
    (r,) = play(node, [WEB], "--diff")
    assert r["changed"] and any(c.startswith("KUBE-SVC-") for c in r["chains"])
    assert r["rule_counts"]["nat/KUBE-SERVICES"] == 2  # the service rule and the NodePort tail
    assert backends(node, "10.96.0.10", 80) == {"be1", "be2"}

    (r,) = play(node, [WEB], "--diff")
    assert not r["changed"] and r["restore_input"] == ""
    assert r["diff"]["before"] == r["diff"]["after"], (node.tmp / "results.json").read_text()

    # An endpoint change: diff shows exactly the endpoint chain going away.
    (r,) = play(node, [{**WEB, "endpoints": [dict(address=PODS["be1"])]}], "--diff")
    assert r["changed"]
    gone = set(r["diff"]["before"].splitlines()) - set(r["diff"]["after"].splitlines())
    assert any("10.244.1.2" in line for line in gone)
    assert backends(node, "10.96.0.10", 80) == {"be1"}

    (r,) = play(node, [dict(name="web", namespace="shop", state="absent")])
    assert r["changed"] and r["chains"] == []
    (r,) = play(node, [dict(name="web", namespace="shop", state="absent")])
    assert not r["changed"]
    assert "KUBE-SVC-" not in save(node.ns("node"), "nat")


def test_other_services_are_left_alone(node):
    play(node, [WEB, DB])
    db_rules = [line for line in save(node.ns("node"), "nat").splitlines() if "shop/db" in line]
    (r,) = play(node, [dict(name="web", namespace="shop", state="absent")])
    assert r["changed"]
    assert [line for line in save(node.ns("node"), "nat").splitlines() if "shop/db" in line] == db_rules
    assert backends(node, "10.96.0.11", 5432, count=3) == {"be2"}
    assert node.request("client", "10.96.0.10", 80, timeout=1).outcome != "ok"


def test_api_objects_form(node):
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "namespace": "shop"},
               "spec": {"clusterIP": "10.96.0.12", "type": "ClusterIP",
                        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}}
    slices = [{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "api-x", "namespace": "shop", "labels": {"kubernetes.io/service-name": "api"}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": [{"addresses": [PODS["be1"]], "conditions": {"ready": True}}]}]
    (r,) = play(node, [dict(service=service, endpoint_slices=slices, cluster_cidr="10.244.0.0/16")])
    assert r["changed"]
    assert backends(node, "10.96.0.12", 80, count=3) == {"be1"}


def test_localhost_nodeports_set_route_localnet_with_check_mode(node):
    # As kube-proxy: localhost NodePorts (the default) need route_localnet=1; the lab's node
    # starts with 0 and the module sets it, reporting the change (and only reporting it in
    # check mode).
    sysctl = ["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]
    np = {**WEB, "type": "NodePort", "ports": [dict(name="http", port=80, target_port=8080, node_port=30080)]}
    assert node.exec("node", sysctl).stdout.strip() == "0"
    (r,) = play(node, [np], "--check")
    assert r["changed"] and r["sysctls"] == {"net.ipv4.conf.all.route_localnet": "0 -> 1"}
    assert node.exec("node", sysctl).stdout.strip() == "0"
    (r,) = play(node, [np])
    assert r["changed"] and r["sysctls"] == {"net.ipv4.conf.all.route_localnet": "0 -> 1"}
    assert node.exec("node", sysctl).stdout.strip() == "1"
    reply = node.request("node", "127.0.0.1", 30080)
    assert reply.ok and reply.backend in PODS
    (r,) = play(node, [np])
    assert not r["changed"] and r["sysctls"] == {}
    # localhost_nodeports=false leaves the sysctl alone (also when it differs).
    node.exec("node", ["sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=0"])
    (r,) = play(node, [{**np, "localhost_nodeports": False}])
    assert r["sysctls"] == {} and node.exec("node", sysctl).stdout.strip() == "0"
