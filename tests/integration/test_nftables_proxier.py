"""nftables mode's proxier on the real kernel, in process: what only a running proxier
does (partial syncs in both chain layouts, the canary check and repair, a failed apply,
the hourly rewrite, conflicting claims, a hostile name that must never reach nft text),
checked with real connections. The traffic scenarios every mode shares (``kubenode-proxy
--proxy-mode nftables --once`` and the daemon) are in test_traffic.py. Topology:
tests/integration/lab.py.
"""
from __future__ import annotations

import subprocess
from collections import Counter

import pytest
from proxyctl import eps, svc, tcp, write_manifests

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.errors import KernelError
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.nft import NftKernel
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.compile import NftablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import NftablesProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

TRIES = 40  # with 3 backends, P(one backend never chosen) = 3 * (2/3)^40 < 1e-6
CLIENT_IP = "10.244.2.10"
EXT_IP = "192.168.50.2"
BACKENDS = {"be1": "10.244.1.1", "be2": "10.244.1.2", "be3": "10.244.1.3"}
HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
# The default layout (endpoints inlined into service chains) and upstream's endpoint-* chains.
LAYOUTS = pytest.mark.parametrize("endpoint_chains", [False, True], ids=["inlined", "endpoint-chains"])


def nft_table(netns: str) -> str:
    proc = subprocess.run(["ip", "netns", "exec", netns, "nft", "list", "table", "ip", "kube-proxy"],
                          capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


@pytest.fixture
def cluster(lab):
    for name, ip in BACKENDS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", CLIENT_IP)
    lab.add_external("ext", EXT_IP)
    return lab


def backends(replies):
    assert all(r.ok for r in replies), Counter(r.outcome for r in replies)
    return Counter(r.backend for r in replies)


# --- in-process: partial syncs, canary, hostile text ---------------------------------------


class Proxy:
    """An NftablesProxier on the lab's node namespace, fed objects directly."""

    def __init__(self, lab, endpoint_chains=False, service_cidrs=()):
        self.lab = lab
        self.state = ProxyState("node1")
        cfg = NftablesConfig(base=IptablesConfig(local_cidrs=("10.244.0.0/16",), localhost_nodeports=False,
                                                 node_ips=(lab.node_ip,)), endpoint_chains=endpoint_chains,
                             service_cidrs=tuple(service_cidrs))
        self.proxier = NftablesProxier(self.state, cfg, NftKernel(lab.ns("node")))

    def set(self, *objects):
        for obj in objects:
            if obj["kind"] == "Service":
                self.state.set_service(parse_service(obj))
            else:
                self.state.set_slice(parse_endpoint_slice(obj))

    def sync(self, **kw):
        return self.proxier.sync(**kw)


def test_only_hairpin_is_masqueraded_between_endpoints_with_endpoint_chains(cluster):
    # The default (inlined) layout: test_traffic.py's hairpin scenario, through the CLI.
    proxy = Proxy(cluster, endpoint_chains=True)
    proxy.set(svc("hp", "10.96.0.80", HTTP), eps("hp", [BACKENDS["be1"], BACKENDS["be2"]], HTTP_EP))
    proxy.sync()
    seen = {(r.backend, r.seen_client) for r in cluster.request_many("be1", "10.96.0.80", 80, count=TRIES)}
    assert seen == {("be1", cluster.node_ip), ("be2", BACKENDS["be1"])}  # to itself: masqueraded; else not


@LAYOUTS
def test_endpoint_change_is_a_partial_sync_and_takes_effect(cluster, endpoint_chains):
    proxy = Proxy(cluster, endpoint_chains)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP),
              svc("other", "10.96.0.11", HTTP), eps("other", [BACKENDS["be1"]], HTTP_EP))
    assert proxy.sync().full
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    proxy.set(eps("web", [BACKENDS["be3"]], HTTP_EP))
    result = proxy.sync()
    assert not result.full and result.changed == {"default/web"}
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=10)) == Counter({"be3": 10})
    table = nft_table(cluster.ns("node"))
    if endpoint_chains:
        assert any(c.startswith("-chain endpoint-") for c in result.changes), result.changes
        assert table.count("chain endpoint-") == 2  # be3 of web, be1 of other: the stale chains are gone
    else:
        assert "chain endpoint-" not in table
        assert "10.244.1.2 . 10.244.1.2" not in table and "10.244.1.1 . 10.244.1.1" in table  # be1: "other"
    # The service goes to no endpoints and back, partially each time.
    proxy.set(eps("web", [], HTTP_EP))
    assert not proxy.sync().full
    assert cluster.request("client", "10.96.0.10", 80, timeout=1).outcome == "refused"
    proxy.set(eps("web", [BACKENDS["be2"]], HTTP_EP))
    assert not proxy.sync().full
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=5)) == Counter({"be2": 5})
    # Deleting the service removes its chains and map entries; the other one still works.
    proxy.state.delete_service("default", "web")
    assert not proxy.sync().full
    table = nft_table(cluster.ns("node"))
    assert "default/web/" not in table and "10.96.0.10" not in table
    assert backends(cluster.request_many("client", "10.96.0.11", 80, count=3)) == Counter({"be1": 3})


@LAYOUTS
def test_affinity_added_and_removed_by_partial_syncs(cluster, endpoint_chains):
    proxy = Proxy(cluster, endpoint_chains)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP))
    proxy.sync()
    proxy.set(svc("web", "10.96.0.10", HTTP, sessionAffinity="ClientIP",
                  sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}))
    assert not proxy.sync().full
    assert len(backends(cluster.request_many("client", "10.96.0.10", 80, count=15))) == 1
    proxy.set(svc("web", "10.96.0.10", HTTP))
    assert not proxy.sync().full
    assert "affinity-" not in nft_table(cluster.ns("node"))


def test_an_endpoint_replaced_is_written_over_netlink_and_a_refused_batch_means_a_full_sync(cluster):
    # Same endpoint count: only elements of endpoints-tcp-00 (and hairpin-ips) change, and they
    # go to the kernel as one nfnetlink batch, without nft.
    proxy = Proxy(cluster)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", [BACKENDS["be1"], BACKENDS["be2"]], HTTP_EP))
    assert proxy.sync().full
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == {"be1", "be2"}
    nft_runs = []
    real_apply = proxy.proxier.kernel.apply
    proxy.proxier.kernel.apply = lambda text, check_only=False: (nft_runs.append(text), real_apply(text, check_only))
    proxy.set(eps("web", [BACKENDS["be1"], BACKENDS["be3"]], HTTP_EP))
    result = proxy.sync()
    assert not result.full and result.changed == {"default/web"} and nft_runs == []
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == {"be1", "be3"}
    table = nft_table(cluster.ns("node"))
    assert "10.244.1.3 . 8080" in table and "10.244.1.2" not in table
    # Someone deletes the element we would replace: the kernel refuses the whole batch
    # (nothing applied), the sync fails, and the next one rewrites the table.
    cluster.exec("node", ["nft", "delete element ip kube-proxy endpoints-tcp-00 { 1 }"])
    proxy.set(eps("web", [BACKENDS["be1"], BACKENDS["be2"]], HTTP_EP))
    with pytest.raises(KernelError, match="endpoints-tcp-00"):
        proxy.sync()
    assert proxy.sync().full
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == {"be1", "be2"}


def affinity_entries(netns):
    """Addresses held by the table's affinity sets (nft prints them as ``elements = { A expires ... }``)."""
    return {line.split("{", 1)[1].split()[0] for line in nft_table(netns).splitlines()
            if "elements = {" in line and "expires" in line}


@LAYOUTS
def test_affinity_entries_survive_a_full_rewrite(cluster, endpoint_chains):
    # A full sync deletes and recreates the table; the client's affinity entry is read first
    # and re-added, so the client keeps its backend. Four rewrites: without the entries the
    # first connection after each one picks at random (all four on the same backend: 1/81).
    proxy = Proxy(cluster, endpoint_chains)
    proxy.proxier.rewrite_period = 0  # every forced full sync rewrites the table
    proxy.set(svc("web", "10.96.0.10", HTTP, sessionAffinity="ClientIP",
                  sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}}),
              eps("web", BACKENDS.values(), HTTP_EP))
    assert proxy.sync().full
    first = backends(cluster.request_many("client", "10.96.0.10", 80, count=5))
    assert len(first) == 1
    assert affinity_entries(cluster.ns("node")) == {CLIENT_IP}
    for _round in range(4):
        result = proxy.sync(force_full=True)
        assert result.full and result.changes == ["table replaced"]
        assert affinity_entries(cluster.ns("node")) == {CLIENT_IP}
        cluster.exec("node", ["conntrack", "-F"], check=False)  # new connections, not old flows
        assert backends(cluster.request_many("client", "10.96.0.10", 80, count=3)) == Counter(
            {next(iter(first)): 3})
    # A shorter timeout now: the kept entry's expiry is capped to it (the kernel refuses more).
    proxy.set(svc("web", "10.96.0.10", HTTP, sessionAffinity="ClientIP",
                  sessionAffinityConfig={"clientIP": {"timeoutSeconds": 30}}))
    assert proxy.sync(force_full=True).full
    table = nft_table(cluster.ns("node"))
    assert "timeout 30s" in table and affinity_entries(cluster.ns("node")) == {CLIENT_IP}


@pytest.mark.parametrize("damage", ["delete table ip kube-proxy", "flush ruleset", "flush table ip kube-proxy",
                                    "flush chain ip kube-proxy services", "flush chain ip kube-proxy nat-prerouting"])
def test_canary_sees_the_damage_and_the_next_sync_repairs(cluster, damage):
    proxy = Proxy(cluster)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP))
    proxy.sync()
    assert proxy.proxier.check() is False
    cluster.nft(damage + "\n")
    assert cluster.request("client", "10.96.0.10", 80, timeout=1).outcome != "ok"
    assert proxy.proxier.check() is True
    assert proxy.proxier.pending_repair
    result = proxy.sync()  # asked for a partial sync: the pending repair makes it full
    assert result.full and result.repair
    assert proxy.proxier.check() is False
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)


def test_failed_apply_keeps_the_table_and_the_next_sync_is_full(cluster):
    proxy = Proxy(cluster)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP))
    proxy.sync()
    real = proxy.proxier.kernel
    proxy.proxier.kernel = NftKernel(cluster.ns("node"), binary="false")  # exits 1, applies nothing
    proxy.set(eps("web", [BACKENDS["be1"]], HTTP_EP))
    with pytest.raises(RuntimeError):
        proxy.sync()
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    proxy.proxier.kernel = real
    result = proxy.sync()
    assert result.full and "default/web" in result.changed
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=5)) == Counter({"be1": 5})


def test_hostile_name_never_reaches_nft_text(cluster):
    calls = []
    proxy = Proxy(cluster)
    kernel = proxy.proxier.kernel
    real_apply = kernel.apply

    def recording_apply(script, check_only=False):
        calls.append(script)
        return real_apply(script, check_only)

    kernel.apply = recording_apply
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP))
    proxy.sync()
    # Objects built without the API server's validation (a module, a future source): the
    # port name carries nft syntax. The parser would refuse it; build the port directly.
    from dataclasses import replace

    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import Service, ServicePortName

    good = proxy.state.services["default/web"]
    hostile_name = 'x" ; flush ruleset ; add table ip pwn { } #'
    port = replace(good.ports[0], name=ServicePortName("default", "evil", hostile_name, "TCP"), cluster_ip="10.96.0.99")
    proxy.state.set_service(Service("default", "evil", (port,)))
    result = proxy.sync()
    assert "default/evil" in result.rejected and "nft" in result.rejected["default/evil"]
    assert all("flush ruleset" not in script and "pwn" not in script for script in calls)
    assert "pwn" not in cluster.exec("node", ["nft", "list", "tables"]).stdout
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)


@pytest.mark.parametrize("selection,endpoint_chains", [("chained", False), ("chained", True), ("vmap", True)])
def test_compiled_text_of_every_feature_passes_nft_check(lab, selection, endpoint_chains):
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
        Endpoint,
        ServicePort,
        ServicePortName,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import compile as nc

    eps_ = [Endpoint("10.244.1.1", 80, is_local=True), Endpoint("10.244.1.2", 80),
            Endpoint("10.244.1.3", 80, ready=False, serving=True, terminating=True)]
    ports = [
        ServicePort(ServicePortName("ns1", "all", "p80", "TCP"), "10.96.0.1", 80, "TCP", node_port=30001,
                    external_ips=("203.0.113.1",), load_balancer_ips=("198.51.100.1",),
                    load_balancer_source_ranges=("192.168.50.0/24", "10.0.0.0/8"), external_policy_local=True,
                    session_affinity_seconds=600),
        ServicePort(ServicePortName("ns1", "udp", "", "UDP"), "10.96.0.2", 53, "UDP", internal_policy_local=True),
        ServicePort(ServicePortName("ns1", "sctp", "s", "SCTP"), "10.96.0.3", 9, "SCTP", node_port=30002),
    ]
    base = IptablesConfig(local_mode="InterfaceNamePrefix", local_interface="cali", node_port_match_all=False,
                          node_port_ips=("192.168.50.1",), masquerade_random_fully=True, node_ips=("192.168.50.1",))
    for b in (IptablesConfig(local_cidrs=("10.244.0.0/16",)), base):
        cfg = nc.NftablesConfig(base=b, endpoint_selection=selection, endpoint_chains=endpoint_chains)
        compiled = {f"ns1/{sp.name.name}": nc.compile_service([sp], {sp.name: eps_}, cfg) for sp in ports}
        compiled["ns1/none"] = nc.compile_service(
            [ServicePort(ServicePortName("ns1", "none", "", "TCP"), "10.96.0.4", 80, "TCP", node_port=30003)], {}, cfg)
        text = nc.render_full(compiled, cfg)
        assert ("ip saddr != 10.244.0.0/16" in text) != ('iifname != "cali*"' in text)
        NftKernel(lab.ns("node")).apply(text, check_only=True)
    assert nft_table(lab.ns("node")) == ""  # -c applied nothing


def test_periodic_full_sync_checks_then_syncs_partially_until_a_rewrite_is_due(cluster):
    proxy = Proxy(cluster)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP))
    assert proxy.sync(force_full=True).full
    proxy.set(eps("web", [BACKENDS["be2"]], HTTP_EP))
    result = proxy.sync(force_full=True)  # the daemon's periodic resync, the table intact
    assert not result.full and result.changed == {"default/web"}
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=5)) == Counter({"be2": 5})
    cluster.nft("delete table ip kube-proxy\n")
    result = proxy.sync(force_full=True)
    assert result.full and "gone" in result.repair
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=5)) == Counter({"be2": 5})
    # A flushed service chain is not seen by the check (it counts the node-wide chains'
    # rules only); the hourly rewrite repairs it. Traffic then hits the empty chain and
    # returns unDNATed: nothing answers at the cluster IP.
    service_chain = next(line.split()[1] for line in nft_table(cluster.ns("node")).splitlines()
                         if line.strip().startswith("chain service-") and "/" in line)
    cluster.nft(f"flush chain ip kube-proxy {service_chain}\n")
    assert proxy.proxier.check() is False, proxy.proxier.pending_repair
    assert cluster.request("client", "10.96.0.10", 80, timeout=1).outcome != "ok"
    proxy.proxier.rewrite_period = 0
    assert proxy.sync(force_full=True).full
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=5)) == Counter({"be2": 5})


@pytest.fixture
def nft_daemon(cluster, tmp_path):
    """kubenode-proxy --proxy-mode nftables as a daemon in the node, following a manifests
    directory (``cluster.manifests``, log ``cluster.log``); SIGTERM after the test."""
    import signal
    import sys

    from proxyctl import BIN

    cluster.manifests = tmp_path / "daemon-manifests"
    write_manifests(cluster.manifests, [svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)])
    cluster.log = tmp_path / "daemon.log"
    proc = cluster.spawn("node", [sys.executable, str(BIN), "--proxy-mode", "nftables",
                                  "--manifests", str(cluster.manifests), "--hostname-override", "node1",
                                  "--cluster-cidr", "10.244.0.0/16",
                                  "--nodeport-addresses", "192.168.50.0/24"], stdout=cluster.log)
    cluster.daemon = proc
    try:
        yield cluster
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)


@pytest.mark.parametrize("damage", ["flush table ip kube-proxy", "flush chain ip kube-proxy services"])
def test_daemon_repairs_a_flushed_table_at_the_next_check(nft_daemon, damage):
    from proxyctl import wait_for

    lab = nft_daemon
    wait_for(lambda: "10.96.0.10" in nft_table(lab.ns("node")), what="the first sync")
    assert set(backends(lab.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    lab.nft(damage + "\n")
    # The check runs every second; the repair is a full rewrite. 15 s: a loaded 2-core machine.
    wait_for(lambda: lab.request("client", "10.96.0.10", 80, timeout=1).ok, timeout=15, what="the repair")
    assert set(backends(lab.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)
    text = lab.log.read_text()
    assert "(table or chain flushed?): our rules were flushed or deleted, repairing now" in text, text


def test_two_services_claiming_one_external_ip_port_do_not_break_the_sync(cluster):
    proxy = Proxy(cluster)
    proxy.set(svc("a", "10.96.0.41", HTTP, externalIPs=["203.0.113.40"]), eps("a", [BACKENDS["be1"]], HTTP_EP),
              svc("web", "10.96.0.10", HTTP), eps("web", [BACKENDS["be3"]], HTTP_EP))
    proxy.sync()
    # "b" claims a's external IP and port, in a partial sync: nft would refuse the whole
    # transaction ("File exists"); the sync goes full and a (first by name) keeps it.
    proxy.set(svc("b", "10.96.0.42", HTTP, externalIPs=["203.0.113.40"]), eps("b", [BACKENDS["be2"]], HTTP_EP))
    result = proxy.sync()
    assert result.full and "already used by Service default/a" in result.rejected["default/b"]
    assert backends(cluster.request_many("ext", "203.0.113.40", 80, count=5)) == Counter({"be1": 5})
    assert backends(cluster.request_many("client", "10.96.0.42", 80, count=3)) == Counter({"be2": 3})
    # Other changes still apply (partially) meanwhile.
    proxy.set(eps("web", [BACKENDS["be1"]], HTTP_EP))
    assert not proxy.sync().full
    assert backends(cluster.request_many("client", "10.96.0.10", 80, count=3)) == Counter({"be1": 3})
    # a goes: b gets the address.
    proxy.state.delete_service("default", "a")
    result = proxy.sync()
    assert result.full and not result.rejected
    assert backends(cluster.request_many("ext", "203.0.113.40", 80, count=5)) == Counter({"be2": 5})


def test_switching_between_iptables_and_nftables_removes_the_other_modes_rules(cluster, tmp_path):
    from proxyctl import kube_chains, run_proxy

    node = cluster.ns("node")
    manifests = tmp_path / "manifests"

    def apply(objects, *args):  # `--once` in nftables mode unless args name another
        write_manifests(manifests, objects)
        return run_proxy(node, "--once", "--proxy-mode", "nftables", *args, manifests=manifests)

    cluster.apply = apply
    objects = [svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP)]
    cluster.apply(objects, "--proxy-mode", "iptables")  # the last --proxy-mode wins
    assert "KUBE-SERVICES" in kube_chains(node) and nft_table(node) == ""
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)

    out = cluster.apply(objects)  # nftables mode (MODE)
    assert "objects left by ipvs or iptables mode (this node runs nftables mode now)" in out.stdout, out.stdout
    assert kube_chains(node) == [] and "10.96.0.10" in nft_table(node)
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)

    out = cluster.apply(objects, "--proxy-mode", "iptables")
    assert "removed 1 objects left by nftables mode" in out.stdout, out.stdout
    assert nft_table(node) == "" and "KUBE-SERVICES" in kube_chains(node)
    assert set(backends(cluster.request_many("client", "10.96.0.10", 80, count=TRIES))) == set(BACKENDS)


@pytest.mark.parametrize("service_cidrs", [(), ("10.96.0.0/16",)], ids=["cidr-unknown", "cidr-known"])
def test_unallocated_cluster_ip_is_dropped_when_the_service_cidr_is_known(cluster, service_cidrs):
    # 10.96.0.99 (no Service holds it) belongs to the external host, routed there by the
    # node: only the service-CIDR rule keeps a pod from reaching it.
    cluster.exec("ext", ["ip", "addr", "add", "10.96.0.99/32", "dev", "lo"])
    cluster.exec("ext", ["ip", "route", "add", "10.244.0.0/16", "via", cluster.node_ip])  # replies to the pod
    cluster.exec("node", ["ip", "route", "add", "10.96.0.99/32", "via", EXT_IP])
    cluster.start_server("ext")
    proxy = Proxy(cluster, service_cidrs=service_cidrs)
    proxy.set(svc("web", "10.96.0.10", HTTP), eps("web", BACKENDS.values(), HTTP_EP))
    proxy.sync()
    assert cluster.request("client", "10.96.0.10", 80).ok
    assert cluster.request("client", "10.96.0.10", 81, timeout=1).outcome == "refused"  # a port no Service has
    outcome = cluster.request("client", "10.96.0.99", 8080, timeout=1).outcome  # the echo server's port
    assert outcome == ("timeout" if service_cidrs else "ok")
    assert proxy.proxier.check() is False  # the extra rule is counted as written


def test_a_large_element_batch_is_split_and_an_oversized_one_is_left_to_nft(lab):
    # One NEWSETELEM message holds at most ELEMENTS_PER_MESSAGE elements (the element list is
    # one attribute, its length 16 bits: ~2,100 IPv4 map elements overflow it); a batch above
    # MAX_BATCH_BYTES is not sent at all (False: nft -f writes that change).
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import nft_netlink
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.compile import (
        encode_element,
    )

    netns = lab.ns("node")
    lab.exec("node", ["nft", "add table ip t; add map ip t endpoints-tcp-00 { typeof numgen random mod 1 : "
                             "ip daddr . tcp dport ; }"])
    n = 5 * nft_netlink.ELEMENTS_PER_MESSAGE + 7  # ~80 KB: one attribute would overflow
    elems = [encode_element("endpoints-tcp-00", f"{i} : 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255} . 8080")
             for i in range(n)]
    counter = nft_netlink.RuleCounter(netns)
    try:
        assert counter.element_batch("ip", "t", [("add", "endpoints-tcp-00", elems)]) is True
        out = lab.exec("node", ["nft", "list", "map", "ip", "t", "endpoints-tcp-00"]).stdout
        assert out.count(" . 8080") == n
        many = [encode_element("endpoints-tcp-00", f"{i} : 10.99.{i >> 8 & 255}.{i & 255} . 80")
                for i in range(n, n + 5000)]
        assert counter.element_batch("ip", "t", [("add", "endpoints-tcp-00", many)]) is False
        out = lab.exec("node", ["nft", "list", "map", "ip", "t", "endpoints-tcp-00"]).stdout
        assert out.count(" . 8080") == n and " . 80," not in out and " . 80 " not in out
        # An element that is not there: the kernel refuses the batch, nothing of it applied.
        with pytest.raises(KernelError, match="endpoints-tcp-00"):
            gone = [encode_element("endpoints-tcp-00", "0"), encode_element("endpoints-tcp-00", str(n + 1))]
            counter.element_batch("ip", "t", [("delete", "endpoints-tcp-00", gone)])
        out = lab.exec("node", ["nft", "list", "map", "ip", "t", "endpoints-tcp-00"]).stdout
        assert out.count(" . 8080") == n
    finally:
        counter.close()
