"""The fleet roll-out of playbooks/site.yml on three "nodes" (network namespaces), one of
which fails: batches follow the play's ``serial``, each node is gated on the role's own
health check (roles/kube_proxy/tasks/health.yml: /healthz 200 *and* a completed sync), and
a failed node ends the roll-out before the next batch while the nodes already done keep
serving.

What is real: site.yml's play keywords (hosts, serial, max_fail_percentage, read from the
file), the role's health tasks, the daemon (bin/kubenode-proxy in each node's namespace,
rules in the namespace's kernel tables), Ansible's batching. What stands in for the rest of
the role: one task that starts the daemon in the node's namespace (the role installs it
under systemd, which namespaces do not have; the role itself runs on VMs in molecule/).

The failing node's daemon points at an API server that does not answer: its /healthz is
200 (no sync is pending yet, as upstream's) but it never completes a sync, which is exactly
what a /healthz-only gate would let through.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml
from lab import Lab
from proxyctl import BIN, ROOT, eps, kube_chains, svc, tcp, write_manifests

SITE = ROOT / "playbooks" / "site.yml"
NODES = ("node-a", "node-b", "node-c")
LAUNCHER = """#!/bin/sh
# start-node NETNS PIDFILE LOG ARGS...: the daemon in NETNS, detached from Ansible's task.
ns=$1 pidfile=$2 log=$3; shift 3
setsid "$@" --netns "$ns" </dev/null >"$log" 2>&1 &
echo $! >"$pidfile"
"""
DEAD_API = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:%d"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rollout_play() -> dict:
    """site.yml's play with the role replaced by: start the daemon here, then the role's
    health gate (the role's last step)."""
    (play,) = yaml.safe_load(SITE.read_text())
    assert play["roles"] == [{"role": "kubenode.proxy.kube_proxy"}], "site.yml changed shape: update this test"
    keep = {k: play[k] for k in ("name", "hosts", "serial", "max_fail_percentage")}
    return {**keep, "gather_facts": False, "tasks": [
        {"name": "Start this node's daemon (stands in for the role's install and systemd start)",
         "ansible.builtin.command": {"argv": "{{ ['sh', launcher, node_netns, node_pidfile, node_log, python, bin]"
                                             " + node_args + ['--healthz-bind-address',"
                                             " kube_proxy_healthz_bind_address, '--metrics-bind-address',"
                                             " kube_proxy_metrics_bind_address] }}"},
         "changed_when": True},
        {"name": "The role's health gate",
         "ansible.builtin.import_role": {"name": "kubenode.proxy.kube_proxy", "tasks_from": "health.yml"}},
        {"name": "Record that this node passed the gate",
         "ansible.builtin.copy": {"content": "ok\n", "dest": "{{ node_passed }}", "mode": "0600"}},
    ]}


class Fleet:
    def __init__(self, stack: ExitStack, tmp: Path) -> None:
        self.tmp = tmp
        self.labs = {name: stack.enter_context(Lab()) for name in NODES}
        stack.callback(self.stop)
        self.launcher = tmp / "start-node"
        self.launcher.write_text(LAUNCHER)
        manifests = tmp / "manifests"
        write_manifests(manifests, [svc("web", "10.96.0.10", [tcp(80)]), eps("web", ["10.244.1.1"], [tcp(8080)])])
        (tmp / "dead-api.kubeconfig").write_text(DEAD_API % free_port())
        self.hostvars = {}
        for name in NODES:
            args = ["--hostname-override", "node1", "--cluster-cidr", "10.244.0.0/16"]
            args += ["--manifests", str(manifests)]
            self.hostvars[name] = {
                "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                "node_netns": self.labs[name].ns("node"), "node_args": args,
                "node_pidfile": str(tmp / f"{name}.pid"), "node_log": str(tmp / f"{name}.log"),
                "node_passed": str(tmp / f"{name}.passed"),
                "kube_proxy_healthz_bind_address": f"127.0.0.1:{free_port()}",
                "kube_proxy_metrics_bind_address": f"127.0.0.1:{free_port()}",
                "kube_proxy_healthz_timeout": 12}

    def break_node(self, name: str) -> None:
        """This node gets a configuration whose API server never answers."""
        self.hostvars[name]["node_args"] = ["--hostname-override", "node1", "--cluster-cidr", "10.244.0.0/16",
                                            "--kubeconfig", str(self.tmp / "dead-api.kubeconfig")]

    def run(self, *extra: str) -> subprocess.CompletedProcess:
        inventory = {"all": {"children": {"kube_proxy_nodes": {"hosts": self.hostvars}},
                             "vars": {"launcher": str(self.launcher), "python": sys.executable, "bin": str(BIN)}}}
        (self.tmp / "hosts.yml").write_text(yaml.safe_dump(inventory))
        (self.tmp / "rollout.yml").write_text(yaml.safe_dump([rollout_play()], sort_keys=False))
        env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_FORKS": "10",
               "ANSIBLE_COLLECTIONS_PATH": os.environ["KUBENODE_COLLECTIONS_PATH"] + ":/usr/share/ansible/collections"}
        return subprocess.run(["ansible-playbook", "-i", str(self.tmp / "hosts.yml"), str(self.tmp / "rollout.yml"),
                               *extra], capture_output=True, text=True, env=env, timeout=300, check=False)

    def pid(self, name: str):
        path = Path(self.hostvars[name]["node_pidfile"])
        return int(path.read_text()) if path.exists() else None

    def started(self, name: str) -> bool:
        return self.pid(name) is not None

    def passed(self, name: str) -> bool:
        return Path(self.hostvars[name]["node_passed"]).exists()

    def alive(self, name: str) -> bool:
        pid = self.pid(name)
        return pid is not None and Path(f"/proc/{pid}").exists()

    def healthz(self, name: str) -> int:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.hostvars[name]['kube_proxy_healthz_bind_address']}/healthz",
                                        timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as e:
            return e.code

    def stop(self) -> None:
        for name in NODES:
            if self.alive(name):
                os.kill(self.pid(name), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(self.alive(n) for n in NODES) and time.monotonic() < deadline:
            time.sleep(0.1)
        for name in NODES:
            if self.alive(name):
                os.kill(self.pid(name), signal.SIGKILL)


@pytest.fixture
def fleet(tmp_path):
    with ExitStack() as stack:
        yield Fleet(stack, tmp_path)


def recap(out: str) -> dict:
    """PLAY RECAP lines: {host: {'ok': n, 'failed': n, ...}}."""
    hosts = {}
    for line in out.split("PLAY RECAP", 1)[-1].splitlines():
        if " : " in line:
            host, counts = line.split(" : ", 1)
            hosts[host.strip()] = {k: int(v) for k, v in (c.split("=") for c in counts.split())}
    return hosts


def test_a_failing_node_stops_the_rollout_and_the_done_nodes_keep_serving(fleet):
    fleet.break_node("node-b")
    started = time.monotonic()
    proc = fleet.run()  # site.yml's defaults: one node, then 10%, then 25% (of 3: one at a time)
    seconds = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]

    # node-a: first batch, gated and passed, still serving: healthz 200, its rules in its kernel.
    assert fleet.passed("node-a") and fleet.alive("node-a"), out[-4000:]
    assert fleet.healthz("node-a") == 200
    assert any(c.startswith("KUBE-SVC-") for c in kube_chains(fleet.hostvars["node-a"]["node_netns"]))

    # node-b: started, /healthz was 200, but it never synced: the gate failed it.
    assert fleet.started("node-b") and not fleet.passed("node-b")
    assert fleet.healthz("node-b") == 200
    assert "Wait until the daemon has completed a sync" in out.split("fatal: [node-b]")[0].rsplit("TASK [", 1)[-1]
    assert not any(c.startswith("KUBE-SVC-") for c in kube_chains(fleet.hostvars["node-b"]["node_netns"]))

    # node-c: its batch never started.
    assert not fleet.started("node-c") and not fleet.passed("node-c")
    assert kube_chains(fleet.hostvars["node-c"]["node_netns"]) == []
    hosts = recap(out)
    assert hosts["node-a"]["failed"] == 0 and hosts["node-b"]["failed"] == 1, hosts
    assert "node-c" not in hosts, hosts
    assert seconds < 120, seconds


def test_a_healthy_fleet_rolls_out_in_the_batches_given(fleet):
    proc = fleet.run("-e", json.dumps({"kube_proxy_rollout_serial": [1, 2]}))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert all(fleet.passed(n) and fleet.healthz(n) == 200 for n in NODES)
    for name in NODES:
        assert any(c.startswith("KUBE-SVC-") for c in kube_chains(fleet.hostvars[name]["node_netns"]))
    # Two batches: node-a alone, then node-b and node-c together (one gate task per batch).
    batches = out.split("PLAY [")[1:]
    assert len(batches) == 2, out[-4000:]
    assert "node-a" in batches[0] and "node-b" not in batches[0]
    assert "node-b" in batches[1] and "node-c" in batches[1] and "ok: [node-a]" not in batches[1]
