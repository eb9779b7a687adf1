"""ipvs_virtual_server: argument handling and the module's flow against an in-memory kernel
(the real kernel is exercised through ansible-playbook in tests/vm/test_ipvs_module.py)."""
import errno
import json

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs
from ansible_collections.kubenode.proxy.plugins.modules import ipvs_virtual_server as mod


class FakeKernel:
    """IPVS in memory: services by key; refuses what the kernel refuses (unknown scheduler,
    duplicates, missing services/real servers)."""

    services = {}
    opened = []
    schedulers = ("rr", "wrr", "lc", "wlc", "sh", "mh", "dh", "sed", "nq", "lblc", "lblcr")

    def __init__(self, netns=""):
        self.netns = netns
        FakeKernel.opened.append(netns)

    def get(self, vs):
        return self.services.get(vs.key)

    def apply(self, ops):
        result = ipvs.ApplyResult()
        for op in ops:
            code = self._check(op)
            if code:
                result.errors.append((op, ipvs.explain(op, code)))
                continue
            after = ipvs.predict(self.services.get(op.virtual.key), [op])
            if after is None:
                del self.services[op.virtual.key]
            else:
                self.services[op.virtual.key] = after
            result.applied += 1
        return result

    def _check(self, op):
        have = self.services.get(op.virtual.key)
        if op.kind in (ipvs.ADD_SERVICE, ipvs.EDIT_SERVICE) and op.virtual.scheduler not in self.schedulers:
            return errno.ENOENT
        if op.kind == ipvs.ADD_SERVICE:
            return errno.EEXIST if have else 0
        if have is None:
            return errno.ESRCH
        if op.real_server is None:
            return 0
        exists = have.real_server(op.real_server.key) is not None
        if op.kind == ipvs.ADD_DEST:
            return errno.EEXIST if exists else 0
        return 0 if exists or op.kind == ipvs.EDIT_SERVICE else errno.ENOENT

    def close(self):
        pass


@pytest.fixture(autouse=True)
def fake_kernel(monkeypatch):
    FakeKernel.services = {}
    FakeKernel.opened = []
    monkeypatch.setattr(ipvs, "IPVSKernel", FakeKernel)
    monkeypatch.setattr(ipvs, "scheduler_available", lambda name: name in FakeKernel.schedulers)
    return FakeKernel


def run_module(capsys, args, check=False, diff=False):
    args = dict(args)
    if check:
        args["_ansible_check_mode"] = True
    if diff:
        args["_ansible_diff"] = True
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


WEB = dict(address="10.96.0.10", port=80, scheduler="rr", real_servers=[
    dict(address="10.244.1.1", port=8080, forwarding="masquerade"),
    dict(address="10.244.1.2", port=8080, forwarding="masquerade"),
])


def test_present_creates_the_service_and_reports_it(capsys):
    out = run_module(capsys, WEB)
    assert out["changed"] and out["changes"] == [
        "-A -t 10.96.0.10:80 -s rr",
        "-a -t 10.96.0.10:80 -r 10.244.1.1:8080 -m -w 1",
        "-a -t 10.96.0.10:80 -r 10.244.1.2:8080 -m -w 1",
    ]
    assert out["service"]["address"] == "10.96.0.10" and out["service"]["scheduler"] == "rr"
    assert [(r["address"], r["port"], r["forwarding"], r["weight"]) for r in out["real_servers"]] == [
        ("10.244.1.1", 8080, "masquerade", 1), ("10.244.1.2", 8080, "masquerade", 1)]


def test_second_run_is_unchanged(capsys):
    run_module(capsys, WEB)
    out = run_module(capsys, WEB)
    assert not out["changed"] and out["changes"] == []


def test_check_mode_changes_nothing_and_predicts_the_result(capsys, fake_kernel):
    out = run_module(capsys, WEB, check=True, diff=True)
    assert out["changed"] and fake_kernel.services == {}
    assert len(out["real_servers"]) == 2
    assert out["diff"]["before"] == ""
    assert out["diff"]["after"] == ("TCP  10.96.0.10:80 rr\n"
                                    "  -> 10.244.1.1:8080              Masq    1\n"
                                    "  -> 10.244.1.2:8080              Masq    1\n")


def test_diff_shows_the_change(capsys):
    run_module(capsys, WEB)
    args = dict(WEB, scheduler="wrr", real_servers=[dict(address="10.244.1.1", port=8080, weight=3,
                                                         forwarding="masquerade")])
    out = run_module(capsys, args, diff=True)
    assert out["diff"]["before_header"] == "ipvs TCP 10.96.0.10:80"
    assert out["diff"]["before"].splitlines()[0] == "TCP  10.96.0.10:80 rr"
    assert out["diff"]["after"] == ("TCP  10.96.0.10:80 wrr\n"
                                    "  -> 10.244.1.1:8080              Masq    3\n"
                                    "  -> 10.244.1.2:8080              Masq    1\n")  # not purged


def test_purge_real_servers_makes_the_list_exact(capsys):
    run_module(capsys, WEB)
    args = dict(WEB, real_servers=[dict(address="10.244.1.3", port=8080, forwarding="masquerade")])
    out = run_module(capsys, dict(args, purge_real_servers=True))
    assert out["changes"] == ["-d -t 10.96.0.10:80 -r 10.244.1.1:8080", "-d -t 10.96.0.10:80 -r 10.244.1.2:8080",
                              "-a -t 10.96.0.10:80 -r 10.244.1.3:8080 -m -w 1"]
    assert [r["address"] for r in out["real_servers"]] == ["10.244.1.3"]


def test_absent_removes_the_service_and_is_idempotent(capsys, fake_kernel):
    run_module(capsys, WEB)
    out = run_module(capsys, dict(address="10.96.0.10", port=80, state="absent"), diff=True)
    assert out["changed"] and out["changes"] == ["-D -t 10.96.0.10:80"] and fake_kernel.services == {}
    assert out["service"] == {} and out["real_servers"] == [] and out["diff"]["after"] == ""
    assert not run_module(capsys, dict(address="10.96.0.10", port=80, state="absent"))["changed"]


def test_forwarding_defaults_to_ipvsadms_direct_routing_and_port_to_the_virtual_port(capsys):
    out = run_module(capsys, dict(address="10.96.0.10", port=80, real_servers=[dict(address="10.244.1.1")]))
    assert out["changes"][1] == "-a -t 10.96.0.10:80 -r 10.244.1.1:80 -g -w 1"
    assert out["real_servers"][0]["forwarding"] == "route"
    assert out["service"]["scheduler"] == "wlc"


def test_fwmark_service(capsys):
    args = dict(fwmark=7, scheduler="sh", scheduler_flags=["sh-port"], persistence_timeout=60,
                real_servers=[dict(address="10.244.1.1", forwarding="masquerade")])
    out = run_module(capsys, args)
    assert out["changes"] == ["-A -f 7 -s sh -b sh-port -p 60", "-a -f 7 -r 10.244.1.1:0 -m -w 1"]
    assert out["service"]["fwmark"] == 7 and out["service"]["protocol"] is None
    assert out["service"]["scheduler_flags"] == ["sh-port"] and out["service"]["persistence_timeout"] == 60
    assert not run_module(capsys, args)["changed"]


def test_ipv6_fwmark_and_persistence_netmask(capsys):
    out = run_module(capsys, dict(fwmark=8, family="ipv6", persistence_timeout=30, persistence_netmask="64"))
    assert out["changes"] == ["-A -f 8 -6 -s wlc -p 30 -M 64"]
    out = run_module(capsys, dict(address="10.96.0.10", port=0, persistence_timeout=30,
                                  persistence_netmask="255.255.255.0", protocol="udp"))
    assert out["changes"] == ["-A -u 10.96.0.10:0 -s wlc -p 30 -M 255.255.255.0"]
    assert out["service"]["persistence_netmask"] == "255.255.255.0"


def test_missing_scheduler_is_named_in_a_real_run_and_in_check_mode(capsys):
    for check in (False, True):
        out = run_module(capsys, dict(WEB, scheduler="twos"), check=check)
        assert out["failed"] and out["msg"] == (
            "scheduler 'twos' is not available in this kernel (module ip_vs_twos not found)")


def test_no_ipvs_fails_cleanly(capsys, monkeypatch):
    def unavailable(self, vs):
        raise ipvs.IPVSUnavailable("kernel has no IPVS (modprobe ip_vs)", errno.ENOENT)
    monkeypatch.setattr(FakeKernel, "get", unavailable)
    out = run_module(capsys, WEB)
    assert out["failed"] and out["msg"] == "kernel has no IPVS (modprobe ip_vs)" and out["errno"] == errno.ENOENT


def test_netns_is_passed_to_the_kernel(capsys, fake_kernel):
    run_module(capsys, dict(WEB, netns="node1"))
    assert fake_kernel.opened == ["node1"]


@pytest.mark.parametrize("args,message", [
    (dict(address="10.0.0.1"), "parameters are required together: address, port"),
    (dict(scheduler="rr"), "one of the following is required: address, fwmark"),
    (dict(port=80), "parameters are required together: address, port"),
    (dict(fwmark=1, address="10.0.0.1"), "mutually exclusive: fwmark|address"),
    (dict(fwmark=1, protocol="udp"), "mutually exclusive: fwmark|protocol"),
    (dict(address="10.0.0.1", port=80, scheduler_flags=["sh-port"]), "'sh-port' needs scheduler 'sh', not 'wlc'"),
    (dict(address="10.0.0.1", port=80, scheduler_flags=["bogus"]), "value of scheduler_flags must be one or more"),
    (dict(address="10.0.0.1", port=0), "port 0 virtual service must be persistent"),
    (dict(address="10.0.0.1", port=80, persistence_timeout=-5), "must not be negative"),
    (dict(address="not-an-ip", port=80), "ipvs_virtual_server: address: must be a valid IP address"),
    (dict(address="10.0.0.1", port=80, persistence_netmask="255.0.255.0", persistence_timeout=5), "contiguous"),
    (dict(address="10.0.0.1", port=80, real_servers=[dict(address="10.1.0.1", port=8080)]),
     "with route forwarding the port must be the virtual port 80"),
    (dict(address="10.0.0.1", port=80, real_servers=[dict(address="10.1.0.1", weight=-1)]), "weight -1 out of range"),
    (dict(address="10.0.0.1", port=80, real_servers=[dict(address="10.1.0.1"), dict(address="10.1.0.1")]),
     "listed twice"),
    (dict(address="10.0.0.1", port=80, real_servers=[dict(address="10.1.0.1", l_threshold=3)]),
     "lower threshold 3 is above the upper threshold 0"),
    (dict(address="10.0.0.1", port=80, real_servers=[dict(port=80)]), "missing required arguments: address"),
    # validation.py's strict IP syntax and names that reach paths or the kernel
    (dict(address="010.0.0.1", port=80), "ipvs_virtual_server: address: must not have leading 0s: '010.0.0.1'"),
    (dict(address="::ffff:10.0.0.1", port=80), "address: must not be an IPv4-mapped IPv6 address"),
    (dict(address="fe80::1%eth0", port=80), "address: must be a valid IP address"),
    (dict(address="10.0.0.1", port=80, real_servers=[dict(address="10.1.0.01")]),
     "real_servers[0].address: must not have leading 0s"),
    (dict(address="10.0.0.1", port=70000), "port: must be between 0 and 65535"),
    (dict(address="10.0.0.1", port=80, scheduler="../../x"), "scheduler: must be a scheduler name"),
    (dict(address="10.0.0.1", port=80, netns="../../etc"), "netns: must be a network namespace name"),
])
def test_bad_arguments_fail_with_a_clear_message(capsys, args, message):
    out = run_module(capsys, args)
    assert out["failed"] and message in out["msg"], out["msg"]


def test_a_refused_change_fails_and_names_it(capsys, fake_kernel, monkeypatch):
    def refuse_dests(self, ops):
        result = ipvs.ApplyResult()
        for op in ops:
            if op.kind == ipvs.ADD_DEST:
                result.errors.append((op, ipvs.explain(op, errno.ERANGE)))
            else:
                result.applied += 1
        return result
    monkeypatch.setattr(FakeKernel, "apply", refuse_dests)
    out = run_module(capsys, WEB)
    assert out["failed"] and out["changed"] and out["failed_change"] == "-a -t 10.96.0.10:80 -r 10.244.1.1:8080 -m -w 1"
    assert len(out["errors"]) == 2 and "weight or thresholds out of range" in out["msg"]


def test_desired_service_conversion():
    state = mod.desired_service(dict(
        protocol="sctp", address="10.0.0.5", port=9999, fwmark=None, family="ipv4", scheduler="mh",
        scheduler_flags=["mh-fallback", "mh-port"], persistence_timeout=0, persistence_netmask=None,
        real_servers=[dict(address="10.1.0.1", port=None, weight=2, forwarding="tunnel", u_threshold=10,
                           l_threshold=2)]))
    assert state.virtual.key == (4, "SCTP", "10.0.0.5", 9999, 0)
    assert state.virtual.flags == ipvs.IP_VS_SVC_F_SCHED1 | ipvs.IP_VS_SVC_F_SCHED2
    (rs,) = state.real_servers
    assert (rs.port, rs.weight, ipvs.forwarding_value(rs.forwarding), rs.u_threshold, rs.l_threshold) == (
        9999, 2, ipvs.IP_VS_CONN_F_TUNNEL, 10, 2)


def test_netns_without_pyroute2_names_the_missing_library(capsys, monkeypatch):
    monkeypatch.setattr(mod, "pyroute2_error", lambda: "Traceback: No module named 'pyroute2'")
    out = run_module(capsys, dict(WEB, netns="node1"))
    assert out["failed"] and "Failed to import the required Python library (pyroute2)" in out["msg"]
    assert "to use netns" in out["msg"]
    assert not run_module(capsys, dict(WEB)).get("failed")  # not needed without netns
