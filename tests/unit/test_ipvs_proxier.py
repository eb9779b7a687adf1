"""IpvsProxier over in-memory kernels: full and partial syncs, graceful removal,
failure handling, leftovers of iptables mode, cleanup."""
import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs as k
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice, parse_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs import compile as ipvsc
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs.proxier import (
    IpvsProxier,
    IpvsSyncError,
    ipvs_config,
    ipvs_sysctls,
    leftover_lines,
    node_addresses,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

from .helpers import endpoint, endpoint_slice, port, service, slice_port
from .ipvs_fakes import FakeIpset, FakeIptables, FakeIPVS, FakeLink, FakeSysctls

NODE_IP = "192.168.50.1"
CFG = ipvsc.IpvsConfig(iptables=IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.244.0.0/16",)),
                       node_ips=(NODE_IP,), node_port_ips=(NODE_IP,), primary_node_ip=NODE_IP)
HTTP = [port(name="http", port=80)]
HTTP_EP = [slice_port(name="http", port=8080)]


class Node:
    def __init__(self, cfg=CFG):
        self.state = ProxyState("node1")
        self.ipvs, self.link, self.ipset = FakeIPVS(), FakeLink(), FakeIpset()
        self.ipt, self.sysctls = FakeIptables(), FakeSysctls()
        self.clock = [100.0]
        self.proxier = IpvsProxier(self.state, cfg, self.ipt, ipvs_kernel=self.ipvs, ipset_kernel=self.ipset,
                                   link=self.link, sysctls=self.sysctls, clock=lambda: self.clock[0])

    def apply(self, services=(), slices=()):
        for s in services:
            self.state.set_service(parse_service(s))
        for s in slices:
            self.state.set_slice(parse_endpoint_slice(s))

    def web(self, ips=("10.244.1.1", "10.244.1.2", "10.244.1.3"), proto="TCP"):
        p = [port(name="http", port=80, protocol=proto)]
        self.apply([service("default", "web", "10.96.0.10", p)],
                   [endpoint_slice("default", "web", [endpoint(ip, node="node1") for ip in ips],
                                   [slice_port(name="http", port=8080, protocol=proto)])])


def test_full_sync_programs_every_part_and_a_second_sync_changes_nothing():
    n = Node()
    n.web()
    n.apply([service("default", "np", "10.96.0.30", [port(name="http", port=80, node_port=30080)], type="NodePort")],
            [endpoint_slice("default", "np", [endpoint("10.244.1.1", node="node2")], HTTP_EP)])
    r = n.proxier.sync()
    assert r.full and r.virtual_servers == 3 and r.real_servers == 5 and r.addresses == 2
    assert n.ipvs.summary() == {
        "10.96.0.10:80/TCP": ["10.244.1.1:8080", "10.244.1.2:8080", "10.244.1.3:8080"],
        "10.96.0.30:80/TCP": ["10.244.1.1:8080"], f"{NODE_IP}:30080/TCP": ["10.244.1.1:8080"]}
    assert n.link.exists and n.link.addrs == {"10.96.0.10", "10.96.0.30"}
    assert n.ipset.entries("KUBE-CLUSTER-IP") == {"10.96.0.10,tcp:80", "10.96.0.30,tcp:80"}
    assert n.ipset.entries("KUBE-NODE-PORT-TCP") == {"30080"}
    assert n.ipset.entries("KUBE-IPVS-IPS") == {"10.96.0.10", "10.96.0.30"}
    assert set(n.ipset.sets) == set(ipvsc.IPSET_NAMES)  # every set exists, empty or not
    assert n.ipt.rules("nat", "KUBE-SERVICES")[-1] == "-m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT"
    assert n.ipt.rules("filter", "INPUT")[0] == (
        '-m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER')
    assert n.sysctls.values["net/ipv4/vs/conntrack"] == "1"
    assert n.sysctls.values["net/ipv4/vs/expire_nodest_conn"] == "1"
    assert n.proxier.rule_counts() == {"nat": 11, "filter": 10}

    restores, ops, ipsets = len(n.ipt.restores), len(n.ipvs.applied), len(n.ipset.restores)
    r = n.proxier.sync(force_full=True)
    assert r.changes == [] and r.rules_written == 0
    assert (len(n.ipt.restores), len(n.ipvs.applied), len(n.ipset.restores)) == (restores, ops, ipsets)


def test_partial_sync_touches_only_the_changed_service():
    n = Node()
    n.web()
    n.apply([service("default", "other", "10.96.0.20", HTTP)],
            [endpoint_slice("default", "other", [endpoint("10.244.2.1")], HTTP_EP)])
    n.proxier.sync()
    restores, ops = len(n.ipt.restores), len(n.ipvs.applied)
    n.web(ips=("10.244.1.3",))
    r = n.proxier.sync()
    assert not r.full and r.changed == {"default/web"}
    new_ops = n.ipvs.applied[ops:]
    assert {op.kind for op in new_ops} == {k.DELETE_DEST}  # TCP without connections: deleted at once
    assert {op.virtual.address for op in new_ops} == {"10.96.0.10"}
    assert n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.3:8080"]
    assert n.ipset.entries("KUBE-LOOP-BACK") == {"10.244.1.3,tcp:8080,10.244.1.3"}
    assert n.ipset.restores[-1] == ["del KUBE-LOOP-BACK 10.244.1.1,tcp:8080,10.244.1.1 -exist",
                                    "del KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2 -exist"]
    assert len(n.ipt.restores) == restores  # no set became empty or non-empty: no iptables write


def test_partial_sync_service_deleted_and_added():
    n = Node()
    n.web()
    n.proxier.sync()
    n.state.delete_service("default", "web")
    n.apply([service("default", "lb", "10.96.0.50", [port(name="http", port=80, node_port=30050)],
                     type="LoadBalancer", status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}})],
            [endpoint_slice("default", "lb", [endpoint("10.244.1.2")], HTTP_EP)])
    r = n.proxier.sync()
    assert not r.full and r.changed == {"default/web", "default/lb"}
    assert n.ipvs.summary() == {"10.96.0.50:80/TCP": ["10.244.1.2:8080"], "198.51.100.50:80/TCP": ["10.244.1.2:8080"],
                                f"{NODE_IP}:30050/TCP": ["10.244.1.2:8080"]}
    assert n.link.addrs == {"10.96.0.50", "198.51.100.50"}
    assert n.link.calls[-1] == "del 10.96.0.10"  # unbound last
    assert n.ipset.entries("KUBE-LOOP-BACK") == set()
    # KUBE-LOOP-BACK emptied and KUBE-LOAD-BALANCER filled: the rules follow.
    assert not any("KUBE-LOOP-BACK" in r for r in n.ipt.rules("nat", "KUBE-POSTROUTING"))
    assert any("KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER" in r for r in n.ipt.rules("nat", "KUBE-SERVICES"))
    # The partial result matches what a full sync computes from scratch.
    snapshot = (n.ipvs.summary(), set(n.link.addrs), {s: n.ipset.entries(s) for s in n.ipset.sets},
                {t: dict(c) for t, c in n.ipt.tables.items()})
    assert n.proxier.sync(force_full=True).changes == []
    assert snapshot == (n.ipvs.summary(), set(n.link.addrs), {s: n.ipset.entries(s) for s in n.ipset.sets},
                        {t: dict(c) for t, c in n.ipt.tables.items()})


def test_graceful_removal_of_a_tcp_real_server_with_connections():
    n = Node()
    n.web(ips=("10.244.1.1", "10.244.1.2"))
    n.proxier.sync()
    vs_key = (4, "TCP", "10.96.0.10", 80, 0)
    n.ipvs.set_connections(vs_key, "10.244.1.1", active=3)
    n.web(ips=("10.244.1.2",))
    r = n.proxier.sync()
    assert n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.1:8080 w0", "10.244.1.2:8080"]
    assert r.pending_removals == 1
    n.clock[0] += 30
    n.proxier.sync(force_full=True)  # still has connections: stays at weight 0
    assert n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.1:8080 w0", "10.244.1.2:8080"]
    n.ipvs.set_connections(vs_key, "10.244.1.1", active=0)
    r = n.proxier.sync(force_full=True)
    assert n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.2:8080"] and r.pending_removals == 0


def test_graceful_removal_comes_back_when_the_endpoint_returns():
    n = Node()
    n.web(ips=("10.244.1.1", "10.244.1.2"))
    n.proxier.sync()
    n.ipvs.set_connections((4, "TCP", "10.96.0.10", 80, 0), "10.244.1.1", active=1)
    n.web(ips=("10.244.1.2",))
    n.proxier.sync()
    n.web(ips=("10.244.1.1", "10.244.1.2"))
    r = n.proxier.sync()
    assert n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.1:8080", "10.244.1.2:8080"]
    assert r.pending_removals == 0


def test_udp_real_servers_go_at_once():
    n = Node()
    n.web(ips=("10.244.1.1", "10.244.1.2"), proto="UDP")
    n.proxier.sync()
    n.ipvs.set_connections((4, "UDP", "10.96.0.10", 80, 0), "10.244.1.1", active=5)
    n.web(ips=("10.244.1.2",), proto="UDP")
    n.proxier.sync()
    assert n.ipvs.summary()["10.96.0.10:80/UDP"] == ["10.244.1.2:8080"]


def test_failure_raises_after_the_other_steps_and_the_next_sync_is_full():
    n = Node()
    n.web()
    n.proxier.sync()
    n.ipvs.fail = {k.ADD_DEST}
    n.web(ips=("10.244.1.1", "10.244.1.9"))
    with pytest.raises(IpvsSyncError, match="Invalid argument"):
        n.proxier.sync()
    assert n.proxier.need_full and n.state._changed == {"default/web"}
    # The other steps ran: the set entries follow the new endpoints.
    assert "10.244.1.9,tcp:8080,10.244.1.9" in n.ipset.entries("KUBE-LOOP-BACK")
    n.ipvs.fail = set()
    r = n.proxier.sync()
    assert r.full and n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.1:8080", "10.244.1.9:8080"]


def test_full_sync_removes_stale_virtual_services_except_excluded_cidrs():
    cfg = ipvsc.IpvsConfig(**{**CFG.__dict__, "exclude_cidrs": ("10.200.0.0/16",)})
    n = Node(cfg)
    for addr in ("10.200.1.1", "10.96.9.9"):
        n.ipvs.apply([k.Op(k.ADD_SERVICE, k.VirtualServer(addr, 80, "TCP", scheduler="rr"))])
    n.web()
    n.proxier.sync()
    assert set(n.ipvs.summary()) == {"10.96.0.10:80/TCP", "10.200.1.1:80/TCP"}


def test_scheduler_and_affinity_changes_edit_the_virtual_service():
    n = Node()
    n.web()
    n.proxier.sync()
    n.apply([service("default", "web", "10.96.0.10", HTTP, sessionAffinity="ClientIP",
                     sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})])
    n.proxier.sync()
    vs = n.ipvs.table[(4, "TCP", "10.96.0.10", 80, 0)].virtual
    assert vs.persistent and vs.timeout == 60
    assert n.ipvs.applied[-1].kind == k.EDIT_SERVICE


def test_iptables_mode_leftovers_are_removed_by_the_first_full_sync():
    n = Node()
    n.ipt.restore(
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-SVC-AAAA - [0:0]\n:KUBE-SEP-BBBB - [0:0]\n"
        ":KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
        "-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAA\n"
        "-A KUBE-SVC-AAAA -j KUBE-SEP-BBBB\n-A KUBE-SEP-BBBB -p tcp -m tcp -j DNAT --to-destination 10.244.1.1:8080\n"
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES\n'
        "COMMIT\n*filter\n:KUBE-EXTERNAL-SERVICES - [0:0]\n:KUBE-FIREWALL - [0:0]\n:MINE - [0:0]\n"
        '-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" '
        "-j KUBE-EXTERNAL-SERVICES\n-A INPUT -j KUBE-FIREWALL\n-A INPUT -j MINE\nCOMMIT\n")
    n.web()
    r = n.proxier.sync()
    nat, filt = n.ipt.tables["nat"], n.ipt.tables["filter"]
    assert not {"KUBE-NODEPORTS", "KUBE-SVC-AAAA", "KUBE-SEP-BBBB"} & set(nat)
    assert "KUBE-EXTERNAL-SERVICES" not in filt
    assert "KUBE-FIREWALL" in filt and "-j KUBE-FIREWALL" in filt["INPUT"]  # not ours to remove in a sync
    assert "-j MINE" in filt["INPUT"] and "MINE" in filt
    assert nat["PREROUTING"] == ['-m comment --comment "kubernetes service portals" -j KUBE-SERVICES']
    assert "- nat chain KUBE-SVC-AAAA (1 rules)" in r.changes


def test_cleanup_removes_everything_ipvs_mode_made():
    n = Node()
    n.web()
    n.ipt.restore("*filter\n:MINE - [0:0]\n-A INPUT -j MINE\nCOMMIT\n")
    n.proxier.sync()
    removed = n.proxier.cleanup()
    assert removed > 20
    assert n.ipvs.table == {} and n.ipvs.flushed == 1
    assert not n.link.exists
    assert n.ipset.sets == {}
    assert all(not c.startswith("KUBE-") for t in n.ipt.tables.values() for c in t)
    assert all("KUBE-" not in r for t in n.ipt.tables.values() for rs in t.values() for r in rs)
    assert n.ipt.tables["filter"]["INPUT"] == ["-j MINE"]
    assert n.proxier.sync().full  # after a cleanup the next sync starts from scratch


def test_sysctls_by_kernel_release_and_strict_arp():
    v = ipvs_sysctls(ipvsc.IpvsConfig(strict_arp=True), kernel_release="5.4.0")
    assert v["net/ipv4/vs/conn_reuse_mode"] == "0" and v["net/ipv4/conf/all/arp_announce"] == "2"
    assert "net/ipv4/vs/conn_reuse_mode" not in ipvs_sysctls(ipvsc.IpvsConfig(), kernel_release="6.1.0-27-amd64")


class _Proc:
    def __init__(self, stdout):
        self.stdout, self.stderr, self.returncode = stdout, "", 0


def test_node_addresses_leave_out_kube_ipvs0_loopback_and_link_local():
    out = ('[{"ifname":"lo","addr_info":[{"local":"127.0.0.1"}]},'
           '{"ifname":"eth0","addr_info":[{"local":"192.168.50.1"},{"local":"fe80::1"}]},'
           '{"ifname":"kube-ipvs0","addr_info":[{"local":"10.96.0.10"}]},'
           '{"ifname":"eth1","addr_info":[{"local":"10.0.0.5"}]}]')
    assert node_addresses(runner=lambda *a, **kw: _Proc(out)) == ["192.168.50.1", "10.0.0.5"]


def test_ipvs_config_from_the_proxy_configuration():
    cfg = kpconfig.parse({"apiVersion": kpconfig.API_VERSION, "kind": kpconfig.KIND, "mode": "ipvs",
                          "nodePortAddresses": ["10.0.0.0/8"],
                          "ipvs": {"scheduler": "wrr", "strictARP": True, "excludeCIDRs": ["10.200.0.0/16"],
                                   "syncPeriod": "10s", "minSyncPeriod": "2s", "tcpTimeout": "0s"}})
    assert (cfg.sync_period, cfg.min_sync_period) == (10.0, 2.0)
    c = ipvs_config(cfg, IptablesConfig(), addresses=["192.168.50.1", "10.0.0.5"])
    assert c.scheduler == "wrr" and c.strict_arp and c.exclude_cidrs == ("10.200.0.0/16",)
    assert c.node_ips == ("192.168.50.1", "10.0.0.5") and c.node_port_ips == ("10.0.0.5",)
    assert c.primary_node_ip == "192.168.50.1"
    assert ipvs_config(kpconfig.ProxyConfig(), IptablesConfig(), addresses=["192.168.50.1"]).node_port_ips == (
        "192.168.50.1",)


def test_ipvs_section_is_validated():
    base = {"apiVersion": kpconfig.API_VERSION, "kind": kpconfig.KIND}
    with pytest.raises(kpconfig.ConfigError, match="ipvs.scheduler"):
        kpconfig.parse({**base, "ipvs": {"scheduler": "fastest"}})
    with pytest.raises(kpconfig.ConfigError, match="ipvs.bogus"):
        kpconfig.parse({**base, "ipvs": {"bogus": 1}})
    # kubeadm writes every field, 0s for unset durations: the iptables defaults stay.
    kubeadm = {"syncPeriod": "0s", "minSyncPeriod": "0s", "scheduler": "", "strictARP": False, "excludeCIDRs": None,
               "tcpTimeout": "0s", "tcpFinTimeout": "0s", "udpTimeout": "0s"}
    cfg = kpconfig.parse({**base, "mode": "ipvs", "ipvs": kubeadm})
    assert (cfg.sync_period, cfg.min_sync_period, cfg.ipvs.scheduler) == (30.0, 1.0, "")
    # In iptables mode the ipvs periods do not apply.
    cfg = kpconfig.parse({**base, "ipvs": {"syncPeriod": "5s"}})
    assert cfg.sync_period == 30.0


def test_leftover_lines_for_cleanup_keep_foreign_rules():
    n = Node()
    n.ipt.restore("*nat\n:KUBE-SERVICES - [0:0]\n:OTHER - [0:0]\n-A OTHER -j RETURN\n"
                  '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES\n'
                  "-A OUTPUT -j OTHER\nCOMMIT\n")
    decls, deletes, changes = leftover_lines(n.ipt.snapshot(), {})
    assert decls["nat"] == [":KUBE-SERVICES - [0:0]"]
    assert deletes["nat"] == ['-D OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
                              "-X KUBE-SERVICES"]
    assert len(changes) == 2


def test_check_finds_a_missing_canary_or_link_and_the_next_sync_repairs_both():
    n = Node()
    n.web()
    assert not n.proxier.check()  # no sync yet: nothing to look at
    n.proxier.sync()
    assert n.ipt.missing_canaries() == [] and not n.proxier.check()
    del n.ipt.tables["nat"]["KUBE-PROXY-CANARY"]  # a firewall reload
    assert n.proxier.check() and n.proxier.pending_repair == "canary KUBE-PROXY-CANARY missing in nat"
    assert n.proxier.sync().full and n.ipt.missing_canaries() == []
    n.link.delete()  # someone removed kube-ipvs0 (and with it the VIPs)
    assert n.proxier.check() and "kube-ipvs0" in n.proxier.pending_repair
    r = n.proxier.sync()
    assert r.full and n.link.exists and n.link.addrs == {"10.96.0.10"} and not n.proxier.check()


def test_ipvs_timeouts_go_to_the_ipvs_kernel_handle_once():
    cfg = ipvsc.IpvsConfig(**{**CFG.__dict__, "tcp_timeout": 600.0, "udp_timeout": 30.0})
    n = Node(cfg)
    n.web()
    r = n.proxier.sync()
    assert n.ipvs.timeout_calls == [(600, 0, 30)]
    assert n.ipvs.timeouts() == (600, 120, 30)  # 0 kept the FIN timeout
    assert "~ ipvs timeouts tcp 600 tcpfin 0 udp 30" in r.changes
    n.proxier.sync(force_full=True)
    assert n.ipvs.timeout_calls == [(600, 0, 30)]


def test_ipvs_timeouts_unset_are_not_written():
    n = Node()
    n.web()
    n.proxier.sync()
    assert n.ipvs.timeout_calls == []


def test_full_sync_recompiles_only_services_whose_inputs_changed(monkeypatch):
    """compile_service is pure: a full sync reuses a service's last result when its ports,
    endpoints and config are equal, and the kernel state is the same as from a recompile."""
    n = Node()
    n.web()
    n.apply([service("default", "other", "10.96.0.20", HTTP)],
            [endpoint_slice("default", "other", [endpoint("10.244.2.1")], HTTP_EP)])
    n.proxier.sync()
    compiled = []
    real = ipvsc.compile_service
    monkeypatch.setattr(ipvsc, "compile_service",
                        lambda ports, eps, cfg: compiled.append(ports) or real(ports, eps, cfg))
    r = n.proxier.sync(force_full=True)
    assert compiled == [] and r.changes == []
    n.web(ips=("10.244.1.3",))  # one service's endpoints change
    r = n.proxier.sync(force_full=True)
    assert [p[0].name.name for p in compiled] == ["web"]
    assert n.ipvs.summary()["10.96.0.10:80/TCP"] == ["10.244.1.3:8080"]
    n.proxier.cfg = ipvsc.IpvsConfig(iptables=CFG.iptables, node_ips=CFG.node_ips, node_port_ips=CFG.node_port_ips,
                                     primary_node_ip=CFG.primary_node_ip, scheduler="sh")
    compiled.clear()
    n.proxier.sync(force_full=True)  # another config: everything again
    assert sorted(p[0].name.name for p in compiled) == ["other", "web"]
    assert {vs.virtual.scheduler for vs in n.ipvs.services()} == {"sh"}
