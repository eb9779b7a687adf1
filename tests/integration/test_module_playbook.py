"""k8s_service_iptables through ansible-playbook against the lab's node namespace:
present, absent, idempotence, check mode, diff, and real traffic."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import yaml
from proxyctl import save

COLLECTIONS = os.environ["KUBENODE_COLLECTIONS_PATH"]  # set by tests/conftest.py
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}


@pytest.fixture
def node(lab, tmp_path):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    wrapper = tmp_path / "python-in-node"
    # Ansible runs the module with this interpreter: Python inside the node namespace.
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {lab.ns("node")} {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    lab.wrapper = wrapper
    lab.tmp = tmp_path
    return lab


def play(lab, tasks, *flags):
    """Run tasks (module args list) and return each task's registered result."""
    playbook = [{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"kubenode.proxy.k8s_service_iptables": args, "register": f"r{i}"} for i, args in enumerate(tasks)
    ] + [{"copy": {"content": "{{ [%s] | to_json }}" % ", ".join(f"r{i}" for i in range(len(tasks))),
                   "dest": str(lab.tmp / "results.json")}, "check_mode": False, "diff": False,
          "vars": {"ansible_python_interpreter": sys.executable}}]}]
    path = lab.tmp / "play.yml"
    path.write_text(yaml.safe_dump(playbook))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    proc = subprocess.run(["ansible-playbook", "-i", "localhost,", "-e", "ansible_connection=local",
                           "-e", f"ansible_python_interpreter={lab.wrapper}", str(path), *flags],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((lab.tmp / "results.json").read_text())


WEB = dict(name="web", namespace="shop", cluster_ip="10.96.0.10", cluster_cidr="10.244.0.0/16",
           ports=[dict(name="http", port=80, target_port=8080)],
           endpoints=[dict(address=ip, node_name="node1") for ip in PODS.values()])
DB = dict(name="db", namespace="shop", cluster_ip="10.96.0.11", cluster_cidr="10.244.0.0/16",
          ports=[dict(name="pg", port=5432, target_port=8080)], endpoints=[dict(address=PODS["be2"])])


def backends(lab, ip, port, count=20):
    replies = lab.request_many("client", ip, port, count=count)
    assert all(r.ok for r in replies), Counter(r.outcome for r in replies)
    return set(r.backend for r in replies)


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
