"""The ipset layer on the real kernel, inside the lab's node namespace: normalisation against
what the kernel prints, batched writes (one `ipset restore`), atomic swap replacement,
idempotence and the error messages."""
from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import (
    EntryError,
    IPSet,
    IpsetError,
    IpsetKernel,
    PlanError,
    entries_of,
    normalize_entry,
    parse_save,
    plan,
    temp_name,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset_specs import (
    KUBE_IPSETS,
    kube_ipset,
)

# Entries written the ways people write them; the kernel decides what they mean.
ODD_ENTRIES = {
    ("hash:ip,port", "inet"): ["10.96.0.10,80", "10.96.0.11,udp:domain", "10.96.0.16,UDP:53", "10.96.0.12,17:53",
                               "10.96.0.13,sctp:5000", "10.96.0.14,tcp:http", "10.96.0.15,tcp:8080-8082",
                               "10.0.0.8-10.0.0.9,tcp:5", "10.0.0.1,icmp:echo-request", "10.0.0.4/31,udp:7"],
    ("hash:ip,port", "inet6"): ["2001:DB8::0001,tcp:80", "[2001:db8::2],udp:53", "2001:db8:0:0::3,443"],
    ("hash:ip,port,ip", "inet"): ["10.96.0.10,80,10.244.1.5", "10.96.0.10,udp:53,10.244.1.6"],
    ("hash:ip,port,net", "inet"): ["198.51.100.1,80,10.1.2.3/16", "198.51.100.1,tcp:80,192.0.2.7/32",
                                   "198.51.100.1,tcp:443,10.0.0.0-10.0.0.5"],
    ("hash:net", "inet"): ["10.0.0.1/32", "10.2.3.4/24", "10.9.0.0-10.9.0.5", "192.0.2.77"],
    ("hash:net", "inet6"): ["2001:DB8:1::/48", "2001:db8:2::5/128"],
    ("hash:ip", "inet"): ["10.0.0.0/30", "10.1.0.7/32", "10.2.0.1-10.2.0.2"],
    ("bitmap:port", ""): ["30080", "tcp:90", "udp:91", "80-82", "https"],
}


@pytest.fixture
def node(lab):
    lab.kernel = IpsetKernel(netns=lab.ns("node"))
    return lab


def ipset(lab, *args, input=None, check=True):
    return lab.exec("node", ["ipset", *args], input=input, check=check)


def saved(lab, name):
    return parse_save(ipset(lab, "save", name).stdout)[name]


def test_normalisation_matches_what_the_kernel_prints(node):
    """The RAW entries go to the kernel (it parses them itself); what `ipset save` prints
    must equal our normalisation, and planning the raw entries again changes nothing."""
    lines = []
    for i, ((set_type, family), entries) in enumerate(ODD_ENTRIES.items()):
        name = f"N{i}"
        header = f"family {family}" if family else "range 0-65535"
        lines.append(f"create {name} {set_type} {header}")
        lines += [f"add {name} {e}" for e in entries]
    ipset(node, "restore", input="\n".join(lines) + "\n")
    current = node.kernel.save()
    for i, ((set_type, family), entries) in enumerate(ODD_ENTRIES.items()):
        name = f"N{i}"
        expected = {e for raw in entries for e in normalize_entry(set_type, raw, family or "inet")}
        assert set(current[name].entries) == expected, (set_type, family)
        want = IPSet(name, set_type, family=family, entries=entries_of(entries),
                     range="0-65535" if not family else None)
        p = plan(current, [want], exclusive=True)
        assert p.empty, (name, p.lines)


def test_layer_creates_then_is_idempotent(node):
    want = IPSet("KN-SVC", "hash:ip,port", timeout=600, comment=True,
                 entries=entries_of(["10.96.0.10,80", "10.96.0.10,UDP:53"], comment="kube-dns"))
    p = node.kernel.sync([want])
    assert p.sets["KN-SVC"].action == "create"
    s = saved(node, "KN-SVC")
    assert (s.timeout, s.comment) == (600, True)
    assert {e: o["comment"] for e, o in s.entries.items()} == {
        "10.96.0.10,tcp:80": "kube-dns", "10.96.0.10,udp:53": "kube-dns"}
    assert int(s.entries["10.96.0.10,tcp:80"]["timeout"]) > 590
    again = node.kernel.sync([want])
    assert again.empty and not again.sets["KN-SVC"].changed
    # a different comment is an update (re-added with -exist), and then idempotent again
    want.entries = entries_of(want.entries, comment="dns")
    p = node.kernel.sync([want])
    assert sorted(p.sets["KN-SVC"].updated) == ["10.96.0.10,tcp:80", "10.96.0.10,udp:53"]
    assert {o["comment"] for o in saved(node, "KN-SVC").entries.values()} == {"dns"}
    assert node.kernel.sync([want]).empty


def test_ten_thousand_entries_one_restore_then_a_batched_change(node):
    kernel = node.kernel
    old = [f"10.{i // 250}.{i % 250}.1,tcp:80" for i in range(10000)]
    want = IPSet("KN-BIG", "hash:ip,port", entries=entries_of(old))
    start = time.monotonic()
    calls = kernel.calls
    p = kernel.sync([want])
    elapsed = time.monotonic() - start
    assert kernel.calls - calls == 2  # `ipset list -n` (the set does not exist yet) and ONE restore
    assert len(saved(node, "KN-BIG").entries) == 10000
    # LAB.md: one restore of 10k entries ~0.08 s, 10k single adds ~2 s. Loose: CI machines are shared.
    assert elapsed < 15, elapsed
    assert len(p.lines) == 10001

    # delete 3,000 and add 2,000 in place: still one restore
    new = old[3000:] + [f"10.200.{i // 250}.{i % 250},udp:53" for i in range(2000)]
    restores = []
    real_restore = kernel.restore
    kernel.restore = lambda lines: restores.append(list(lines)) or real_restore(lines)
    try:
        p = kernel.sync([IPSet("KN-BIG", "hash:ip,port", entries=entries_of(new))])
    finally:
        kernel.restore = real_restore
    assert len(restores) == 1 and len(restores[0]) == 5000
    assert len(p.sets["KN-BIG"].removed) == 3000 and len(p.sets["KN-BIG"].added) == 2000
    assert set(saved(node, "KN-BIG").entries) == {normalize_entry("hash:ip,port", e)[0] for e in new}
    assert kernel.sync([IPSet("KN-BIG", "hash:ip,port", entries=entries_of(new))]).empty


def _poll_counts(lab, name, stop, seen):
    argv = ["ip", "netns", "exec", lab.ns("node"), "ipset", "list", name, "-t"]
    while not stop.is_set():
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        m = re.search(r"Number of entries: (\d+)", out)
        if m:
            seen.append(int(m.group(1)))


def _replace_while_polling(lab, name, entries, atomic):
    stop, seen = threading.Event(), []
    poller = threading.Thread(target=_poll_counts, args=(lab, name, stop, seen))
    poller.start()
    try:
        time.sleep(0.2)
        p = lab.kernel.sync([IPSet(name, "hash:ip,port", entries=entries_of(entries))], atomic=atomic)
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    return p, seen


def test_atomic_replacement_is_never_seen_half_done(node):
    """20,000 entries replaced by 15,000 others (5,000 kept). A poller reads the live set's
    size all the time: with the swap it only ever sees 20,000 or 15,000; done in place it
    sees the intermediate sizes (which shows the poller can catch them)."""
    old = [f"10.1.{i // 250}.{i % 250},tcp:80" for i in range(20000)]
    new = old[:5000] + [f"10.2.{i // 250}.{i % 250},tcp:80" for i in range(10000)]
    node.kernel.sync([IPSet("KN-SWAP", "hash:ip,port", entries=entries_of(old))])
    node.iptables_restore("*filter\n-A FORWARD -m set --match-set KN-SWAP dst,dst -j DROP\nCOMMIT\n")

    p, seen = _replace_while_polling(node, "KN-SWAP", new, atomic=True)
    assert p.sets["KN-SWAP"].action == "swap"
    assert p.lines[-2:] == ["swap KN-SWAP-tmp KN-SWAP", "destroy KN-SWAP-tmp"]
    assert seen and set(seen) <= {20000, 15000}, sorted(set(seen))[:10]
    assert "KN-SWAP-tmp" not in node.kernel.names()
    assert re.search(r"References: 1", ipset(node, "list", "KN-SWAP", "-t").stdout)  # the rule still uses it
    assert set(saved(node, "KN-SWAP").entries) == set(new)

    # control: the same kind of change in place is visible half done
    p, seen = _replace_while_polling(node, "KN-SWAP", old, atomic=False)
    assert p.sets["KN-SWAP"].action == "update"
    assert set(seen) - {20000, 15000}, "the poller never saw an in-place change half done"


def test_swap_with_a_leftover_temporary_set_and_a_header_change(node):
    node.kernel.sync([IPSet("KN-H", "hash:net", entries=entries_of(["10.0.0.0/8"]))])
    ipset(node, "create", temp_name("KN-H"), "hash:ip")  # left by a crashed run, another type
    want = IPSet("KN-H", "hash:net", timeout=120, comment=True, entries=entries_of(["10.1.0.0/16"], comment="x"))
    p = node.kernel.sync([want], exclusive=False)
    assert p.lines[0] == f"destroy {temp_name('KN-H')}" and p.sets["KN-H"].action == "swap"
    s = saved(node, "KN-H")
    assert (s.timeout, s.comment) == (120, True) and set(s.entries) == {"10.0.0.0/8", "10.1.0.0/16"}
    assert s.entries["10.1.0.0/16"]["comment"] == "x"
    assert temp_name("KN-H") not in node.kernel.names()
    assert node.kernel.sync([want], exclusive=False).empty


def test_long_names_use_a_short_temporary_name(node):
    name = kube_ipset("KUBE-LOAD-BALANCER-SOURCE-CIDR", ipv6=True).name
    assert len(name) == 31
    want = kube_ipset("KUBE-LOAD-BALANCER-SOURCE-CIDR", ipv6=True, entries=["2001:db8::1,tcp:80,2001:db8:1::/64"])
    node.kernel.sync([want])
    want = kube_ipset("KUBE-LOAD-BALANCER-SOURCE-CIDR", ipv6=True, entries=["2001:db8::1,tcp:80,2001:db8:2::/64"])
    p = node.kernel.sync([want], atomic=True)
    assert p.sets[name].action == "swap" and any(temp_name(name) in line for line in p.lines)
    assert set(saved(node, name).entries) == {"2001:db8::1,tcp:80,2001:db8:2::/64"}


def test_all_kube_proxy_sets_can_be_created_in_one_batch(node):
    sets = [kube_ipset(s.name) for s in KUBE_IPSETS] + [kube_ipset(s.name, ipv6=True) for s in KUBE_IPSETS]
    calls = node.kernel.calls
    node.kernel.sync(sets)
    assert node.kernel.calls - calls == 2  # list -n + one restore
    current = node.kernel.save()
    for spec in KUBE_IPSETS:
        assert current[spec.name].type == spec.type
    assert current["KUBE-6-CLUSTER-IP"].family == "inet6"
    assert current["KUBE-NODE-PORT-TCP"].range == "0-65535"
    assert node.kernel.sync(sets).empty


def test_destroying_a_set_in_use_is_refused_clearly(node):
    node.kernel.sync([IPSet("KN-USED", "hash:ip", entries=entries_of(["10.0.0.1"]))])
    node.iptables_restore("*filter\n-A FORWARD -m set --match-set KN-USED dst -j DROP\nCOMMIT\n")
    with pytest.raises(IpsetError) as exc:
        node.kernel.sync(destroy=["KN-USED"])
    msg = str(exc.value)
    assert "in use by a kernel component" in msg and "--match-set KN-USED" in msg, msg
    assert "KN-USED" in node.kernel.names()
    # a type change cannot be swapped in, and is refused before anything is written
    with pytest.raises(PlanError, match="different types"):
        node.kernel.sync([IPSet("KN-USED", "hash:net", entries=entries_of(["10.0.0.0/8"]))])
    node.iptables_restore("*filter\n-D FORWARD -m set --match-set KN-USED dst -j DROP\nCOMMIT\n")
    p = node.kernel.sync([IPSet("KN-USED", "hash:net", entries=entries_of(["10.0.0.0/8"]))], recreate=True)
    assert p.sets["KN-USED"].action == "recreate" and saved(node, "KN-USED").type == "hash:net"
    node.kernel.sync(destroy=["KN-USED"])
    assert "KN-USED" not in node.kernel.names()


def test_a_bad_entry_never_reaches_the_kernel(node):
    calls = node.kernel.calls
    with pytest.raises(EntryError, match="bad entry '10.96.0.300,tcp:80'"):
        node.kernel.sync([IPSet("KN-BAD", "hash:ip,port", entries=entries_of(["10.96.0.1,tcp:80",
                                                                              "10.96.0.300,tcp:80"]))])
    assert node.kernel.calls - calls == 1  # only `ipset list -n`
    assert "KN-BAD" not in node.kernel.names()


def test_kernel_errors_name_the_failing_line(node):
    node.kernel.sync([IPSet("KN-FULL", "hash:ip", maxelem=2, entries=entries_of(["10.0.0.1"]))])
    with pytest.raises(IpsetError) as exc:
        node.kernel.sync([IPSet("KN-FULL", "hash:ip", entries=entries_of(["10.0.0.1", "10.0.0.2", "10.0.0.3"]))])
    msg = str(exc.value)
    assert "line 2 (add KN-FULL 10.0.0.3 -exist)" in msg and "Hash is full" in msg, msg
