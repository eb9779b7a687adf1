"""Conntrack tuning core (kernel/conntrack_tune.py, kernel/sysctl.py): the pure rules
(upstream's getConntrackMax and hashsize, durations, plans, rendering), flow filters, and the
/proc I/O against a fake tree."""
from __future__ import annotations

import errno
import os

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import conntrack_tune as tune
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import sysctl
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.conntrack import Flow

MAX = tune.MAX_KEY
EST = tune.KEYS["tcp_timeout_established"]
CW = tune.KEYS["tcp_timeout_close_wait"]
LIB = tune.KEYS["tcp_be_liberal"]
UDP = tune.KEYS["udp_timeout"]
UDPS = tune.KEYS["udp_timeout_stream"]
HS = tune.HASHSIZE_KEY


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("per_core, cpus, minimum, expected", [
    (32768, 2, 131072, 131072),  # upstream defaults on a small node: the floor wins
    (32768, 8, 131072, 262144),  # scaled
    (32768, 4, 131072, 131072),  # equal: either
    (32768, 8, None, 262144),  # no floor
    (0, 64, 131072, 0),  # 0 = leave alone, even with a min
    (-1, 8, 131072, 0),
])
def test_conntrack_max_is_upstreams_rule(per_core, cpus, minimum, expected):
    assert tune.conntrack_max(per_core, cpus, minimum) == expected


def test_hashsize_granularity_is_buckets_per_page():
    assert tune.hashsize_granularity(4096, 8) == 512
    assert tune.hashsize_granularity(65536, 8) == 8192
    assert tune.hashsize_granularity(4096, 4) == 1024
    assert tune.hashsize_granularity() >= 1


@pytest.mark.parametrize("size, expected", [(512, 512), (513, 1024), (100000, 100352), (1, 512), (65536, 65536)])
def test_round_hashsize(size, expected):
    assert tune.round_hashsize(size, 512) == expected


@pytest.mark.parametrize("explicit, max_value, live, expected", [
    (None, 262144, 16384, 65536),  # upstream: raise to max/4
    (None, 262144, 65536, None),  # already max/4
    (None, 262144, 262144, None),  # bigger: never lowered
    (None, 262144, None, 65536),  # unknown live size (files only): max/4
    (None, None, 16384, None),  # max not managed: leave alone
    (None, 300000, 16384, 75264),  # 75000 rounded up to 512s
    (0, 262144, 16384, None),  # 0: never touch
    (131072, None, 262144, 131072),  # explicit: exactly, may lower
    (100000, 262144, 16384, 100352),  # explicit, rounded
])
def test_hashsize_target(explicit, max_value, live, expected):
    assert tune.hashsize_target(explicit, max_value, live, 512) == expected


@pytest.mark.parametrize("value, expected", [
    (86400, 86400), ("86400", 86400), (" 30 ", 30), ("24h0m0s", 86400), ("1h", 3600), ("1m30s", 90),
    ("90s", 90), ("0s", 0), (0, 0), (3600.0, 3600), (None, None), ("", None), ("1500ms", None),
])
def test_parse_seconds(value, expected):
    if value == "1500ms":
        with pytest.raises(tune.TuneError, match="whole seconds"):
            tune.parse_seconds(value, "udp_timeout")
    else:
        assert tune.parse_seconds(value, "udp_timeout") == expected


@pytest.mark.parametrize("value", [True, "abc", "-1", -5, "1d", [30], 1.5])
def test_parse_seconds_refuses_and_names_the_option(value):
    with pytest.raises(tune.TuneError, match="^udp_timeout: "):
        tune.parse_seconds(value, "udp_timeout")


def test_wanted_sysctls_upstream_defaults():
    params = dict(max_per_core=32768, min=131072, tcp_timeout_established="24h0m0s",
                  tcp_timeout_close_wait="1h0m0s", tcp_be_liberal=None, udp_timeout=None, udp_timeout_stream=None)
    assert tune.wanted_sysctls(params, cpus=8) == {MAX: 262144, EST: 86400, CW: 3600}
    assert tune.wanted_sysctls(params, cpus=2)[MAX] == 131072


def test_wanted_sysctls_zero_leaves_alone_and_bool_sets_both_ways():
    params = dict(max=0, tcp_timeout_established=0, tcp_timeout_close_wait="0s", tcp_be_liberal=False,
                  udp_timeout=30, udp_timeout_stream="2m")
    assert tune.wanted_sysctls(params, cpus=4) == {LIB: 0, UDP: 30, UDPS: 120}
    assert tune.wanted_sysctls(dict(tcp_be_liberal=True), cpus=4) == {LIB: 1}
    assert tune.wanted_sysctls(dict(max_per_core=0, min=131072), cpus=4) == {}
    assert tune.wanted_sysctls({}, cpus=0) == {}


@pytest.mark.parametrize("params, message", [
    (dict(max=1, max_per_core=1), "mutually exclusive"),
    (dict(min=131072), "min is only used with max_per_core"),
    (dict(max=-1), "max: must be a non-negative integer"),
    (dict(max_per_core=32768), "with 0 CPUs"),
    (dict(tcp_timeout_close_wait="soon"), "tcp_timeout_close_wait: 'soon' is neither seconds nor a duration"),
])
def test_wanted_sysctls_errors(params, message):
    with pytest.raises(tune.TuneError, match=message):
        tune.wanted_sysctls(params, cpus=0)


def test_plan_changes_only_differences_hashsize_first():
    wanted = {MAX: 262144, EST: 86400, HS: 65536, UDP: 30}
    current = {MAX: 131072, EST: 86400, HS: 16384, UDP: None}
    assert tune.plan_changes(wanted, current) == [
        tune.Change(HS, 16384, 65536), tune.Change(MAX, 131072, 262144), tune.Change(UDP, None, 30)]
    assert tune.plan_changes(wanted, dict(wanted)) == []


# --------------------------------------------------------------------------- rendering


def test_render_values_in_given_order_with_absent():
    text = tune.render_values({MAX: 262144, HS: None, EST: 5}, [MAX, HS])
    assert text == f"{MAX} = 262144\n{HS} = (absent)\n"
    assert tune.render_values({"b": 2, "a": 1}) == "a = 1\nb = 2\n"


def test_sysctl_file_round_trips_and_leaves_out_the_hash_size():
    text = tune.render_sysctl_file({MAX: 262144, EST: 86400, HS: 65536})
    assert text.startswith("# Managed by kubenode.proxy.conntrack_tune")
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        f"{MAX} = 262144", f"{EST} = 86400"]
    assert sysctl.parse_sysctl_conf(text) == {MAX: "262144", EST: "86400"}


def test_parse_sysctl_conf_like_systemd():
    text = "# c\n; c\n\n-net.a.b = 1\nnet.c=2\nnet.c = 3\nnonsense\n"
    assert sysctl.parse_sysctl_conf(text) == {"net.a.b": "1", "net.c": "3"}


def test_modprobe_file():
    text = tune.render_modprobe_file(65536)
    assert text.splitlines()[-1] == "options nf_conntrack hashsize=65536"
    assert all(line.startswith("#") for line in text.splitlines()[:-1])
    assert "nf_conntrack.hashsize=65536" in text  # the built-in alternative


# --------------------------------------------------------------------------- sysctl I/O


def test_key_path():
    assert sysctl.key_path("net.netfilter.nf_conntrack_max") == "/proc/sys/net/netfilter/nf_conntrack_max"
    assert sysctl.key_path("net/ipv4/conf/eth0.100/rp_filter", "/x") == "/x/net/ipv4/conf/eth0.100/rp_filter"
    with pytest.raises(ValueError):
        sysctl.key_path("net/../../etc/passwd")


def test_read_and_write(tmp_path):
    path = tmp_path / "value"
    assert sysctl.read_int(str(path)) is None
    path.write_text("42\n")
    assert sysctl.read_int(str(path)) == 42
    sysctl.write_value(str(path), 7)
    assert path.read_text() == "7\n"
    path.write_text("4096\t87380\t6291456\n")
    assert sysctl.read_int(str(path)) == 4096
    path.write_text("abc\n")
    with pytest.raises(sysctl.SysctlError, match="does not hold an integer"):
        sysctl.read_int(str(path))


@pytest.mark.parametrize("code, kind", [(errno.EACCES, sysctl.ReadOnlyError), (errno.EOPNOTSUPP, sysctl.ReadOnlyError),
                                        (errno.EROFS, sysctl.ReadOnlyError), (errno.EINVAL, sysctl.SysctlError)])
def test_write_errors(monkeypatch, code, kind):
    def refuse(*_args, **_kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(kind) as info:
        sysctl.write_value("/proc/sys/x", 1, "net.x")
    assert isinstance(info.value, kind)
    assert isinstance(info.value, sysctl.ReadOnlyError) == (kind is sysctl.ReadOnlyError)
    if kind is sysctl.ReadOnlyError:
        assert info.value.key == "net.x" and os.strerror(code) in info.value.reason


def fake_tree(tmp_path, initial=True, **values):
    """A /proc/sys + hashsize tree; nf_conntrack_max mode 0644 in the initial namespace, else 0444."""
    base = {MAX: 262144, EST: 432000, CW: 60, LIB: 0, UDP: 30, UDPS: 120, HS: 65536}
    base.update({tune.KEYS.get(k, k): v for k, v in values.items()})
    proc = tmp_path / "proc" / "sys"
    live = tune.LiveConntrack(str(proc), str(tmp_path / "hashsize"))
    for key, value in base.items():
        if value is None:
            continue
        path = live.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(f"{value}\n")
    if os.path.exists(live.path(MAX)):
        os.chmod(live.path(MAX), 0o644 if initial else 0o444)
    return live


def test_live_reads_and_knows_its_namespace(tmp_path):
    live = fake_tree(tmp_path)
    assert live.loaded() and live.initial_netns()
    assert live.read()[MAX] == 262144 and live.read()[HS] == 65536
    assert live.readonly_reason(MAX) is None and live.readonly_reason(EST) is None
    live.write(EST, 86400)
    assert live.read([EST]) == {EST: 86400}


def test_live_in_a_child_namespace_global_keys_are_read_only(tmp_path):
    live = fake_tree(tmp_path, initial=False)
    assert not live.initial_netns()
    for key in (MAX, HS):
        reason = live.readonly_reason(key)
        assert reason.startswith("global") and "initial network namespace" in reason
    assert live.readonly_reason(EST) is None


def test_live_max_alias_and_not_loaded(tmp_path):
    live = fake_tree(tmp_path, max=None, **{EST: None})
    os.makedirs(tmp_path / "proc/sys/net/netfilter", exist_ok=True)
    assert not live.loaded()
    assert "modprobe nf_conntrack" in live.not_loaded_message()
    (tmp_path / "proc/sys/net/nf_conntrack_max").write_text("1024\n")
    assert live.read([MAX, EST]) == {MAX: 1024, EST: None}
    os.unlink(live.path(HS))
    assert live.read([HS]) == {HS: None}
    (tmp_path / "proc/sys/net/netfilter/nf_conntrack_buckets").write_text("4096\n")
    assert live.read([HS]) == {HS: 4096}
    with pytest.raises(sysctl.SysctlError, match="does not exist"):
        live.write(EST, 1)


def test_live_write_refused_names_the_key(tmp_path, monkeypatch):
    live = fake_tree(tmp_path)

    def refuse(path, value, key=""):
        raise sysctl.ReadOnlyError(key, "writing failed: Operation not supported")

    monkeypatch.setattr(sysctl, "write_value", refuse)
    with pytest.raises(sysctl.ReadOnlyError, match="nf_conntrack.hashsize: global"):
        live.write(HS, 131072)
    with pytest.raises(sysctl.ReadOnlyError, match="Operation not supported"):
        live.write(EST, 1)


# --------------------------------------------------------------------------- flow filters


def flow(proto="UDP", src="10.244.2.10", sport=40000, dst="10.96.0.10", dport=53, rsrc="10.244.1.1", rsport=5353):
    return Flow(proto=proto, orig_src=src, orig_dst=dst, orig_dport=dport, reply_src=rsrc, reply_sport=rsport,
                orig_sport=sport)


def test_filter_from_params_canonical_and_validated():
    f = tune.FlowFilter.from_params(dict(protocol="udp", orig_dst="fd00:0::a", orig_dst_port=53, reply_src=None))
    assert (f.protocol, f.orig_dst, f.orig_dst_port, f.reply_src) == ("UDP", "fd00::a", 53, None)
    assert f.families() == {6} and f.protocols() == ("UDP",)
    g = tune.FlowFilter.from_params(dict(orig_dst_port=53))
    assert g.families() == {4, 6} and set(g.protocols()) == {"TCP", "UDP", "SCTP"}
    assert str(f) == "protocol=UDP orig_dst=fd00::a orig_dst_port=53"


@pytest.mark.parametrize("params, message", [
    ({}, "delete: give at least one of"),
    (dict(protocol=None, orig_dst=None), "give at least one"),
    (dict(protocol="icmp"), "'icmp' is not tcp, udp or sctp"),
    (dict(orig_dst="10.96.0.300"), "delete.orig_dst: '10.96.0.300' is not an IP address"),
    (dict(orig_dst_port=0), "delete.orig_dst_port: 0 is not a port"),
    (dict(reply_src_port=70000), "is not a port"),
    (dict(orig_src="10.0.0.1", orig_dst="fd00::1"), "mixes IPv4 and IPv6"),
    (dict(nat="x"), "unknown field 'nat'"),
])
def test_filter_errors(params, message):
    with pytest.raises(tune.TuneError, match=message):
        tune.FlowFilter.from_params(params)


def test_select_flows_and_within_or_across():
    flows = [flow(), flow(sport=40001, rsrc="10.244.1.2"), flow(dst="10.96.0.11"), flow(proto="TCP", dport=80),
             flow(sport=40002, dport=5353)]
    by_service = tune.FlowFilter.from_params(dict(protocol="udp", orig_dst="10.96.0.10", orig_dst_port=53))
    by_endpoint = tune.FlowFilter.from_params(dict(reply_src="10.244.1.2", reply_src_port=5353))
    assert tune.select_flows(flows, [by_service]) == [flows[0], flows[1]]
    assert tune.select_flows(flows, [by_endpoint]) == [flows[1]]
    assert tune.select_flows(flows, [by_endpoint, by_service]) == [flows[0], flows[1]]  # once each
    by_client = tune.FlowFilter.from_params(dict(orig_src="10.244.2.10", orig_src_port=40002))
    assert tune.select_flows(flows, [by_client]) == [flows[4]]
    assert tune.select_flows(flows, [tune.FlowFilter.from_params(dict(protocol="tcp"))]) == [flows[3]]


def test_find_flows_dumps_only_what_filters_can_match():
    calls = []

    def lister(netns, protocols, families):
        calls.append((netns, list(protocols), list(families)))
        return [flow(), flow(dst="10.96.0.11")]

    filters = [tune.FlowFilter.from_params(dict(protocol="udp", orig_dst="10.96.0.10")),
               tune.FlowFilter.from_params(dict(protocol="sctp", orig_dst="10.96.0.12"))]
    assert tune.find_flows(filters, "ns1", lister) == [flow()]
    assert calls == [("ns1", ["SCTP", "UDP"], [4])]
    assert tune.find_flows([], lister=lister) == [] and len(calls) == 1
