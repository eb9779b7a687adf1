"""stale_flows(): which conntrack entries a sync must delete (pure, no kernel).

Semantics follow kube-proxy's pkg/proxy/conntrack/cleanup.go: a UDP (or SCTP) flow
whose original destination is a service frontend IP:port (or a nodePort) and whose
reply source is not a serving endpoint IP:port of that service port is stale.
"""
from __future__ import annotations

import importlib.util
import struct
import sys

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import conntrack
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.conntrack import (
    ConntrackCleaner,
    ConntrackUnavailable,
    Flow,
    ServiceTarget,
    delete_message,
    stale_flows,
)

CLIENT = "10.244.2.10"
SVC_IP = "10.96.0.53"
EXT_IP = "203.0.113.7"
LB_IP = "198.51.100.7"
NODE_IP = "192.168.50.1"
BE1 = ("10.244.1.1", 5353)
BE2 = ("10.244.1.2", 5353)
BE3 = ("10.244.1.3", 5353)


def flow(dst: str, dport: int, backend: tuple[str, int], proto: str = "UDP", sport: int = 40000,
         src: str = CLIENT) -> Flow:
    return Flow(proto=proto, orig_src=src, orig_dst=dst, orig_dport=dport, reply_src=backend[0],
                reply_sport=backend[1], orig_sport=sport, reply_dst=src, reply_dport=sport)


def dns(*endpoints: tuple[str, int], proto: str = "UDP", node_port: int = 0,
        ips: tuple[str, ...] = (SVC_IP,)) -> ServiceTarget:
    return ServiceTarget(proto=proto, ips=set(ips), port=53, node_port=node_port, endpoints=set(endpoints))


def test_removed_endpoint_flows_go_remaining_stay():
    flows = [flow(SVC_IP, 53, BE1, sport=40001), flow(SVC_IP, 53, BE2, sport=40002),
             flow(SVC_IP, 53, BE1, sport=40003), flow(SVC_IP, 53, BE3, sport=40004)]
    stale = stale_flows(flows, [dns(BE2, BE3)])
    assert stale == [flows[0], flows[2]]


def test_endpoint_port_change_is_stale():
    # same pod IP, new targetPort: the old DNAT target IP:port no longer serves
    flows = [flow(SVC_IP, 53, ("10.244.1.1", 5353)), flow(SVC_IP, 53, ("10.244.1.1", 5454), sport=40001)]
    assert stale_flows(flows, [dns(("10.244.1.1", 5454))]) == [flows[0]]


def test_all_frontends_are_checked():
    flows = [flow(SVC_IP, 53, BE1), flow(EXT_IP, 53, BE1), flow(LB_IP, 53, BE1), flow(LB_IP, 53, BE2)]
    stale = stale_flows(flows, [dns(BE2, ips=(SVC_IP, EXT_IP, LB_IP))])
    assert stale == flows[:3]


def test_tcp_is_never_touched():
    flows = [flow(SVC_IP, 53, BE1, proto="TCP"), flow(SVC_IP, 80, BE1, proto="TCP")]
    targets = [dns(BE2), dns(BE2, proto="TCP"),
               ServiceTarget(proto="TCP", ips={SVC_IP}, port=80, endpoints={BE2})]
    assert stale_flows(flows, targets) == []
    assert stale_flows(flows, targets, clear_without_endpoints=True) == []


def test_tcp_target_does_not_clean_udp_flows():
    flows = [flow(SVC_IP, 53, BE1)]
    assert stale_flows(flows, [dns(BE2, proto="TCP")]) == []


def test_node_port_flows():
    flows = [flow(NODE_IP, 30053, BE1, src="192.168.50.2"),
             flow(NODE_IP, 30053, BE2, src="192.168.50.2", sport=40001),
             flow("127.0.0.1", 30053, BE1, src="127.0.0.1", sport=40002),  # any node address
             flow(NODE_IP, 30054, BE1, src="192.168.50.2", sport=40003)]  # another port
    stale = stale_flows(flows, [dns(BE2, node_port=30053)])
    assert stale == [flows[0], flows[2]]


def test_node_port_zero_means_none():
    flows = [flow(NODE_IP, 0, BE1)]
    assert stale_flows(flows, [dns(BE2, node_port=0)]) == []


def test_service_without_endpoints_keeps_flows_like_upstream():
    # current upstream skips service ports without serving endpoints
    flows = [flow(SVC_IP, 53, BE1), flow(NODE_IP, 30053, BE1, sport=40001)]
    assert stale_flows(flows, [dns(node_port=30053)]) == []


def test_service_without_endpoints_clear_option_drops_all_its_udp_flows():
    flows = [flow(SVC_IP, 53, BE1), flow(SVC_IP, 53, BE2, sport=40001),
             flow(SVC_IP, 53, (SVC_IP, 53), sport=40002),  # never DNATed
             flow(NODE_IP, 30053, BE1, sport=40003),
             flow(SVC_IP, 53, BE1, proto="TCP", sport=40004),  # TCP stays
             flow("10.96.0.54", 53, BE1, sport=40005)]  # another service stays
    stale = stale_flows(flows, [dns(node_port=30053)], clear_without_endpoints=True)
    assert stale == flows[:4]


def test_zero_to_some_endpoints_clears_unnatted_flows():
    # sent to the service IP before it had endpoints: no DNAT, reply source = the service IP
    never_natted = flow(SVC_IP, 53, (SVC_IP, 53))
    natted = flow(SVC_IP, 53, BE1, sport=40001)
    assert stale_flows([never_natted, natted], [dns(BE1)]) == [never_natted]


def test_flows_to_anything_else_are_untouched():
    flows = [flow("10.96.0.54", 53, BE1),  # other service IP
             flow(SVC_IP, 54, BE1),  # same IP, other port
             flow(BE1[0], BE1[1], BE1),  # straight to the pod
             flow("8.8.8.8", 53, ("8.8.8.8", 53))]  # outside world
    assert stale_flows(flows, [dns(BE2)]) == []


def test_other_service_with_active_endpoint_is_untouched():
    flows = [flow(SVC_IP, 53, BE1), flow("10.96.0.54", 53, BE1, sport=40001)]
    other = ServiceTarget(proto="UDP", ips={"10.96.0.54"}, port=53, endpoints={BE1})
    assert stale_flows(flows, [dns(BE2), other]) == [flows[0]]


def test_no_targets_no_flows():
    assert stale_flows([flow(SVC_IP, 53, BE1)], []) == []
    assert stale_flows([], [dns(BE2)]) == []


def test_sctp_like_udp_unless_restricted_to_udp():
    flows = [flow(SVC_IP, 53, BE1, proto="SCTP"), flow(SVC_IP, 53, BE1)]
    targets = [dns(BE2, proto="SCTP"), dns(BE2)]
    assert stale_flows(flows, targets) == flows
    assert stale_flows(flows, targets, protocols=("UDP",)) == [flows[1]]


def test_protocol_names_are_normalised():
    flows = [flow(SVC_IP, 53, BE1)]
    assert stale_flows(flows, [dns(BE2, proto="udp")]) == flows
    assert stale_flows(flows, [dns(BE2, proto=17)]) == flows


def test_frontend_match_wins_over_node_port_with_same_number():
    # service A listens on 10.96.0.53:30053, service B has nodePort 30053
    flows = [flow(SVC_IP, 30053, BE1)]
    a = ServiceTarget(proto="UDP", ips={SVC_IP}, port=30053, endpoints={BE1})
    b = ServiceTarget(proto="UDP", ips={"10.96.0.99"}, port=53, node_port=30053, endpoints={BE2})
    assert stale_flows(flows, [a, b]) == []


def test_duplicate_targets_union_their_endpoints():
    flows = [flow(SVC_IP, 53, BE1), flow(SVC_IP, 53, BE2, sport=40001), flow(SVC_IP, 53, BE3, sport=40002)]
    assert stale_flows(flows, [dns(BE1), dns(BE2)]) == [flows[2]]


def test_ipv6_addresses_are_canonicalised():
    f = flow("fd00:96::35", 53, ("fd00:244::1", 5353), src="fd00:244::2:10")
    target = ServiceTarget(proto="UDP", ips={"fd00:96:0:0::35"}, port=53, endpoints={("fd00:244:0::2", 5353)})
    assert stale_flows([f], [target]) == [f]
    target.endpoints = {("FD00:244:0:0:0:0:0:1", 5353)}
    assert stale_flows([f], [target]) == []


def test_flow_text_and_family():
    f = flow(SVC_IP, 53, BE1)
    assert str(f) == "UDP 10.244.2.10:40000 -> 10.96.0.53:53 (reply from 10.244.1.1:5353)"
    assert f.family == 4
    assert flow("fd00::1", 53, ("fd00::2", 53), src="fd00::3").family == 6


def test_single_ip_string_is_one_frontend():
    f = flow(SVC_IP, 53, BE1)
    assert stale_flows([f], [ServiceTarget(proto="UDP", ips=SVC_IP, port=53, endpoints={BE2})]) == [f]


# --------------------------------------------------------------------------
# the delete request (pure encoding), the dump fallback


def test_dump_falls_back_when_the_kernel_cannot_filter():
    import pyroute2.netlink.exceptions as netlink

    class OldKernel:
        def __init__(self):
            self.calls = []

        def dump(self, tuple_orig=None):
            self.calls.append(tuple_orig)
            if tuple_orig is not None:
                raise netlink.NetlinkError(95)  # EOPNOTSUPP
            return iter(["everything"])

    ct = OldKernel()
    assert conntrack._dump_messages(ct, 4, "UDP", None, None) == ["everything"]
    assert ct.calls[0].proto == 17 and ct.calls[1] is None


def test_delete_message_carries_tuple_zone_and_id():
    f = Flow(proto="UDP", orig_src=CLIENT, orig_dst=SVC_IP, orig_dport=53, reply_src=BE1[0],
             reply_sport=BE1[1], orig_sport=40000, zone=7, ct_id=0xDEADBEEF)
    msg = delete_message(f, seq=42)
    length, kind, flags, seq, _unused = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags, seq) == (len(msg), 0x102, 0x5, 42)
    assert msg[16] == 2  # nfgen_family AF_INET
    assert bytes([10, 244, 2, 10]) in msg and bytes([10, 96, 0, 53]) in msg
    assert struct.pack("!H", 40000) in msg and struct.pack("!I", 0xDEADBEEF) in msg
    assert struct.pack("=HH", 6, 18) + struct.pack("!H", 7) in msg  # CTA_ZONE


def test_delete_message_ipv6_and_unsupported_protocol():
    f = flow("fd00:96::35", 53, ("fd00:244::1", 5353), src="fd00:244::2:10")
    msg = delete_message(f, seq=1)
    assert msg[16] == 10  # AF_INET6
    assert len(msg) == struct.unpack_from("=I", msg)[0] and len(msg) % 4 == 0
    with pytest.raises(ValueError):
        delete_message(flow(SVC_IP, 0, BE1, proto="ICMP"), seq=1)


# --------------------------------------------------------------------------
# pyroute2 is optional until the kernel is used


def test_module_imports_and_decides_without_pyroute2(monkeypatch):
    for name in [m for m in sys.modules if m == "pyroute2" or m.startswith("pyroute2.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyroute2", None)  # makes "import pyroute2" fail
    # A sibling of kernel/conntrack in its package: its relative imports (errors) resolve.
    spec = importlib.util.spec_from_file_location(f"{conntrack.__package__}.conntrack_without_pyroute2",
                                                  conntrack.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    target = module.ServiceTarget(proto="UDP", ips={SVC_IP}, port=53, endpoints={BE2})
    f = module.Flow(proto="UDP", orig_src=CLIENT, orig_dst=SVC_IP, orig_dport=53, reply_src=BE1[0],
                    reply_sport=BE1[1])
    assert module.stale_flows([f], [target]) == [f]
    assert module.ConntrackCleaner("x").cleanup([]).deleted == 0  # nothing to do: no kernel access
    with pytest.raises(module.ConntrackUnavailable, match="pyroute2"):
        module.ConntrackCleaner("x").cleanup([target])
    assert issubclass(ConntrackUnavailable, conntrack.ConntrackError)
    assert isinstance(ConntrackCleaner(), ConntrackCleaner)
