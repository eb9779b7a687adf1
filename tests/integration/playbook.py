"""Run Ansible tasks with the module's Python inside a lab namespace (the modules' integration
tests share this). ansible_python_interpreter is a wrapper script (``ip netns exec NS
python``): a plain ``ip netns exec`` interpreter string does not work in ansible-core 2.19."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Sequence

import yaml

COLLECTIONS = os.environ["KUBENODE_COLLECTIONS_PATH"]  # set by tests/conftest.py


def python_in(lab: Any, ns: str, tmp_path: Path) -> Path:
    """An interpreter wrapper that runs Python inside the lab's namespace ``ns``."""
    wrapper = tmp_path / f"python-in-{ns}"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {lab.ns(ns)} {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    return wrapper


def run_tasks(interpreter: Path, tmp_path: Path, tasks: Sequence[Dict[str, Any]], *flags: str) -> List[Dict]:
    """Run ``tasks`` (whole task dicts) on localhost with ``interpreter``; return each task's
    registered result. The results are written out by a last task run on the host."""
    body = [{**task, "register": f"r{i}"} for i, task in enumerate(tasks)]
    results = tmp_path / "results.json"
    body.append({"copy": {"content": "{{ [%s] | to_json }}" % ", ".join(f"r{i}" for i in range(len(tasks))),
                          "dest": str(results)},
                 "check_mode": False, "diff": False, "vars": {"ansible_python_interpreter": sys.executable}})
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": body}]))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    proc = subprocess.run(["ansible-playbook", "-i", "localhost,", "-e", "ansible_connection=local",
                           "-e", f"ansible_python_interpreter={interpreter}", str(path), *flags],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(results.read_text())


# The Service both module playbook tests (iptables and nftables) program, its pods and client.
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}
WEB = dict(name="web", namespace="shop", cluster_ip="10.96.0.10", cluster_cidr="10.244.0.0/16",
           ports=[dict(name="http", port=80, target_port=8080)],
           endpoints=[dict(address=ip, node_name="node1") for ip in PODS.values()])
DB = dict(name="db", namespace="shop", cluster_ip="10.96.0.11", cluster_cidr="10.244.0.0/16",
          ports=[dict(name="pg", port=5432, target_port=8080)], endpoints=[dict(address=PODS["be2"])])


def module_node(lab: Any, tmp_path: Path) -> Any:
    """The lab's node with PODS and a client; Ansible runs the modules inside the node."""
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    lab.wrapper = python_in(lab, "node", tmp_path)
    lab.tmp = tmp_path
    return lab


def backends(lab: Any, ip: str, port: int, count: int = 20) -> set:
    """The backends that answered ``count`` connections to ip:port (every one must answer)."""
    replies = lab.request_many("client", ip, port, count=count)
    assert all(r.ok for r in replies), Counter(r.outcome for r in replies)
    return set(r.backend for r in replies)
