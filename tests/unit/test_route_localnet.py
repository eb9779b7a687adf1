"""When the iptables proxier turns route_localnet on (upstream's NewProxier rule), and
kernel/sysctl.py's EnsureSysctl over a stand-in /proc/sys tree (real files)."""
from __future__ import annotations

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import sysctl
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (
    ensure_route_localnet,
    localhost_nodeports_on,
)


@pytest.mark.parametrize("cfg, on", [
    (IptablesConfig(), True),  # default: localhostNodePorts, every address
    (IptablesConfig(localhost_nodeports=False), False),
    (IptablesConfig(node_port_match_all=False, node_port_ips=("192.168.50.1",)), False),
    (IptablesConfig(node_port_match_all=False, node_port_ips=("192.168.50.1", "127.0.0.1")), True),
    (IptablesConfig(node_port_match_all=False, node_port_ips=("::1",)), False),  # IPv6 loopback: not route_localnet
])
def test_localhost_nodeports_on_follows_upstream(cfg, on):
    assert localhost_nodeports_on(cfg) is on


def test_ensure_here_writes_only_what_differs_and_check_writes_nothing(tmp_path):
    key = tmp_path / "net" / "ipv4" / "conf" / "all" / "route_localnet"
    key.parent.mkdir(parents=True)
    key.write_text("0\n")
    values = {sysctl.ROUTE_LOCALNET: 1}
    assert sysctl.ensure_here(values, check=True, root=str(tmp_path)) == {sysctl.ROUTE_LOCALNET: "0 -> 1"}
    assert key.read_text() == "0\n"
    assert sysctl.ensure_here(values, root=str(tmp_path)) == {sysctl.ROUTE_LOCALNET: "0 -> 1"}
    assert key.read_text() == "1\n"
    assert sysctl.ensure_here(values, root=str(tmp_path)) == {}
    with pytest.raises(sysctl.SysctlError, match="net.ipv4.nope: no such sysctl"):
        sysctl.ensure_here({"net.ipv4.nope": 1}, root=str(tmp_path))


def test_a_namespace_that_cannot_be_entered_is_a_clear_error():
    with pytest.raises(sysctl.SysctlError, match=r"cannot set net.ipv4.conf.all.route_localnet=1 in network "
                                                 r"namespace kn-no-such-ns: .*kn-no-such-ns"):
        sysctl.ensure({sysctl.ROUTE_LOCALNET: 1}, "kn-no-such-ns")


def test_the_proxier_logs_before_it_sets_and_skips_when_off(monkeypatch):
    logs = []
    calls = []

    def fake_ensure(values, netns="", check=False, runner=None):
        calls.append((dict(values), netns))
        return {sysctl.ROUTE_LOCALNET: "0 -> 1"}

    # The real one: tests/integration/test_traffic.py::test_localhost_nodeports.
    monkeypatch.setattr(sysctl, "ensure", fake_ensure)
    assert ensure_route_localnet(IptablesConfig(), "node-ns", logs.append) is True
    assert ensure_route_localnet(IptablesConfig(localhost_nodeports=False), "node-ns", logs.append) is False
    assert calls == [({sysctl.ROUTE_LOCALNET: 1}, "node-ns")]
    assert logs[0].startswith("setting net.ipv4.conf.all.route_localnet=1 to allow NodePorts on localhost")
    assert logs[1] == "sysctl net.ipv4.conf.all.route_localnet: 0 -> 1"
