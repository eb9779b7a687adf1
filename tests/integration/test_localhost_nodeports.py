"""Localhost NodePorts (iptables.localhostNodePorts, default on) as upstream's IPv4 packet-flow
cases have them, with real connections in a lab whose node namespace starts with
net.ipv4.conf.all.route_localnet=0: nobody but the proxy sets it (upstream's NewProxier
does, and logs it). Without it the kernel drops packets from 127.0.0.1 once DNAT has sent
them towards a pod, so every case below fails unless the proxy set the sysctl itself.

Cases (upstream pkg/proxy/iptables/proxier_test.go packet-flow tests, IPv4):
  localhost to NodePort gets masqueraded (externalTrafficPolicy Cluster, TCP and UDP),
  localhost to NodePort of an eTP:Local service is masqueraded and may use every endpoint,
  localhost to NodePort of a service without endpoints is rejected,
  node IP to NodePort (the same services) is unaffected;
and the cases where the proxy must leave the sysctl alone: nodePortAddresses without
127.0.0.1, localhostNodePorts false."""
from __future__ import annotations

from collections import Counter

import pytest
from proxyctl import eps, run_proxy, svc, tcp, write_manifests

ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"
LOCAL = {"be1": "10.244.1.1", "be2": "10.244.1.2"}
REMOTE = {"be3": "10.244.1.3"}
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
DNS_EP = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
TRIES = 24  # 2 backends: P(one never chosen) = 2 * (1/2)^24 < 1e-6


def route_localnet(lab) -> str:
    return lab.exec("node", ["cat", ROUTE_LOCALNET]).stdout.strip()


def objects():
    return [
        svc("np", "10.96.0.30", [tcp(80, "http", node_port=30080)], type="NodePort"),
        eps("np", LOCAL.values(), HTTP_EP),
        svc("dns", "10.96.0.53", [tcp(53, "dns", node_port=30053, protocol="UDP")], type="NodePort"),
        eps("dns", LOCAL.values(), DNS_EP),
        svc("loc", "10.96.0.31", [tcp(80, "http", node_port=30081)], type="NodePort",
            externalTrafficPolicy="Local"),
        eps("loc", [LOCAL["be1"]], HTTP_EP, name="loc-local"),
        eps("loc", REMOTE.values(), HTTP_EP, node="node2", name="loc-remote"),
        svc("empty", "10.96.0.32", [tcp(80, "http", node_port=30082)], type="NodePort"),
    ]


@pytest.fixture
def node(lab, tmp_path):
    for name, ip in {**LOCAL, **REMOTE}.items():
        lab.add_pod(name, ip)
    manifests = tmp_path / "manifests"
    write_manifests(manifests, objects())
    lab.manifests = manifests
    assert route_localnet(lab) == "0"  # the lab did not set it (Lab(route_localnet=False))
    return lab


def seen(replies):
    assert all(r.ok for r in replies), Counter(r.outcome for r in replies)
    return {r.backend for r in replies}, {r.seen_client for r in replies}


def test_localhost_nodeports_work_because_the_proxy_sets_route_localnet(node):
    proc = run_proxy(node.ns("node"), "--once", manifests=node.manifests)
    assert route_localnet(node) == "1"
    assert "setting net.ipv4.conf.all.route_localnet=1 to allow NodePorts on localhost" in proc.stdout
    assert "sysctl net.ipv4.conf.all.route_localnet: 0 -> 1" in proc.stdout

    # localhost to NodePort gets masqueraded (the pod cannot answer 127.0.0.1).
    backends, clients = seen(node.request_many("node", "127.0.0.1", 30080, count=TRIES))
    assert backends == set(LOCAL) and clients == {node.node_ip}
    backends, clients = seen(node.request_many("node", "127.0.0.1", 30053, proto="udp", count=TRIES))
    assert backends == set(LOCAL) and clients == {node.node_ip}
    # eTP:Local: traffic from the node itself is masqueraded and may use every endpoint.
    backends, clients = seen(node.request_many("node", "127.0.0.1", 30081, count=TRIES))
    assert backends == {"be1", "be3"} and clients == {node.node_ip}
    # No endpoints: rejected, also on localhost.
    assert node.request("node", "127.0.0.1", 30082, timeout=1).outcome == "refused"
    # node to NodePort on the node IP: unchanged.
    backends, _clients = seen(node.request_many("node", node.node_ip, 30080, count=TRIES))
    assert backends == set(LOCAL)

    # A second run finds the sysctl set and changes nothing.
    proc = run_proxy(node.ns("node"), "--once", manifests=node.manifests)
    assert "sysctl net.ipv4.conf.all.route_localnet" not in proc.stdout and route_localnet(node) == "1"


def test_node_port_addresses_without_loopback_leave_route_localnet_alone(node):
    proc = run_proxy(node.ns("node"), "--once", "--nodeport-addresses", "192.168.50.0/24",
                     manifests=node.manifests)
    assert route_localnet(node) == "0" and "route_localnet" not in proc.stdout
    assert not node.request("node", "127.0.0.1", 30080, timeout=1).ok
    assert seen(node.request_many("node", node.node_ip, 30080, count=4))[0] <= set(LOCAL)


def test_localhost_nodeports_off_leaves_route_localnet_alone(node, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                      "iptables:\n  localhostNodePorts: false\n")
    proc = run_proxy(node.ns("node"), "--once", "--config", str(config), manifests=node.manifests)
    assert route_localnet(node) == "0" and "route_localnet" not in proc.stdout
    assert not node.request("node", "127.0.0.1", 30080, timeout=1).ok
    assert seen(node.request_many("node", node.node_ip, 30080, count=4))[0] <= set(LOCAL)
