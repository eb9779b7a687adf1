"""Restart of a large iptables table: the record a clean shutdown writes, and the first sync
after a start that adopts it (writing only what changed while the daemon was down) or, when
a cheap check finds the kernel is not as recorded, rewrites everything. A fake kernel that
holds every chain's rules and applies restore input as iptables-restore --noflush does."""
import os
import stat

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (
    APPLIED_MARK,
    CANARY_CHAIN,
    Snapshot,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (
    IptablesProxier,
    chain_digest,
    record_path,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port

CFG = ipt.IptablesConfig(local_cidrs=("10.244.0.0/16",))


class RuleKernel:
    """Every chain's rules, as a large table that is never read rule by rule: the proxier
    sees only chain names and built-in chains (``complete=False``) and first rules."""

    diff_max_chains = 5000
    binary = "iptables"

    def __init__(self):
        self.rules = {}
        self.restores = []

    def netns_id(self):
        return "4026531840"

    listings = 0

    def snapshot_for_full_sync(self):
        self.listings += 1
        builtin = {k: list(v) for k, v in self.rules.items() if k[1] in ipt.BUILTIN_CHAINS}
        return Snapshot(builtin, set(self.rules), complete=False)

    def large_table_snapshot(self):
        return self.snapshot_for_full_sync()

    def builtin_snapshot(self):
        builtin = {k: list(v) for k, v in self.rules.items() if k[1] in ipt.BUILTIN_CHAINS}
        return Snapshot(builtin, set(), complete=False, listed=False)

    def restore(self, text):
        self.restores.append(text)
        table = ""
        for line in text.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                self.rules[(table, line[1:].split()[0])] = []  # --noflush: a declared chain is flushed
            elif line.startswith("-X "):
                del self.rules[(table, line.split()[1])]
            elif line.startswith("-A "):
                _verb, chain, rule = line.split(" ", 2)
                self.rules.setdefault((table, chain), []).append(rule)
            elif line.startswith("-I "):
                _verb, chain, _pos, rule = line.split(" ", 3)
                self.rules.setdefault((table, chain), []).insert(0, rule)
            elif line.startswith("-D "):
                _verb, chain, rule = line.split(" ", 2)
                self.rules[(table, chain)].remove(rule)
        return 0.0

    def missing_canaries(self, tables=("mangle", "nat", "filter")):
        return [t for t in tables if (t, CANARY_CHAIN) not in self.rules]

    def create_canaries(self, tables):
        for t in tables:
            self.rules[(t, CANARY_CHAIN)] = []

    def mark_applied(self, token):
        self.rules[("nat", CANARY_CHAIN)] = [f"-m comment --comment {APPLIED_MARK}{token}"]

    def first_rule(self, table, chain):
        rules = self.rules.get((table, chain))
        if rules is None:
            return None
        return rules[0] if rules else ""

    def ours(self):
        """Our chains' content; shared chains as sorted multisets (their order after partial
        syncs is not the compiled one, and does not matter)."""
        return {k: sorted(v) if k[1] in ipt.SHARED_CHAINS else v for k, v in self.rules.items()
                if k[1] != CANARY_CHAIN}


def cluster(n=4, moved=None):
    """n services with two endpoints each; ``moved``: service index whose 2nd endpoint moved."""
    state = ProxyState("node1")
    for i in range(n):
        second = f"10.244.{i}.9" if i == moved else f"10.244.{i}.2"
        state.set_service(parse_service(service("default", f"s{i}", f"10.96.0.{i + 1}", [port("http", 80)])))
        state.set_slice(parse_endpoint_slice(endpoint_slice(
            "default", f"s{i}", [endpoint(f"10.244.{i}.1"), endpoint(second)], [slice_port("http", 8080)])))
    return state


def declared(text):
    return {line[1:].split()[0] for line in text.splitlines() if line.startswith(":")}


@pytest.fixture
def stopped(tmp_path):
    """A kernel as a clean shutdown leaves it, and the record's path."""
    kernel = RuleKernel()
    first = IptablesProxier(cluster(), CFG, kernel)
    assert first.sync().full
    path = str(tmp_path / "run" / "applied.json")
    assert first.save_record(path).startswith("recorded the ")
    kernel.restores.clear()
    return kernel, path


def expected(state):
    """What a full rewrite into an empty table leaves for ``state``."""
    kernel = RuleKernel()
    IptablesProxier(state, CFG, kernel).sync()
    return kernel.ours()


def test_record_is_root_only_and_tied_to_the_kernel_by_a_token(stopped):
    kernel, path = stopped
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    (mark,) = kernel.rules[("nat", CANARY_CHAIN)]
    assert APPLIED_MARK in mark


def test_restart_adopts_the_record_and_writes_only_what_changed_while_down(stopped):
    kernel, path = stopped
    state = cluster(moved=2)
    proxier = IptablesProxier(state, CFG, kernel)
    assert proxier.load_record(path).startswith("found the record")
    assert not os.path.exists(path)  # used once: it describes the kernel only until we write
    result = proxier.sync()
    assert result.full and result.restart.startswith("adopted the rules recorded at shutdown"), result.restart
    (text,) = kernel.restores
    written = {n for n in declared(text) if n.startswith(ipt.SERVICE_CHAIN_PREFIXES)}
    # s2's service chain and its new endpoint chain; the old endpoint chain is deleted.
    assert len(written) == 3 and all(n in text for n in written), written
    assert not declared(text) & {"KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"}
    assert len([line for line in text.splitlines() if line.startswith("-X KUBE-SEP-")]) == 1
    assert kernel.ours() == expected(state)
    assert kernel.rules[("nat", CANARY_CHAIN)] == []  # the token is gone with the first write
    # The hourly rewrite keeps the recorded schedule: the next periodic sync only checks.
    kernel.restores.clear()
    assert not proxier.sync(force_full=True).full and kernel.restores == []


def test_nothing_changed_while_down_writes_nothing(stopped):
    kernel, path = stopped
    proxier = IptablesProxier(cluster(), CFG, kernel)
    proxier.load_record(path)
    result = proxier.sync()
    assert result.restart.startswith("adopted") and result.rules_written == 0 and kernel.restores == []


def rewritten_everything(kernel, state, result, why):
    assert why in result.restart, result.restart
    (text,) = kernel.restores
    services = {n for n in declared(text) if n.startswith("KUBE-SVC-")}
    assert len(services) == 4, "a kernel not as recorded must be rewritten, not trusted"
    assert kernel.ours() == expected(state)


def test_a_full_sync_by_another_writer_invalidates_the_record(stopped):
    kernel, path = stopped
    IptablesProxier(cluster(moved=1), CFG, kernel).sync()  # e.g. the Ansible module, daemon down
    assert kernel.rules[("nat", CANARY_CHAIN)] == []
    state = cluster(moved=2)
    kernel.restores.clear()
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    rewritten_everything(kernel, state, proxier.sync(), "its token is not in nat KUBE-PROXY-CANARY")


def test_firewall_reload_while_down_is_not_trusted(stopped):
    kernel, path = stopped
    del kernel.rules[("filter", CANARY_CHAIN)]
    state = cluster()
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    rewritten_everything(kernel, state, proxier.sync(), "a canary chain is missing")


def test_flushed_kube_services_while_down_is_not_trusted(stopped):
    kernel, path = stopped
    kernel.rules[("nat", "KUBE-SERVICES")] = []
    state = cluster()
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    rewritten_everything(kernel, state, proxier.sync(), "nat KUBE-SERVICES does not start as recorded")


def test_flushed_service_chain_while_down_is_not_trusted(stopped):
    kernel, path = stopped
    svc_chain = sorted(k for k in kernel.rules if k[1].startswith("KUBE-SVC-"))[0]
    kernel.rules[svc_chain] = []
    state = cluster()
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    rewritten_everything(kernel, state, proxier.sync(), f"{svc_chain[1]} does not start as recorded")


def test_deleted_or_foreign_chain_while_down_is_not_trusted(stopped):
    kernel, path = stopped
    sep = sorted(k for k in kernel.rules if k[1].startswith("KUBE-SEP-"))[0]
    del kernel.rules[sep]
    state = cluster()
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    rewritten_everything(kernel, state, proxier.sync(), "the chain listing differs from the record")


def test_no_record_when_the_kernel_is_not_known_exactly(tmp_path):
    kernel = RuleKernel()
    proxier = IptablesProxier(cluster(), CFG, kernel)
    proxier.sync()
    proxier.need_full = True  # e.g. the last sync failed
    path = str(tmp_path / "applied.json")
    assert proxier.save_record(path).startswith("no record")
    assert not os.path.exists(path) and kernel.rules[("nat", CANARY_CHAIN)] == []


@pytest.mark.parametrize("content,mode", [('{"version": 1, "token": "x", "chains": {}}', 0o644),
                                          ("not json", 0o600),
                                          ('{"version": 99, "token": "x", "chains": {}}', 0o600),
                                          ('{"version": 1, "token": "x", "chains": {"nochain": "d"}}', 0o600)])
def test_a_record_that_is_not_ours_is_ignored_and_removed(tmp_path, content, mode):
    path = tmp_path / "applied.json"
    path.write_text(content)
    path.chmod(mode)
    proxier = IptablesProxier(cluster(), CFG, RuleKernel())
    assert proxier.load_record(str(path)).startswith("ignored")
    assert proxier.record is None and not path.exists()
    assert proxier.load_record(str(path)) == ""  # none at all: nothing to say


def test_shared_chain_digest_ignores_order_owned_chain_digest_does_not():
    assert chain_digest("KUBE-SERVICES", ["a", "b"]) == chain_digest("KUBE-SERVICES", ["b", "a"])
    assert chain_digest("KUBE-SVC-X", ["a", "b"]) != chain_digest("KUBE-SVC-X", ["b", "a"])


def test_record_path_is_per_namespace_and_binary():
    kernel = RuleKernel()
    assert record_path(kernel, "/run/x") == "/run/x/iptables-applied-iptables-netns4026531840.json"


def test_the_listing_made_while_the_sources_load_is_used_by_the_first_sync(stopped):
    kernel, path = stopped
    state = cluster(moved=2)
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    before = kernel.listings
    assert proxier.prefetch() and not proxier.prefetch()  # one listing, started once
    result = proxier.sync()
    assert result.restart.startswith("adopted") and "read while the sources loaded" in result.restart, result.restart
    assert kernel.listings == before + 1 and kernel.ours() == expected(state)


def test_a_full_sync_by_another_writer_after_the_listing_still_invalidates_the_record(stopped):
    """The token is checked at the first sync, not when the chains were listed; the rewrite
    then plans against a fresh listing, not the one made while the sources loaded."""
    kernel, path = stopped
    state = cluster(moved=1)
    proxier = IptablesProxier(state, CFG, kernel)
    proxier.load_record(path)
    before = kernel.listings
    proxier.prefetch()
    proxier._prefetch.join()
    IptablesProxier(cluster(n=6), CFG, kernel).sync()  # e.g. the Ansible module, meanwhile
    kernel.restores.clear()
    result = proxier.sync()
    assert "its token is not in nat KUBE-PROXY-CANARY" in result.restart, result.restart
    assert kernel.listings == before + 3  # the prefetch, the other writer's, and the fresh one
    assert kernel.ours() == expected(state)


def test_no_prefetch_without_a_record():
    proxier = IptablesProxier(cluster(), CFG, RuleKernel())
    assert not proxier.prefetch()
