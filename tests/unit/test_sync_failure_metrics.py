"""What the node's hooks make of a failed sync, and what /proxyMode answers: upstream counts
``kubeproxy_sync_proxy_rules_iptables_restore_failures_total`` only when an iptables-restore
failed (in iptables and IPVS mode) and the partial counter only for a partial attempt; an
IPVS or ipset failure is no restore failure. The proxiers run over the in-memory kernels."""
from __future__ import annotations

import urllib.request
from typing import List

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.app import NodeHooks
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs as k
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import KernelError
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import IptablesProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port
from .ipvs_fakes import FakeIptables
from .test_ipvs_proxier import Node

RESTORE = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
PARTIAL = "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"
OURS = "kubenode_proxy_sync_failures_total"


def counters(hooks: NodeHooks) -> dict:
    values = {}
    for line in hooks.metrics.render().splitlines():
        name, _sep, value = line.partition(" ")
        if name in (RESTORE, PARTIAL, OURS):
            values[name] = float(value)
    return values


def hooks_for(mode: str, proxier) -> NodeHooks:
    cfg = kpconfig.ProxyConfig()
    cfg.mode = mode
    logs: List[str] = []
    return NodeHooks(cfg, proxier.state, proxier, "", logs.append)


def fail_once(hooks: NodeHooks, proxier) -> BaseException:
    with pytest.raises(KernelError) as info:
        proxier.sync()
    hooks.sync_failed(info.value)
    return info.value


def web(state: ProxyState, ips=("10.244.1.1",)) -> None:
    state.set_service(parse_service(service("default", "web", "10.96.0.10", [port(name="http", port=80)])))
    state.set_slice(parse_endpoint_slice(endpoint_slice(
        "default", "web", [endpoint(ip, node="node1") for ip in ips], [slice_port(name="http", port=8080)])))


def test_an_ipvs_failure_is_not_an_iptables_restore_failure() -> None:
    n = Node()
    n.web()
    n.proxier.sync()
    hooks = hooks_for("ipvs", n.proxier)
    n.ipvs.fail = {k.ADD_DEST}
    n.web(ips=("10.244.1.1", "10.244.1.9"))
    fail_once(hooks, n.proxier)
    assert counters(hooks) == {RESTORE: 0, PARTIAL: 0, OURS: 1}


def test_an_iptables_restore_failure_in_ipvs_mode_is_counted() -> None:
    n = Node()
    hooks = hooks_for("ipvs", n.proxier)
    n.web()
    n.ipt.fail_restore = "iptables-restore: line 3 failed"
    error = fail_once(hooks, n.proxier)
    assert "iptables-restore: line 3 failed" in str(error)
    # A full sync (the first one): restore failure, not a partial one.
    assert counters(hooks) == {RESTORE: 1, PARTIAL: 0, OURS: 1}


def iptables_node() -> tuple:
    state = ProxyState("node1")
    kernel = FakeIptables()
    proxier = IptablesProxier(state, IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.244.0.0/16",)),
                              kernel)
    return state, kernel, proxier


def test_iptables_mode_counts_a_partial_restore_failure_as_both() -> None:
    state, kernel, proxier = iptables_node()
    web(state)
    assert proxier.sync().full
    hooks = hooks_for("iptables", proxier)
    web(state, ips=("10.244.1.1", "10.244.1.2"))
    kernel.fail_restore = "iptables-restore: line 7 failed"
    fail_once(hooks, proxier)
    assert not proxier.last_attempt_full
    assert counters(hooks) == {RESTORE: 1, PARTIAL: 1, OURS: 1}


def test_iptables_mode_a_failure_that_is_no_restore_is_not_counted_as_one() -> None:
    state, kernel, proxier = iptables_node()
    web(state)

    def save_fails(*args, **kwargs):
        raise KernelError("iptables-save failed: permission denied")

    kernel.snapshot_for_full_sync = save_fails
    hooks = hooks_for("iptables", proxier)
    fail_once(hooks, proxier)
    assert counters(hooks) == {RESTORE: 0, PARTIAL: 0, OURS: 1}


@pytest.mark.parametrize("mode", ["iptables", "ipvs"])
def test_proxy_mode_answers_the_configured_mode_over_http(mode: str) -> None:
    n = Node()
    hooks = hooks_for(mode, n.proxier)
    hooks.cfg.metrics_bind_address = "127.0.0.1:0"
    hooks.metrics_server.start()
    try:
        with urllib.request.urlopen(f"http://{hooks.metrics_server.address}/proxyMode", timeout=5) as resp:
            assert (resp.status, resp.read()) == (200, mode.encode())
    finally:
        hooks.stop()
