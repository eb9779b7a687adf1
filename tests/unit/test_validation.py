"""validation.py: the API server's rules, table by table (accepted and refused values), and
what parse_* make of them (field path in every message, other IP family ignored)."""
import copy

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import validation as v
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Skipped,
    ValidationError,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)

from .helpers import endpoint, endpoint_slice, port, service, slice_port


def ok(rule, value):
    return rule(value) == ""


@pytest.mark.parametrize("rule,good,bad", [
    (v.dns1035_label, ["web", "a", "web-1", "a" * 63],
     ["Web_Service", "web_service", "Web", "1web", "-web", "web-", "", "a" * 64, "web\n", "wéb", "web.x"]),
    (v.dns1123_label, ["default", "1ns", "a-b", "a" * 63],
     ["Default", "ns_1", "-ns", "ns-", "", "a" * 64, "ns\n", "a.b", "Http_Port"]),
    (v.dns1123_subdomain, ["web-7f9c2", "a.b.c", "node1.example.com", "1-2", "a" * 253],
     ["Web", "a..b", ".a", "a.", "a_b", "", "a" * 254, "node1\n", "a/b"]),
    (v.iana_svc_name, ["http", "http-alt", "h2", "a" * 15],
     ["", "a" * 16, "HTTP", "8080", "-http", "http-", "ht--tp", "http_x"]),
    (v.label_key, ["app", "kubernetes.io/service-name", "a.b/c_d.e-f", "A"],
     ["", "/x", "a/", "a/b/c", "Bad_/x", "-x", "x-", "a" * 64, "x\ny"]),
    (v.label_value, ["", "web", "A_b.c-d", "a" * 63],
     ["-web", "web-", "a" * 64, "a b", "a\n", "a/b"]),
    (v.netns_name, ["node1", "kn1a2b3c-node", "a.b"], ["", ".", "..", "a/b", "../x", "a b", "a" * 256]),
    (v.ipvs_scheduler, ["rr", "wlc", "lblcr", "twos"], ["", "RR", "../x", "ip_vs", "a" * 16, "1rr"]),
])
def test_name_rules(rule, good, bad):
    assert [g for g in good if not ok(rule, g)] == []
    assert [b for b in bad if ok(rule, b)] == []


@pytest.mark.parametrize("value,version", [
    ("10.0.0.1", 4), ("0.0.0.0", 4), ("255.255.255.255", 4), ("2001:db8::1", 6), ("FD00::1", 6),
    ("fd00:0:0::0001", 6), ("64:ff9b::10.0.0.1", 6),
])
def test_ip_accepted(value, version):
    assert v.parse_ip(value).version == version


@pytest.mark.parametrize("value,problem", [
    ("010.0.0.1", "leading 0s"), ("10.0.0.01", "leading 0s"), ("10.00.0.1", "leading 0s"),
    ("::ffff:10.0.0.1", "IPv4-mapped"), ("::ffff:a00:1", "IPv4-mapped"),
    ("fe80::1%eth0", "valid IP"), ("10.0.0.256", "valid IP"), ("10.0.0", "valid IP"), (" 10.0.0.1", "valid IP"),
    ("10.0.0.1\n", "valid IP"), ("1.2.3.4.5", "valid IP"), ("", "valid IP"), ("x" * 300, "valid IP"),
    ("\u0661.2.3.4", "valid IP"), ("64:ff9b::010.0.0.1", "leading 0s"), (10, "not integer"), (None, "not null"),
])
def test_ip_refused(value, problem):
    with pytest.raises(ValueError, match=problem):
        v.parse_ip(value)


@pytest.mark.parametrize("value,problem", [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("169.254.169.254", "link-local range"), ("169.254.0.1", "link-local range"), ("fe80::1", "link-local range"),
    ("224.0.0.1", "link-local multicast"), ("ff02::1", "link-local multicast"), ("ff12::2", "link-local multicast"),
])
def test_endpoint_ip_refused(value, problem):
    assert problem in v.endpoint_ip_problem(v.parse_ip(value))


@pytest.mark.parametrize("value", ["10.244.1.1", "192.168.0.1", "2001:db8::5", "239.1.1.1", "ff05::1"])
def test_endpoint_ip_accepted(value):
    # Global multicast passes, as upstream's ValidateEndpointIP lets it.
    assert v.endpoint_ip_problem(v.parse_ip(value)) == ""


@pytest.mark.parametrize("value,expected", [
    ("10.0.0.0/8", "10.0.0.0/8"), ("10.1.2.3/8", "10.0.0.0/8"), ("0.0.0.0/0", "0.0.0.0/0"),
    ("2001:db8::/64", "2001:db8::/64"), ("192.168.1.1/32", "192.168.1.1/32"),
])
def test_cidr_accepted(value, expected):
    assert str(v.parse_cidr(value)) == expected


@pytest.mark.parametrize("value", ["10.0.0.0/33", "10.0.0.0", "010.0.0.0/8", "10.0.0.0/08", "::ffff:10.0.0.0/104",
                                   "10.0.0.0/8\n", "10.0.0.0/-1", "10.0.0.0/ 8", "/8", "2001:db8::/129", 8])
def test_cidr_refused(value):
    with pytest.raises(ValueError):
        v.parse_cidr(value)


def test_messages_escape_and_clip_hostile_names_and_values():
    name = "x\n-A INPUT -j ACCEPT\n" + "y" * 500
    svc = service("default", name, "10.96.0.10", [port()])
    with pytest.raises(ValidationError) as err:
        parse_service(svc)
    msg = str(err.value)
    assert "\n" not in msg and len(msg) <= v.MESSAGE_BUDGET
    assert msg.startswith("Service default/x\\n-A INPUT") and ": metadata.name: " in msg
    assert len(v.shown("z" * 5000)) <= v.VALUE_LIMIT
    assert len(v.shown([[["a" * 1000] * 1000] * 10])) <= v.VALUE_LIMIT


# --- Service ------------------------------------------------------------------------------

SVC_CASES = [
    (lambda s: s["metadata"].update(name="Web_Service"), "metadata.name", "RFC 1035 label"),
    (lambda s: s["metadata"].update(name="w" * 64), "metadata.name", "no more than 63"),
    (lambda s: s["metadata"].update(name=7), "metadata.name", "must be a string, not integer"),
    (lambda s: s["metadata"].update(namespace="Shop"), "metadata.namespace", "RFC 1123 label"),
    (lambda s: s["metadata"].update(labels=["a"]), "metadata.labels", "must be an object, not list"),
    (lambda s: s["metadata"].update(labels={"bad key!": "x"}), "metadata.labels[bad key!]", "invalid key"),
    (lambda s: s["metadata"].update(labels={"app": "x\ny"}), "metadata.labels[app]", "must be empty or"),
    (lambda s: s.update(metadata="web"), "metadata", "must be an object, not string"),
    (lambda s: s.update(spec=["x"]), "spec", "must be an object, not list"),
    (lambda s: s["spec"]["ports"][0].update(name="Http_Port"), "spec.ports[0].name", "RFC 1123 label"),
    (lambda s: s["spec"]["ports"][0].update(name="http\n"), "spec.ports[0].name", "RFC 1123 label"),
    (lambda s: s["spec"]["ports"][0].update(port=0), "spec.ports[0].port", "between 1 and 65535"),
    (lambda s: s["spec"]["ports"][0].update(port=True), "spec.ports[0].port", "not boolean"),
    (lambda s: s["spec"]["ports"][0].update(targetPort="Http_Port"), "spec.ports[0].targetPort", "lowercase"),
    (lambda s: s["spec"]["ports"][0].update(targetPort=70000), "spec.ports[0].targetPort", "between 1 and 65535"),
    (lambda s: s["spec"]["ports"][0].update(nodePort=-1), "spec.ports[0].nodePort", "between 0 and 65535"),
    (lambda s: s["spec"].update(ports={"name": "http"}), "spec.ports", "must be a list, not object"),
    (lambda s: s["spec"].update(ports="http"), "spec.ports", "must be a list, not string"),
    (lambda s: s["spec"].update(ports=[]), "spec.ports", "required"),
    (lambda s: s["spec"].update(ports=[port("", 80), port("", 81)]), "spec.ports[0].name", "required when"),
    (lambda s: s["spec"].update(ports=[port("a", 80), port("b", 80)]), "spec.ports[1]", "duplicate port 80/TCP"),
    (lambda s: s["spec"].update(clusterIP="010.96.0.10"), "spec.clusterIP", "leading 0s"),
    (lambda s: s["spec"].update(clusterIP="::ffff:10.96.0.10"), "spec.clusterIP", "IPv4-mapped"),
    (lambda s: s["spec"].update(clusterIPs=["10.96.0.11"]), "spec.clusterIPs[0]", "must match spec.clusterIP"),
    (lambda s: s["spec"].update(clusterIPs=["10.96.0.10", "10.96.0.11"]), "spec.clusterIPs", "one address of each"),
    (lambda s: s["spec"].update(clusterIPs="10.96.0.10"), "spec.clusterIPs", "must be a list"),
    (lambda s: s["spec"].update(ipFamilies=["IPv6"]), "spec.ipFamilies[0]", "must match the family"),
    (lambda s: s["spec"].update(ipFamilies=["IPv5"]), "spec.ipFamilies[0]", "supported: IPv4, IPv6"),
    (lambda s: s["spec"].update(ipFamilyPolicy="DualStack"), "spec.ipFamilyPolicy", "supported: SingleStack"),
    (lambda s: s["spec"].update(externalIPs=["127.0.0.1"]), "spec.externalIPs[0]", "loopback"),
    (lambda s: s["spec"].update(externalIPs="203.0.113.1"), "spec.externalIPs", "must be a list, not string"),
    (lambda s: s["spec"].update(internalTrafficPolicy="Nearby"), "spec.internalTrafficPolicy", "Cluster, Local"),
    (lambda s: s["spec"].update(sessionAffinity=["ClientIP"]), "spec.sessionAffinity", "supported: None"),
    (lambda s: s["spec"].update(sessionAffinityConfig="x"), "spec.sessionAffinityConfig", "must be an object"),
    (lambda s: s["spec"].update(loadBalancerSourceRanges=["10.0.0.0/8\n-A X"]), "spec.loadBalancerSourceRanges[0]",
     "valid CIDR"),
    (lambda s: s.update(status={"loadBalancer": {"ingress": [{"ip": "x", "ipMode": "VIP"}]}}),
     "status.loadBalancer.ingress[0].ip", "valid IP"),
    (lambda s: s.update(status={"loadBalancer": {"ingress": [{"ipMode": "VIP"}]}}),
     "status.loadBalancer.ingress[0].ipMode", "only be set when ip"),
    (lambda s: s.update(status={"loadBalancer": {"ingress": "1.2.3.4"}}), "status.loadBalancer.ingress",
     "must be a list"),
    (lambda s: s.update(status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4", "ipMode": "Tunnel"}]}}),
     "status.loadBalancer.ingress[0].ipMode", "supported: VIP, Proxy"),
]


@pytest.mark.parametrize("mutate,path,problem", SVC_CASES)
def test_service_refused_with_field(mutate, path, problem):
    svc = service("shop", "web", "10.96.0.10", [port()])
    mutate(svc)
    with pytest.raises(ValidationError) as err:
        parse_service(svc)
    assert err.value.path == path, str(err.value)
    assert str(err.value).startswith("Service ") and f": {path}: " in str(err.value)
    assert problem in str(err.value)
    assert len(str(err.value)) <= v.MESSAGE_BUDGET


def test_service_accepted_forms():
    svc = service("shop", "web", "10.96.0.10", [port("http", 80), port("metrics", 9090)],
                  ipFamilies=["IPv4"], ipFamilyPolicy="SingleStack", clusterIPs=["10.96.0.10"],
                  loadBalancerSourceRanges=[" 10.0.0.0/8 "], type="LoadBalancer")
    svc["spec"]["ports"][0]["targetPort"] = "http"
    svc["spec"]["ports"][1]["targetPort"] = 9090
    svc["metadata"]["labels"] = {"app.kubernetes.io/name": "web", "tier": ""}
    parsed = parse_service(svc)
    assert parsed.ports[0].load_balancer_source_ranges == ("10.0.0.0/8",)
    assert parse_service(service("shop", "one", "10.96.0.11", [port("", 80)])).ports[0].name.port == ""


def dual(ips, families=None, **spec):
    svc = service("shop", "dual", ips[0], [port("http", 80)], clusterIPs=list(ips), **spec)
    if families:
        svc["spec"]["ipFamilies"] = families
    return svc


@pytest.mark.parametrize("ips", [["10.96.0.12", "fd00::12"], ["fd00::12", "10.96.0.12"]])
def test_dual_stack_service_keeps_its_ipv4_half_in_either_order(ips):
    fams = ["IPv4" if "." in ip else "IPv6" for ip in ips]
    svc = dual(ips, fams, ipFamilyPolicy="PreferDualStack", type="LoadBalancer",
               externalIPs=["fd00::99", "203.0.113.12"], loadBalancerSourceRanges=["fd00::/8", "192.0.2.0/24"],
               status={"loadBalancer": {"ingress": [{"ip": "fd00::77"}, {"ip": "198.51.100.12"}]}})
    sp = parse_service(svc).ports[0]
    assert sp.cluster_ip == "10.96.0.12"
    assert sp.external_ips == ("203.0.113.12",)
    assert sp.load_balancer_ips == ("198.51.100.12",)
    assert sp.load_balancer_source_ranges == ("192.0.2.0/24",)
    # An IPv6 node (the dual-stack issue) gets the other half from the same object.
    assert parse_service(svc, family=6).ports[0].cluster_ip == "fd00::12"


def test_ipv6_only_service_is_skipped_not_rejected():
    with pytest.raises(Skipped, match="IPv6 only; this node serves IPv4"):
        parse_service(service("shop", "v6", "fd00::10", [port()], ipFamilies=["IPv6"]))


def test_other_family_service_is_still_validated():
    with pytest.raises(ValidationError, match="spec.ports.0..name"):
        parse_service(service("shop", "v6", "fd00::10", [port("Http_Port")]))


@pytest.mark.parametrize("mutate,reason", [
    (lambda s: s["spec"].update(type="ExternalName", externalName="x.example"), "ExternalName"),
    (lambda s: s["spec"].update(clusterIP="None"), "headless"),
    (lambda s: s["metadata"].update(labels={"service.kubernetes.io/headless": ""}), "headless"),
    (lambda s: s["metadata"].update(labels={"service.kubernetes.io/service-proxy-name": "other"}), "not ours"),
])
def test_skipped_by_design(mutate, reason):
    svc = service("shop", "web", "10.96.0.10", [port()])
    mutate(svc)
    with pytest.raises(Skipped, match=reason):
        parse_service(svc)


# --- EndpointSlice --------------------------------------------------------------------------

SLICE_CASES = [
    (lambda e: e["endpoints"][0].update(addresses=["127.0.0.1"]), "endpoints[0].addresses[0]", "loopback"),
    (lambda e: e["endpoints"][0].update(addresses=["0.0.0.0"]), "endpoints[0].addresses[0]", "unspecified"),
    (lambda e: e["endpoints"][0].update(addresses=["169.254.169.254"]), "endpoints[0].addresses[0]", "link-local"),
    (lambda e: e["endpoints"][0].update(addresses=["224.0.0.5"]), "endpoints[0].addresses[0]", "multicast"),
    (lambda e: e["endpoints"][0].update(addresses=["010.244.0.1"]), "endpoints[0].addresses[0]", "leading 0s"),
    (lambda e: e["endpoints"][0].update(addresses=["::ffff:10.0.0.1"]), "endpoints[0].addresses[0]", "IPv4-mapped"),
    (lambda e: e["endpoints"][0].update(addresses=[]), "endpoints[0].addresses", "at least 1"),
    (lambda e: e["endpoints"][0].update(addresses="10.244.0.1"), "endpoints[0].addresses", "must be a list"),
    (lambda e: e["endpoints"][0].update(addresses=["10.244.0.1"] * 101), "endpoints[0].addresses", "at most 100"),
    (lambda e: e["endpoints"][0].update(nodeName="Node_1"), "endpoints[0].nodeName", "RFC 1123 subdomain"),
    (lambda e: e["endpoints"][0].update(nodeName=["n"]), "endpoints[0].nodeName", "must be a string"),
    (lambda e: e["endpoints"][0].update(hostname="a.b"), "endpoints[0].hostname", "RFC 1123 label"),
    (lambda e: e["endpoints"][0].update(conditions=[True]), "endpoints[0].conditions", "must be an object"),
    (lambda e: e.update(endpoints=[[]]), "endpoints[0]", "must be an object, not list"),
    (lambda e: e.update(endpoints=[{"addresses": ["10.0.0.1"]}] * 1001), "endpoints", "at most 1000"),
    (lambda e: e["ports"][0].update(name="Http_Port"), "ports[0].name", "RFC 1123 label"),
    (lambda e: e["ports"][0].update(name=5), "ports[0].name", "must be a string"),
    (lambda e: e.update(ports=[slice_port("a"), slice_port("a", 81)]), "ports[1].name", "duplicate"),
    (lambda e: e["ports"][0].update(port=70000), "ports[0].port", "between 1 and 65535"),
    (lambda e: e["ports"][0].update(protocol="tcp"), "ports[0].protocol", "supported: TCP"),
    (lambda e: e.update(addressType=None), "addressType", "required"),
    (lambda e: e["metadata"].update(name="Web.Slice"), "metadata.name", "RFC 1123 subdomain"),
    (lambda e: e["metadata"].update(labels={"kubernetes.io/service-name": "x" * 64}),
     "metadata.labels[kubernetes.io/service-name]", "no more than 63"),
]


@pytest.mark.parametrize("mutate,path,problem", SLICE_CASES)
def test_endpoint_slice_refused_with_field(mutate, path, problem):
    eps = endpoint_slice("shop", "web", [endpoint("10.244.0.1")], [slice_port()])
    mutate(eps)
    with pytest.raises(ValidationError) as err:
        parse_endpoint_slice(eps)
    assert err.value.path == path, str(err.value)
    assert str(err.value).startswith("EndpointSlice shop/") and problem in str(err.value)


def test_ipv6_slice_on_ipv4_node_is_skipped():
    eps = endpoint_slice("shop", "web", [endpoint("fd00::1")], [slice_port()], address_type="IPv6")
    with pytest.raises(Skipped, match="IPv6; this node serves IPv4"):
        parse_endpoint_slice(eps)
    assert parse_endpoint_slice(eps, family=6).endpoints[0].addresses == ("fd00::1",)


def test_ipv6_slice_with_a_link_local_address_is_rejected_not_skipped():
    eps = endpoint_slice("shop", "web", [endpoint("fe80::1")], [slice_port()], address_type="IPv6")
    with pytest.raises(ValidationError, match="link-local"):
        parse_endpoint_slice(eps)


# --- Node ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,path", [
    ({"podCIDRs": ["10.244.0.0/33"]}, "spec.podCIDRs[0]"),
    ({"podCIDRs": "10.244.0.0/24"}, "spec.podCIDRs"),
    ({"podCIDRs": ["10.244.0.0/24", "10.245.0.0/24"]}, "spec.podCIDRs"),
    ({"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.245.0.0/24"]}, "spec.podCIDR"),
    ({"podCIDR": 5}, "spec.podCIDR"),
])
def test_node_refused_with_field(spec, path):
    with pytest.raises(ValidationError) as err:
        parse_node({"kind": "Node", "metadata": {"name": "node1"}, "spec": spec})
    assert err.value.path == path


def test_node_accepted():
    node = parse_node({"kind": "Node", "metadata": {"name": "node1.example", "labels": {"zone": "a"}},
                       "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]}})
    assert node.pod_cidrs == ("10.244.1.0/24", "fd00:1::/64") and node.labels == (("zone", "a"),)
    with pytest.raises(ValidationError, match="metadata.name"):
        parse_node({"kind": "Node", "metadata": {"name": "Node_1"}})


def test_validation_does_not_modify_the_object():
    svc = service("shop", "web", "10.96.0.10", [port()], loadBalancerSourceRanges=[" 10.0.0.0/8 "],
                  type="LoadBalancer")
    before = copy.deepcopy(svc)
    parse_service(svc)
    assert svc == before
