"""Canary chains, the top-level dispatch check, the targeted repair of a large table, and
xtables-lock failures: kernel-facing parts with a fake command runner, the proxier with
a fake kernel, the runner with a real thread."""
import subprocess
import threading
import time

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (
    CANARY_CHAIN,
    IptablesKernel,
    KernelError,
    LockBusy,
    Snapshot,
    cleanup_text,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (
    LISTING_EVERY,
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sync import BoundedFrequencyRunner

from .helpers import endpoint, endpoint_slice, port, service, slice_port

LOCK_MSG = "Another app is currently holding the xtables lock. Stopped waiting after 5s.\n"


def runner_of(answers):
    """A subprocess.run stand-in: answers[(table, chain)] = (returncode, stdout, stderr)."""
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        table = argv[argv.index("-t") + 1] if "-t" in argv else ""
        chain = argv[argv.index("-S") + 1] if "-S" in argv else ""
        rc, out, err = answers.get((table, chain), (0, "", ""))
        return subprocess.CompletedProcess(argv, rc, out, err)

    run.calls = calls
    return run


# --- kernel -------------------------------------------------------------------------


def test_missing_canaries_reads_the_exit_status_of_each_table():
    run = runner_of({("nat", CANARY_CHAIN): (1, "", "iptables: No chain/target/match by that name.\n")})
    k = IptablesKernel(netns="n1", runner=run)
    assert k.missing_canaries() == ["nat"]
    # One "iptables -w 1 -t T -S KUBE-PROXY-CANARY" per table, inside the namespace.
    assert [c[c.index("-t") + 1] for c in run.calls] == ["mangle", "nat", "filter"]
    assert all(c[:4] == ["ip", "netns", "exec", "n1"] and c[c.index("-w") + 1] == "1" for c in run.calls)
    assert IptablesKernel(runner=runner_of({})).missing_canaries() == []


def test_canary_check_is_undecided_while_the_lock_is_held():
    k = IptablesKernel(runner=runner_of({("nat", CANARY_CHAIN): (4, "", LOCK_MSG)}))
    assert k.missing_canaries() is None  # not "gone": a held lock must not trigger a repair


def test_canary_check_reports_other_failures():
    k = IptablesKernel(runner=runner_of({("mangle", CANARY_CHAIN): (2, "", "iptables: bad argument\n")}))
    with pytest.raises(KernelError, match="mangle -S KUBE-PROXY-CANARY failed: iptables: bad argument"):
        k.missing_canaries()


def test_first_rule():
    run = runner_of({("nat", "KUBE-SERVICES"): (0, "-A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-X\n", ""),
                     ("nat", "KUBE-NODEPORTS"): (0, "", ""),
                     ("filter", "KUBE-SERVICES"): (1, "", "iptables: No chain/target/match by that name.\n")})
    k = IptablesKernel(runner=run)
    assert k.first_rule("nat", "KUBE-SERVICES") == "-d 10.96.0.1/32 -j KUBE-SVC-X"
    assert run.calls[-1][-3:] == ["-S", "KUBE-SERVICES", "1"]  # only the first rule is printed
    assert k.first_rule("nat", "KUBE-NODEPORTS") == ""
    assert k.first_rule("filter", "KUBE-SERVICES") is None


def restore_runner(rc, err):
    def run(argv, **kw):
        if argv[-1] == "--version":
            return subprocess.CompletedProcess(argv, 0, "iptables v1.8.9 (legacy)\n", "")
        return subprocess.CompletedProcess(argv, rc, "", err)
    return run


def test_restore_refused_for_the_lock_is_lock_busy():
    with pytest.raises(LockBusy, match="held the xtables lock") as e:
        IptablesKernel(runner=restore_runner(4, LOCK_MSG)).restore("*nat\nCOMMIT\n")
    assert e.value.retry_soon and isinstance(e.value, KernelError)
    # Exit status 4 for another reason, or a parse error: an ordinary failure.
    for rc, err in ((4, "iptables-restore: out of memory\n"), (1, "iptables-restore: line 2 failed\n")):
        with pytest.raises(KernelError) as e:
            IptablesKernel(runner=restore_runner(rc, err)).restore("*nat\nCOMMIT\n")
        assert not isinstance(e.value, LockBusy)


def test_cleanup_removes_the_canaries_of_every_table():
    snap = Snapshot(rules={}, chains={("mangle", CANARY_CHAIN), ("nat", CANARY_CHAIN), ("filter", CANARY_CHAIN),
                                      ("mangle", "OTHER"), ("nat", "KUBE-SERVICES")})
    text = cleanup_text(snap)
    for table in ("mangle", "nat", "filter"):
        section = text.split(f"*{table}\n", 1)[1].split("COMMIT", 1)[0]
        assert f"-X {CANARY_CHAIN}" in section
    assert "OTHER" not in text


# --- proxier with a fake kernel ---------------------------------------------------------


class FakeKernel:
    """Chain names, built-in chains' rules and first rules as a large table shows them."""

    def __init__(self):
        self.chains = set()
        self.builtin = {}
        self.first = {}  # (table, chain) -> first rule ("" empty); missing key: the real first rule
        self.canaries = set()
        self.restores = []
        self.fail = None
        self.created = []

    diff_max_chains = 5000  # as IptablesKernel: above this many of our chains, listings are rationed
    listings = 0

    def snapshot_for_full_sync(self):
        self.listings += 1
        return Snapshot({k: list(v) for k, v in self.builtin.items()}, set(self.chains), complete=False)

    def builtin_snapshot(self):
        return Snapshot({k: list(v) for k, v in self.builtin.items()}, set(), complete=False, listed=False)

    def restore(self, text):
        if self.fail is not None:
            raise self.fail
        self.restores.append(text)
        table = ""
        for line in text.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                self.chains.add((table, line[1:].split()[0]))
                self.first.pop((table, line[1:].split()[0]), None)
            elif line.startswith("-X "):
                self.chains.discard((table, line.split()[1]))
            elif line.startswith("-I ") and line.split()[1] in ipt.BUILTIN_CHAINS:
                rest = line.split(" ", 3)[3]
                self.builtin.setdefault((table, line.split()[1]), []).insert(0, rest)
        return 0.0

    def missing_canaries(self, tables=("mangle", "nat", "filter")):
        return [t for t in tables if t not in self.canaries]

    def create_canaries(self, tables):
        self.created.append(list(tables))
        self.canaries |= set(tables)

    def first_rule(self, table, chain):
        if (table, chain) not in self.chains:
            return None
        return self.first.get((table, chain), _REAL)


_REAL = object()


class Proxier(IptablesProxier):
    """first_rule() answers from what the proxier applied unless the fake overrides it."""

    def __init__(self, state, kernel):
        super().__init__(state, ipt.IptablesConfig(local_cidrs=("10.244.0.0/16",)), kernel)
        real = kernel.first_rule

        def first_rule(table, chain):
            got = real(table, chain)
            if got is _REAL:
                lines = [r for s in self.compiled.values()
                         for r in s.shared.get((table, chain), []) + s.chains.get((table, chain), [])]
                return lines[0] if lines else ""
            return got
        kernel.first_rule = first_rule


def cluster(n=3):
    state = ProxyState("node1")
    for i in range(n):
        state.set_service(parse_service(service("default", f"s{i}", f"10.96.0.{i + 1}", [port("http", 80)])))
        state.set_slice(parse_endpoint_slice(endpoint_slice(
            "default", f"s{i}", [endpoint(f"10.244.{i}.1"), endpoint(f"10.244.{i}.2")], [slice_port("http", 8080)])))
    return state


@pytest.fixture
def synced():
    kernel = FakeKernel()
    proxier = Proxier(cluster(), kernel)
    first = proxier.sync()
    assert first.full and kernel.created == [["mangle", "nat", "filter"]]
    kernel.restores.clear()
    return proxier, kernel


def declared(text):
    return {line[1:].split()[0] for line in text.splitlines() if line.startswith(":")}


def test_intact_large_table_resync_writes_nothing(synced):
    proxier, kernel = synced
    quiet = proxier.sync(force_full=True)
    assert not quiet.full and quiet.rules_written == 0 and not quiet.repair and kernel.restores == []


def test_flushed_kube_services_alone_is_repaired_by_the_periodic_sync(synced):
    proxier, kernel = synced
    kernel.first[("nat", "KUBE-SERVICES")] = ""  # iptables -t nat -F KUBE-SERVICES
    result = proxier.sync(force_full=True)
    assert result.repair == "nat KUBE-SERVICES is empty"
    (text,) = kernel.restores
    names = declared(text)
    assert {"KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-POSTROUTING"} <= names  # empty shared chains stay
    # The service chains the listing shows are trusted, not rewritten.
    assert not any(n.startswith(ipt.SERVICE_CHAIN_PREFIXES) for n in names), names
    assert text.count("-A KUBE-SERVICES -d 10.96.0.") == 3
    # Repaired: the next periodic check is quiet again.
    assert proxier.sync(force_full=True).rules_written == 0


def test_foreign_first_rule_counts_as_broken(synced):
    proxier, kernel = synced
    kernel.first[("nat", "KUBE-SERVICES")] = "-j ACCEPT"
    assert "starts with a rule not ours: -j ACCEPT" in proxier.sync(force_full=True).repair


def test_missing_service_chain_is_written_without_rewriting_the_others(synced):
    proxier, kernel = synced
    sep = sorted(c for t, c in kernel.chains if c.startswith("KUBE-SEP-"))[0]
    kernel.chains.discard(("nat", sep))
    result = proxier.sync(force_full=True)
    assert result.repair == "chain listing or built-in jumps differ"
    names = declared(kernel.restores[0])
    assert {n for n in names if n.startswith(ipt.SERVICE_CHAIN_PREFIXES)} == {sep}


def test_deleted_builtin_jump_is_put_back(synced):
    proxier, kernel = synced
    kernel.builtin[("nat", "PREROUTING")] = []
    result = proxier.sync(force_full=True)
    assert result.repair and "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES" \
        in kernel.restores[0]


def test_missing_canary_makes_the_next_sync_a_repair_and_recreates_it(synced):
    proxier, kernel = synced
    assert proxier.check() is False
    kernel.canaries.discard("nat")
    kernel.first[("nat", "KUBE-SERVICES")] = ""
    assert proxier.check() is True
    assert proxier.pending_repair == "canary KUBE-PROXY-CANARY missing in nat"
    result = proxier.sync()  # asked for a partial sync: the pending repair makes it full
    assert result.repair.startswith("canary KUBE-PROXY-CANARY missing in nat; nat KUBE-SERVICES is empty")
    assert kernel.created[-1] == ["nat"] and proxier.pending_repair == ""
    assert proxier.check() is False


def test_canary_gone_alone_costs_no_rewrite(synced):
    proxier, kernel = synced
    kernel.canaries.clear()
    assert proxier.check()
    result = proxier.sync()
    assert result.rules_written == 0 and kernel.restores == [] and kernel.canaries == {"mangle", "nat", "filter"}


def test_check_before_the_first_sync_and_after_a_failure_does_nothing():
    kernel = FakeKernel()
    proxier = Proxier(cluster(), kernel)
    assert proxier.check() is False  # nothing written yet: no canary to look for
    proxier.sync()
    kernel.canaries.clear()
    proxier.need_full = True
    assert proxier.check() is False and proxier.pending_repair == ""


def test_lock_busy_keeps_what_we_know_and_the_changes(synced):
    proxier, kernel = synced
    state = proxier.state
    state.set_slice(parse_endpoint_slice(endpoint_slice("default", "s0", [endpoint("10.244.9.9")],
                                                        [slice_port("http", 8080)])))
    kernel.fail = LockBusy("held")
    with pytest.raises(LockBusy):
        proxier.sync()
    assert proxier.need_full is False  # nothing was applied: no reason to distrust memory
    kernel.fail = None
    retry = proxier.sync()
    assert not retry.full and retry.changed == {"default/s0"} and "10.244.9.9:8080" in kernel.restores[-1]
    # An ordinary failure still makes the next sync a full one.
    state.set_slice(parse_endpoint_slice(endpoint_slice("default", "s1", [endpoint("10.244.9.8")],
                                                        [slice_port("http", 8080)])))
    kernel.fail = KernelError("line 3 failed")
    with pytest.raises(KernelError):
        proxier.sync()
    assert proxier.need_full is True


# --- runner -------------------------------------------------------------------------


class Busy(RuntimeError):
    retry_soon = True


def test_check_asks_for_a_full_sync_at_once(running):
    calls, checks = [], []
    flag = threading.Event()

    def check():
        checks.append(time.monotonic())
        return flag.is_set()

    running(BoundedFrequencyRunner(lambda full: calls.append((time.monotonic(), full)), 0.05, 60,
                                   check=check, check_period=0.1))
    time.sleep(0.5)
    assert len(calls) == 1 and len(checks) >= 3  # the first (full) sync, then checks only
    gaps = [b - a for a, b in zip(checks, checks[1:])]
    assert min(gaps) >= 0.09, gaps
    flag.set()
    t = time.monotonic()
    time.sleep(0.3)
    repair = [c for c in calls[1:] if c[0] >= t]
    assert repair and repair[0][1] is True and repair[0][0] - t <= 0.2


def test_failing_check_does_not_stop_syncs(running):
    errors, calls = [], []

    def check():
        raise KernelError("iptables: bad argument")

    runner = running(BoundedFrequencyRunner(calls.append, 0.05, 60, check=check,
                                            check_period=0.05, on_check_error=errors.append))
    time.sleep(0.3)
    runner.request()
    time.sleep(0.2)
    assert errors and calls == [True, False]


def test_lock_failure_is_retried_soon_as_the_same_kind_of_sync(running):
    calls, errors = [], []

    def sync(full):
        calls.append((time.monotonic(), full))
        if 2 <= len(calls) <= 5:
            raise Busy("xtables lock held")

    runner = running(BoundedFrequencyRunner(sync, 0.05, 60, on_error=errors.append))
    time.sleep(0.1)
    runner.request()
    time.sleep(0.6)
    assert len(calls) >= 6 and len(errors) == 4
    # Partial, partial, ...: nothing was applied, so no full sync is needed; and no backoff
    # growth (0.5 s, 1 s, 2 s, ... would have allowed only 2 attempts by now).
    assert [full for _t, full in calls[1:6]] == [False] * 5
    gaps = [b[0] - a[0] for a, b in zip(calls[1:], calls[2:6])]
    assert max(gaps) < 0.2, gaps


def test_ordinary_failure_still_backs_off_into_a_full_sync(running):
    calls = []

    def sync(full):
        calls.append((time.monotonic(), full))
        if len(calls) == 2:
            raise RuntimeError("line 3 failed")

    runner = running(BoundedFrequencyRunner(sync, 0.05, 60))
    time.sleep(0.1)
    runner.request()
    time.sleep(0.8)
    assert [full for _t, full in calls] == [True, False, True]
    assert calls[2][0] - calls[1][0] >= 0.45


def test_a_section_naming_many_chains_as_targets_is_bulk():
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import bulk_restore_text

    rules = "".join(f"-A KUBE-SERVICES -d 10.96.0.{i}/32 -j KUBE-SVC-{i:016d}\n" for i in range(5))
    text = f"*nat\n:KUBE-SERVICES - [0:0]\n{rules}COMMIT\n"
    assert bulk_restore_text(text, threshold=6).startswith("*nat\n-Z\n")  # 1 declared + 5 targets
    assert "-Z" not in bulk_restore_text(text, threshold=7)


def test_large_table_periodic_checks_list_the_chains_one_time_in_six(synced):
    # Listing 40,000 chain names costs 0.4-0.6 s of the sync thread; the built-in chains and
    # the shared chains' first rules are read at every periodic check, the listing in 1 of 6.
    proxier, kernel = synced
    kernel.diff_max_chains = 1
    listed = kernel.listings
    sep = sorted(c for t, c in kernel.chains if c.startswith("KUBE-SEP-"))[0]
    kernel.chains.discard(("nat", sep))  # seen by a listing only
    repairs = [proxier.sync(force_full=True).repair for _check in range(LISTING_EVERY)]
    assert kernel.listings - listed == 1
    assert repairs[:-1] == [""] * (LISTING_EVERY - 1) and repairs[-1] == "chain listing or built-in jumps differ"
    assert ("nat", sep) in kernel.chains
    # A flush the cheap reads see (KUBE-SERVICES emptied) lists the chains for the repair,
    # which rewrites the shared chains and trusts the service chains the listing shows.
    kernel.restores.clear()
    kernel.first[("nat", "KUBE-SERVICES")] = ""
    result = proxier.sync(force_full=True)
    assert result.repair == "nat KUBE-SERVICES is empty" and kernel.listings - listed == 2
    names = declared(kernel.restores[0])
    assert "KUBE-SERVICES" in names and not any(n.startswith(ipt.SERVICE_CHAIN_PREFIXES) for n in names)


def test_a_table_flushed_without_deleting_its_chains_is_rewritten_whole(synced):
    # `iptables -t nat -F`: every chain emptied, none deleted (the canaries survive). The
    # listing shows the service chains, but they hold nothing: they must not be trusted.
    proxier, kernel = synced
    for key in list(kernel.chains):
        if key[0] == "nat":
            kernel.first[key] = ""
    kernel.builtin = {k: v for k, v in kernel.builtin.items() if k[0] != "nat"}  # jumps gone too
    result = proxier.sync(force_full=True)
    assert result.repair
    names = declared(kernel.restores[0])
    svc_chains = {c for t, c in kernel.chains if t == "nat" and c.startswith(ipt.SERVICE_CHAIN_PREFIXES)}
    assert svc_chains and svc_chains <= names  # every service chain rewritten


def test_kube_services_flushed_alone_still_trusts_the_service_chains(synced):
    proxier, kernel = synced
    kernel.first[("nat", "KUBE-SERVICES")] = ""
    proxier.sync(force_full=True)
    assert not any(n.startswith(ipt.SERVICE_CHAIN_PREFIXES) for n in declared(kernel.restores[0]))
