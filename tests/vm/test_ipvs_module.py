"""ipvs_virtual_server on a real kernel: ansible-playbook over SSH against a VM lab guest.

* In the guest's own network namespace, with the guest's system python3 (no pyroute2: the
  module needs it only for ``netns``): present, idempotence, check mode changes nothing,
  diff, purge_real_servers, absent, a fwmark service, a scheduler the kernel lacks, and
  ``ipvsadm -Ln`` agreeing with what the module returns, line for line.
* Real traffic: a namespace lab in the guest (tests/vm/guest/ipvs_lab.py: a director
  namespace with the VIP on a dummy link, three backend pods running echo_server.py, a
  client pod); the module programs the director through ``netns`` (the guest's test venv
  python, which has pyroute2); connections from the client reach every real server,
  masqueraded, and follow weights and purges.
* The core layer's kernel tests (graceful removal with a held-open connection included)
  run inside the guest: tests/vm/guest/test_ipvs_kernel.py, started from here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import vmlab
import yaml

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs

COLLECTIONS = os.environ["KUBENODE_COLLECTIONS_PATH"]  # set by tests/conftest.py
MODULE = "kubenode.proxy.ipvs_virtual_server"
VIP = "10.96.200.10"  # root-namespace services of this file (test_vmlab.py uses 10.96.0.1/.2)
VIP2 = "10.96.200.11"
FWMARK = 4242
TRAFFIC_VIP = "10.96.201.10"
RS = [{"address": f"10.244.9.{i}", "port": 8080, "forwarding": "masquerade"} for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def guest(vm: vmlab.VM, vm_repo: str):
    vm.ssh(["modprobe", "ip_vs"])
    yield vm
    for args in (["-t", f"{VIP}:80"], ["-u", f"{VIP2}:53"], ["-f", str(FWMARK)]):
        vm.ssh(["ipvsadm", "-D", *args], check=False)


class Play:
    """Runs module tasks with ansible-playbook against the lab's inventory."""

    def __init__(self, vm_lab: vmlab.VMLab, tmp_path):
        self.vm_lab = vm_lab
        self.tmp = tmp_path
        self.runs = 0

    def __call__(self, tasks, *flags, python=None, ignore_errors=False):
        """Run ``tasks`` (module argument dicts) in one play; each task's registered result."""
        self.runs += 1
        results = self.tmp / f"results{self.runs}.json"
        task_vars = {"ansible_python_interpreter": python} if python else {}
        playbook = [{"hosts": self.vm_lab.group, "gather_facts": False, "tasks": [
            {MODULE: args, "register": f"r{i}", "ignore_errors": ignore_errors, "vars": task_vars}
            for i, args in enumerate(tasks)
        ] + [{"copy": {"content": "{{ [%s] | to_json }}" % ", ".join(f"r{i}" for i in range(len(tasks))),
                       "dest": str(results)},
              "delegate_to": "localhost", "check_mode": False, "diff": False,
              "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}]}]
        path = self.tmp / f"play{self.runs}.yml"
        path.write_text(yaml.safe_dump(playbook, sort_keys=False))
        env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_HOST_KEY_CHECKING": "0", "ANSIBLE_RETRY_FILES_ENABLED": "0"}
        proc = subprocess.run(["ansible-playbook", "-i", str(self.vm_lab.inventory), str(path), *flags],
                              capture_output=True, text=True, env=env, timeout=900, check=False)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        return json.loads(results.read_text())


@pytest.fixture
def play(vm_lab, tmp_path):
    return Play(vm_lab, tmp_path)


TITLES = ("IP Virtual Server version", "Prot LocalAddress:Port", "  -> RemoteAddress:Port")


def ipvsadm_service(vm, *service_args, ns=None):
    """``ipvsadm -Ln <service>`` without its title lines, trailing blanks stripped (None if
    there is no such service)."""
    prefix = ["ip", "netns", "exec", ns] if ns else []
    out = vm.ssh([*prefix, "ipvsadm", "-Ln", *service_args], check=False)
    if out.returncode != 0:
        return None
    return "".join(line.rstrip() + "\n" for line in out.stdout.splitlines() if not line.startswith(TITLES))


def without_counters(listing):
    """ipvsadm -Ln text as format_service(counters=False) prints it."""
    lines = []
    for line in listing.splitlines():
        words = line.split()
        lines.append(f"  -> {words[1]:<28} {words[2]:<7} {words[3]}" if words[:1] == ["->"] else line)
    return "\n".join(lines) + "\n"


def state_of(result):
    """The ServiceState the module reported (service + real_servers), to format like ipvsadm."""
    s = result["service"]
    vs = ipvs.virtual_server(protocol=s["protocol"] or "tcp", address=s["address"] or "", port=s["port"] or 0,
                             fwmark=s["fwmark"] or 0, family=s["family"], scheduler=s["scheduler"],
                             scheduler_flags=s["scheduler_flags"], persistence_timeout=s["persistence_timeout"],
                             persistence_netmask=s["persistence_netmask"])
    reals = [ipvs.RealServer(r["address"], r["port"], r["weight"], r["forwarding"], r["u_threshold"],
                             r["l_threshold"], active_connections=r["active_connections"],
                             inactive_connections=r["inactive_connections"]) for r in result["real_servers"]]
    return ipvs.ServiceState(vs, tuple(reals))


WEB = {"address": VIP, "port": 80, "scheduler": "rr", "real_servers": RS[:2]}


def test_present_is_idempotent_and_ipvsadm_agrees(guest, play):
    first, second = play([WEB, WEB])
    assert first["changed"] and not second["changed"], (first, second)
    assert first["changes"] == [f"-A -t {VIP}:80 -s rr",
                                f"-a -t {VIP}:80 -r 10.244.9.1:8080 -m -w 1",
                                f"-a -t {VIP}:80 -r 10.244.9.2:8080 -m -w 1"]
    assert second["changes"] == []
    listed = ipvsadm_service(guest, "-t", f"{VIP}:80")
    assert listed == ipvs.format_service(state_of(second))
    assert listed == (f"TCP  {VIP}:80 rr\n"
                      "  -> 10.244.9.1:8080              Masq    1      0          0\n"
                      "  -> 10.244.9.2:8080              Masq    1      0          0\n")


def test_check_mode_changes_nothing_and_diff_shows_the_change(guest, play):
    play([WEB])
    before = ipvsadm_service(guest, "-t", f"{VIP}:80")
    changed = dict(WEB, scheduler="wrr", persistence_timeout=120, persistence_netmask="255.255.255.0",
                   real_servers=[dict(RS[0], weight=3), RS[2]])
    (checked,) = play([changed], "--check", "--diff")
    assert checked["changed"] and ipvsadm_service(guest, "-t", f"{VIP}:80") == before
    expected_after = (f"TCP  {VIP}:80 wrr persistent 120 mask 255.255.255.0\n"
                      "  -> 10.244.9.1:8080              Masq    3\n"
                      "  -> 10.244.9.2:8080              Masq    1\n"
                      "  -> 10.244.9.3:8080              Masq    1\n")
    assert checked["diff"]["before"] == (f"TCP  {VIP}:80 rr\n"
                                         "  -> 10.244.9.1:8080              Masq    1\n"
                                         "  -> 10.244.9.2:8080              Masq    1\n")
    assert checked["diff"]["after"] == expected_after
    (applied,) = play([changed], "--diff")
    assert applied["changes"] == checked["changes"] and applied["diff"] == checked["diff"]
    assert ipvsadm_service(guest, "-t", f"{VIP}:80") == ipvs.format_service(state_of(applied))
    assert "wrr persistent 120 mask 255.255.255.0" in ipvsadm_service(guest, "-t", f"{VIP}:80")


def test_purge_real_servers_and_absent(guest, play):
    play([dict(WEB, real_servers=RS)])
    keep_only = dict(WEB, real_servers=[RS[1]], purge_real_servers=True)
    purged, again = play([keep_only, keep_only])
    assert purged["changes"] == [f"-d -t {VIP}:80 -r 10.244.9.1:8080", f"-d -t {VIP}:80 -r 10.244.9.3:8080"]
    assert [r["address"] for r in purged["real_servers"]] == ["10.244.9.2"] and not again["changed"]
    assert ipvsadm_service(guest, "-t", f"{VIP}:80").count("->") == 1
    gone = {"address": VIP, "port": 80, "state": "absent"}
    removed, still_gone = play([gone, gone], "--diff")
    assert removed["changed"] and removed["changes"] == [f"-D -t {VIP}:80"] and removed["diff"]["after"] == ""
    assert not still_gone["changed"] and removed["service"] == {}
    assert ipvsadm_service(guest, "-t", f"{VIP}:80") is None  # ipvsadm: no such service


def test_fwmark_and_udp_services(guest, play):
    fw = {"fwmark": FWMARK, "scheduler": "sh", "scheduler_flags": ["sh-fallback", "sh-port"],
          "real_servers": [{"address": "10.244.9.7", "forwarding": "route", "weight": 2},
                           {"address": "10.244.9.8", "forwarding": "tunnel", "u_threshold": 50, "l_threshold": 10}]}
    dns = {"protocol": "udp", "address": VIP2, "port": 53, "scheduler": "lc", "persistence_timeout": 30,
           "real_servers": [{"address": "10.244.9.9", "forwarding": "masquerade", "port": 5353}]}
    first_fw, first_dns, second_fw, second_dns = play([fw, dns, fw, dns])
    assert first_fw["changed"] and first_dns["changed"] and not second_fw["changed"] and not second_dns["changed"]
    assert first_fw["service"]["fwmark"] == FWMARK and first_fw["service"]["scheduler_flags"] == [
        "sh-fallback", "sh-port"]
    assert ipvsadm_service(guest, "-f", str(FWMARK)) == (
        f"FWM  {FWMARK} sh (sh-fallback,sh-port)\n"
        "  -> 10.244.9.7:0                 Route   2      0          0\n"
        "  -> 10.244.9.8:0                 Tunnel  1      0          0\n")
    assert ipvsadm_service(guest, "-f", str(FWMARK)) == ipvs.format_service(state_of(second_fw))
    thresholds = guest.ssh(["ipvsadm", "-Ln", "--thresholds", "-f", str(FWMARK)]).stdout
    assert any(line.split()[1:4] == ["10.244.9.8:0", "50", "10"] for line in thresholds.splitlines()
               if "->" in line), thresholds
    assert ipvsadm_service(guest, "-u", f"{VIP2}:53") == (
        f"UDP  {VIP2}:53 lc persistent 30\n"
        "  -> 10.244.9.9:5353              Masq    1      0          0\n")
    assert all(r["changed"] for r in play([{**fw, "state": "absent"}, {**dns, "state": "absent"}]))


def test_a_scheduler_the_kernel_lacks_is_named(guest, play):
    missing = "twos" if not guest.ssh(["modinfo", "ip_vs_twos"], check=False).returncode == 0 else "nosuch"
    args = dict(WEB, address=VIP2, scheduler=missing)
    checked = play([args], "--check", ignore_errors=True)[0]
    real = play([args], ignore_errors=True)[0]
    message = f"scheduler '{missing}' is not available in this kernel (module ip_vs_{missing} not found)"
    assert checked["failed"] and checked["msg"] == message
    assert real["failed"] and real["msg"] == message
    assert ipvsadm_service(guest, "-t", f"{VIP2}:80") is None


# -- real traffic through the director namespace


@pytest.fixture
def traffic_lab(guest, vm_repo):
    """The guest-side namespace lab; torn down when the pipe closes."""
    argv = guest.ssh_argv([vmlab.GUEST_PYTHON, f"{vm_repo}/tests/vm/guest/ipvs_lab.py", TRAFFIC_VIP])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"ipvs_lab.py failed: {proc.stderr.read()}")
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def requests(vm, lab, count):
    """``count`` TCP connections from the client pod to TRAFFIC_VIP:80; backend names seen."""
    out = vm.ssh(["ip", "netns", "exec", lab["client"], "python3", "-I", "-S", lab["echo_client"], "--host",
                  TRAFFIC_VIP, "--port", "80", "--count", str(count), "--timeout", "5"], timeout=300).stdout
    replies = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert all(r["outcome"] == "ok" for r in replies), Counter((r["outcome"], r["error"]) for r in replies)
    return replies


def test_connections_reach_every_real_server(guest, play, traffic_lab):
    lab = traffic_lab
    backends = [{"address": pod["ip"], "port": 8080, "forwarding": "masquerade"} for pod in lab["pods"].values()]
    svc = {"address": TRAFFIC_VIP, "port": 80, "scheduler": "rr", "netns": lab["node"], "real_servers": backends}
    (created,) = play([svc], python=vmlab.GUEST_PYTHON)
    assert created["changed"] and len(created["real_servers"]) == 3
    replies = requests(guest, lab, 30)
    assert Counter(r["backend"] for r in replies) == {"be1": 10, "be2": 10, "be3": 10}  # rr
    assert {r["server_ip"] for r in replies} == {pod["ip"] for pod in lab["pods"].values()}
    assert {r["seen_client"] for r in replies} == {lab["client_ip"]}  # masquerading = DNAT only
    (counted,) = play([svc], python=vmlab.GUEST_PYTHON)
    assert not counted["changed"]
    # closed connections stay in IPVS's table (TIME_WAIT, 2 min) as inactive ones
    assert 0 < sum(r["active_connections"] + r["inactive_connections"] for r in counted["real_servers"]) <= 30
    listed = ipvsadm_service(guest, "-t", f"{TRAFFIC_VIP}:80", ns=lab["node"])
    assert without_counters(listed) == ipvs.format_service(state_of(counted), counters=False)
    # weights, then a purge: traffic follows
    weighted = dict(svc, scheduler="wrr", real_servers=[dict(backends[0], weight=1), dict(backends[1], weight=2)],
                    purge_real_servers=True)
    (changed,) = play([weighted], python=vmlab.GUEST_PYTHON)
    assert f"-d -t {TRAFFIC_VIP}:80 -r 10.244.1.3:8080" in changed["changes"]
    assert Counter(r["backend"] for r in requests(guest, lab, 30)) == {"be1": 10, "be2": 20}
    assert guest.ssh(["ipvsadm", "-Ln"]).stdout.count(TRAFFIC_VIP) == 0  # only in the director namespace


# -- the core layer's own kernel tests, inside the guest


def test_core_kernel_tests_pass_in_the_guest(guest, vm_repo):
    path = f"{vm_repo}/tests/vm/guest/test_ipvs_kernel.py"
    proc = guest.ssh([vmlab.GUEST_PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", path],
                     check=False, timeout=1800)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
