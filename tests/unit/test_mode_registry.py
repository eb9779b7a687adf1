"""The mode registry: every mode is registered once, and --cleanup's order works on a node
that ran IPVS mode (its chains jump to KUBE-MARK-MASQ, which iptables mode's cleanup deletes;
IPVS mode's cleanup removes the chains of both, so it must go first)."""

from __future__ import annotations

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import modes


def test_every_upstream_mode_is_implemented():
    assert set(modes.names()) == set(modes.UPSTREAM_MODES)


@pytest.mark.parametrize("configured", ["iptables", "ipvs", "nftables"])
def test_cleanup_runs_every_mode_once_ipvs_first_and_the_configured_one_last_otherwise(configured):
    order = [m.name for m in modes.cleanup_order(configured)]
    assert sorted(order) == sorted(modes.names())
    assert order[0] == "ipvs"
    if configured != "ipvs":
        assert order[-1] == configured


@pytest.mark.parametrize("name", ["iptables", "ipvs", "nftables"])
def test_every_mode_hook_resolves(name):
    mode = modes.get(name)
    for attr in ("proxier", "config", "cleanup"):
        assert callable(mode._hook(attr)), (name, attr)


@pytest.mark.parametrize("configured,removed", [
    ("nftables", ["ipvs", "iptables"]),  # IPVS first: its cleanup removes iptables mode's chains too
    ("iptables", ["nftables"]),
    ("ipvs", ["nftables"]),  # iptables and IPVS mode share iptables rules: as upstream, kept
])
def test_starting_a_mode_removes_the_other_backends_leftovers(configured, removed):
    assert [m.name for m in modes.other_backends(configured)] == removed
