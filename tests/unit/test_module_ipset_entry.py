"""ipset_entry argument handling and results, with a fake `ipset` (the real kernel is used in
tests/integration/test_ipset_module.py through ansible-playbook)."""
import json
import subprocess

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import IpsetKernel
from ansible_collections.kubenode.proxy.plugins.modules import ipset_entry as mod

SET_S = """\
create S hash:ip,port family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1
add S 10.96.0.10,tcp:80
add S 10.96.0.11,udp:53
"""


class FakeIpset:
    """Answers `ipset list -n` / `ipset save NAME` from a save text; records restores."""

    def __init__(self, save_text="", restore_rc=0, restore_err=""):
        self.save_text = save_text
        self.restore_rc = restore_rc
        self.restore_err = restore_err
        self.restores = []

    def __call__(self, argv, input=None, **kwargs):
        args = argv[1:]
        names = [line.split()[1] for line in self.save_text.splitlines() if line.startswith("create ")]
        if args == ["list", "-n"]:
            return subprocess.CompletedProcess(argv, 0, "".join(n + "\n" for n in names), "")
        if args[0] == "save":
            if args[1] not in names:
                err = "ipset v7.17: The set with the given name does not exist\n"
                return subprocess.CompletedProcess(argv, 1, "", err)
            text = "".join(line + "\n" for line in self.save_text.splitlines() if line.split()[1] == args[1])
            return subprocess.CompletedProcess(argv, 0, text, "")
        if args == ["restore"]:
            self.restores.append(input)
            return subprocess.CompletedProcess(argv, self.restore_rc, "", self.restore_err)
        raise AssertionError(argv)


@pytest.fixture
def fake(monkeypatch):
    fake = FakeIpset()
    monkeypatch.setattr(mod.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: "/sbin/" + name)
    monkeypatch.setattr(mod, "IpsetKernel", lambda binary: IpsetKernel(binary=binary, runner=fake))
    return fake


def run_module(capsys, args):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def test_present_needs_a_type(capsys, fake):
    out = run_module(capsys, {"name": "S", "entries": ["10.0.0.1,tcp:80"]})
    assert out["failed"] and out["msg"] == "type is required with state=present"
    assert fake.restores == []


def test_bitmap_port_needs_a_range(capsys, fake):
    out = run_module(capsys, {"name": "P", "type": "bitmap:port", "entries": ["30080"]})
    assert out["failed"] and "range is required with type=bitmap:port" in out["msg"]
    out = run_module(capsys, {"name": "P", "type": "hash:ip", "range": "0-10"})
    assert out["failed"] and "range applies to type=bitmap:port only" in out["msg"]
    out = run_module(capsys, {"name": "P", "type": "bitmap:port", "range": "0-10", "maxelem": 3})
    assert out["failed"] and "hash types only" in out["msg"]


def test_type_choices_are_enforced(capsys, fake):
    out = run_module(capsys, {"name": "S", "type": "hash:foo"})
    assert out["failed"] and "value of type must be one of" in out["msg"]


def test_create_with_options_in_one_restore(capsys, fake):
    out = run_module(capsys, {"name": "S", "type": "hash:ip,port", "entries": ["10.96.0.10,80", "10.96.0.11,UDP:53"],
                              "timeout": 300, "comment": "svc", "maxelem": 1000, "hashsize": 128,
                              "_ansible_diff": True})
    assert out["changed"] and out["action"] == "create"
    assert out["added"] == ["10.96.0.10,tcp:80", "10.96.0.11,udp:53"] and out["removed"] == []
    assert out["entries"] == out["added"]
    assert fake.restores == [
        "create S hash:ip,port family inet hashsize 128 maxelem 1000 timeout 300 comment\n"
        'add S 10.96.0.10,tcp:80 comment "svc" -exist\n'
        'add S 10.96.0.11,udp:53 comment "svc" -exist\n']
    assert out["restore_input"] == fake.restores[0]
    assert out["diff"]["before"] == ""
    assert out["diff"]["after"].splitlines() == [
        "create S hash:ip,port family inet maxelem 1000 timeout 300 comment",
        'add S 10.96.0.10,tcp:80 comment "svc"', 'add S 10.96.0.11,udp:53 comment "svc"']


def test_present_is_idempotent_with_differently_written_entries(capsys, fake):
    fake.save_text = SET_S
    out = run_module(capsys, {"name": "S", "type": "hash:ip,port", "entries": ["10.96.0.11,17:domain", "10.96.0.10,80"],
                              "_ansible_diff": True})
    assert not out["changed"] and out["action"] == "none" and fake.restores == []
    assert out["diff"]["before"] == out["diff"]["after"]
    assert out["entries"] == ["10.96.0.10,tcp:80", "10.96.0.11,udp:53"]


def test_check_mode_reports_without_writing(capsys, fake):
    fake.save_text = SET_S
    out = run_module(capsys, {"name": "S", "type": "hash:ip,port", "entries": ["10.96.0.12,tcp:443"],
                              "exclusive": True, "_ansible_check_mode": True, "_ansible_diff": True})
    assert out["changed"] and out["action"] == "swap" and fake.restores == []
    assert out["added"] == ["10.96.0.12,tcp:443"]
    assert out["removed"] == ["10.96.0.10,tcp:80", "10.96.0.11,udp:53"]
    assert "swap S-tmp S" in out["restore_input"]
    assert out["diff"]["after"].splitlines()[1:] == ["add S 10.96.0.12,tcp:443"]


def test_exclusive_without_entries_empties_the_set(capsys, fake):
    fake.save_text = SET_S
    out = run_module(capsys, {"name": "S", "type": "hash:ip,port", "exclusive": True})
    assert out["changed"] and out["entries"] == [] and len(out["removed"]) == 2


def test_absent_entries_and_absent_set(capsys, fake):
    fake.save_text = SET_S
    out = run_module(capsys, {"name": "S", "state": "absent", "entries": ["10.96.0.10,80", "10.1.1.1,tcp:9"]})
    assert out["changed"] and out["removed"] == ["10.96.0.10,tcp:80"] and out["entries"] == ["10.96.0.11,udp:53"]
    assert fake.restores == ["del S 10.96.0.10,tcp:80 -exist\n"]
    out = run_module(capsys, {"name": "S", "state": "absent", "_ansible_diff": True})
    assert out["changed"] and out["action"] == "destroy" and out["entries"] == []
    assert fake.restores[-1] == "destroy S\n" and out["diff"]["after"] == ""
    fake.save_text = ""
    out = run_module(capsys, {"name": "S", "state": "absent"})
    assert not out["changed"] and out["action"] == "none"


def test_bad_entry_fails_naming_it(capsys, fake):
    out = run_module(capsys, {"name": "S", "type": "hash:ip,port", "entries": ["10.96.0.10,80", "10.96.0.300,80"]})
    assert out["failed"] and out["entry"] == "10.96.0.300,80"
    assert out["msg"].startswith("set S: bad entry '10.96.0.300,80'") and fake.restores == []


def test_type_change_is_refused(capsys, fake):
    fake.save_text = SET_S
    out = run_module(capsys, {"name": "S", "type": "hash:net", "entries": ["10.0.0.0/8"]})
    assert out["failed"] and "cannot swap sets of different types" in out["msg"]


def test_kernel_errors_are_reported(capsys, fake):
    fake.save_text = SET_S
    fake.restore_rc = 1
    fake.restore_err = "ipset v7.17: Error in line 1: Set cannot be destroyed: it is in use by a kernel component\n"
    out = run_module(capsys, {"name": "S", "state": "absent"})
    assert out["failed"] and "in use by a kernel component" in out["msg"] and "--match-set S" in out["msg"]


def test_missing_ipset_tool(capsys, monkeypatch):
    monkeypatch.setattr(mod.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: None)
    out = run_module(capsys, {"name": "S", "type": "hash:ip"})
    assert out["failed"] and "install the ipset package" in out["msg"]
