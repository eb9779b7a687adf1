"""Hostile and foreign objects through ``kubenode-proxy --once`` on the real kernel: objects of
the IP family the node does not serve are ignored (exit 0) and a dual-stack Service's IPv4
half answers; objects the API server would refuse are named with their field (exit 3), never
programmed, and the good ones beside them answer real TCP connections."""
from __future__ import annotations

from collections import Counter

import pytest
from proxyctl import eps, run_proxy, save, svc, tcp, write_manifests

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}


@pytest.fixture
def node(lab, tmp_path):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    manifests = tmp_path / "manifests"

    def once(objects):
        write_manifests(manifests, objects)
        return run_proxy(lab.ns("node"), "--once", manifests=manifests, check=False)

    lab.once = once
    return lab


def answers(lab, ip, count=6):
    replies = lab.request_many("client", ip, 80, count=count, timeout=1.0)
    return Counter(r.backend if r.ok else r.outcome for r in replies)


def v6_slice(service, ips, name=None):
    obj = eps(service, ips, HTTP_EP, name=name)
    obj["addressType"] = "IPv6"
    return obj


def test_other_family_services_are_ignored_and_the_dual_stack_ipv4_half_answers(node):
    proc = node.once([
        svc("v6only", "fd00::10", HTTP, ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack", clusterIPs=["fd00::10"]),
        v6_slice("v6only", ["fd00:244::1"]),
        # IPv6 first: the primary family is not the node's, its second cluster IP is.
        svc("dual", "fd00::11", HTTP, clusterIPs=["fd00::11", "10.96.0.11"], ipFamilies=["IPv6", "IPv4"],
            ipFamilyPolicy="PreferDualStack"),
        eps("dual", [PODS["be2"]], HTTP_EP, name="dual-v4"),
        v6_slice("dual", ["fd00:244::2"], name="dual-v6"),
        svc("web", "10.96.0.10", HTTP),
        eps("web", [PODS["be1"]], HTTP_EP),
    ])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rejected" not in proc.stderr
    assert answers(node, "10.96.0.10") == Counter({"be1": 6})
    assert answers(node, "10.96.0.11") == Counter({"be2": 6})
    assert "fd00" not in save(node.ns("node"))


BAD_ENDPOINTS = {"lo": "127.0.0.1", "any": "0.0.0.0", "meta": "169.254.169.254"}


def test_refused_objects_are_named_and_never_programmed(node):
    objects = [svc("web", "10.96.0.10", HTTP), eps("web", [PODS["be1"]], HTTP_EP),
               svc("api", "10.96.0.11", HTTP), eps("api", [PODS["be2"]], HTTP_EP, name="api-good")]
    for short, ip in BAD_ENDPOINTS.items():
        # Each bad address in its own slice of a served Service: the slice is refused whole.
        objects.append(eps("api", [ip], HTTP_EP, name=f"api-{short}"))
    objects.append(svc("Web_Service", "10.96.0.12", HTTP))
    objects.append(eps("Web_Service", [PODS["be1"]], HTTP_EP, name="web-underscore"))
    proc = node.once(objects)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    err = proc.stderr
    for short, ip in BAD_ENDPOINTS.items():
        line = next((x for x in err.splitlines() if f"EndpointSlice default/api-{short}:" in x), "")
        assert "endpoints[0].addresses[0]" in line and ip in line, err
    assert "Service default/Web_Service: metadata.name:" in err, err
    # The slice of Web_Service names a label value that no valid Service has; it is valid
    # itself, and programs nothing without its Service.
    assert answers(node, "10.96.0.10") == Counter({"be1": 6})
    assert answers(node, "10.96.0.11") == Counter({"be2": 6})
    nat = save(node.ns("node"), "nat")
    for ip in BAD_ENDPOINTS.values():
        assert f"--to-destination {ip}:" not in nat
    assert "10.96.0.12" not in nat and "Web_Service" not in nat
