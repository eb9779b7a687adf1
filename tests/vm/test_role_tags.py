"""Every tag of the kube_proxy role runs alone, in check mode, on a fresh node: playbooks/site.yml
with ``--check --tags <tag>`` against the VM lab's guest (Debian, systemd, the stock kernel),
for each tag the role's tasks/main.yml declares. A tag whose tasks use what another tag's
tasks register or load fails here (as `--tags kube_proxy_conntrack` did on an undefined
variable). The whole role (converge, idempotence, uninstall, re-install) runs in molecule/.

The runs share the session's VM and go three at a time (each is mostly waiting on SSH).
"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
from pathlib import Path

import vmlab
import yaml

COLLECTIONS = os.environ["KUBENODE_COLLECTIONS_PATH"] + ":/usr/share/ansible/collections"
ROOT = Path(__file__).resolve().parents[2]
ROLE_TASKS = ROOT / "roles" / "kube_proxy" / "tasks" / "main.yml"


def role_tags() -> list[str]:
    tags = {tag for task in yaml.safe_load(ROLE_TASKS.read_text()) for tag in task.get("tags", [])}
    return sorted(tags - {"always", "kube_proxy"})


def test_the_tag_list_is_what_the_docs_name():
    assert {"kube_proxy_validate", "kube_proxy_packages", "kube_proxy_kernel", "kube_proxy_conntrack",
            "kube_proxy_install", "kube_proxy_config", "kube_proxy_service", "kube_proxy_health",
            "kube_proxy_absent"} == set(role_tags())


def test_every_tag_runs_alone_in_check_mode_on_a_fresh_node(vm_lab: vmlab.VMLab, tmp_path: Path):
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(Path(vm_lab.inventory).read_text() + "\n[kube_proxy_nodes:children]\nvms\n")
    extra = tmp_path / "extra.yml"
    extra.write_text(yaml.safe_dump({
        "kube_proxy_mode": "ipvs", "kube_proxy_source": "manifests",
        "kube_proxy_wheelhouse_dir": vmlab.GUEST_WHEELHOUSE, "kube_proxy_rollout_serial": "100%",
        "kube_proxy_manifests": {"web.yaml": {"apiVersion": "v1", "kind": "Service",
                                              "metadata": {"name": "web", "namespace": "tags"},
                                              "spec": {"clusterIP": "10.96.210.10", "ports": [{"port": 80}]}}}}))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOST_KEY_CHECKING": "0", "ANSIBLE_RETRY_FILES_ENABLED": "0", "ANSIBLE_PIPELINING": "1"}

    def run(tag: str) -> tuple[str, subprocess.CompletedProcess]:
        state = ["-e", "kube_proxy_state=absent"] if tag == "kube_proxy_absent" else []
        return tag, subprocess.run(
            ["ansible-playbook", "-i", str(inventory), str(ROOT / "playbooks" / "site.yml"), "--check", "--diff",
             "--tags", tag, "-e", f"@{extra}", *state], capture_output=True, text=True, env=env, timeout=1500,
            check=False)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(pool.map(run, role_tags()))
    failed = {tag: proc.stdout[-2500:] + proc.stderr[-1000:] for tag, proc in results.items() if proc.returncode}
    assert not failed, "\n\n".join(f"--tags {tag}:\n{out}" for tag, out in failed.items())
    # Each run did something of its own beyond the validation (tasks ran, not just skipped).
    for tag, proc in results.items():
        assert "ok=" in proc.stdout and "failed=0" in proc.stdout, (tag, proc.stdout[-1500:])
    # Nothing was installed: check mode.
    script = "test ! -e /etc/systemd/system/kubenode-proxy.service && test ! -e /opt/kubenode-proxy && echo clean"
    clean = ["sh", "-c", script]
    assert vm_lab.vms[0].ssh(clean).stdout.strip() == "clean"
