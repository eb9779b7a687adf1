"""IPVS core: conversions, model validation, planning (graceful removal included), ipvsadm-like
text, and the netlink codec (checked against pyroute2's own IPVS message classes) and client
(against a scripted fake socket). The kernel side runs in the VM lab (tests/vm/test_ipvs_module.py)."""
import ctypes
import errno
import socket
import struct

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs_netlink as nl
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs_sockopt as so
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipvs import (
    ADD_DEST,
    ADD_SERVICE,
    DELETE_DEST,
    DELETE_SERVICE,
    EDIT_DEST,
    EDIT_SERVICE,
    Graceful,
    Op,
    RealServer,
    ServiceState,
    VirtualServer,
    plan,
    virtual_server,
)

VS = virtual_server("tcp", "10.96.0.10", 80, scheduler="rr")
RS1 = RealServer("10.244.1.1", 8080)
RS2 = RealServer("10.244.1.2", 8080)
RS3 = RealServer("10.244.1.3", 8080)


def kinds(p):
    return [(op.kind, str(op.real_server) if op.real_server else str(op.virtual)) for op in p.ops]


def conns(rs, active=0, inactive=0):
    return RealServer(rs.address, rs.port, rs.weight, rs.forwarding, active_connections=active,
                      inactive_connections=inactive)


# -- conversions


@pytest.mark.parametrize("name,value", [
    ("masquerade", 0), ("masq", 0), ("nat", 0), ("MASQ", 0), ("local", 1), ("tunnel", 2), ("ipip", 2),
    ("route", 3), ("droute", 3), ("direct", 3), ("dr", 3), ("gatewaying", 3), ("bypass", 4),
])
def test_forwarding_names_to_ip_vs_conn_f_values(name, value):
    assert ipvs.forwarding_value(name) == value


@pytest.mark.parametrize("value,name", [(0, "masquerade"), (1, "local"), (2, "tunnel"), (3, "route"),
                                        (4, "bypass"), (0x0100 | 3, "route")])
def test_forwarding_values_to_names_ignore_other_conn_flags(value, name):
    assert ipvs.forwarding_name(value) == name


def test_unknown_forwarding_is_refused():
    with pytest.raises(ValueError, match="unknown forwarding method 'fullnat'"):
        ipvs.forwarding_value("fullnat")


def test_uapi_constants():
    assert (ipvs.IP_VS_CONN_F_MASQ, ipvs.IP_VS_CONN_F_TUNNEL, ipvs.IP_VS_CONN_F_DROUTE) == (0, 2, 3)
    assert ipvs.IP_VS_SVC_F_PERSISTENT == 1 and ipvs.IP_VS_SVC_F_ONEPACKET == 4
    assert (ipvs.IP_VS_SVC_F_SCHED1, ipvs.IP_VS_SVC_F_SCHED2, ipvs.IP_VS_SVC_F_SCHED3) == (0x8, 0x10, 0x20)


@pytest.mark.parametrize("names,scheduler,bits", [
    ([], "rr", 0), (["flag-1"], "rr", 0x8), (["flag-2", "flag-3"], "wlc", 0x30),
    (["sh-fallback"], "sh", 0x8), (["sh-port"], "sh", 0x10), (["sh-fallback", "sh-port"], "sh", 0x18),
    (["mh-port"], "mh", 0x10), (["MH-Fallback"], "mh", 0x8),
])
def test_scheduler_flag_bits(names, scheduler, bits):
    assert ipvs.scheduler_flag_bits(names, scheduler) == bits


def test_scheduler_flags_of_another_scheduler_are_refused_like_ipvsadm():
    with pytest.raises(ValueError, match="'sh-port' needs scheduler 'sh', not 'rr'"):
        ipvs.scheduler_flag_bits(["sh-port"], "rr")
    with pytest.raises(ValueError, match="unknown scheduler flag 'sh-foo'"):
        ipvs.scheduler_flag_bits(["sh-foo"], "sh")


@pytest.mark.parametrize("flags,scheduler,names", [
    (0x18, "sh", ["sh-fallback", "sh-port"]), (0x10, "mh", ["mh-port"]), (0x38, "rr", ["flag-1", "flag-2", "flag-3"]),
    (0x20, "sh", ["flag-3"]), (0x1 | 0x2, "rr", []),
])
def test_scheduler_flag_names(flags, scheduler, names):
    assert ipvs.scheduler_flag_names(flags, scheduler) == names


@pytest.mark.parametrize("value,family,prefix", [
    (None, 4, 32), ("", 6, 128), ("255.255.255.0", 4, 24), ("24", 4, 24), ("/16", 4, 16), (0, 4, 0),
    ("64", 6, 64), (128, 6, 128),
])
def test_persistence_netmask(value, family, prefix):
    assert ipvs.parse_netmask(value, family) == prefix


@pytest.mark.parametrize("value,family,match", [
    ("255.0.255.0", 4, "contiguous"), ("33", 4, "out of range 0-32"), ("0", 6, "out of range 1-128"),
    ("ffff::", 6, "prefix length"),
])
def test_bad_persistence_netmask(value, family, match):
    with pytest.raises(ValueError, match=match):
        ipvs.parse_netmask(value, family)


def test_netmask_text():
    assert ipvs.netmask_text(24, 4) == "255.255.255.0" and ipvs.netmask_text(64, 6) == "64"


def test_scheduler_available_reads_the_module_lists(tmp_path):
    base = tmp_path / "modules" / "6.1.0-test"
    base.mkdir(parents=True)
    (base / "modules.dep").write_text(
        "kernel/net/netfilter/ipvs/ip_vs_rr.ko.xz: kernel/net/netfilter/ipvs/ip_vs.ko.xz\n"
        "kernel/net/netfilter/ipvs/ip_vs.ko.xz: kernel/net/netfilter/nf_conntrack.ko.xz\n")
    (base / "modules.builtin").write_text("kernel/net/netfilter/ipvs/ip_vs_wlc.ko\n")
    sysmod = tmp_path / "sys"
    (sysmod / "ip_vs_mh").mkdir(parents=True)
    kw = dict(release="6.1.0-test", modules_root=str(tmp_path / "modules"), sys_module=str(sysmod))
    assert ipvs.scheduler_available("rr", **kw) is True
    assert ipvs.scheduler_available("wlc", **kw) is True
    assert ipvs.scheduler_available("mh", **kw) is True  # loaded
    assert ipvs.scheduler_available("twos", **kw) is False
    assert ipvs.scheduler_available("rr", release="other", modules_root=str(tmp_path / "modules"),
                                    sys_module=str(sysmod)) is None


# -- model


def test_virtual_server_from_options():
    vs = virtual_server("UDP", "10.96.0.53", 53, scheduler="sh", scheduler_flags=["sh-port"],
                        persistence_timeout=300, persistence_netmask="255.255.255.0")
    assert vs.key == (4, "UDP", "10.96.0.53", 53, 0)
    assert vs.flags == ipvs.IP_VS_SVC_F_PERSISTENT | ipvs.IP_VS_SVC_F_SCHED2 and vs.timeout == 300
    assert vs.netmask == 24 and vs.persistent and vs.scheduler_flags == ["sh-port"]
    assert vs.as_dict() == {"protocol": "udp", "address": "10.96.0.53", "port": 53, "fwmark": None,
                            "family": "ipv4", "scheduler": "sh", "scheduler_flags": ["sh-port"],
                            "persistence_timeout": 300, "persistence_netmask": "255.255.255.0", "flags": 17}


def test_fwmark_service_has_no_address_port_or_protocol():
    vs = VirtualServer(fwmark=7, address="10.0.0.1", port=80, protocol="UDP")
    assert vs.key == (4, "", "", 0, 7) and str(vs) == "FWM 7"
    v6 = virtual_server(fwmark=7, family="ipv6")
    assert v6.key == (6, "", "", 0, 7) and v6.netmask == 128 and str(v6) == "FWM 7 IPv6"


def test_ipv6_service_is_canonical():
    vs = virtual_server("tcp", "FD00:0:0::0010", 443)
    assert vs.address == "fd00::10" and vs.family == 6 and vs.netmask == 128
    assert str(vs) == "TCP [fd00::10]:443"


def test_kernel_hashed_flag_is_never_part_of_the_model():
    assert VirtualServer("10.0.0.1", 80, flags=ipvs.IP_VS_SVC_F_HASHED | 1).flags == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(address="10.0.0.1", port=0), "port 0 virtual service must be persistent"),
    (dict(address="10.0.0.1", port=70000), "port 70000 out of range"),
    (dict(address="10.0.0.1", port=80, scheduler="averyveryverylongname"), "invalid scheduler name"),
    (dict(address="10.0.0.1", port=80, flags=ipvs.IP_VS_SVC_F_ONEPACKET), "only for UDP"),
    (dict(address="10.0.0.1", port=80, timeout=-1, flags=1), "must not be negative"),
])
def test_virtual_server_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VirtualServer(**kwargs).validate()


def test_port_zero_persistent_service_is_fine():
    virtual_server("tcp", "10.0.0.1", 0, persistence_timeout=60).validate()


def test_family_must_match_the_address():
    with pytest.raises(ValueError, match="not IPv6"):
        virtual_server("tcp", "10.0.0.1", 80, family="ipv6")


@pytest.mark.parametrize("rs,match", [
    (RealServer("10.1.0.1", 80, weight=-1), "weight -1 out of range"),
    (RealServer("10.1.0.1", 80, u_threshold=5, l_threshold=6), "lower threshold 6 is above"),
    (RealServer("10.1.0.1", 8080, forwarding="route"), "must be the virtual port 80"),
    (RealServer("10.1.0.1", 8080, forwarding="tunnel"), "must be the virtual port 80"),
    (RealServer("fd00::1", 80, forwarding="masquerade"), "needs tunnel forwarding"),
])
def test_real_server_validation(rs, match):
    with pytest.raises(ValueError, match=match):
        rs.validate(virtual_server("tcp", "10.0.0.1", 80))


def test_route_to_another_port_is_fine_for_fwmark_services_and_masquerade_anywhere():
    RealServer("10.1.0.1", 0, forwarding="route").validate(virtual_server(fwmark=1))
    RealServer("10.1.0.1", 8080, forwarding="masquerade").validate(virtual_server("tcp", "10.0.0.1", 80))
    RealServer("fd00::1", 80, forwarding="tunnel").validate(virtual_server("tcp", "10.0.0.1", 80))


def test_duplicate_real_servers_are_refused():
    with pytest.raises(ValueError, match="listed twice"):
        ServiceState(VS, (RS1, RealServer("10.244.1.1", 8080, weight=5))).validate()


def test_connection_counts_do_not_make_real_servers_differ():
    assert conns(RS1, 3, 4) == RS1 and conns(RS1, 3, 4).same_config(RS1) and conns(RS1, 3, 4).connections == 7


def test_local_forwarding_reported_by_the_kernel_equals_masquerade():
    assert RealServer("10.1.0.1", 80, forwarding="local").same_config(RealServer("10.1.0.1", 80, forwarding="masq"))
    assert not RealServer("10.1.0.1", 80, forwarding="route").same_config(RealServer("10.1.0.1", 80))


# -- planning


def test_plan_creates_a_missing_service_with_its_real_servers():
    p = plan([], [ServiceState(VS, (RS2, RS1))])
    assert [str(op) for op in p.ops] == [
        "-A -t 10.96.0.10:80 -s rr",
        "-a -t 10.96.0.10:80 -r 10.244.1.1:8080 -m -w 1",
        "-a -t 10.96.0.10:80 -r 10.244.1.2:8080 -m -w 1",
    ]


def test_plan_is_empty_when_the_kernel_matches():
    have = ServiceState(VS, (conns(RS1, 2, 5), RS2))
    assert plan([have], [ServiceState(VS, (RS1, RS2))]).empty


def test_plan_edits_service_settings_in_place():
    changed = virtual_server("tcp", "10.96.0.10", 80, scheduler="sh", scheduler_flags=["sh-port"],
                             persistence_timeout=30)
    p = plan([ServiceState(VS, (RS1,))], [ServiceState(changed, (RS1,))])
    assert kinds(p) == [(EDIT_SERVICE, "TCP 10.96.0.10:80")]
    assert str(p.ops[0]) == "-E -t 10.96.0.10:80 -s sh -b sh-port -p 30"


def test_plan_adds_edits_and_purges_real_servers():
    have = ServiceState(VS, (RS1, RS2))
    want = ServiceState(VS, (RealServer("10.244.1.1", 8080, weight=5), RS3))
    p = plan([have], [want])
    assert kinds(p) == [(DELETE_DEST, "10.244.1.2:8080"), (EDIT_DEST, "10.244.1.1:8080"),
                        (ADD_DEST, "10.244.1.3:8080")]
    assert str(p.ops[1]) == "-e -t 10.96.0.10:80 -r 10.244.1.1:8080 -m -w 5"
    assert str(p.ops[0]) == "-d -t 10.96.0.10:80 -r 10.244.1.2:8080"


def test_plan_leaves_unlisted_real_servers_alone_without_purge():
    p = plan([ServiceState(VS, (RS1, RS2))], [ServiceState(VS, (RS3,))], purge_real_servers=False)
    assert kinds(p) == [(ADD_DEST, "10.244.1.3:8080")]


def test_plan_deletes_services_not_desired_unless_told_otherwise():
    other = virtual_server("udp", "10.96.0.53", 53)
    cur = [ServiceState(VS, (RS1,)), ServiceState(other, ())]
    assert kinds(plan(cur, [ServiceState(VS, (RS1,))])) == [(DELETE_SERVICE, "UDP 10.96.0.53:53")]
    assert plan(cur, [ServiceState(VS, (RS1,))], delete_services=False).empty
    only_ours = plan(cur, [], delete_services=lambda vs: vs.protocol == "UDP")
    assert kinds(only_ours) == [(DELETE_SERVICE, "UDP 10.96.0.53:53")]


def test_a_service_whose_key_changed_is_replaced():
    moved = virtual_server("tcp", "10.96.0.11", 80, scheduler="rr")
    p = plan([ServiceState(VS, (RS1,))], [ServiceState(moved, (RS1,))])
    assert kinds(p) == [(DELETE_SERVICE, "TCP 10.96.0.10:80"), (ADD_SERVICE, "TCP 10.96.0.11:80"),
                        (ADD_DEST, "10.244.1.1:8080")]


def test_desiring_a_service_twice_is_an_error():
    with pytest.raises(ValueError, match="desired twice"):
        plan([], [ServiceState(VS), ServiceState(VS)])


def test_fwmark_and_sctp_and_ipv6_ops_as_ipvsadm_arguments():
    fw = virtual_server(fwmark=3, family=6, scheduler="mh", scheduler_flags=["mh-port"])
    sc = virtual_server("sctp", "10.96.0.9", 9999, persistence_timeout=10, persistence_netmask=16)
    rs = RealServer("fd00::5", 0, forwarding="tunnel", weight=2, u_threshold=10, l_threshold=5)
    assert str(Op(ADD_SERVICE, fw)) == "-A -f 3 -6 -s mh -b mh-port"
    assert str(Op(ADD_DEST, fw, rs)) == "-a -f 3 -6 -r [fd00::5]:0 -i -w 2 -x 10 -y 5"
    assert str(Op(ADD_SERVICE, sc)) == "-A --sctp-service 10.96.0.9:9999 -s wlc -p 10 -M 255.255.0.0"
    assert str(Op(DELETE_SERVICE, sc)) == "-D --sctp-service 10.96.0.9:9999"


# -- graceful removal


def test_graceful_removal_quiesces_a_busy_real_server_then_deletes_it_when_idle():
    g = Graceful()
    want = [ServiceState(VS, (RS1,))]
    busy = [ServiceState(VS, (RS1, conns(RS2, active=1)))]
    p1 = plan(busy, want, graceful=g, now=100.0)
    assert kinds(p1) == [(EDIT_DEST, "10.244.1.2:8080")] and p1.ops[0].real_server.weight == 0
    pending_key = (VS.key, RS2.key)
    assert p1.pending == {pending_key: 100.0}
    quiesced = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0, active_connections=1)))]
    p2 = plan(quiesced, want, graceful=g, pending=p1.pending, now=200.0)
    assert p2.empty and p2.pending == {pending_key: 100.0}  # waiting, nothing to do
    lingering = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0, inactive_connections=2)))]
    assert plan(lingering, want, graceful=g, pending=p2.pending, now=300.0).empty  # inactive counts too
    idle = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0)))]
    p3 = plan(idle, want, graceful=g, pending=p2.pending, now=400.0)
    assert kinds(p3) == [(DELETE_DEST, "10.244.1.2:8080")] and p3.pending == {}


def test_graceful_removal_deletes_an_idle_real_server_at_once():
    p = plan([ServiceState(VS, (RS1, RS2))], [ServiceState(VS, (RS1,))], graceful=Graceful())
    assert kinds(p) == [(DELETE_DEST, "10.244.1.2:8080")] and p.pending == {}


def test_graceful_removal_timeout():
    g = Graceful(timeout=30)
    want = [ServiceState(VS, (RS1,))]
    busy = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0, active_connections=5)))]
    pending = {(VS.key, RS2.key): 100.0}
    assert plan(busy, want, graceful=g, pending=pending, now=129.0).pending == pending
    p = plan(busy, want, graceful=g, pending=pending, now=130.0)
    assert kinds(p) == [(DELETE_DEST, "10.244.1.2:8080")] and p.pending == {}


def test_udp_and_sctp_real_servers_are_deleted_at_once_like_upstream():
    udp = virtual_server("udp", "10.96.0.53", 53)
    busy = [ServiceState(udp, (conns(RS1, 1, 1), conns(RS2, 0, 9)))]
    p = plan(busy, [ServiceState(udp, (RS1,))], graceful=Graceful())
    assert kinds(p) == [(DELETE_DEST, "10.244.1.2:8080")] and p.pending == {}
    everything = Graceful(immediate=())
    assert kinds(plan(busy, [ServiceState(udp, (RS1,))], graceful=everything)) == [(EDIT_DEST, "10.244.1.2:8080")]


def test_a_pending_real_server_that_comes_back_gets_its_weight_back():
    pending = {(VS.key, RS2.key): 100.0}
    quiesced = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0, active_connections=1)))]
    p = plan(quiesced, [ServiceState(VS, (RS1, RS2))], graceful=Graceful(), pending=pending, now=150.0)
    assert kinds(p) == [(EDIT_DEST, "10.244.1.2:8080")] and p.ops[0].real_server.weight == 1
    assert p.pending == {}


def test_pending_entries_vanish_with_their_real_server_or_service():
    pending = {(VS.key, RS2.key): 100.0}
    assert plan([ServiceState(VS, (RS1,))], [ServiceState(VS, (RS1,))], graceful=Graceful(), pending=pending,
                now=150.0).pending == {}
    busy = [ServiceState(VS, (RS1, conns(RS2, active=1)))]
    p = plan(busy, [], graceful=Graceful(), pending=pending, now=150.0)
    assert kinds(p) == [(DELETE_SERVICE, "TCP 10.96.0.10:80")] and p.pending == {}


def test_pending_removals_continue_in_services_a_partial_sync_does_not_touch():
    other = virtual_server("tcp", "10.96.0.20", 443)
    pending = {(VS.key, RS2.key): 100.0}
    cur = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0))), ServiceState(other, ())]
    p = plan(cur, [ServiceState(other, (RS3,))], delete_services=False, graceful=Graceful(), pending=pending,
             now=150.0)
    assert kinds(p) == [(DELETE_DEST, "10.244.1.2:8080"), (ADD_DEST, "10.244.1.3:8080")]
    assert p.pending == {}


def test_pending_removals_continue_without_purge():
    pending = {(VS.key, RS2.key): 100.0}
    cur = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0)))]
    p = plan(cur, [ServiceState(VS, (RS1,))], purge_real_servers=False, graceful=Graceful(), pending=pending,
             now=150.0)
    assert kinds(p) == [(DELETE_DEST, "10.244.1.2:8080")]


def test_without_graceful_pending_real_servers_are_deleted():
    pending = {(VS.key, RS2.key): 100.0}
    cur = [ServiceState(VS, (RS1, RealServer("10.244.1.2", 8080, weight=0, active_connections=4)))]
    assert kinds(plan(cur, [ServiceState(VS, (RS1,))], pending=pending)) == [(DELETE_DEST, "10.244.1.2:8080")]


def test_predict_applies_ops_to_one_service_and_keeps_counters():
    have = ServiceState(VS, (conns(RS1, 3, 1), RS2))
    want = ServiceState(VS, (RealServer("10.244.1.1", 8080, weight=4), RS3))
    after = ipvs.predict(have, plan([have], [want]).ops)
    assert {(rs.address, rs.weight, rs.active_connections) for rs in after.real_servers} == {
        ("10.244.1.1", 4, 3), ("10.244.1.3", 1, 0)}
    assert ipvs.predict(have, [Op(DELETE_SERVICE, VS)]) is None
    assert ipvs.predict(None, plan([], [want]).ops).real_servers == tuple(ipvs.sort_real_servers(want.real_servers))


# -- ipvsadm-like text


def test_format_service_like_ipvsadm_ln():
    vs = virtual_server("tcp", "10.96.0.10", 80, scheduler="sh", scheduler_flags=["sh-fallback", "sh-port"],
                        persistence_timeout=300, persistence_netmask="255.255.255.0")
    state = ServiceState(vs, (conns(RS2, 0, 12), RealServer("10.244.1.1", 8080, weight=3, forwarding="route",
                                                            active_connections=2)))
    assert ipvs.format_service(state) == (
        "TCP  10.96.0.10:80 sh (sh-fallback,sh-port) persistent 300 mask 255.255.255.0\n"
        "  -> 10.244.1.1:8080              Route   3      2          0\n"
        "  -> 10.244.1.2:8080              Masq    1      0          12\n")
    assert ipvs.format_service(state, counters=False).splitlines()[1] == "  -> 10.244.1.1:8080              Route   3"


def test_format_fwmark_sctp_and_table():
    fw = ServiceState(virtual_server(fwmark=5, scheduler="rr"), (RealServer("10.0.0.1", 0, forwarding="tunnel"),))
    sc = ServiceState(virtual_server("sctp", "10.96.0.9", 9999))
    text = ipvs.format_table([fw, sc], counters=False)
    assert text == (ipvs.IPVSADM_TITLE_NO_COUNTERS + "SCTP 10.96.0.9:9999 wlc\n"
                    + "FWM  5 rr\n  -> 10.0.0.1:0                   Tunnel  1\n")


# -- netlink codec


def encode_decode(op):
    """Our encoding of an op, split back into (cmd, service attrs, dest attrs)."""
    data = nl.nlmsg(42, nl.NLM_F_REQUEST | nl.NLM_F_ACK, 7, ipvs.op_payload(op))
    ((kind, flags, seq, body),) = list(nl.split_messages(data))
    assert (kind, flags, seq) == (42, 5, 7)
    cmd, attrs = nl.genl_attrs(body)
    svc = nl.parse_attrs(attrs[nl.IPVS_CMD_ATTR_SERVICE])
    dest = nl.parse_attrs(attrs[nl.IPVS_CMD_ATTR_DEST]) if nl.IPVS_CMD_ATTR_DEST in attrs else None
    return cmd, svc, dest


def test_add_service_message_round_trip():
    vs = virtual_server("udp", "10.96.0.53", 53, scheduler="sh", scheduler_flags=["sh-port"],
                        persistence_timeout=300, persistence_netmask=24)
    cmd, svc, dest = encode_decode(Op(ADD_SERVICE, vs))
    assert cmd == nl.IPVS_CMD_NEW_SERVICE and dest is None
    assert ipvs.service_from_wire(nl.decode_service(svc)) == vs
    assert svc[nl.IPVS_SVC_ATTR_NETMASK] == socket.inet_aton("255.255.255.0")
    assert svc[nl.IPVS_SVC_ATTR_FLAGS] == struct.pack("=II", 0x11, 0xFFFFFFFF)
    assert svc[nl.IPVS_SVC_ATTR_SCHED_NAME] == b"sh\0"


def test_ipv6_netmask_is_a_host_order_prefix_length():
    vs = virtual_server("tcp", "fd00::10", 443, persistence_timeout=60, persistence_netmask=64)
    _unused, svc, _unused = encode_decode(Op(EDIT_SERVICE, vs))
    assert svc[nl.IPVS_SVC_ATTR_NETMASK] == struct.pack("=I", 64)
    assert svc[nl.IPVS_SVC_ATTR_ADDR] == socket.inet_pton(socket.AF_INET6, "fd00::10")
    assert ipvs.service_from_wire(nl.decode_service(svc)) == vs


def test_key_only_messages_for_deletes_and_dest_ops():
    _cmd, svc, _unused = encode_decode(Op(DELETE_SERVICE, VS))
    assert set(svc) == {nl.IPVS_SVC_ATTR_AF, nl.IPVS_SVC_ATTR_PROTOCOL, nl.IPVS_SVC_ATTR_ADDR, nl.IPVS_SVC_ATTR_PORT}
    fw = virtual_server(fwmark=9)
    cmd, svc, dest = encode_decode(Op(DELETE_DEST, fw, RS1))
    assert cmd == nl.IPVS_CMD_DEL_DEST and set(svc) == {nl.IPVS_SVC_ATTR_AF, nl.IPVS_SVC_ATTR_FWMARK}
    assert set(dest) == {nl.IPVS_DEST_ATTR_ADDR, nl.IPVS_DEST_ATTR_PORT, nl.IPVS_DEST_ATTR_ADDR_FAMILY}


def test_dest_message_round_trip_with_tunnel_settings():
    rs = RealServer("10.1.0.7", 80, weight=7, forwarding="tunnel", u_threshold=100, l_threshold=50,
                    tunnel_type="gue", tunnel_port=6080, tunnel_flags=1)
    cmd, _svc, dest = encode_decode(Op(ADD_DEST, VS, rs))
    assert cmd == nl.IPVS_CMD_NEW_DEST
    assert dest[nl.IPVS_DEST_ATTR_TUN_PORT] == struct.pack("!H", 6080)  # big endian (pyroute2 sends host order)
    decoded = nl.decode_dest(dest, 4)
    assert decoded["fwd_method"] == ipvs.IP_VS_CONN_F_TUNNEL
    back = ipvs.dest_from_wire({**decoded, "active_conns": 0, "inact_conns": 0, "persist_conns": 0})
    assert back == rs and back.same_config(rs)
    _cmd, _svc, plain = encode_decode(Op(EDIT_DEST, VS, RS1))
    assert nl.IPVS_DEST_ATTR_TUN_TYPE not in plain  # older kernels never see tunnel attributes


def test_dest_without_address_family_attribute_takes_the_services():
    attrs = {nl.IPVS_DEST_ATTR_ADDR: socket.inet_pton(socket.AF_INET6, "fd00::9"),
             nl.IPVS_DEST_ATTR_PORT: struct.pack("!H", 80)}
    assert nl.decode_dest(attrs, 6)["address"] == "fd00::9"
    attrs[nl.IPVS_DEST_ATTR_ADDR] = socket.inet_aton("10.0.0.9") + b"\0" * 12  # the kernel sends 16 bytes
    assert nl.decode_dest(attrs, 4)["address"] == "10.0.0.9"


import pyroute2.netlink.generic.ipvs as pyroute2_ipvs  # noqa: E402 - a requirement; compared with our encoder


def test_our_messages_parse_with_pyroute2():
    vs = virtual_server("tcp", "10.96.0.10", 80, scheduler="wrr", persistence_timeout=60,
                        persistence_netmask="255.255.0.0")
    rs = RealServer("10.244.1.5", 8080, weight=3, u_threshold=9, l_threshold=2)
    for op in (Op(ADD_SERVICE, vs), Op(ADD_DEST, vs, rs)):
        msg = pyroute2_ipvs.ipvsmsg(nl.nlmsg(30, 5, 1, ipvs.op_payload(op)))
        msg.decode()
        svc = msg.get_attr("IPVS_CMD_ATTR_SERVICE")
        assert (svc.get_attr("IPVS_SVC_ATTR_ADDR"), svc.get_attr("IPVS_SVC_ATTR_PORT"),
                svc.get_attr("IPVS_SVC_ATTR_PROTOCOL")) == ("10.96.0.10", 80, 6)
        if op.kind == ADD_SERVICE:
            assert msg["cmd"] == nl.IPVS_CMD_NEW_SERVICE
            assert svc.get_attr("IPVS_SVC_ATTR_SCHED_NAME") == "wrr"
            assert svc.get_attr("IPVS_SVC_ATTR_TIMEOUT") == 60
            assert svc.get_attr("IPVS_SVC_ATTR_NETMASK") == "255.255.0.0"
            assert svc.get_attr("IPVS_SVC_ATTR_FLAGS")["flags"] == 1
        else:
            dest = msg.get_attr("IPVS_CMD_ATTR_DEST")
            assert (dest.get_attr("IPVS_DEST_ATTR_ADDR"), dest.get_attr("IPVS_DEST_ATTR_PORT"),
                    dest.get_attr("IPVS_DEST_ATTR_WEIGHT"), dest.get_attr("IPVS_DEST_ATTR_FWD_METHOD"),
                    dest.get_attr("IPVS_DEST_ATTR_U_THRESH"), dest.get_attr("IPVS_DEST_ATTR_L_THRESH")) == (
                "10.244.1.5", 8080, 3, 0, 9, 2)


def test_pyroute2_messages_parse_with_ours():
    from pyroute2 import IPVSDest, IPVSService

    svc = IPVSService(addr="10.96.0.10", port=80, protocol=socket.IPPROTO_TCP, sched_name="lc", timeout=5)
    dest = IPVSDest(addr="10.244.1.5", port=8080, weight=4, fwd_method=0)
    msg = pyroute2_ipvs.ipvsmsg()
    msg["cmd"], msg["version"] = nl.IPVS_CMD_NEW_DEST, 1
    msg["attrs"] = [("IPVS_CMD_ATTR_SERVICE", svc.dump_nla()), ("IPVS_CMD_ATTR_DEST", dest.dump_nla())]
    msg["header"]["type"] = 30
    msg.encode()
    cmd, attrs = nl.genl_attrs(list(nl.split_messages(msg.data))[0][3])
    s = nl.decode_service(nl.parse_attrs(attrs[nl.IPVS_CMD_ATTR_SERVICE]))
    d = nl.decode_dest(nl.parse_attrs(attrs[nl.IPVS_CMD_ATTR_DEST]), 4)
    assert cmd == nl.IPVS_CMD_NEW_DEST
    assert (s["address"], s["port"], s["protocol"], s["scheduler"], s["timeout"], s["netmask"]) == (
        "10.96.0.10", 80, 6, "lc", 5, 32)
    assert (d["address"], d["port"], d["weight"], d["fwd_method"]) == ("10.244.1.5", 8080, 4, 0)


# -- the netlink client, against a scripted socket


def ack(seq, code=0):
    return nl.nlmsg(nl.NLMSG_ERROR, 0, seq, struct.pack("=i", -code) + b"\0" * 16)


def genl_answer(kind, seq, attrs, flags=nl.NLM_F_MULTI):
    return nl.nlmsg(kind, flags, seq, nl.genl_payload(nl.IPVS_CMD_NEW_SERVICE, attrs))


class FakeSocket:
    """Answers each datagram sent with what ``respond(requests)`` returns (a list of datagrams)."""

    def __init__(self, respond):
        self.respond = respond
        self.sent = []
        self.queue = []

    def send(self, data):
        requests = list(nl.split_messages(data))
        self.sent.append(requests)
        self.queue.extend(self.respond(requests))
        return len(data)

    def recv(self, _size):
        if not self.queue:
            raise TimeoutError("timed out")
        return self.queue.pop(0)

    def close(self):
        pass


def connection(respond, family_id=30):
    conn = nl.GenlConnection.__new__(nl.GenlConnection)
    conn.sock = FakeSocket(respond)
    conn.seq = 0
    conn.family_id = family_id
    return conn


def test_family_lookup():
    def respond(requests):
        ((kind, _flags, seq, body),) = requests
        assert kind == nl.GENL_ID_CTRL
        assert nl.genl_attrs(body)[1][nl.CTRL_ATTR_FAMILY_NAME] == b"IPVS\0"
        return [genl_answer(nl.GENL_ID_CTRL, seq, nl.nla_u16(nl.CTRL_ATTR_FAMILY_ID, 33), 0) + ack(seq)]
    assert connection(respond).resolve_family("IPVS") == 33


def test_family_lookup_without_ipvs_is_enoent():
    def respond(requests):
        return [ack(requests[0][2], errno.ENOENT)]
    with pytest.raises(nl.NetlinkError) as exc:
        connection(respond).resolve_family("IPVS")
    assert exc.value.errno == errno.ENOENT


def test_batch_acks_map_to_their_requests():
    def respond(requests):
        # acks in reverse order, one datagram each; the 3rd request of a batch fails
        seqs = [seq for _kind, _flags, seq, _body in requests]
        return [ack(seq, errno.EEXIST if i == 2 else 0) for i, seq in reversed(list(enumerate(seqs)))]
    conn = connection(respond)
    assert conn.request_batch([b"a", b"b", b"c"]) == [0, 0, errno.EEXIST]
    assert conn.request_batch([b"x"] * 5, batch_size=3) == [0, 0, errno.EEXIST, 0, 0]
    assert [len(d) for d in conn.sock.sent] == [3, 3, 2]


def test_dump_collects_multipart_answers_until_done():
    svc_attrs = nl.service_attrs(ipvs._service_wire(VS), full=True)

    def respond(requests):
        ((kind, flags, seq, _body),) = requests
        assert kind == 30 and flags & nl.NLM_F_DUMP == nl.NLM_F_DUMP
        other = nl.nlmsg(30, nl.NLM_F_MULTI, seq + 100, b"")  # another request's answer: ignored
        part = genl_answer(30, seq, svc_attrs)
        return [part + other, part, nl.nlmsg(nl.NLMSG_DONE, nl.NLM_F_MULTI, seq, struct.pack("=i", 0))]
    answers = connection(respond).dump(nl.IPVS_CMD_GET_SERVICE)
    assert len(answers) == 2
    assert ipvs.service_from_wire(nl.decode_service(nl.parse_attrs(answers[0][1]))) == VS


def test_a_silent_kernel_times_out():
    with pytest.raises(nl.NetlinkError) as exc:
        connection(lambda requests: []).request_batch([b"x"])
    assert exc.value.errno == errno.ETIMEDOUT


# -- IPVSKernel over a fake connection


class FakeConn:
    def __init__(self, codes=None, dumps=None, get_error=0):
        self.codes = codes
        self.dumps = dumps or {}
        self.get_error = get_error
        self.requests = []

    def request_batch(self, payloads, batch_size=128):
        self.requests.extend(payloads)
        return self.codes if self.codes is not None else [0] * len(payloads)

    def dump(self, cmd, attrs=b""):
        return self.dumps.get(cmd, [])

    def get(self, cmd, attrs=b""):
        if self.get_error:
            raise nl.NetlinkError(self.get_error)
        return {}

    def close(self):
        pass


def kernel_with(conn, reader=None):
    k = ipvs.IPVSKernel()
    k._conn = conn
    k._sockopt = reader
    k._sockopt_failed = reader is None  # never this machine's kernel in unit tests
    return k


def test_apply_reports_each_refused_operation_clearly():
    ops = [Op(ADD_SERVICE, virtual_server("tcp", "10.0.0.1", 80, scheduler="bogus")), Op(ADD_DEST, VS, RS1),
           Op(DELETE_DEST, VS, RS2), Op(ADD_DEST, VS, RS3)]
    result = kernel_with(FakeConn([errno.ENOENT, errno.ESRCH, errno.ENOENT, 0])).apply(ops)
    assert result.applied == 1 and not result.ok
    messages = [str(e) for _op, e in result.errors]
    assert messages == [
        "scheduler 'bogus' is not available in this kernel (module ip_vs_bogus not found)",
        "virtual service TCP 10.96.0.10:80 does not exist",
        "real server 10.244.1.2:8080 of TCP 10.96.0.10:80 does not exist",
    ]
    assert isinstance(result.errors[0][1], ipvs.SchedulerUnavailable)
    with pytest.raises(ipvs.SchedulerUnavailable):
        result.raise_first()


def test_unexpected_errors_name_the_operation():
    result = kernel_with(FakeConn([errno.EPERM])).apply([Op(ADD_SERVICE, VS)])
    assert str(result.errors[0][1]) == (
        "ipvsadm -A -t 10.96.0.10:80 -s rr: Operation not permitted (IPVS needs CAP_NET_ADMIN)")


def test_single_operations_raise():
    with pytest.raises(ipvs.IPVSError, match="already exists") as exc:
        kernel_with(FakeConn([errno.EEXIST])).add_service(VS)
    assert exc.value.code == errno.EEXIST


def test_services_lists_services_and_their_real_servers():
    svc = nl.service_attrs(ipvs._service_wire(VS), full=True)
    dest_values = dict(ipvs._dest_wire(RS1))
    dest = nl.dest_attrs(dest_values, full=True)[4:]
    dest += nl.nla_u32(nl.IPVS_DEST_ATTR_ACTIVE_CONNS, 2) + nl.nla_u32(nl.IPVS_DEST_ATTR_INACT_CONNS, 3)
    conn = FakeConn(dumps={nl.IPVS_CMD_GET_SERVICE: [nl.parse_attrs(svc)],
                           nl.IPVS_CMD_GET_DEST: [{nl.IPVS_CMD_ATTR_DEST: dest}]})
    (state,) = kernel_with(conn).services()
    assert state.virtual == VS and state.real_servers == (RS1,)
    assert (state.real_servers[0].active_connections, state.real_servers[0].inactive_connections) == (2, 3)


def test_get_of_a_missing_service_is_none():
    assert kernel_with(FakeConn(get_error=errno.ESRCH)).get(VS) is None


def test_no_ipvs_in_the_kernel_is_a_clear_error(monkeypatch):
    def no_family(*_args, **_kwargs):
        raise nl.NetlinkError(errno.ENOENT, "generic netlink family IPVS")
    monkeypatch.setattr(nl, "GenlConnection", no_family)
    with pytest.raises(ipvs.IPVSUnavailable, match=r"^kernel has no IPVS \(modprobe ip_vs\)$"):
        ipvs.IPVSKernel().services()
    with pytest.raises(ipvs.IPVSUnavailable, match=r"modprobe ip_vs\) in network namespace ns1"):
        ipvs.IPVSKernel(netns="ns1").services()


def test_missing_namespace_is_a_clear_error(monkeypatch):
    def no_netns(*_args, **_kwargs):
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setattr(nl, "GenlConnection", no_netns)
    with pytest.raises(ipvs.IPVSUnavailable, match="network namespace 'nope' does not exist"):
        ipvs.IPVSKernel(netns="nope").services()


def test_sync_plans_against_the_listing_and_applies():
    conn = FakeConn()
    k = kernel_with(conn)
    p, result = k.sync([ServiceState(VS, (RS1,))], current=[])
    assert kinds(p) == [(ADD_SERVICE, "TCP 10.96.0.10:80"), (ADD_DEST, "10.244.1.1:8080")]
    assert result.applied == 2 and len(conn.requests) == 2


# -- IPVS timeouts over netlink (IPVS_CMD_SET_CONFIG / GET_CONFIG)


def test_set_timeouts_sends_set_config_with_the_three_timeouts():
    conn = FakeConn()
    kernel_with(conn).set_timeouts(900, 0, 300)
    ((payload),) = conn.requests
    cmd, attrs = nl.genl_attrs(payload)
    assert cmd == nl.IPVS_CMD_SET_CONFIG
    assert nl.decode_timeouts(attrs) == (900, 0, 300)  # 0: the kernel keeps the FIN timeout
    assert sorted(attrs) == [nl.IPVS_CMD_ATTR_TIMEOUT_TCP, nl.IPVS_CMD_ATTR_TIMEOUT_TCP_FIN,
                             nl.IPVS_CMD_ATTR_TIMEOUT_UDP]


def test_set_timeouts_errors():
    with pytest.raises(ValueError, match="out of range"):
        kernel_with(FakeConn()).set_timeouts(-1, 0, 0)
    with pytest.raises(ipvs.IPVSError, match="Invalid argument") as exc:
        kernel_with(FakeConn([errno.EINVAL])).set_timeouts(10 ** 9, 0, 0)
    assert exc.value.code == errno.EINVAL


def test_timeouts_read_get_config():
    class Conn(FakeConn):
        def get(self, cmd, attrs=b""):
            assert cmd == nl.IPVS_CMD_GET_CONFIG
            return nl.parse_attrs(nl.timeout_attrs(901, 121, 301))
    assert kernel_with(Conn()).timeouts() == (901, 121, 301)


# -- the fast listing: services by one dump, IPv4 real servers by getsockopt


@pytest.mark.parametrize("vs", [
    VS, virtual_server("udp", "10.96.0.11", 53, scheduler="sh", scheduler_flags=["sh-port"]),
    virtual_server("tcp", "10.96.0.12", 443, persistence_timeout=600, persistence_netmask="255.255.255.0"),
    virtual_server("tcp", "fd00::10", 80, persistence_timeout=60, persistence_netmask=64),
    virtual_server("sctp", "10.96.0.13", 3868), virtual_server(fwmark=7, family="ipv6"),
    VirtualServer("10.96.0.14", 5060, "UDP", flags=ipvs.IP_VS_SVC_F_PERSISTENT | ipvs.IP_VS_SVC_F_ONEPACKET,
                  timeout=30, pe_name="sip"),
])
def test_service_hot_path_decodes_like_the_reference(vs):
    wire = ipvs._service_wire(vs)
    attrs = nl.parse_attrs(nl.service_attrs(wire, full=True)[4:])
    attrs[nl.IPVS_SVC_ATTR_FLAGS] = nl.SVC_FLAGS.pack(vs.flags | ipvs.IP_VS_SVC_F_HASHED, 0xFFFFFFFF)
    fast = ipvs._service_from_attrs(attrs)
    assert fast == ipvs.service_from_wire(nl.decode_service(attrs)) == vs
    assert fast.__dict__ == vs.__dict__ and hash(fast) == hash(vs)


def test_dest_from_wire_builds_the_same_real_server_as_the_constructor():
    rs = RealServer("10.244.1.9", 8443, weight=5, forwarding="tunnel", u_threshold=9, l_threshold=2,
                    tunnel_type="gue", tunnel_port=6080, tunnel_flags=1)
    attrs = nl.parse_attrs(nl.dest_attrs(ipvs._dest_wire(rs), full=True)[4:])
    got = ipvs.dest_from_wire(nl.decode_dest(attrs, 4))
    assert got == rs and got.__dict__ == rs.__dict__ and got.same_config(rs)


class FakeSockoptKernel:
    """The kernel's side of IP_VS_SO_GET_SERVICES / IP_VS_SO_GET_DESTS (ip_vs_ctl.c),
    written with ctypes structures, independently of the reader's struct formats: the
    exact-length check (EINVAL), IPv4 services only, ESRCH for an unknown service, other
    families' destinations skipped, at most num_dests entries."""

    def __init__(self, services):
        self.services = services  # [(VirtualServer, [RealServer])]
        self.calls = []

    def getsockopt(self, _fd, level, opt, buf, length_ref):
        assert level == socket.IPPROTO_IP
        size = length_ref._obj.value
        self.calls.append(opt)
        v4 = [(vs, reals) for vs, reals in self.services if vs.family == 4]
        if opt == so.IP_VS_SO_GET_SERVICES:
            head = so._GetServices.from_buffer(buf)
            if size != ctypes.sizeof(so._GetServices) + head.num_services * ctypes.sizeof(so._ServiceEntry):
                ctypes.set_errno(errno.EINVAL)
                return -1
            for i, (vs, reals) in enumerate(v4[:head.num_services]):
                e = so._ServiceEntry.from_buffer(buf, so._GetServices.entrytable.offset
                                                 + i * ctypes.sizeof(so._ServiceEntry))
                if vs.fwmark:
                    e.fwmark = vs.fwmark
                else:
                    e.protocol = ipvs.PROTOCOLS[vs.protocol]
                    e.addr = int.from_bytes(socket.inet_aton(vs.address), "little")  # __be32 as stored
                    e.port = int.from_bytes(vs.port.to_bytes(2, "big"), "little")
                e.sched_name = vs.scheduler.encode()
                e.num_dests = len(reals)
            return 0
        if opt == so.IP_VS_SO_GET_DESTS:
            head = so._GetDests.from_buffer(buf)
            if size != ctypes.sizeof(so._GetDests) + head.num_dests * ctypes.sizeof(so._DestEntry):
                ctypes.set_errno(errno.EINVAL)
                return -1
            for vs, reals in v4:
                if vs.fwmark:
                    if head.fwmark != vs.fwmark:
                        continue
                elif (head.fwmark or head.protocol != ipvs.PROTOCOLS[vs.protocol]
                      or head.addr != int.from_bytes(socket.inet_aton(vs.address), "little")
                      or head.port != int.from_bytes(vs.port.to_bytes(2, "big"), "little")):
                    continue
                same = [rs for rs in reals if rs.family == 4][:head.num_dests]
                for i, rs in enumerate(same):
                    e = so._DestEntry.from_buffer(buf, so._GetDests.entrytable.offset
                                                  + i * ctypes.sizeof(so._DestEntry))
                    e.addr = int.from_bytes(socket.inet_aton(rs.address), "little")
                    e.port = int.from_bytes(rs.port.to_bytes(2, "big"), "little")
                    e.conn_flags = ipvs.FORWARDING[rs.forwarding] | 0x100  # other conn flags are ignored
                    e.weight, e.u_threshold, e.l_threshold = rs.weight, rs.u_threshold, rs.l_threshold
                    e.activeconns, e.inactconns, e.persistconns = (
                        rs.active_connections, rs.inactive_connections, rs.persistent_connections)
                return 0
            ctypes.set_errno(errno.ESRCH)
            return -1
        ctypes.set_errno(errno.ENOPROTOOPT)
        return -1


class FakeRawSocket:
    def __init__(self, kernel):
        self.kernel = kernel

    def fileno(self):
        return -1

    def getsockopt(self, level, opt, size):
        assert (level, opt, size) == (socket.IPPROTO_IP, so.IP_VS_SO_GET_INFO, 12)
        return struct.pack("=III", 0x010201, 4096, len(self.kernel.services))

    def close(self):
        pass


def sockopt_reader(kernel, monkeypatch):
    monkeypatch.setattr(so, "_libc", kernel.getsockopt)
    return so.SockoptReader(FakeRawSocket(kernel))


class DumpConn(FakeConn):
    """GET_SERVICE dumps the table; GET_DEST dumps one service's real servers (and is counted)."""

    def __init__(self, services):
        super().__init__()
        self.services = services
        self.dest_dumps = []

    def dump(self, cmd, attrs=b""):
        if cmd == nl.IPVS_CMD_GET_SERVICE:
            return [{nl.IPVS_CMD_ATTR_SERVICE: nl.service_attrs(ipvs._service_wire(vs), full=True)[4:]}
                    for vs, _reals in self.services]
        assert cmd == nl.IPVS_CMD_GET_DEST
        key = ipvs.service_from_wire(nl.decode_service(nl.parse_attrs(nl.parse_attrs(attrs)[nl.IPVS_CMD_ATTR_SERVICE])))
        self.dest_dumps.append(str(key))
        for vs, reals in self.services:
            if vs.key == key.key:
                return [{nl.IPVS_CMD_ATTR_DEST: nl.dest_attrs(ipvs._dest_wire(rs), full=True)[4:]
                         + nl.nla_u32(nl.IPVS_DEST_ATTR_ACTIVE_CONNS, rs.active_connections)} for rs in reals]
        return []


MIXED = [
    (VS, [conns(RS1, active=4), RS2, RealServer("10.244.1.3", 8080, weight=0, u_threshold=50, l_threshold=5)]),
    (virtual_server("udp", "10.96.0.53", 53), []),
    (virtual_server(fwmark=9), [RealServer("10.244.2.1", 0, forwarding="route")]),
    (virtual_server("tcp", "10.96.0.20", 80), [RealServer("10.244.3.1", 80, forwarding="tunnel", tunnel_type="gue",
                                                          tunnel_port=6080)]),
    (virtual_server("tcp", "10.96.0.21", 80), [RealServer("10.244.4.1", 80, forwarding="tunnel"),
                                               RealServer("fd00::4:1", 80, forwarding="tunnel")]),
    (virtual_server("tcp", "fd00::96", 443), [RealServer("fd00::1:1", 8443)]),
]


def test_fast_listing_equals_the_per_service_listing(monkeypatch):
    sockopt_kernel = FakeSockoptKernel(MIXED)
    conn = DumpConn(MIXED)
    k = kernel_with(conn, sockopt_reader(sockopt_kernel, monkeypatch))
    fast = k.services()
    assert [s.virtual for s in fast] == [vs for vs, _reals in MIXED]
    assert [list(s.real_servers) for s in fast] == [reals for _vs, reals in MIXED]
    assert fast[0].real_servers[0].active_connections == 4
    assert [rs.__dict__ for s in fast for rs in s.real_servers] == [rs.__dict__ for _vs, reals in MIXED
                                                                    for rs in reals]
    # netlink only where getsockopt cannot tell: tunnel parameters, a mixed-family pool, IPv6
    assert conn.dest_dumps == ["TCP 10.96.0.20:80", "TCP 10.96.0.21:80", "TCP [fd00::96]:443"]
    conn.dest_dumps.clear()
    assert k.services_each() == fast and len(conn.dest_dumps) == len(MIXED)


def test_fast_listing_asks_netlink_when_a_real_server_came_in_between(monkeypatch):
    sockopt_kernel = FakeSockoptKernel([(VS, [RS1])])
    reader = sockopt_reader(sockopt_kernel, monkeypatch)
    counts = reader.service_counts

    def stale_counts(capacity):  # listed before RS2 and RS3 were added
        found = counts(capacity)
        sockopt_kernel.services = [(VS, [RS1, RS2, RS3])]
        return found
    reader.service_counts = stale_counts
    conn = DumpConn([(VS, [RS1, RS2, RS3])])
    (state,) = kernel_with(conn, reader).services()
    assert state.real_servers == (RS1, RS2, RS3) and conn.dest_dumps == ["TCP 10.96.0.10:80"]


def test_fast_listing_falls_back_to_netlink_when_getsockopt_fails(monkeypatch):
    sockopt_kernel = FakeSockoptKernel(MIXED)
    reader = sockopt_reader(sockopt_kernel, monkeypatch)
    monkeypatch.setattr(reader, "getsockopt", lambda *args: (ctypes_errno(errno.EPERM), -1)[1])
    conn = DumpConn(MIXED)
    k = kernel_with(conn, reader)
    assert [list(s.real_servers) for s in k.services()] == [reals for _vs, reals in MIXED]
    assert len(conn.dest_dumps) == len(MIXED) and k._sockopt is None and k._sockopt_failed


def ctypes_errno(code):
    ctypes.set_errno(code)


def test_sockopt_requests_state_their_exact_size_and_read_thousands(monkeypatch):
    many = [(virtual_server("tcp", f"10.97.{i // 256}.{i % 256}", 80),
             [RealServer(f"10.245.{(3 * i + j) // 256 % 256}.{(3 * i + j) % 256}", 8080) for j in range(3)])
            for i in range(1200)]
    sockopt_kernel = FakeSockoptKernel(many)
    conn = DumpConn(many)
    listing = kernel_with(conn, sockopt_reader(sockopt_kernel, monkeypatch)).services()
    assert [list(s.real_servers) for s in listing] == [reals for _vs, reals in many]
    assert conn.dest_dumps == []  # one getsockopt per service, no EINVAL (exact sizes)
    assert sockopt_kernel.calls.count(so.IP_VS_SO_GET_DESTS) == 1200
