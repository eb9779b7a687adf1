"""NftablesProxier.check(): the node-wide chains' rule counts decide (netlink, cheap); the
canary set is listed only to name the cause, or when counting is not possible. The real
kernel side: tests/integration/test_nftables_traffic.py (flush table, flush chain, delete
table, flush ruleset, each repaired) and benchmarks/bench_nft_check.py (cost at 10k)."""
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.errors import Unavailable
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import compile as nc
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import NftablesProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState


class FakeKernel:
    def __init__(self, cfg):
        self.counts = {c: len(r) for c, r in nc.infrastructure(cfg).rules.items()}
        self.canary = [nc.CANARY_ELEMENT]
        self.listed = 0
        self.counting = True

    def apply(self, script, check_only=False):
        pass

    def rule_counts(self, family, table, chains):
        if not self.counting:
            raise Unavailable("no netlink here")
        return {c: self.counts.get(c, 0) for c in chains}

    def set_elements(self, family, table, name):
        self.listed += 1
        return self.canary


def synced():
    cfg = nc.NftablesConfig()
    kernel = FakeKernel(cfg)
    proxier = NftablesProxier(ProxyState("n"), cfg, kernel)
    proxier.sync(force_full=True)
    return proxier, kernel


def test_intact_table_is_one_count_and_no_nft_listing():
    proxier, kernel = synced()
    assert proxier.check() is False and kernel.listed == 0


def test_a_flushed_dispatch_chain_is_seen_and_named():
    proxier, kernel = synced()
    kernel.counts["services"] = 0
    assert proxier.check() is True
    assert proxier.pending_repair == ("chain ip kube-proxy services has 0 rule(s), 2 written "
                                      "(table or chain flushed?)")
    assert proxier.sync().full  # the repair is a full rewrite


def test_a_deleted_table_is_named_by_the_canary():
    proxier, kernel = synced()
    kernel.counts = {}
    kernel.canary = None
    assert proxier.check() is True and "is gone (table deleted?)" in proxier.pending_repair


def test_without_netlink_the_canary_alone_decides():
    proxier, kernel = synced()
    kernel.counting = False
    assert proxier.check() is False and kernel.listed == 1
    kernel.canary = None
    assert proxier.check() is True
