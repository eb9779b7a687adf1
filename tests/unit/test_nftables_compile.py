"""The nftables compiler and planner against golden nft text (names as upstream's
pkg/proxy/nftables golden tests: ULMVA6XW-ns1/svc1/tcp/p80, 5OJB2KTY-...__10.180.0.1/80)."""
from dataclasses import replace

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Endpoint,
    ServicePort,
    ServicePortName,
    ValidationError,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import compile as nc
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.plan import (
    apply_refs,
    count_refs,
    plan_partial,
)

CFG = nc.NftablesConfig(base=IptablesConfig(local_cidrs=("10.0.0.0/8",), node_ips=("192.168.0.2",),
                                            localhost_nodeports=False), endpoint_chains=True)  # upstream's layout
SVC1 = ServicePortName("ns1", "svc1", "p80", "TCP")
EP1 = Endpoint("10.180.0.1", 80, is_local=True)
EP2 = Endpoint("10.180.0.2", 80)
EP3 = Endpoint("10.180.0.3", 80)
S1 = "service-ULMVA6XW-ns1/svc1/tcp/p80"
E1 = "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"


def one(sp, eps, cfg=CFG):
    return nc.compile_service([sp], {sp.name: eps}, cfg)


def test_names_are_upstreams():
    assert nc.chain_base("ns1", "svc1", "p80", "tcp") == "ULMVA6XW-ns1/svc1/tcp/p80"
    assert nc.endpoint_base("ns1", "svc1", "p80", "tcp", EP1) == "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"


def test_cluster_ip_golden():
    out = one(ServicePort(SVC1, "172.30.0.41", 80, "TCP"), [EP1])
    assert out.chains == {
        S1: ["ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade", f"goto {E1}"],
        E1: ["ip saddr 10.180.0.1 jump mark-for-masquerade", "meta l4proto tcp dnat to 10.180.0.1:80"],
    }
    assert out.elements == {"cluster-ips": ["172.30.0.41"], "service-ips": [f"172.30.0.41 . tcp . 80 : goto {S1}"]}
    assert out.endpoints == 1 and out.no_endpoint_ports == 0


def test_endpoint_choice_chained_and_upstream_vmap():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP")
    e1, e2, e3 = ("endpoint-" + nc.endpoint_base("ns1", "svc1", "p80", "tcp", ep) for ep in (EP1, EP2, EP3))
    assert one(sp, [EP1, EP2, EP3]).chains[S1][1:] == [
        f"numgen random mod 3 == 0 goto {e1}", f"numgen random mod 2 == 0 goto {e2}", f"goto {e3}"]
    vmap = one(sp, [EP1, EP2, EP3], replace(CFG, endpoint_selection=nc.ENDPOINT_VMAP)).chains[S1][1:]
    assert vmap == [f"numgen random mod 3 vmap {{ 0 : goto {e1}, 1 : goto {e2}, 2 : goto {e3} }}"]


def test_no_endpoints_reject_and_no_local_endpoints_drop():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP", node_port=3001, external_ips=("1.2.3.4",))
    out = one(sp, [])
    assert out.chains == {}
    assert out.elements["no-endpoint-services"] == ["172.30.0.41 . tcp . 80 : goto reject-chain",
                                                    "1.2.3.4 . tcp . 80 : goto reject-chain"]
    assert out.elements["no-endpoint-nodeports"] == ["tcp . 3001 : goto reject-chain"]
    assert out.no_endpoint_ports == 1
    local = one(replace(sp, external_policy_local=True), [EP2])  # EP2 is not local
    assert local.elements["no-endpoint-nodeports"] == ["tcp . 3001 : drop"]
    assert local.elements["no-endpoint-services"] == ["1.2.3.4 . tcp . 80 : drop"]
    assert local.elements["service-nodeports"] == [f"tcp . 3001 : goto external-{S1[8:]}"]


def test_external_local_policy_and_firewall_golden():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP", node_port=3001, load_balancer_ips=("5.6.7.8",),
                     load_balancer_source_ranges=("203.0.113.0/25",), external_policy_local=True)
    out = one(sp, [EP1, EP2])
    base = S1[8:]
    assert out.chains[f"external-{base}"] == [
        f'ip saddr 10.0.0.0/8 goto {S1} comment "short-circuit pod traffic"',
        'fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"',
        f'fib saddr type local goto {S1} comment "short-circuit local traffic"',
        f"goto local-{base}",
    ]
    assert out.chains[f"local-{base}"] == [f"goto {E1}"]
    assert out.chains[f"firewall-{base}"] == ["ip saddr != { 203.0.113.0/25 } drop"]
    assert out.elements["firewall-ips"] == [f"5.6.7.8 . tcp . 80 : goto firewall-{base}"]


def test_affinity_sets_and_rules():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP", session_affinity_seconds=10800)
    out = one(sp, [EP1])
    aff = "affinity-" + E1[9:]
    assert out.sets == {aff: "type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ;"}
    assert out.chains[S1][1:] == [f"ip saddr @{aff} goto {E1}", f"goto {E1}"]
    assert out.chains[E1][1] == f"update @{aff} {{ ip saddr }} meta l4proto tcp dnat to 10.180.0.1:80"


def test_inlined_endpoints_have_no_endpoint_chains():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP", session_affinity_seconds=60)
    out = one(sp, [EP1, EP2], replace(CFG, endpoint_chains=False))
    aff1 = "affinity-" + E1[9:]
    aff2 = "affinity-" + nc.endpoint_base("ns1", "svc1", "p80", "tcp", EP2)
    assert list(out.chains) == [S1]
    assert out.chains[S1] == [
        "ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
        f"ip saddr @{aff1} update @{aff1} {{ ip saddr }} meta l4proto tcp dnat to 10.180.0.1:80",
        f"ip saddr @{aff2} update @{aff2} {{ ip saddr }} meta l4proto tcp dnat to 10.180.0.2:80",
        f"numgen random mod 2 == 0 update @{aff1} {{ ip saddr }} meta l4proto tcp dnat to 10.180.0.1:80",
        f"update @{aff2} {{ ip saddr }} meta l4proto tcp dnat to 10.180.0.2:80",
    ]
    assert set(out.sets) == {aff1, aff2}
    assert out.elements["hairpin-ips"] == ["10.180.0.1 . 10.180.0.1", "10.180.0.2 . 10.180.0.2"]
    infra = nc.infrastructure(replace(CFG, endpoint_chains=False))
    assert infra.rules["nat-postrouting"] == [
        "ct status dnat ip saddr . ip daddr @hairpin-ips jump mark-for-masquerade", "jump masquerading"]


def test_shared_set_elements_are_counted_across_services():
    cfg = replace(CFG, endpoint_chains=False)
    a = ServicePort(SVC1, "172.30.0.41", 80, "TCP")
    b = ServicePort(ServicePortName("ns1", "svc2", "p80", "TCP"), "172.30.0.42", 80, "TCP")
    applied = {"a": one(a, [EP1], cfg), "b": one(b, [EP1], cfg)}
    refs = count_refs(applied)
    assert refs["hairpin-ips"] == {"10.180.0.1 . 10.180.0.1": 2}
    # One of the two services lets go of 10.180.0.1: the element stays for the other.
    p = plan_partial("ip kube-proxy", {"a": applied["a"]}, {"a": one(a, [EP2], cfg)}, refs)
    assert "delete element ip kube-proxy hairpin-ips { 10.180.0.1 . 10.180.0.1 }" not in p.text
    assert "add element ip kube-proxy hairpin-ips { 10.180.0.2 . 10.180.0.2 }" in p.text
    assert refs["hairpin-ips"] == {"10.180.0.1 . 10.180.0.1": 2}  # the input is not changed
    apply_refs(refs, p.ref_delta)
    assert refs["hairpin-ips"] == {"10.180.0.1 . 10.180.0.1": 1, "10.180.0.2 . 10.180.0.2": 1}
    # The last one goes too: now it is deleted.
    p2 = plan_partial("ip kube-proxy", {"b": applied["b"]}, {"b": None}, refs)
    assert "delete element ip kube-proxy hairpin-ips { 10.180.0.1 . 10.180.0.1 }" in p2.text
    assert "delete element ip kube-proxy cluster-ips { 172.30.0.42 }" in p2.text
    apply_refs(refs, p2.ref_delta)
    assert refs["hairpin-ips"] == {"10.180.0.2 . 10.180.0.2": 1}


@pytest.mark.parametrize("port_name", ['a"b', "a b", "a;b", "a\nb", "ä", "a}b", "a{b", "a#b"])
def test_hostile_port_names_are_refused(port_name):
    sp = ServicePort(ServicePortName("ns1", "svc1", port_name, "TCP"), "172.30.0.41", 80, "TCP")
    with pytest.raises(ValidationError):
        one(sp, [EP1])


def test_render_full_replaces_the_table_in_one_transaction():
    text = nc.render_full({"ns1/svc1": one(ServicePort(SVC1, "172.30.0.41", 80, "TCP"), [EP1])}, CFG)
    lines = text.splitlines()
    assert lines[:3] == ["add table ip kube-proxy", "delete table ip kube-proxy",
                         'add table ip kube-proxy { comment "rules for kube-proxy" ; }']
    assert "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport " \
           "vmap @service-nodeports" in lines
    assert f"add element ip kube-proxy service-ips {{ 172.30.0.41 . tcp . 80 : goto {S1} }}" in lines
    # Chains are declared before any rule refers to them.
    assert lines.index(f"add chain ip kube-proxy {E1}") < lines.index(f"add rule ip kube-proxy {S1} goto {E1}")


def test_partial_plan_of_one_endpoint_change():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP")
    old = one(sp, [EP1, EP2])
    new = one(sp, [EP1, EP3])
    p = plan_partial("ip kube-proxy", {"ns1/svc1": old}, {"ns1/svc1": new})
    lines = p.text.splitlines()
    e2 = "endpoint-" + nc.endpoint_base("ns1", "svc1", "p80", "tcp", EP2)
    e3 = "endpoint-" + nc.endpoint_base("ns1", "svc1", "p80", "tcp", EP3)
    assert lines == [
        f"add chain ip kube-proxy {e3}",
        f"flush chain ip kube-proxy {S1}",
        f"add rule ip kube-proxy {S1} ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/8 "
        "jump mark-for-masquerade",
        f"add rule ip kube-proxy {S1} numgen random mod 2 == 0 goto {E1}",
        f"add rule ip kube-proxy {S1} goto {e3}",
        f"add rule ip kube-proxy {e3} ip saddr 10.180.0.3 jump mark-for-masquerade",
        f"add rule ip kube-proxy {e3} meta l4proto tcp dnat to 10.180.0.3:80",
        f"flush chain ip kube-proxy {e2}",
        f"delete chain ip kube-proxy {e2}",
    ]
    assert plan_partial("ip kube-proxy", {"ns1/svc1": new}, {"ns1/svc1": new}).text == ""


def test_partial_plan_moves_a_key_between_maps():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP")
    p = plan_partial("ip kube-proxy", {"ns1/svc1": one(sp, [EP1])}, {"ns1/svc1": one(sp, [])})
    lines = p.text.splitlines()
    assert "delete element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 }" in lines
    assert "add element ip kube-proxy no-endpoint-services { 172.30.0.41 . tcp . 80 : goto reject-chain }" in lines
    assert lines[-2:] == [f"delete chain ip kube-proxy {S1}", f"delete chain ip kube-proxy {E1}"]


def test_resolve_keeps_one_element_per_key_and_names_the_loser():
    a = ServicePort(ServicePortName("ns1", "a", "", "TCP"), "172.30.0.1", 80, "TCP", external_ips=("1.2.3.4",))
    b = ServicePort(ServicePortName("ns1", "b", "", "TCP"), "172.30.0.2", 80, "TCP", external_ips=("1.2.3.4",))
    compiled = {"ns1/b": one(b, [EP2]), "ns1/a": one(a, [EP1])}
    elements, own = nc.resolve(compiled)
    ext = [e for e in elements["service-ips"] if e.startswith("1.2.3.4 ")]
    assert len(ext) == 1 and "ns1/a/" in ext[0]
    assert own.owners[("service-ips", "1.2.3.4 . tcp . 80")] == "ns1/a"
    assert list(own.conflicts) == ["ns1/b"] and "already used by Service ns1/a" in own.conflicts["ns1/b"]
    assert nc.render_full(compiled, CFG).count("1.2.3.4 . tcp . 80 :") == 1


def test_unallocated_cluster_ips_are_dropped_only_when_the_service_cidrs_are_known():
    assert nc.infrastructure(CFG).rules["cluster-ips-check"] == [
        'ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"']
    cfg = replace(CFG, service_cidrs=("10.96.0.0/16", "fd00:96::/112", "172.30.0.1/24"))
    assert nc.infrastructure(cfg).rules["cluster-ips-check"] == [
        'ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"',
        'ip daddr { 10.96.0.0/16, 172.30.0.0/24 } drop comment "Drop traffic to unallocated ClusterIPs"']
    with pytest.raises(Exception, match="serviceCIDRs"):
        nc.infrastructure(replace(CFG, service_cidrs=("10.96.0.0/16 } accept ; {",)))


def test_kept_affinity_entries_are_capped_at_the_new_timeout_and_only_for_sets_still_wanted():
    sets = {"affinity-A": "type ipv4_addr ; flags dynamic,timeout ; timeout 30s ;"}
    text = nc.kept_entries_text("ip kube-proxy", sets, {
        "affinity-A": [("10.0.0.1", 5000), ("10.0.0.2", 600000), ("10.0.0.3", 0)],
        "affinity-gone": [("10.0.0.4", 5000)]})
    assert text == "add element ip kube-proxy affinity-A { 10.0.0.1 expires 5000ms, 10.0.0.2 expires 30000ms }\n"
    assert nc.kept_entries_text("ip kube-proxy", sets, {}) == ""


def test_expiring_entries_without_netlink_read_nft_json_and_drop_what_is_not_an_address():
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.nft import NftKernel

    class Proc:
        def __init__(self, rc, out):
            self.returncode, self.stdout, self.stderr = rc, out, ""

    listing = ('{"nftables": [{"metainfo": {}}, {"set": {"name": "affinity-A", "elem": ['
               '{"elem": {"val": "10.0.0.1", "expires": 99}}, {"elem": {"val": "x; flush ruleset", "expires": 5}},'
               '{"elem": {"val": "10.0.0.2"}}]}}]}')

    def runner(argv, **kw):
        return Proc(0, listing) if argv[-1] == "affinity-A" else Proc(1, "")

    got = NftKernel(runner=runner).expiring_entries("ip", "kube-proxy", ["affinity-A", "affinity-B"])
    assert got == {"affinity-A": [("10.0.0.1", 99000)]}


def test_endpoint_map_elements_are_encoded_as_the_kernel_stores_them():
    # As `nft --debug=netlink add element ip m eps { 2 : 10.1.1.3 . 80 }` shows: key word
    # 00000002 (host order), data 0301010a 00005000 (address, port padded to 4 bytes).
    import struct
    key, data = nc.encode_element("endpoints-tcp", "2 : 10.1.1.3 . 80")
    assert key == struct.pack("=I", 2) and data == bytes([10, 1, 1, 3, 0, 80, 0, 0])
    assert nc.encode_element("endpoints-udp", "7") == (struct.pack("=I", 7), b"")
    assert nc.encode_element("hairpin-ips", "10.0.0.1 . 10.0.0.1") == (bytes([10, 0, 0, 1] * 2), b"")
    assert nc.encode_element("service-ips", "10.96.0.1 . tcp . 80 : goto x") is None
    assert nc.encode_element("endpoints-tcp", "x : 10.1.1.3 . 80") is None


def test_endpoint_slots_are_stable_per_chain_grow_and_never_reuse_keys():
    slots = nc.EndpointSlots()
    a = slots("service-A", 3)
    b = slots("service-B", 100)
    assert (a, b) == (0, 64) and slots("service-A", 64) == a
    grown = slots("service-A", 65)  # past its block: a new, larger one
    assert grown == 64 + 128 and slots("service-B", 100) == 64
    slots.keep_only({"service-B"})
    assert slots("service-A", 1) == 64 + 128 + 128  # freed keys are not handed out again
    assert slots("service-C", nc.EndpointSlots.MAX + 1) is None


def test_service_chain_draws_from_its_block_of_the_protocol_map():
    sp = ServicePort(SVC1, "172.30.0.41", 80, "TCP")
    inline = replace(CFG, endpoint_chains=False)
    slots = nc.EndpointSlots()
    slots("service-OTHER", 1)  # another chain holds keys 0-63
    out = nc.compile_service([sp], {sp.name: [EP1, EP2, EP3]}, inline, slots)
    assert out.chains[S1][1:] == ["meta l4proto tcp dnat ip to numgen random mod 3 offset 64 map @endpoints-tcp-01"]
    assert out.elements["endpoints-tcp-01"] == ["64 : 10.180.0.1 . 80", "65 : 10.180.0.2 . 80", "66 : 10.180.0.3 . 80"]
    assert {"endpoints-tcp-00", "endpoints-sctp-31"} <= set(nc.infrastructure(inline).sets)
    # Without slots (the module), with affinity, or endpoint_maps=False: one dnat rule per endpoint.
    plain = nc.compile_service([sp], {sp.name: [EP1, EP2]}, inline)
    assert not [w for w in plain.elements if w.startswith("endpoints-")]
    assert "endpoints-tcp-01" not in nc.compile_service([sp], {sp.name: [EP1]}, replace(inline, endpoint_maps=False),
                                                        slots).elements
    sticky = ServicePort(SVC1, "172.30.0.41", 80, "TCP", session_affinity_seconds=60)
    assert "endpoints-tcp-01" not in nc.compile_service([sticky], {sp.name: [EP1]}, inline, slots).elements
