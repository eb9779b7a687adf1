"""The ipset layer without a kernel: parsing `ipset save`, normalising entries the way the
kernel prints them, planning restore lines, error messages, and the kube-proxy set table.
(What the kernel really prints is checked in tests/integration/test_ipset_kernel.py.)"""
import subprocess

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import (
    IPSET_MAXNAMELEN,
    MISSING_TOOL,
    EntryError,
    IPSet,
    IpsetError,
    IpsetKernel,
    PlanError,
    entries_of,
    entry_sort_key,
    explain_error,
    normalize_entry,
    parse_save,
    plan,
    temp_name,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset_specs import (
    KUBE_IPSET_MATCHES,
    KUBE_IPSETS,
    KUBE_IPSETS_BY_NAME,
    kube_ipset,
    kube_ipset_name,
)

# Captured from `ipset save` (ipset 7.17, kernel 6.18).
SAVE = """\
create A hash:ip,port family inet hashsize 1024 maxelem 65536 timeout 300 comment bucketsize 12 initval 0x4922be31
add A 10.96.0.11,udp:53 timeout 299
add A 10.96.0.13,sctp:5000 timeout 299
add A 10.96.0.10,tcp:80 timeout 299 comment "hi there"
add A 10.96.0.21,tcp:80 timeout 299 comment "a b\\c"
create B hash:net family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0xa2666cb8
add B 10.0.0.1
add B 10.2.3.0/24
add B 10.0.0.0/8 nomatch
create C bitmap:port range 0-65535
add C 80
add C 30080
create WW hash:ip family inet hashsize 1024 maxelem 65536 counters bucketsize 12 initval 0xb29b400f
add WW 1.2.3.4 packets 0 bytes 0
create F hash:ip family inet6 hashsize 1024 maxelem 65536 bucketsize 12 initval 0x4c8f2fa3
add F 2001:db8::2
"""


def by_name(text=SAVE):
    return parse_save(text)


# ------------------------------------------------------------------ parsing


def test_parse_save_headers_and_entries():
    sets = by_name()
    assert list(sets) == ["A", "B", "C", "WW", "F"]
    a = sets["A"]
    assert (a.type, a.family, a.hashsize, a.maxelem, a.timeout, a.comment) == (
        "hash:ip,port", "inet", 1024, 65536, 300, True)
    assert a.options == {"bucketsize": "12", "initval": "0x4922be31"}
    assert a.entries["10.96.0.10,tcp:80"] == {"timeout": "299", "comment": "hi there"}
    assert a.entries["10.96.0.21,tcp:80"]["comment"] == "a b\\c"
    assert sets["B"].entries["10.0.0.0/8"] == {"nomatch": ""}
    c = sets["C"]
    assert (c.type, c.range, c.family, c.is_hash) == ("bitmap:port", "0-65535", "", False)
    assert set(c.entries) == {"80", "30080"}
    assert sets["WW"].counters and sets["WW"].entries["1.2.3.4"] == {"packets": "0", "bytes": "0"}
    assert sets["F"].family == "inet6"


def test_parse_save_rejects_garbage_and_orphan_entries():
    with pytest.raises(IpsetError, match="unknown set X"):
        parse_save("add X 1.2.3.4\n")
    with pytest.raises(IpsetError, match="cannot parse"):
        parse_save("Name: A\n")


def test_header_round_trip_and_text():
    a = by_name()["A"]
    assert a.create_line() == "create A hash:ip,port family inet hashsize 1024 maxelem 65536 timeout 300 comment"
    assert a.create_line("A-tmp").startswith("create A-tmp hash:ip,port ")
    text = a.text()
    assert text.splitlines()[0] == "create A hash:ip,port family inet maxelem 65536 timeout 300 comment"
    # sorted numerically, comments kept, remaining timeouts dropped
    assert text.splitlines()[1:] == [
        'add A 10.96.0.10,tcp:80 comment "hi there"', "add A 10.96.0.11,udp:53",
        "add A 10.96.0.13,sctp:5000", 'add A 10.96.0.21,tcp:80 comment "a b\\c"']
    assert by_name()["C"].create_line() == "create C bitmap:port range 0-65535"


# ------------------------------------------------------------------ normalising


@pytest.mark.parametrize("set_type, entry, family, expected", [
    ("hash:ip,port", "10.96.0.10,80", "inet", ["10.96.0.10,tcp:80"]),
    ("hash:ip,port", "10.96.0.10,TCP:http", "inet", ["10.96.0.10,tcp:80"]),
    ("hash:ip,port", "10.96.0.11,UDP:domain", "inet", ["10.96.0.11,udp:53"]),
    ("hash:ip,port", "10.96.0.11,17:53", "inet", ["10.96.0.11,udp:53"]),
    ("hash:ip,port", "10.96.0.12,sctp:5000", "inet", ["10.96.0.12,sctp:5000"]),
    ("hash:ip,port", "10.0.0.6,tcp:80-81", "inet", ["10.0.0.6,tcp:80", "10.0.0.6,tcp:81"]),
    ("hash:ip,port", "10.0.0.6,udp:81-80", "inet", ["10.0.0.6,udp:80", "10.0.0.6,udp:81"]),
    ("hash:ip,port", "10.0.0.8-10.0.0.9,tcp:5", "inet", ["10.0.0.8,tcp:5", "10.0.0.9,tcp:5"]),
    ("hash:ip,port", "10.0.0.1,ICMP:echo-request", "inet", ["10.0.0.1,icmp:echo-request"]),
    ("hash:ip,port", "10.0.0.1,gre:0", "inet", ["10.0.0.1,gre:0"]),
    ("hash:ip,port", "2001:DB8::0001,tcp:80", "inet6", ["2001:db8::1,tcp:80"]),
    ("hash:ip,port", "[2001:db8::2],tcp:80", "inet6", ["2001:db8::2,tcp:80"]),
    ("hash:ip,port,ip", "10.96.0.10,tcp:80,10.244.1.5", "inet", ["10.96.0.10,tcp:80,10.244.1.5"]),
    ("hash:ip,port,net", "10.96.0.10,80,10.1.2.3/16", "inet", ["10.96.0.10,tcp:80,10.1.0.0/16"]),
    ("hash:ip,port,net", "10.96.0.10,80,10.1.2.3/32", "inet", ["10.96.0.10,tcp:80,10.1.2.3"]),
    ("hash:ip,port,net", "10.0.0.1,tcp:80,10.0.0.0-10.0.0.5", "inet",
     ["10.0.0.1,tcp:80,10.0.0.0/30", "10.0.0.1,tcp:80,10.0.0.4/31"]),
    ("hash:net", "10.0.0.1/32", "inet", ["10.0.0.1"]),
    ("hash:net", "10.2.3.4/24", "inet", ["10.2.3.0/24"]),
    ("hash:net", "10.0.0.9", "inet", ["10.0.0.9"]),
    ("hash:net", "2001:DB8::/64", "inet6", ["2001:db8::/64"]),
    ("hash:ip", "10.0.0.0/30", "inet", ["10.0.0.0", "10.0.0.1", "10.0.0.2", "10.0.0.3"]),
    ("hash:ip", "10.0.0.7/32", "inet", ["10.0.0.7"]),
    ("bitmap:port", "30080", "", ["30080"]),
    ("bitmap:port", "tcp:90", "", ["90"]),
    ("bitmap:port", "80-82", "", ["80", "81", "82"]),
    ("bitmap:port", "http", "", ["80"]),
    ("hash:net,iface", "10.0.0.0/8,ETH0", "inet", ["10.0.0.0/8,eth0"]),
    ("list:set", "other", "", ["other"]),
])
def test_normalize_entry_like_the_kernel(set_type, entry, family, expected):
    assert sorted(normalize_entry(set_type, entry, family)) == sorted(expected)


@pytest.mark.parametrize("set_type, entry, family, reason", [
    ("hash:ip,port", "10.0.0.300,tcp:80", "inet", "not an IP address"),
    ("hash:ip,port", "10.0.0.1", "inet", "form ip,port"),
    ("hash:ip,port", "10.0.0.1,tcp:65536", "inet", "out of range"),
    ("hash:ip,port", "10.0.0.1,tcp:nosuchservice", "inet", "cannot parse 'nosuchservice' as a tcp port"),
    ("hash:ip,port", "1.2.3.4,tcp:80", "inet6", "not an IPv6 address"),
    ("hash:ip,port", "2001:db8::1,tcp:80", "inet", "not an IPv4 address"),
    ("hash:ip,port,ip", "10.0.0.1,tcp:80,10.0.0.0/31", "inet", "not allowed here"),
    ("hash:ip,port,ip", "10.0.0.1,tcp:80,10.0.0.5-10.0.0.6", "inet", "not allowed here"),
    ("hash:net", "0.0.0.0/0", "inet", "prefix length 0"),
    ("hash:net", "10.0.0.0/33", "inet", "bad prefix length"),
    ("hash:ip", "10.0.0.0/8", "inet", "more than 65536"),
    ("hash:ip", "2001:db8::/120", "inet6", "not allowed"),
    ("bitmap:port", "icmp:8", "", "tcp or udp"),
    ("hash:ip", "10.0.0.1 timeout 5", "inet", "blanks"),
    ("hash:ip", "", "inet", "empty"),
])
def test_normalize_entry_errors_name_the_entry(set_type, entry, family, reason):
    with pytest.raises(EntryError, match=reason) as exc:
        normalize_entry(set_type, entry, family, set_name="S")
    assert exc.value.entry == entry and exc.value.set_name == "S"
    assert str(exc.value).startswith("set S: bad entry %r" % entry)


def test_bitmap_port_range_is_checked():
    assert normalize_entry("bitmap:port", "1500", port_range="1000-2000") == ["1500"]
    with pytest.raises(EntryError, match="out of the set's range 1000-2000"):
        normalize_entry("bitmap:port", "80", port_range="1000-2000")


def test_entries_sort_numerically():
    entries = ["10.0.0.10,tcp:80", "10.0.0.9,tcp:443", "10.0.0.9,tcp:80", "9.0.0.1,udp:53"]
    assert sorted(entries, key=entry_sort_key) == [
        "9.0.0.1,udp:53", "10.0.0.9,tcp:80", "10.0.0.9,tcp:443", "10.0.0.10,tcp:80"]
    assert sorted(["30080", "80", "443"], key=entry_sort_key) == ["80", "443", "30080"]


# ------------------------------------------------------------------ planning


def want(name="S", set_type="hash:ip,port", entries=(), comment=None, **header):
    return IPSet(name, set_type, entries=entries_of(entries, comment=comment), comment=comment is not None, **header)


def test_plan_creates_a_missing_set_in_one_batch():
    p = plan({}, [want(entries=["10.96.0.10,80", "10.96.0.11,udp:domain"], timeout=300)])
    assert p.lines == [
        "create S hash:ip,port family inet maxelem 65536 timeout 300",
        "add S 10.96.0.10,tcp:80 -exist",
        "add S 10.96.0.11,udp:53 -exist",
    ]
    c = p.sets["S"]
    assert c.action == "create" and c.changed
    assert c.added == ["10.96.0.10,tcp:80", "10.96.0.11,udp:53"] and c.removed == []
    assert p.text() == "".join(line + "\n" for line in p.lines)


def test_plan_is_idempotent_against_what_the_kernel_prints():
    current = by_name()
    # The same entries written differently: nothing to do.
    p = plan(current, [want("A", entries=["10.96.0.11,UDP:53", "10.96.0.13,132:5000", "10.96.0.10,80",
                                          "10.96.0.21,tcp:80"])])
    assert p.empty and not p.sets["A"].changed and p.sets["A"].action == "none"
    p = plan(current, [want("B", "hash:net", entries=["10.0.0.1/32", "10.2.3.77/24"])], exclusive=False)
    assert p.empty
    p = plan(current, [want("C", "bitmap:port", entries=["tcp:80", "30080"], range="0-65535")])
    assert p.empty
    p = plan(current, [want("F", "hash:ip", entries=["2001:DB8:0::2"], family="inet6")])
    assert p.empty


def test_plan_in_place_adds_and_deletes_with_exist():
    current = by_name()
    p = plan(current, [want("B", "hash:net", entries=["10.0.0.1", "10.9.0.0/16"])])
    assert p.lines == ["del B 10.0.0.0/8 -exist", "del B 10.2.3.0/24 -exist", "add B 10.9.0.0/16 -exist"]
    assert p.sets["B"].added == ["10.9.0.0/16"] and p.sets["B"].removed == ["10.0.0.0/8", "10.2.3.0/24"]
    assert sorted(p.sets["B"].after.entries) == ["10.0.0.1", "10.9.0.0/16"]
    # not exclusive: only the addition
    p = plan(current, [want("B", "hash:net", entries=["10.0.0.1", "10.9.0.0/16"])], exclusive=False)
    assert p.lines == ["add B 10.9.0.0/16 -exist"]
    assert len(p.sets["B"].after.entries) == 4


def test_plan_atomic_replacement_swaps_a_temporary_set():
    current = by_name()
    p = plan(current, [want("B", "hash:net", entries=["10.0.0.1", "10.9.0.0/16"])], atomic=True)
    assert p.lines == [
        "create B-tmp hash:net family inet hashsize 1024 maxelem 65536",
        "add B-tmp 10.0.0.1 -exist",
        "add B-tmp 10.9.0.0/16 -exist",
        "swap B-tmp B",
        "destroy B-tmp",
    ]
    assert p.sets["B"].action == "swap"
    # unchanged content: no swap
    assert plan(current, [want("B", "hash:net", entries=["10.0.0.1", "10.2.3.0/24", "10.0.0.0/8"])],
                atomic=True).empty


def test_plan_destroys_a_leftover_temporary_set_first():
    current = parse_save(SAVE + "create B-tmp hash:ip family inet hashsize 1024 maxelem 65536\n")
    p = plan(current, [want("B", "hash:net", entries=["10.0.0.1"])], atomic=True)
    assert p.lines[:2] == ["destroy B-tmp", "create B-tmp hash:net family inet hashsize 1024 maxelem 65536"]


def test_plan_header_change_goes_through_a_swap_keeping_entries():
    current = by_name()
    p = plan(current, [want("B", "hash:net", entries=["10.7.0.0/16"], timeout=600, comment="x")], exclusive=False)
    assert p.sets["B"].action == "swap"
    assert p.lines[0] == "create B-tmp hash:net family inet hashsize 1024 maxelem 65536 timeout 600 comment"
    assert 'add B-tmp 10.7.0.0/16 comment "x" -exist' in p.lines
    assert "add B-tmp 10.0.0.0/8 nomatch -exist" in p.lines  # kept, with its flag
    assert p.lines[-2:] == ["swap B-tmp B", "destroy B-tmp"]
    # a larger maxelem, too
    p = plan(current, [want("B", "hash:net", entries=[], maxelem=131072)], exclusive=False)
    assert p.sets["B"].action == "swap" and "maxelem 131072" in p.lines[0]


def test_plan_dont_care_header_options_are_not_compared():
    current = by_name()
    # A has timeout 300 and comment support; asking for neither changes nothing
    p = plan(current, [want("A", entries=list(current["A"].entries))])
    assert p.empty
    # hashsize is never compared (the kernel grows it)
    assert plan(current, [want("B", "hash:net", entries=list(current["B"].entries), hashsize=64)]).empty


def test_plan_updates_entries_with_another_comment():
    current = by_name()
    p = plan(current, [want("A", entries=["10.96.0.10,tcp:80", "10.96.0.11,udp:53"], comment="hi there")],
             exclusive=False)
    # not exclusive: the entry keeps what it had (its remaining timeout), and gets the comment
    assert p.lines == ['add A 10.96.0.11,udp:53 timeout 299 comment "hi there" -exist']
    assert p.sets["A"].updated == ["10.96.0.11,udp:53"] and p.sets["A"].added == []
    assert p.sets["A"].changed


def test_plan_type_or_family_change_is_refused_unless_recreate():
    current = by_name()
    with pytest.raises(PlanError, match="cannot swap sets of different types"):
        plan(current, [want("B", "hash:ip", entries=["10.0.0.1"])])
    with pytest.raises(PlanError, match="family"):
        plan(current, [want("F", "hash:ip", entries=["10.0.0.1"])])
    p = plan(current, [want("B", "hash:ip", entries=["10.0.0.1"])], recreate=True)
    assert p.lines[:2] == ["destroy B", "create B hash:ip family inet maxelem 65536"]
    assert p.sets["B"].action == "recreate"


def test_plan_remove_and_destroy():
    current = by_name()
    p = plan(current, remove={"A": ["10.96.0.10,80", "10.1.1.1,tcp:1"], "NOPE": ["1.2.3.4,tcp:1"]},
             destroy=["C", "MISSING"])
    assert p.lines == ["del A 10.96.0.10,tcp:80 -exist", "destroy C"]
    assert p.sets["A"].removed == ["10.96.0.10,tcp:80"]
    assert p.sets["NOPE"].action == "none" and not p.sets["NOPE"].changed
    assert p.sets["C"].action == "destroy" and p.sets["C"].removed == ["80", "30080"]
    assert not p.sets["MISSING"].changed
    assert p.changes == ["del A 10.96.0.10,tcp:80", "destroy C", "del C 80", "del C 30080"]


def test_plan_validates_everything_before_writing():
    with pytest.raises(EntryError, match="set S: bad entry '10.0.0.999,tcp:1'"):
        plan({}, [want(entries=["10.0.0.1,tcp:1", "10.0.0.999,tcp:1"])])
    with pytest.raises(PlanError, match="needs a range"):
        plan({}, [want("P", "bitmap:port", entries=["80"])])
    with pytest.raises(PlanError, match="hash types only"):
        plan({}, [want("P", "bitmap:port", entries=["80"], range="0-100", maxelem=5)])
    with pytest.raises(IpsetError, match="1 to 31 characters"):
        plan({}, [want("X" * 32)])
    with pytest.raises(EntryError, match="comment cannot contain"):
        plan({}, [want(entries=["10.0.0.1,tcp:1"], comment='say "hi"')])
    with pytest.raises(EntryError, match="longer than 255"):
        plan({}, [want(entries=["10.0.0.1,tcp:1"], comment="x" * 256)])


def test_plan_bitmap_entries_checked_against_the_existing_range():
    current = parse_save("create P bitmap:port range 1000-2000\n")
    with pytest.raises(EntryError, match="out of the set's range"):
        plan(current, [want("P", "bitmap:port", entries=["80"])])


def test_temp_names_fit_ipsets_limit():
    assert temp_name("KUBE-CLUSTER-IP") == "KUBE-CLUSTER-IP-tmp"
    long_a = "KUBE-6-LOAD-BALANCER-SOURCE-CID"
    long_b = "KUBE-6-LOAD-BALANCER-SOURCE-IPX"
    assert len(long_a) == IPSET_MAXNAMELEN
    ta, tb = temp_name(long_a), temp_name(long_b)
    assert len(ta) <= IPSET_MAXNAMELEN and len(tb) <= IPSET_MAXNAMELEN
    assert ta != tb and ta.endswith("-tmp") and ta == temp_name(long_a)


def test_ten_thousand_entries_plan_quickly_into_one_batch():
    entries = ["10.%d.%d.1,tcp:80" % (i // 250, i % 250) for i in range(10000)]
    p = plan({}, [want(entries=entries)])
    assert len(p.lines) == 10001 and p.lines[0].startswith("create S ")


# ------------------------------------------------------------------ kernel wrapper (fake runner)


class FakeRunner:
    def __init__(self, outputs):
        self.outputs = outputs  # argv tail tuple -> (rc, stdout, stderr)
        self.calls = []

    def __call__(self, argv, input=None, **kwargs):
        self.calls.append((argv, input))
        tail = tuple(argv[argv.index("ipset") + 1:]) if "ipset" in argv else tuple(argv)
        rc, out, err = self.outputs.get(tail, (0, "", ""))
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_kernel_runs_in_a_namespace_and_batches_one_restore():
    runner = FakeRunner({
        ("list", "-n"): (0, "A\nB\n", ""),
        ("save", "B"): (0, "create B hash:net family inet hashsize 1024 maxelem 65536\nadd B 10.0.0.1\n", ""),
    })
    k = IpsetKernel(netns="ns1", runner=runner)
    p = k.sync([want("B", "hash:net", entries=["10.0.0.1", "10.0.0.2", "10.0.0.3"])])
    assert p.sets["B"].added == ["10.0.0.2", "10.0.0.3"]
    argvs = [call[0] for call in runner.calls]
    assert argvs == [["ip", "netns", "exec", "ns1", "ipset", "list", "-n"],
                     ["ip", "netns", "exec", "ns1", "ipset", "save", "B"],
                     ["ip", "netns", "exec", "ns1", "ipset", "restore"]]
    assert runner.calls[-1][1] == "add B 10.0.0.2 -exist\nadd B 10.0.0.3 -exist\n"
    # check mode: read only
    runner.calls.clear()
    k.sync([want("B", "hash:net", entries=["10.0.0.9"])], check_mode=True)
    assert [call[0][-1] for call in runner.calls] == ["-n", "B"]


def test_kernel_save_of_a_missing_set_is_empty():
    runner = FakeRunner({("save", "X"): (1, "", "ipset v7.17: The set with the given name does not exist\n")})
    assert IpsetKernel(runner=runner).save("X") == {}
    assert IpsetKernel(runner=runner).get("X") is None


def test_kernel_missing_tool():
    def runner(argv, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", argv[0])
    with pytest.raises(IpsetError, match="install the ipset package"):
        IpsetKernel(runner=runner).save()
    in_ns = FakeRunner({("restore",): (255, "", 'exec of "ipset" failed: No such file or directory\n')})
    in_ns.outputs[("ip", "netns", "exec", "n", "ipset", "restore")] = in_ns.outputs[("restore",)]
    with pytest.raises(IpsetError, match="install the ipset package"):
        IpsetKernel(netns="n", runner=in_ns).restore(["destroy X"])


def test_restore_errors_name_the_failing_line():
    lines = ["add S 10.0.0.1 -exist", "add S 10.0.0.2 -exist"]
    err = "ipset v7.17: Error in line 2: Hash is full, cannot add more elements\n"
    runner = FakeRunner({("restore",): (1, "", err)})
    with pytest.raises(IpsetError) as exc:
        IpsetKernel(runner=runner).restore(lines)
    msg = str(exc.value)
    assert "line 2 (add S 10.0.0.2 -exist)" in msg and "Hash is full" in msg and "may have been applied" in msg


def test_error_explanations():
    msg = explain_error("ipset v7.17: Error in line 1: Set cannot be destroyed: it is in use by a kernel component\n",
                        ["destroy KUBE-CLUSTER-IP"], restore=True)
    assert "in use by a kernel component" in msg and "--match-set KUBE-CLUSTER-IP" in msg
    msg = explain_error("ipset v7.17: Error in line 1: Kernel error received: set type not supported\n",
                        ["create S hash:ip,port,net family inet"], restore=True)
    assert "the kernel does not support hash:ip,port,net" in msg and "ip_set_hash_ipportnet" in msg
    msg = explain_error("ipset v7.17: Cannot open session to kernel.\n", [])
    assert "no ipset support" in msg


# ------------------------------------------------------------------ kube-proxy's sets


def test_kube_ipset_table_matches_upstream():
    names = [s.name for s in KUBE_IPSETS]
    assert len(names) == len(set(names)) == 17
    types = {s.name: s.type for s in KUBE_IPSETS}
    assert types["KUBE-LOOP-BACK"] == "hash:ip,port,ip"
    assert types["KUBE-CLUSTER-IP"] == types["KUBE-EXTERNAL-IP"] == types["KUBE-LOAD-BALANCER-FW"] == "hash:ip,port"
    assert types["KUBE-LOAD-BALANCER-SOURCE-IP"] == "hash:ip,port,ip"
    assert types["KUBE-LOAD-BALANCER-SOURCE-CIDR"] == "hash:ip,port,net"
    assert types["KUBE-NODE-PORT-TCP"] == types["KUBE-NODE-PORT-LOCAL-UDP"] == "bitmap:port"
    assert types["KUBE-NODE-PORT-SCTP-HASH"] == types["KUBE-NODE-PORT-LOCAL-SCTP-HASH"] == "hash:ip,port"
    assert types["KUBE-HEALTH-CHECK-NODE-PORT"] == "bitmap:port"
    assert types["KUBE-IPVS-IPS"] == "hash:ip"
    assert KUBE_IPSETS_BY_NAME["KUBE-LOAD-BALANCER"].comment == "Kubernetes service lb portal"
    assert all(m.set in KUBE_IPSETS_BY_NAME for m in KUBE_IPSET_MATCHES)
    assert all(len(kube_ipset_name(n, ipv6=True)) <= IPSET_MAXNAMELEN for n in names)


def test_kube_ipset_builds_upstream_headers():
    s = kube_ipset("KUBE-CLUSTER-IP", entries=["10.96.0.10,tcp:80"])
    assert s.create_line() == "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536"
    s6 = kube_ipset("KUBE-LOAD-BALANCER-SOURCE-CIDR", ipv6=True)
    assert s6.name == "KUBE-6-LOAD-BALANCER-SOURCE-CID" and s6.family == "inet6"
    bp = kube_ipset("KUBE-NODE-PORT-TCP", entries=["30080"])
    assert bp.create_line() == "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535"
    p = plan({}, [kube_ipset(spec.name) for spec in KUBE_IPSETS])
    assert len(p.lines) == 17 and all(line.startswith("create KUBE-") for line in p.lines)


def test_missing_tool_message_is_exported():
    assert "ipset" in MISSING_TOOL
