"""IPVS mode's netfilter half on this machine's kernel (no IPVS, no dummy links here):
the ipsets and the ``-m set`` iptables rules load into a real namespace and read back
exactly as compiled, syncs converge, the other mode's leftovers go, --cleanup leaves
nothing. IPVS itself and kube-ipvs0 are in-memory stand-ins here; traffic through IPVS
is tested in the VM (test_traffic.py's IPVS cases, run in the guest by
tests/vm/test_ipvs_proxy_mode.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from proxyctl import run_proxy, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from ipvs_fakes import FakeIPVS, FakeLink, FakeSysctls  # noqa: E402

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import IpsetKernel  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (  # noqa: E402
    IptablesKernel,
    parse_save,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (  # noqa: E402
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import (  # noqa: E402
    IptablesConfig,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.plan import render  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (  # noqa: E402
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs import compile as ipvsc  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs.proxier import (  # noqa: E402
    IpvsProxier,
    Sysctls,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState  # noqa: E402

NODE_IP = "192.168.50.1"
CFG = ipvsc.IpvsConfig(iptables=IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.244.0.0/16",)),
                       node_ips=(NODE_IP,), node_port_ips=(NODE_IP,), primary_node_ip=NODE_IP)


def svc(name, ip, port=80, node_port=0, **spec):
    p = {"name": "http", "port": port, "protocol": "TCP"}
    if node_port:
        p["nodePort"] = node_port
        spec.setdefault("type", "NodePort")
    status = spec.pop("status", None)
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
           "spec": {"clusterIP": ip, "ports": [p], **spec}}
    if status:
        obj["status"] = status
    return parse_service(obj)


def eps(service, ips, node="node1", name=None):
    return parse_endpoint_slice({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name or f"{service}-a", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "nodeName": node} for ip in ips]})


@pytest.fixture
def node(lab):
    ns = lab.ns("node")
    state = ProxyState("node1")
    ipvs, link = FakeIPVS(), FakeLink()
    proxier = IpvsProxier(state, CFG, IptablesKernel(netns=ns), ns, ipvs_kernel=ipvs, ipset_kernel=IpsetKernel(ns),
                          link=link, sysctls=FakeSysctls())
    yield ns, state, proxier, ipvs, link


def populate(state):
    state.set_service(svc("web", "10.96.0.10"))
    state.set_slice(eps("web", ["10.244.1.1", "10.244.1.2", "10.244.1.3"]))
    state.set_service(svc("np", "10.96.0.30", node_port=30080, externalTrafficPolicy="Local"))
    state.set_slice(eps("np", ["10.244.1.1"]))
    state.set_service(svc("ext", "10.96.0.40", externalIPs=["203.0.113.40"]))
    state.set_slice(eps("ext", ["10.244.1.3"], node="node2"))
    # A source range holding the node: no KUBE-IPVS-OUT-FILTER rule (xt_ipvs is not on this kernel).
    state.set_service(svc("lb", "10.96.0.50", node_port=30050, type="LoadBalancer",
                          loadBalancerSourceRanges=["192.168.50.0/24"],
                          status={"loadBalancer": {"ingress": [{"ip": "198.51.100.50"}]}}))
    state.set_slice(eps("lb", ["10.244.1.2"], node="node2"))


BUILTIN = {"INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING"}


def kube_rules(ns, skip=("KUBE-FIREWALL", "KUBE-PROXY-CANARY")):
    """Our chains and jumps as the kernel has them. Built-in chains are listed in reverse:
    each jump was inserted at the top, in the compiled order (upstream's Prepend)."""
    rules = {}
    for table in ("filter", "nat"):
        r, _chains = parse_save(save(ns, table), table)
        for (t, c), lines in r.items():
            if c in skip:
                continue
            if c in BUILTIN:
                lines = [x for x in reversed(lines) if not any(x.endswith(f"-j {s}") for s in skip)]
            if c.startswith("KUBE-") or lines:
                rules[(t, c)] = lines
    return rules


def ipset_save(ns):
    return subprocess.run(["ip", "netns", "exec", ns, "ipset", "save"], capture_output=True, text=True,
                          check=True).stdout


def test_rules_and_sets_load_and_read_back_as_compiled(node):
    ns, state, proxier, ipvs, link = node
    populate(state)
    r = proxier.sync()
    assert r.full and r.rules_written > 0
    desired = proxier.agg.desired(CFG)
    # iptables-save prints exactly the compiled text (our chains and our jumps).
    assert render(kube_rules(ns), include_builtin=True) == render(desired.rules, include_builtin=True)
    text = ipset_save(ns)
    for name in ipvsc.IPSET_NAMES:
        assert f"create {name} " in text
    assert "add KUBE-LOAD-BALANCER-SOURCE-CIDR 198.51.100.50,tcp:80,192.168.50.0/24" in text
    assert "add KUBE-LOAD-BALANCER-SOURCE-IP 198.51.100.50,tcp:80,198.51.100.50" in text
    assert "add KUBE-NODE-PORT-LOCAL-TCP 30080" in text
    assert "add KUBE-EXTERNAL-IP 203.0.113.40,tcp:80" in text
    assert sorted(ipvs.summary()) == ["10.96.0.10:80/TCP", "10.96.0.30:80/TCP", "10.96.0.40:80/TCP",
                                      "10.96.0.50:80/TCP", "192.168.50.1:30050/TCP", "192.168.50.1:30080/TCP",
                                      "198.51.100.50:80/TCP", "203.0.113.40:80/TCP"]
    # A second full sync finds nothing to do in the kernel.
    again = proxier.sync(force_full=True)
    assert again.changes == [] and again.rules_written == 0


def test_partial_sync_updates_set_entries_and_rules(node):
    ns, state, proxier, _ipvs, _link = node
    populate(state)
    proxier.sync()
    state.set_slice(eps("web", ["10.244.1.3"]))  # 10.244.1.2 was web's only local use
    state.delete_service("default", "ext")
    r = proxier.sync()
    assert not r.full
    text = ipset_save(ns)
    assert "add KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2" not in text
    assert "add KUBE-LOOP-BACK 10.244.1.1,tcp:8080,10.244.1.1" in text  # np still has it
    assert "KUBE-EXTERNAL-IP 203.0.113.40" not in text
    # KUBE-EXTERNAL-IP became empty: its three KUBE-SERVICES rules went.
    assert not any("KUBE-EXTERNAL-IP " in rule for rule in kube_rules(ns)[("nat", "KUBE-SERVICES")])
    assert render(kube_rules(ns), include_builtin=True) == render(proxier.agg.rules(CFG), include_builtin=True)
    assert proxier.sync(force_full=True).changes == []


def test_switch_from_iptables_mode_and_cleanup(node, lab):
    ns, state, proxier, _ipvs, link = node
    populate(state)
    kernel = IptablesKernel(netns=ns)
    IptablesProxier(state, IptablesConfig(local_mode="ClusterCIDR", local_cidrs=("10.244.0.0/16",)),
                    kernel).sync(force_full=True)
    assert "KUBE-SVC-" in save(ns, "nat")
    state.mark_all_changed()
    proxier.sync(force_full=True)
    assert render(kube_rules(ns), include_builtin=True) == render(proxier.agg.rules(CFG), include_builtin=True)
    # The canaries (beside the ruleset, as upstream's IPVS proxier makes them) and the
    # every-second check that finds them gone.
    assert kernel.missing_canaries() == [] and not proxier.check()
    lab.iptables_restore("*mangle\n-X KUBE-PROXY-CANARY\nCOMMIT\n")
    assert proxier.check() and "mangle" in proxier.pending_repair
    assert proxier.sync().full and kernel.missing_canaries() == []
    text = save(ns)
    for gone in ("KUBE-SVC-", "KUBE-SEP-", "KUBE-NODEPORTS", "KUBE-EXTERNAL-SERVICES", "KUBE-EXT-"):
        assert gone not in text, gone

    lab.iptables_restore("*filter\n:MINE - [0:0]\n-A INPUT -s 10.9.9.9/32 -j MINE\nCOMMIT\n")
    assert proxier.cleanup() > 0
    text = save(ns)
    assert "KUBE-" not in text
    assert "-A INPUT -s 10.9.9.9/32 -j MINE" in text
    assert "KUBE-" not in ipset_save(ns)
    assert not link.exists


def test_sysctls_in_a_namespace(lab):
    ns = lab.ns("node")
    s = Sysctls(ns)
    assert s.ensure({"net/ipv4/conf/all/arp_ignore": "1"}) == {"net/ipv4/conf/all/arp_ignore": "0 -> 1"}
    assert s.ensure({"net/ipv4/conf/all/arp_ignore": "1"}) == {}
    with pytest.raises(Exception, match="ip_vs kernel module"):
        s.ensure({"net/ipv4/vs/conntrack": "1"})


def test_cleanup_in_iptables_mode_removes_ipvs_leftovers(node):
    """A node switched from IPVS to iptables mode: ``--cleanup`` (iptables mode configured)
    removes every mode's leftovers, KUBE-IPVS-FILTER and the ipsets included."""
    ns, state, proxier, _ipvs, _link = node
    populate(state)
    proxier.sync(force_full=True)
    assert ":KUBE-IPVS-FILTER" in save(ns, "filter") and "KUBE-CLUSTER-IP" in ipset_save(ns)
    proc = run_proxy(ns, "--cleanup")
    assert "of ipvs mode" in proc.stdout, proc.stdout  # its cleanup takes iptables mode's chains too
    assert "KUBE-" not in save(ns)
    assert "KUBE-" not in ipset_save(ns)
    again = run_proxy(ns, "--cleanup").stdout.rstrip()
    assert again.endswith("removed nothing (objects: chains, virtual services, links, sets)"), again


def test_cleanup_in_ipvs_mode_removes_both_modes_rules(node):
    """--cleanup --proxy-mode ipvs: IPVS mode's chains jump to KUBE-MARK-MASQ, so they must
    go before iptables mode's cleanup deletes it (iptables-restore refused, EBUSY)."""
    ns, state, proxier, _ipvs, _link = node
    populate(state)
    proxier.sync(force_full=True)
    proc = run_proxy(ns, "--cleanup", "--proxy-mode", "ipvs")
    assert "of ipvs mode" in proc.stdout, proc.stdout + proc.stderr
    assert "KUBE-" not in save(ns) and "KUBE-" not in ipset_save(ns)


def test_canary_and_dispatch_flush_each_repaired_in_the_real_kernel(node, lab):
    """Issue 11 item 1 for IPVS mode, its iptables part on this kernel: the every-second
    check (three ``iptables -S`` and a link lookup, whatever the number of services) finds a
    canary deleted or kube-ipvs0 gone and the sync it forces rewrites our rules; a flush of
    nat KUBE-SERVICES alone keeps the canaries, so the check does not see it, and the periodic
    full sync (every syncPeriod; it reads IPVS mode's few dozen iptables rules whole) repairs it."""
    ns, state, proxier, _ipvs, link = node
    populate(state)
    proxier.sync()
    want = render(kube_rules(ns), include_builtin=True)
    kernel = IptablesKernel(netns=ns)
    lab.iptables_restore("*nat\n-F KUBE-SERVICES\n-X KUBE-PROXY-CANARY\nCOMMIT\n")
    assert proxier.check() and "nat" in proxier.pending_repair
    r = proxier.sync()
    assert r.full and r.rules_written > 0 and kernel.missing_canaries() == []
    assert render(kube_rules(ns), include_builtin=True) == want
    link.delete()
    assert proxier.check() and "kube-ipvs0" in proxier.pending_repair
    assert proxier.sync().full and link.exists and not proxier.check()
    lab.iptables_restore("*nat\n-F KUBE-SERVICES\nCOMMIT\n")
    assert render(kube_rules(ns), include_builtin=True) != want
    assert not proxier.check()  # not detected every second: the canaries are intact
    r = proxier.sync(force_full=True)  # what the runner does every syncPeriod
    assert r.rules_written > 0 and render(kube_rules(ns), include_builtin=True) == want
