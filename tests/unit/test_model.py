"""Parsing and validation: every rejection names the object and the field."""
import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Skipped,
    ValidationError,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)

from .helpers import endpoint, endpoint_slice, port, service, slice_port


@pytest.mark.parametrize("mutate,path,problem", [
    (lambda s: s["spec"].update(clusterIP="10.96.0.300"), "spec.clusterIP", "must be a valid IP"),
    (lambda s: s["spec"]["ports"][0].update(port=70000), "spec.ports[0].port", "must be between 1 and 65535"),
    (lambda s: s["spec"]["ports"][0].update(port="80"), "spec.ports[0].port", "must be an integer, not string"),
    (lambda s: s["spec"]["ports"][0].update(protocol="ICMP"), "spec.ports[0].protocol", "supported: TCP, UDP, SCTP"),
    (lambda s: s["spec"].update(externalIPs=["1.2.3"]), "spec.externalIPs[0]", "must be a valid IP"),
    (lambda s: s["spec"].update(loadBalancerSourceRanges=["10.0.0.0/33"]), "spec.loadBalancerSourceRanges[0]",
     "prefix length must be at most 32"),
    (lambda s: s["spec"].update(externalTrafficPolicy="Nearby"), "spec.externalTrafficPolicy", "Cluster, Local"),
    (lambda s: s["spec"].update(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}),
     "spec.sessionAffinityConfig.clientIP.timeoutSeconds", "must be between 1 and 86400"),
    (lambda s: s["spec"].update(type="Bogus"), "spec.type", "unsupported value"),
    (lambda s: s["spec"]["ports"].append(dict(s["spec"]["ports"][0])), "spec.ports[1].name", "duplicate value"),
    (lambda s: s.update(status={"loadBalancer": {"ingress": [{"ip": "x"}]}}), "status.loadBalancer.ingress[0].ip",
     "must be a valid IP"),
])
def test_service_errors_name_object_and_field(mutate, path, problem):
    svc = service("shop", "web", "10.96.0.10", [port()])
    mutate(svc)
    with pytest.raises(ValidationError) as err:
        parse_service(svc)
    assert err.value.path == path
    assert str(err.value).startswith(f"Service shop/web: {path}: ")
    assert problem in str(err.value)


def test_service_without_metadata_name():
    with pytest.raises(ValidationError, match="metadata.name"):
        parse_service({"kind": "Service", "metadata": {}, "spec": {}})


def test_service_parses_all_fields():
    svc = parse_service(service(
        "ns", "lb", "10.96.0.20", [port("http", 80, "TCP", node_port=30080), port("dns", 53, "UDP", 30053)],
        type="LoadBalancer", externalIPs=["203.0.113.5", "fd00::5"], externalTrafficPolicy="Local",
        healthCheckNodePort=31000, loadBalancerSourceRanges=["198.51.100.0/24"],
        sessionAffinity="ClientIP",
        status={"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}, {"ip": "198.51.100.8", "ipMode": "Proxy"},
                                             {"hostname": "lb.example"}]}}))
    http = svc.ports[0]
    assert (http.node_port, http.protocol, str(http.name)) == (30080, "TCP", "ns/lb:http")
    assert http.external_ips == ("203.0.113.5",)  # other family dropped
    assert http.load_balancer_ips == ("198.51.100.7",)  # ipMode Proxy and hostnames are not captured
    assert http.health_check_node_port == 31000 and http.uses_external_local
    assert http.session_affinity_seconds == 10800


def test_cluster_ip_service_ignores_node_port_and_health_check():
    svc = parse_service(service("ns", "c", "10.96.0.21", [port(node_port=30001)], externalTrafficPolicy="Local",
                                healthCheckNodePort=31000))
    assert svc.ports[0].node_port == 0 and svc.ports[0].health_check_node_port == 0
    assert not svc.ports[0].uses_external_local


@pytest.mark.parametrize("mutate,path", [
    (lambda e: e.update(addressType="IPX"), "addressType"),
    (lambda e: e["endpoints"][0].update(addresses=["10.0.0.x"]), "endpoints[0].addresses[0]"),
    (lambda e: e["endpoints"][0].update(addresses=["fd00::1"]), "endpoints[0].addresses[0]"),
    (lambda e: e["endpoints"][0].update(conditions={"ready": "yes"}), "endpoints[0].conditions.ready"),
    (lambda e: e["ports"][0].update(port=0), "ports[0].port"),
    (lambda e: e.update(endpoints={"a": 1}), "endpoints"),
])
def test_endpoint_slice_errors(mutate, path):
    eps = endpoint_slice("shop", "web", [endpoint("10.244.0.1")], [slice_port()])
    mutate(eps)
    with pytest.raises(ValidationError) as err:
        parse_endpoint_slice(eps)
    assert err.value.path == path and "EndpointSlice shop/web-1" in str(err.value)


def test_endpoint_conditions_follow_upstream_defaults():
    eps = [endpoint("10.244.0.1"), endpoint("10.244.0.2", ready=False),
           endpoint("10.244.0.3", ready=False, serving=True, terminating=True)]
    sl = parse_endpoint_slice(endpoint_slice("ns", "s", eps, [slice_port()]))
    (a, b, c) = sl.endpoints
    assert (a.ready, a.serving, a.terminating) == (True, True, False)
    assert (b.ready, b.serving, b.terminating) == (False, False, False)
    assert (c.ready, c.serving, c.terminating) == (False, True, True)


def test_slices_without_service_label_or_fqdn_are_skipped():
    eps = endpoint_slice("ns", "s", [], [slice_port()])
    eps["metadata"]["labels"] = {}
    with pytest.raises(Skipped):
        parse_endpoint_slice(eps)
    eps = endpoint_slice("ns", "s", [], [slice_port()], address_type="FQDN")
    with pytest.raises(Skipped):
        parse_endpoint_slice(eps)


def test_node_pod_cidrs():
    node = parse_node({"kind": "Node", "metadata": {"name": "n1", "labels": {"a": "b"}},
                       "spec": {"podCIDRs": ["10.244.1.0/24"]}})
    assert node.pod_cidrs == ("10.244.1.0/24",) and node.labels == (("a", "b"),)
    with pytest.raises(ValidationError, match="Node n1: spec.podCIDRs\\[0\\]"):
        parse_node({"kind": "Node", "metadata": {"name": "n1"}, "spec": {"podCIDRs": ["bad"]}})
