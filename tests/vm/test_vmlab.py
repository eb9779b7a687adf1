"""The VM lab works: a booted Debian guest with SSH, systemd, IPVS, namespaces and the
offline wheelhouse venv. One VM for the whole session (see conftest.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import vmlab

SERVICE = "10.96.0.1:443"
REAL_SERVER = "10.244.0.2:8080"


def test_ssh_runs_argv_as_root_with_exact_quoting(vm: vmlab.VM) -> None:
    assert vm.ssh(["id", "-u"]).stdout.strip() == "0"
    assert vm.ssh(["hostname"]).stdout.strip() == vm.name
    words = ["a b", "it's", "$HOME", "*", "x;y", ""]
    assert vm.ssh(["printf", "[%s]", *words]).stdout == "".join(f"[{w}]" for w in words)
    result = vm.ssh(["sh", "-c", "exit 3"], check=False)
    assert result.returncode == 3
    with pytest.raises(vmlab.VMLabError, match="rc=3"):
        vm.ssh(["sh", "-c", "exit 3"])


def test_guest_runs_the_stock_debian_kernel_under_systemd(vm: vmlab.VM) -> None:
    assert vm.ssh(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    state = vm.ssh(["systemctl", "is-system-running", "--wait"], check=False).stdout.strip()
    failed = vm.ssh(["systemctl", "--failed", "--no-legend", "--plain"]).stdout
    assert state in ("running", "degraded"), failed
    release = vm.ssh(["uname", "-r"]).stdout.strip()
    assert release.endswith("-amd64"), release
    assert "bookworm" in vm.ssh(["cat", "/etc/os-release"]).stdout


def test_ipvsadm_programs_a_service_after_modprobe(vm: vmlab.VM) -> None:
    vm.ssh(["modprobe", "ip_vs"])
    assert "ip_vs" in vm.ssh(["cat", "/proc/modules"]).stdout
    vm.ssh(["ipvsadm", "-A", "-t", SERVICE, "-s", "rr"])
    try:
        vm.ssh(["ipvsadm", "-a", "-t", SERVICE, "-r", REAL_SERVER, "-m"])
        listing = vm.ssh(["ipvsadm", "-Ln"]).stdout
        service_lines = [line.split() for line in listing.splitlines() if SERVICE in line]
        assert service_lines == [["TCP", SERVICE, "rr"]], listing
        assert [REAL_SERVER, "Masq"] == [
            line.split()[1:3] for line in listing.splitlines() if REAL_SERVER in line
        ][0], listing
    finally:
        vm.ssh(["ipvsadm", "-D", "-t", SERVICE], check=False)
    assert SERVICE not in vm.ssh(["ipvsadm", "-Ln"]).stdout


PYROUTE2_IPVS = """
import socket, sys
from pyroute2 import IPVS, IPVSDest, IPVSService
ipvs = IPVS()
service = IPVSService(addr="10.96.0.2", port=80, protocol=socket.IPPROTO_TCP, sched_name="rr")
ipvs.service("add", service=service)
ipvs.dest("add", service=service, dest=IPVSDest(addr="10.244.0.3", port=8080, fwd_method=0))
found = [IPVSService.from_message(m) for m in ipvs.service("dump")]
print(sorted((s.get("addr"), s.get("port"), s.get("sched_name")) for s in found))
"""


def test_wheelhouse_venv_has_pyroute2_and_its_ipvs_socket_works(vm: vmlab.VM) -> None:
    vm.ssh(["modprobe", "ip_vs"])
    try:
        out = vm.ssh([vmlab.GUEST_PYTHON, "-c", PYROUTE2_IPVS]).stdout
        assert "('10.96.0.2', 80, 'rr')" in out, out
        listing = vm.ssh(["ipvsadm", "-Ln"]).stdout
        assert "10.96.0.2:80" in listing and "10.244.0.3:8080" in listing and "Masq" in listing, listing
    finally:
        vm.ssh(["ipvsadm", "-D", "-t", "10.96.0.2:80"], check=False)


def test_venv_packages_come_from_the_offline_wheelhouse(vm: vmlab.VM) -> None:
    versions = vm.ssh([vmlab.GUEST_PYTHON, "-c", (
        "import importlib.metadata as m\n"
        "for n in ('pyroute2', 'kubernetes', 'PyYAML', 'jmespath', 'pytest'): print(n, m.version(n))"
    )]).stdout.split()
    got = dict(zip(versions[::2], versions[1::2]))
    assert got["pyroute2"] == "0.9.7" and got["kubernetes"] == "37.0.2", got
    wheels = vm.ssh(["ls", vmlab.GUEST_WHEELHOUSE]).stdout.split()
    assert "requirements.txt" in wheels
    assert any(name.startswith("pyroute2-0.9.7-") for name in wheels), wheels
    # Every distribution in the venv is a wheel of the offline wheelhouse, same version
    # (the venv was installed with pip --no-index --find-links from it).
    missing = vm.ssh([vmlab.GUEST_PYTHON, "-c", WHEEL_CHECK, vmlab.GUEST_WHEELHOUSE]).stdout.split()
    assert missing == [], f"not in the wheelhouse: {missing}"


WHEEL_CHECK = """
import importlib.metadata as m, os, re, sys
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
wheels = {tuple(norm(part) for part in f.split("-")[:2]) for f in os.listdir(sys.argv[1]) if f.endswith(".whl")}
for dist in m.distributions():
    key = (norm(dist.metadata["Name"]), norm(dist.version))
    if key[0] not in ("pip", "setuptools") and key not in wheels:
        print("%s==%s" % key)
"""


def test_guest_makes_namespaces_veth_and_dummy_links(vm: vmlab.VM) -> None:
    script = """
        ip netns add vmlab-t1
        trap 'ip netns del vmlab-t1' EXIT
        ip link add vmlab-a type veth peer name vmlab-b netns vmlab-t1
        ip addr add 10.250.0.1/30 dev vmlab-a
        ip link set vmlab-a up
        ip -n vmlab-t1 addr add 10.250.0.2/30 dev vmlab-b
        ip -n vmlab-t1 link set vmlab-b up
        ip -n vmlab-t1 link add kube-ipvs0 type dummy
        ip -n vmlab-t1 link set kube-ipvs0 up
        ping -c 1 -W 5 10.250.0.2 >/dev/null
        ip -n vmlab-t1 -o link show kube-ipvs0
    """
    try:
        assert "kube-ipvs0" in vm.sh(script).stdout
    finally:
        vm.ssh(["ip", "link", "del", "vmlab-a"], check=False)
    assert "vmlab-t1" not in vm.ssh(["ip", "netns", "list"]).stdout


def test_put_and_get_copy_files_and_trees(vm: vmlab.VM, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a file.txt").write_text("hello\n")
    script = tree / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    vm.put(tree, "/tmp/vmlab-put/tree")
    vm.put(script, "/tmp/vmlab-put/single/run.sh")
    assert vm.ssh(["cat", "/tmp/vmlab-put/tree/sub/a file.txt"]).stdout == "hello\n"
    assert vm.ssh(["/tmp/vmlab-put/single/run.sh"]).stdout == "ran\n"
    vm.get("/tmp/vmlab-put/tree/sub/a file.txt", tmp_path / "back.txt")
    assert (tmp_path / "back.txt").read_text() == "hello\n"


def test_repository_checkout_is_copied_into_the_guest(vm: vmlab.VM, vm_repo: str) -> None:
    listing = vm.ssh(["ls", vm_repo]).stdout.split()
    assert {"galaxy.yml", "plugins", "tests"} <= set(listing)
    assert vm.ssh(["test", "-e", f"{vm_repo}/.git"], check=False).returncode != 0  # files only, no history
    assert vm.ssh(["cat", f"{vm_repo}/tests/vm/vmlab.py"]).stdout == Path(vmlab.__file__).read_text()


def test_inventory_drives_ansible_over_ssh(vm_lab: vmlab.VMLab) -> None:
    text = vm_lab.inventory.read_text()
    vm = vm_lab.vms[0]
    assert f"{vm.name} ansible_host=127.0.0.1 ansible_port={vm.port} ansible_user=root" in text
    proc = subprocess.run(["ansible", "-i", str(vm_lab.inventory), "all", "-m", "ansible.builtin.ping"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and '"ping": "pong"' in proc.stdout, proc.stdout + proc.stderr


def test_namespace_lab_runs_inside_the_guest(vm: vmlab.VM, vm_repo: str) -> None:
    """tests/integration/lab.py works in the guest (root, ip netns, iptables, real traffic).
    Two representative self-tests only: the whole test_lab.py passes too but takes minutes
    under emulation."""
    proc = vm.ssh(["sh", "-c", 'cd "$1" && shift && exec "$@" 2>&1', "run", vm_repo, vmlab.GUEST_PYTHON,
                   "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_lab.py",
                   "-k", "pod_to_pod_tcp_and_udp or cluster_ip_dnat_from_every_client_kind"],
                  check=False, timeout=900)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-4000:]


def test_a_boot_that_times_out_says_why_and_leaves_no_qemu(vm_lab: vmlab.VMLab) -> None:
    lab = vmlab.VMLab(1, names=["slow"], image=vm_lab.image, boot_timeout=1)
    with pytest.raises(vmlab.VMLabError, match=r"(?s)not ready after .*serial log tail"), lab:
        pass
    pid = lab.vms[0].pid
    assert pid is not None and lab.vms[0].process is not None and lab.vms[0].process.poll() is not None
    assert not lab.workdir.exists()
    assert lab.id not in [state["id"] for state in vmlab.list_labs()]
