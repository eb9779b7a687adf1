"""ipsets written by the layer decide real traffic: iptables rules in the node namespace
match on `-m set --match-set`, and probes go from client pods through the node to a
backend pod. Adding an entry flips the verdict, removing it flips it back; an atomic
(swap) replacement keeps the rule working."""
from __future__ import annotations

from collections import Counter

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import (
    IPSet,
    IpsetKernel,
    entries_of,
)

BACKEND = "10.244.1.1"
CLIENT = "10.244.2.10"
CLIENT2 = "10.244.2.11"


@pytest.fixture
def net(lab):
    lab.add_pod("be1", BACKEND, tcp_ports=(8080,), udp_ports=(5353,))
    lab.add_client("client", CLIENT)
    lab.add_client("client2", CLIENT2)
    lab.kernel = IpsetKernel(netns=lab.ns("node"))
    return lab


def outcomes(lab, client, ip, port, proto="tcp", count=3, timeout=1.0):
    replies = lab.request_many(client, ip, port, proto, count=count, timeout=timeout, concurrency=count)
    return Counter(r.backend if r.ok else r.outcome for r in replies)


def test_a_member_is_rejected_and_a_non_member_passes(net):
    k = net.kernel
    blocked = IPSet("KN-BLOCK", "hash:ip,port")
    k.sync([blocked])
    net.iptables_restore("*filter\n-A FORWARD -m set --match-set KN-BLOCK dst,dst -j REJECT\nCOMMIT\n")
    assert outcomes(net, "client", BACKEND, 8080) == {"be1": 3}
    assert outcomes(net, "client", BACKEND, 5353, "udp") == {"be1": 3}

    # TCP 8080 becomes a member: TCP is rejected, UDP 5353 still passes
    k.sync([IPSet("KN-BLOCK", "hash:ip,port", entries=entries_of([f"{BACKEND},8080"]))], exclusive=False)
    assert outcomes(net, "client", BACKEND, 8080) == {"refused": 3}
    assert outcomes(net, "client", BACKEND, 5353, "udp") == {"be1": 3}

    # the UDP port too (written with a service number the kernel prints as udp:5353)
    k.sync([IPSet("KN-BLOCK", "hash:ip,port", entries=entries_of([f"{BACKEND},17:5353"]))], exclusive=False)
    assert outcomes(net, "client", BACKEND, 5353, "udp") == {"refused": 3}

    # remove the TCP entry: TCP passes again, UDP stays rejected
    k.sync(remove={"KN-BLOCK": [f"{BACKEND},tcp:8080"]})
    assert outcomes(net, "client", BACKEND, 8080) == {"be1": 3}
    assert outcomes(net, "client", BACKEND, 5353, "udp") == {"refused": 3}


def test_dnat_only_for_members(net):
    """A service IP is DNATed to the backend only while IP,port is in the set (what
    kube-proxy's IPVS mode does with KUBE-CLUSTER-IP, minus IPVS)."""
    k = net.kernel
    k.sync([IPSet("KN-CLUSTER-IP", "hash:ip,port")])
    net.iptables_restore(
        "*nat\n-A PREROUTING -m set --match-set KN-CLUSTER-IP dst,dst -p tcp -d 10.96.0.10 --dport 80 "
        f"-j DNAT --to-destination {BACKEND}:8080\nCOMMIT\n")
    assert outcomes(net, "client", "10.96.0.10", 80) == {"timeout": 3}  # not a member: off to the lan, dropped
    k.sync([IPSet("KN-CLUSTER-IP", "hash:ip,port", entries=entries_of(["10.96.0.10,tcp:http"]))])
    assert outcomes(net, "client", "10.96.0.10", 80) == {"be1": 3}
    k.sync([IPSet("KN-CLUSTER-IP", "hash:ip,port", entries=entries_of([]))])  # exclusive: emptied
    assert outcomes(net, "client", "10.96.0.10", 80) == {"timeout": 3}


def test_source_ranges_swapped_atomically_flip_which_client_passes(net):
    """hash:ip,port,net matched dst,dst,src (like KUBE-LOAD-BALANCER-SOURCE-CIDR): only
    listed sources reach the backend. An exclusive atomic replacement swaps in another
    source range under the live rule."""
    k = net.kernel
    allow = [f"{BACKEND},tcp:8080,{CLIENT}/32"]
    k.sync([IPSet("KN-SRC", "hash:ip,port,net", entries=entries_of(allow))])
    net.iptables_restore(
        f"*filter\n-A FORWARD -p tcp -d {BACKEND} --dport 8080 -m set ! --match-set KN-SRC dst,dst,src -j REJECT\n"
        "COMMIT\n")
    assert outcomes(net, "client", BACKEND, 8080) == {"be1": 3}
    assert outcomes(net, "client2", BACKEND, 8080) == {"refused": 3}

    p = k.sync([IPSet("KN-SRC", "hash:ip,port,net", entries=entries_of([f"{BACKEND},8080,{CLIENT2}"]))],
               atomic=True)
    assert p.sets["KN-SRC"].action == "swap"
    assert outcomes(net, "client", BACKEND, 8080) == {"refused": 3}
    assert outcomes(net, "client2", BACKEND, 8080) == {"be1": 3}

    # a /31 covering both clients' neighbourhood: 10.244.2.10/31 = .10 and .11
    k.sync([IPSet("KN-SRC", "hash:ip,port,net", entries=entries_of([f"{BACKEND},tcp:8080,10.244.2.11/31"]))],
           atomic=True)
    assert outcomes(net, "client", BACKEND, 8080) == {"be1": 3}
    assert outcomes(net, "client2", BACKEND, 8080) == {"be1": 3}
