"""kube-ipvs0's addresses through DummyLink's raw rtnetlink path (kernel/rtnl_addr.py) on
this machine's kernel, in a throw-away namespace. This kernel has no dummy links, so a
veth named kube-ipvs0 stands in: addresses behave the same on any link. Checked against
``ip -j addr``: what is bound (prefix, scope, family), that a batch with one failing
request reports that address and still applies the others, and the one-dump listing."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
from lab import Lab

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.dummy_link import DummyLink, LinkError


@pytest.fixture
def ns():
    with Lab() as lab:  # its node namespace (registered: other runs' stale-lab cleanup leaves it alone)
        name = lab.ns("node")
        subprocess.run(["ip", "-n", name, "link", "add", "kube-ipvs0", "type", "veth", "peer", "name", "kipvs-peer"],
                       check=True)
        yield name


def ip_addrs(ns: str, dev: str = "kube-ipvs0"):
    out = subprocess.run(["ip", "-n", ns, "-j", "addr", "show", "dev", dev], check=True, capture_output=True,
                         text=True).stdout
    return {(a["family"], a["local"], a["prefixlen"], a["scope"]) for link in json.loads(out)
            for a in link.get("addr_info", []) if not a["local"].startswith("fe80:")}


def test_bind_list_unbind_match_ip_addr(ns, measurements):
    link = DummyLink(ns)
    try:
        assert link.ensure() is False  # the link is there already (a veth here)
        assert link.addresses() == set()
        v4 = [f"10.96.{i // 250}.{i % 250 + 1}" for i in range(3000)]
        v6 = ["fd00:10:96::a", "fd00:10:96::1:0"]
        t0 = time.perf_counter()
        added = link.add(v4 + v6)
        seconds = time.perf_counter() - t0
        measurements.append(f"kube-ipvs0: 3,002 addresses bound in {seconds:.3f} s (raw rtnetlink, batched)")
        assert added == sorted(v4 + v6)
        # what ip addr add IP/32 dev kube-ipvs0 would have made
        want = {("inet", ip, 32, "global") for ip in v4} | {("inet6", ip, 128, "global") for ip in v6}
        assert ip_addrs(ns) == want
        t0 = time.perf_counter()
        listed = link.addresses()
        measurements.append(f"kube-ipvs0: 3,002 addresses listed in {time.perf_counter() - t0:.3f} s (one dump)")
        assert listed == set(v4) | set(v6)  # the node's own 192.168.50.1 is not listed
        assert link.add(v4[:10] + v6[:1]) == []  # already bound: fine, nothing new
        gone = v4[100:1100] + v6[1:]
        assert link.remove(gone + ["10.97.0.1"]) == sorted(gone)  # 10.97.0.1 was never bound: fine
        assert link.remove(gone) == []
        assert ip_addrs(ns) == {a for a in want if a[1] not in set(gone)}
        assert link.addresses() == set(v4 + v6) - set(gone)
    finally:
        link.close()


def test_a_failing_request_is_reported_and_the_rest_of_its_batch_applies(ns):
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.kube-ipvs0.disable_ipv6=1"],
                   check=True)
    link = DummyLink(ns)
    try:
        with pytest.raises(LinkError, match=r"cannot bind fd00:10:96::5 to kube-ipvs0: Permission denied"):
            link.add(["10.96.0.1", "fd00:10:96::5", "10.96.0.2"])  # EACCES: IPv6 is off on the link
        assert ip_addrs(ns) == {("inet", "10.96.0.1", 32, "global"), ("inet", "10.96.0.2", 32, "global")}
    finally:
        link.close()


def test_missing_link_and_missing_namespace(ns):
    link = DummyLink(ns, name="kube-ipvs9")
    try:
        assert link.index() is None
        assert link.addresses() == set()
        assert link.remove(["10.96.0.1"]) == []
        with pytest.raises(LinkError, match="does not exist"):
            link.add(["10.96.0.1"])
    finally:
        link.close()
    with pytest.raises(LinkError, match="does not exist"):
        DummyLink(f"{ns}-typo").index()
