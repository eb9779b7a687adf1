"""playbooks/migrate_from_daemonset.yml against an API server: kubernetes.core's k8s and
k8s_info (the real modules, the real kubernetes client) talk to tests/integration/
fake_apiserver.py, extended here with what the playbook needs and the fake does not serve:
DaemonSets and Pods, PATCH (JSON merge patch; the playbook's strategic-merge patches replace
maps and lists the same way), a ``spec.nodeName`` field selector, and a stand-in for the
DaemonSet controller (a kube-proxy pod, Ready, on every node the DaemonSet's node affinity
admits; none elsewhere).

What stands in for the node side: the playbook's role includes, the service stop and the
--cleanup command are replaced by tasks that record what would run on the node, with the
variables the playbook gives them. The role itself runs on VMs (molecule/); its health gate
in tests/integration/test_rollout.py.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import fake_apiserver
import pytest
import yaml
from fake_apiserver import FakeApiServer, ResourceType, status_object

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "migrate_from_daemonset.yml"
LABEL = "kubenode.proxy/managed"
NODES = ("node1", "node2")
STAND_INS = {  # the playbook's node-side actions -> what the stand-in records
    "ansible.builtin.include_role": "role state={{ kube_proxy_state | default('present') }}"
                                    " service={{ kube_proxy_service_state | default('started') }}"
                                    " cleanup={{ kube_proxy_cleanup_on_absent | default(true) }}",
    "ansible.builtin.systemd_service": "stop",
    "ansible.builtin.command": "cleanup {{ item }}",
}


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class ClusterApi(FakeApiServer):
    """The fake API server with PATCH and a DaemonSet controller stand-in."""

    def _handle(self, h):
        if h.command != "PATCH":
            super()._handle(h)
            return
        path = h.path.split("?", 1)[0].rstrip("/")
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length", 0))) or b"null")
        rt, namespace, name = self._route(path)
        kind = h.headers.get("Content-Type", "")
        self.patches.append((rt.kind if rt else "", name, kind, body))
        if rt is None or name is None or not isinstance(body, dict) or "json-patch" in kind:
            h.send_json(415 if "json-patch" in kind else 404, status_object(404, f"cannot PATCH {path}"))
            return
        current = self.get(rt.kind, namespace, name)
        if current is None:
            h.send_json(404, status_object(404, f'{rt.plural} "{name}" not found'))
            return
        patched = merge_patch(current, body)
        patched["metadata"].pop("resourceVersion", None)
        stored = self.update(patched)
        self.reconcile()
        h.send_json(200, stored)

    def reconcile(self):
        """The DaemonSet controller, instantly: a Ready kube-proxy pod on every admitted node."""
        ds = self.get("DaemonSet", "kube-system", "kube-proxy")
        terms = (ds["spec"]["template"]["spec"].get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
        absent_keys = [e["key"] for t in terms for e in t.get("matchExpressions", [])
                       if e["operator"] == "DoesNotExist"]
        for node in self.objects("Node"):
            name = node["metadata"]["name"]
            admitted = not any(k in node["metadata"].get("labels", {}) for k in absent_keys)
            pod = self.get("Pod", "kube-system", f"kube-proxy-{name}")
            if admitted and pod is None:
                self.create({"apiVersion": "v1", "kind": "Pod",
                             "metadata": {"name": f"kube-proxy-{name}", "namespace": "kube-system",
                                          "labels": {"k8s-app": "kube-proxy"}},
                             "spec": {"nodeName": name},
                             "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
            elif not admitted and pod is not None:
                self.delete("Pod", "kube-system", f"kube-proxy-{name}")


@pytest.fixture
def api(monkeypatch, tmp_path):
    monkeypatch.setattr(fake_apiserver, "RESOURCES", fake_apiserver.RESOURCES + (
        ResourceType("DaemonSet", "daemonsets", "apps/v1", True),
        ResourceType("Pod", "pods", "v1", True, ("metadata.name", "metadata.namespace", "spec.nodeName"))))
    field_value = fake_apiserver._field_value
    monkeypatch.setattr(fake_apiserver, "_field_value", lambda obj, name: (
        str(obj.get("spec", {}).get("nodeName", "")) if name == "spec.nodeName" else field_value(obj, name)))
    with ClusterApi(bookmark_interval=None) as server:
        server.patches = []
        for name in NODES:
            server.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {}}})
        # kubeadm's DaemonSet, as far as the playbook looks: no affinity of its own.
        server.create({"apiVersion": "apps/v1", "kind": "DaemonSet",
                       "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
                       "spec": {"selector": {"matchLabels": {"k8s-app": "kube-proxy"}},
                                "template": {"metadata": {"labels": {"k8s-app": "kube-proxy"}},
                                             "spec": {"nodeSelector": {"kubernetes.io/os": "linux"},
                                                      "containers": [{"name": "kube-proxy",
                                                                      "image": "registry.k8s.io/kube-proxy"}]}}}})
        server.reconcile()
        server.kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        yield server


def stand_in(tasks, record):
    out = []
    for task in tasks:
        task = dict(task)
        if "block" in task:
            task["block"] = stand_in(task["block"], record)
        for action, what in STAND_INS.items():
            if action in task:
                del task[action]
                task.pop("register", None)
                task.pop("changed_when", None)
                task.pop("failed_when", None)
                task["ansible.builtin.lineinfile"] = {"path": record, "line": what, "create": True, "mode": "0600",
                                                      "insertafter": "EOF"}
        out.append(task)
    return out


def run(api, tmp_path, *extra):
    plays = yaml.safe_load(PLAYBOOK.read_text())
    record = str(tmp_path / "{{ inventory_hostname }}.record")
    plays[1]["tasks"] = stand_in(plays[1]["tasks"], record)
    (tmp_path / "migrate.yml").write_text(yaml.safe_dump(plays, sort_keys=False))
    hosts = {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable} for name in NODES}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {
        "hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}},
        "children": {"kube_proxy_nodes": {"hosts": hosts}}}}))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "0",
           "ANSIBLE_COLLECTIONS_PATH": os.environ["KUBENODE_COLLECTIONS_PATH"] + ":/usr/share/ansible/collections"}
    return subprocess.run(["ansible-playbook", "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "migrate.yml"),
                           "-e", f"migrate_kubeconfig={api.kubeconfig}", "-e", "migrate_wait_seconds=9", *extra],
                          capture_output=True, text=True, env=env, timeout=600, check=False)


def pods_on(api):
    return sorted(p["spec"]["nodeName"] for p in api.objects("Pod"))


def lines(tmp_path, node):
    path = tmp_path / f"{node}.record"
    return path.read_text().splitlines() if path.exists() else []


def test_migrate_then_roll_back_one_node(api, tmp_path):
    assert pods_on(api) == ["node1", "node2"]

    proc = run(api, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    # The DaemonSet now avoids labelled nodes; both nodes are labelled, so no kube-proxy pod is left.
    ds = api.get("DaemonSet", "kube-system", "kube-proxy")
    assert ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": LABEL, "operator": "DoesNotExist"}]}]
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}  # kept
    assert all(api.get("Node", None, n)["metadata"]["labels"] == {LABEL: "true"} for n in NODES)
    assert pods_on(api) == []
    # On each node: the role once (installed and started), no --cleanup (migrate_cleanup is off).
    assert lines(tmp_path, "node1") == lines(tmp_path, "node2") == ["role state=present service=started cleanup=True"]

    proc = run(api, tmp_path, "-e", "migrate_rollback=true", "--limit", "localhost,node2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert LABEL not in api.get("Node", None, "node2")["metadata"]["labels"]
    assert pods_on(api) == ["node2"]  # the DaemonSet is back there, and only there
    assert lines(tmp_path, "node2")[1:] == ["stop", "role state=absent service=started cleanup=False"]
    assert len(lines(tmp_path, "node1")) == 1  # untouched


def test_migrate_cleanup_installs_stopped_cleans_every_mode_then_starts(api, tmp_path):
    proc = run(api, tmp_path, "-e", "migrate_cleanup=true", "--limit", "localhost,node1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert lines(tmp_path, "node1") == ["role state=present service=stopped cleanup=True", "cleanup iptables",
                                        "cleanup ipvs", "role state=present service=started cleanup=True"]
    assert pods_on(api) == ["node2"]


def test_a_pod_that_does_not_go_fails_the_node_and_stops_the_rollout(api, tmp_path):
    # A DaemonSet that ignores the affinity (as if the patch were reverted by a GitOps tool):
    # the pod on node1 stays; the wait fails; node2 is never touched.
    original = api.reconcile
    api.reconcile = lambda: None
    proc = run(api, tmp_path)
    api.reconcile = original
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-5000:]
    assert "Wait until no kube-proxy pod runs on the node" in out.split("fatal: [node1]")[0].rsplit("TASK [", 1)[-1]
    assert lines(tmp_path, "node1") == [] and lines(tmp_path, "node2") == []
    assert LABEL not in api.get("Node", None, "node2")["metadata"]["labels"]
