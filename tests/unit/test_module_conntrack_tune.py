"""conntrack_tune argument handling and behaviour against a fake /proc/sys tree (the real
kernel, in a lab namespace, is tests/integration/test_module_conntrack_tune.py)."""
from __future__ import annotations

import json
import os

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import conntrack_tune as tune
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import sysctl
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.conntrack import (
    CleanupResult,
    ConntrackUnavailable,
    Flow,
)
from ansible_collections.kubenode.proxy.plugins.modules import conntrack_tune as mod

MAX = tune.MAX_KEY
EST = tune.KEYS["tcp_timeout_established"]
CW = tune.KEYS["tcp_timeout_close_wait"]
LIB = tune.KEYS["tcp_be_liberal"]
UDP = tune.KEYS["udp_timeout"]
HS = tune.HASHSIZE_KEY
START = {MAX: 262144, EST: 432000, CW: 60, LIB: 0, UDP: 30, tune.KEYS["udp_timeout_stream"]: 120, HS: 16384}


class Node:
    """A fake /proc/sys + hashsize tree the module reads and writes."""

    def __init__(self, root, initial=True, values=None):
        values = START if values is None else values
        self.root = root
        self.live = tune.LiveConntrack(str(root / "proc/sys"), str(root / "hashsize"))
        for key, value in values.items():
            path = self.live.path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(f"{value}\n")
        if MAX in values:
            os.chmod(self.live.path(MAX), 0o644 if initial else 0o444)
        self.sysctl_file = root / "etc/sysctl.d/90-kubenode-conntrack.conf"
        self.modprobe_file = root / "etc/modprobe.d/kubenode-nf_conntrack.conf"

    def values(self):
        return self.live.read()

    def args(self, **kwargs):
        base = dict(sysctl_file=str(self.sysctl_file), modprobe_file=str(self.modprobe_file))
        return {**base, **kwargs}


@pytest.fixture
def node(tmp_path, monkeypatch):
    n = Node(tmp_path)
    monkeypatch.setattr(sysctl, "PROC_SYS", str(tmp_path / "proc/sys"))
    monkeypatch.setattr(tune, "HASHSIZE_PATH", str(tmp_path / "hashsize"))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    return n


def run_module(capsys, args):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def test_sets_values_live_and_in_files_then_idempotent(node, capsys):
    args = node.args(max_per_core=32768, min=131072, tcp_timeout_established="24h0m0s",
                     tcp_timeout_close_wait=3600, tcp_be_liberal=True, _ansible_diff=True)
    out = run_module(capsys, args)
    assert out["changed"] and not out.get("failed"), out
    assert out["cpus"] == 8
    assert out["wanted"] == {MAX: 262144, EST: 86400, CW: 3600, LIB: 1, HS: 65536}  # max/4 raise
    assert node.values() == {**START, EST: 86400, CW: 3600, LIB: 1, HS: 65536}
    assert out["values"] == node.values() and out["previous"] == START
    assert out["skipped"] == [] and out["deleted"] == 0
    assert out["files"] == [str(node.sysctl_file), str(node.modprobe_file)]

    live_diff, sysctl_diff, modprobe_diff = out["diff"]
    assert live_diff["before"].splitlines() == [f"{MAX} = 262144", f"{EST} = 432000", f"{CW} = 60",
                                                f"{LIB} = 0", f"{HS} = 16384"]
    assert live_diff["after"].splitlines() == [f"{MAX} = 262144", f"{EST} = 86400", f"{CW} = 3600",
                                               f"{LIB} = 1", f"{HS} = 65536"]
    assert sysctl_diff["before"] == "" and sysctl_diff["after_header"] == str(node.sysctl_file)
    assert sysctl_diff["after"] == node.sysctl_file.read_text()
    assert sysctl.parse_sysctl_conf(node.sysctl_file.read_text()) == {
        MAX: "262144", EST: "86400", CW: "3600", LIB: "1"}
    assert node.modprobe_file.read_text().endswith("\noptions nf_conntrack hashsize=65536\n")
    assert modprobe_diff["after"] == node.modprobe_file.read_text()
    for path in (node.sysctl_file, node.modprobe_file):
        assert os.stat(path).st_mode & 0o7777 == 0o644
    assert not [p for p in node.sysctl_file.parent.iterdir() if p.name.startswith(".")]  # no temp files left

    again = run_module(capsys, args)
    assert not again["changed"] and again["files"] == []
    assert again["wanted"] == {MAX: 262144, EST: 86400, CW: 3600, LIB: 1}  # hash size already big enough
    assert again["diff"][0]["before"] == again["diff"][0]["after"] and len(again["diff"]) == 1
    assert node.modprobe_file.exists()  # left alone


def test_check_mode_changes_nothing_but_reports(node, capsys):
    args = node.args(max=524288, udp_timeout="1m", _ansible_check_mode=True, _ansible_diff=True)
    out = run_module(capsys, args)
    assert out["changed"]
    assert out["values"][MAX] == 524288 and out["values"][UDP] == 60 and out["values"][HS] == 131072
    assert node.values() == START
    assert not node.sysctl_file.exists() and not node.modprobe_file.exists()
    assert out["files"] == [str(node.sysctl_file), str(node.modprobe_file)]
    assert f"{MAX} = 524288" in out["diff"][0]["after"] and f"{MAX} = 262144" in out["diff"][0]["before"]
    assert f"{MAX} = 524288" in out["diff"][1]["after"]


def test_file_with_wrong_mode_is_fixed_without_rewriting(node, capsys):
    args = node.args(udp_timeout=60)
    run_module(capsys, args)
    os.chmod(node.sysctl_file, 0o600)
    inode = os.stat(node.sysctl_file).st_ino
    out = run_module(capsys, args)
    assert out["changed"] and out["files"] == [str(node.sysctl_file)]
    assert os.stat(node.sysctl_file).st_mode & 0o7777 == 0o644 and os.stat(node.sysctl_file).st_ino == inode


def test_file_content_replaced_atomically(node, capsys):
    node.sysctl_file.parent.mkdir(parents=True)
    node.sysctl_file.write_text("net.netfilter.nf_conntrack_udp_timeout = 10\n")
    inode = os.stat(node.sysctl_file).st_ino
    out = run_module(capsys, node.args(udp_timeout=60, apply_live=False, _ansible_diff=True))
    assert out["changed"] and node.values() == START  # apply_live=false: only the file
    assert out["diff"][0]["before"] == "net.netfilter.nf_conntrack_udp_timeout = 10\n"
    assert sysctl.parse_sysctl_conf(node.sysctl_file.read_text()) == {UDP: "60"}
    assert os.stat(node.sysctl_file).st_ino != inode  # renamed into place


def test_persist_false_writes_no_files(node, capsys):
    out = run_module(capsys, node.args(max=524288, hashsize=0, persist=False))
    assert out["changed"] and node.values()[MAX] == 524288 and node.values()[HS] == 16384  # 0: never touch
    assert not node.sysctl_file.exists() and not node.modprobe_file.exists()


def test_explicit_hashsize_is_rounded_and_may_lower(node, capsys):
    out = run_module(capsys, node.args(hashsize=10000))
    assert out["changed"] and node.values()[HS] == 10240
    assert node.modprobe_file.read_text().endswith("hashsize=10240\n")
    assert not node.sysctl_file.exists()  # no sysctl to hold
    assert not run_module(capsys, node.args(hashsize=10000))["changed"]


def test_global_keys_in_a_child_namespace_fail_clearly_and_change_nothing(tmp_path, monkeypatch, capsys):
    node = Node(tmp_path, initial=False)
    monkeypatch.setattr(sysctl, "PROC_SYS", str(tmp_path / "proc/sys"))
    monkeypatch.setattr(tune, "HASHSIZE_PATH", str(tmp_path / "hashsize"))
    out = run_module(capsys, node.args(max=524288, tcp_timeout_established=86400))
    assert out["failed"] and not out["changed"]
    assert out["msg"].startswith(
        "cannot set read-only keys: nf_conntrack.hashsize (have 16384, want 131072 = nf_conntrack_max/4 by "
        "upstream's rule; hashsize=0 leaves it alone), net.netfilter.nf_conntrack_max (have 262144, want "
        "524288): global (one value for the whole host): writable only from the initial network namespace")
    assert "initial network namespace" in out["msg"] and "skip_readonly" in out["msg"]
    assert node.values() == START and not node.sysctl_file.exists()

    out = run_module(capsys, node.args(max=524288, tcp_timeout_established=86400, skip_readonly=True))
    assert out["changed"] and not out.get("failed")
    assert [(s["key"], s["current"], s["wanted"]) for s in out["skipped"]] == [
        (HS, 16384, 131072), (MAX, 262144, 524288)]
    assert all("global" in s["reason"] for s in out["skipped"])
    assert node.values() == {**START, EST: 86400}
    assert sysctl.parse_sysctl_conf(node.sysctl_file.read_text())[MAX] == "524288"  # persisted anyway

    # the current global value needs no write, so it is fine from a child namespace
    out = run_module(capsys, node.args(max=262144, hashsize=16384, persist=False))
    assert not out["changed"] and not out.get("failed") and out["skipped"] == []


def test_write_refused_by_the_kernel(node, capsys, monkeypatch):
    def refuse(path, value, key=""):
        raise sysctl.ReadOnlyError(key, "writing failed: Read-only file system (errno 30)")

    monkeypatch.setattr(sysctl, "write_value", refuse)
    out = run_module(capsys, node.args(udp_timeout=61, persist=False))
    assert out["failed"] and "net.netfilter.nf_conntrack_udp_timeout (have 30, want 61)" in out["msg"]
    assert "Read-only file system" in out["msg"]
    out = run_module(capsys, node.args(udp_timeout=61, persist=False, skip_readonly=True))
    assert not out["changed"] and out["skipped"][0]["key"] == UDP


def test_nf_conntrack_not_loaded(tmp_path, monkeypatch, capsys):
    node = Node(tmp_path, values={})
    monkeypatch.setattr(sysctl, "PROC_SYS", str(tmp_path / "proc/sys"))
    monkeypatch.setattr(tune, "HASHSIZE_PATH", str(tmp_path / "hashsize"))
    out = run_module(capsys, node.args(udp_timeout=60))
    assert out["failed"] and "nf_conntrack kernel module is not loaded" in out["msg"]
    assert "modprobe nf_conntrack" in out["msg"]
    out = run_module(capsys, node.args(udp_timeout=60, max=262144, apply_live=False))  # files only: fine
    assert out["changed"] and out["values"][MAX] is None
    assert node.modprobe_file.read_text().endswith("hashsize=65536\n")  # max/4, live size unknown


@pytest.mark.parametrize("args, message", [
    (dict(max=1, max_per_core=1), "parameters are mutually exclusive: max|max_per_core"),
    (dict(min=131072), "missing parameter(s) required by 'min': max_per_core"),
    (dict(udp_timeout="soon"), "udp_timeout: 'soon' is neither seconds nor a duration"),
    (dict(tcp_timeout_established="1.5s"), "tcp_timeout_established: the kernel takes whole seconds"),
    (dict(delete=[{}]), "delete[0]: give at least one of"),
    (dict(delete=[dict(protocol="udp"), dict(orig_dst="nope")]), "delete[1].orig_dst: 'nope' is not an IP"),
    (dict(delete=[dict(protocol="icmp")]), "value of protocol must be one of: tcp, udp, sctp"),
    (dict(max=-5), "max: must be a non-negative integer"),
])
def test_argument_errors(node, capsys, args, message):
    out = run_module(capsys, node.args(**args))
    assert out["failed"] and message in out["msg"], out["msg"]
    assert node.values() == START


FLOWS = [Flow("UDP", "10.244.2.10", "10.96.0.10", 53, "10.244.1.1", 5353, orig_sport=40000),
         Flow("UDP", "10.244.2.10", "10.96.0.11", 53, "10.244.1.1", 5353, orig_sport=40001)]


def test_delete_counts_in_check_mode_and_deletes_otherwise(node, capsys, monkeypatch):
    seen = {}

    def find(filters, netns="", lister=None):
        seen["filters"] = filters
        return tune.select_flows(FLOWS, filters)

    deleted = []

    def delete(flows, netns=""):
        deleted.extend(flows)
        return CleanupResult(deleted=len(flows))

    monkeypatch.setattr(tune, "find_flows", find)
    monkeypatch.setattr(tune, "delete_flows", delete)
    args = node.args(delete=[dict(protocol="udp", orig_dst="10.96.0.10", orig_dst_port=53)])
    out = run_module(capsys, {**args, "_ansible_check_mode": True})
    assert out["changed"] and out["deleted"] == 1 and deleted == []
    assert seen["filters"] == [tune.FlowFilter(protocol="UDP", orig_dst="10.96.0.10", orig_dst_port=53)]
    out = run_module(capsys, args)
    assert out["changed"] and out["deleted"] == 1 and deleted == [FLOWS[0]]
    assert node.values() == START and not node.sysctl_file.exists()

    monkeypatch.setattr(tune, "find_flows", lambda filters, netns="", lister=None: [])
    out = run_module(capsys, args)
    assert not out["changed"] and out["deleted"] == 0


def test_delete_errors(node, capsys, monkeypatch):
    monkeypatch.setattr(tune, "find_flows", lambda filters, netns="", lister=None: list(FLOWS))
    monkeypatch.setattr(tune, "delete_flows",
                        lambda flows, netns="": CleanupResult(deleted=1, errors=["delete x: Permission denied"]))
    out = run_module(capsys, node.args(delete=[dict(protocol="udp")]))
    assert out["failed"] and out["changed"] and out["deleted"] == 1
    assert out["msg"] == "1 of 2 conntrack deletes failed; first: delete x: Permission denied"

    def unavailable(filters, netns="", lister=None):
        raise ConntrackUnavailable("no pyroute2")

    monkeypatch.setattr(tune, "find_flows", unavailable)
    out = run_module(capsys, node.args(delete=[dict(protocol="udp")]))
    assert out["failed"] and "Failed to import the required Python library (pyroute2)" in out["msg"]


def test_nothing_asked_reports_values(node, capsys):
    out = run_module(capsys, node.args())
    assert not out["changed"] and out["values"] == START == out["previous"] and out["wanted"] == {}
    assert "cpus" not in out
