"""Property tests: the parsers take any JSON-like value without crashing. Only ValidationError
(naming a field, bounded, one line) or Skipped come out; whatever parses is well-formed."""
import copy
import ipaddress

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import validation as v
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Skipped,
    ValidationError,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.manifests import load_objects

from .helpers import endpoint, endpoint_slice, port, service, slice_port

MAX_MESSAGE = 340  # "~300": the budget plus a short kind

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
    st.text(max_size=80), st.sampled_from(["", "None", "TCP", "10.0.0.1", "::ffff:1.2.3.4", "x\ny", "IPv6",
                                           "a" * 300, "010.0.0.1", "fd00::1", "LoadBalancer", "Local"]),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=20)

BASE_SERVICE = service("shop", "web", "10.96.0.10", [port("http", 80, node_port=30080), port("dns", 53, "UDP")],
                       type="LoadBalancer", clusterIPs=["10.96.0.10", "fd00::10"], ipFamilies=["IPv4", "IPv6"],
                       externalIPs=["203.0.113.1"], loadBalancerSourceRanges=["10.0.0.0/8"],
                       sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
                       status={"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "VIP"}]}})
BASE_SLICE = endpoint_slice("shop", "web", [endpoint("10.244.0.1", node="n1", ready=True)],
                            [slice_port("http", 8080)])
BASE_NODE = {"kind": "Node", "metadata": {"name": "n1", "labels": {"zone": "a"}},
             "spec": {"podCIDRs": ["10.244.0.0/24"]}}


def paths(obj, prefix=()):
    """Every (path) into a nested dict/list, for mutation."""
    yield prefix
    if isinstance(obj, dict):
        for k, val in obj.items():
            yield from paths(val, prefix + (k,))
    elif isinstance(obj, list):
        for i, val in enumerate(obj):
            yield from paths(val, prefix + (i,))


def mutated(base):
    """``base`` with one node (any depth) replaced by an arbitrary JSON-like value."""
    all_paths = [p for p in paths(base) if p]

    @st.composite
    def strategy(draw):
        obj = copy.deepcopy(base)
        path = draw(st.sampled_from(all_paths))
        target = obj
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = draw(json_values)
        return obj
    return strategy()


def check(parse, obj):
    try:
        result = parse(obj)
    except ValidationError as e:
        msg = str(e)
        assert e.path and f": {e.path}: " in msg, msg
        assert "\n" not in msg and "\r" not in msg, msg
        assert len(msg) <= MAX_MESSAGE, (len(msg), msg)
        return None
    except Skipped:
        return None
    return result


def well_formed_service(svc):
    for sp in svc.ports:
        assert ipaddress.ip_address(sp.cluster_ip).version == 4
        assert 1 <= sp.port <= 65535 and sp.protocol in ("TCP", "UDP", "SCTP")
        assert v.dns1035_label(svc.name) == "" and v.dns1123_label(svc.namespace) == ""
        assert sp.name.port == "" or v.dns1123_label(sp.name.port) == ""
        for ip in sp.external_ips + sp.load_balancer_ips:
            assert ipaddress.ip_address(ip).version == 4


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.one_of(json_values, mutated(BASE_SERVICE)))
def test_parse_service_never_crashes(obj):
    svc = check(parse_service, obj)
    if svc is not None:
        well_formed_service(svc)


@SETTINGS
@given(st.one_of(json_values, mutated(BASE_SLICE)))
def test_parse_endpoint_slice_never_crashes(obj):
    sl = check(parse_endpoint_slice, obj)
    if sl is not None:
        for ep in sl.endpoints:
            ip = v.parse_ip(ep.addresses[0])
            assert ip.version == 4 and v.endpoint_ip_problem(ip) == ""
        for p in sl.ports:
            assert 1 <= p.port <= 65535


@SETTINGS
@given(st.one_of(json_values, mutated(BASE_NODE)))
def test_parse_node_never_crashes(obj):
    node = check(parse_node, obj)
    if node is not None:
        assert all(ipaddress.ip_network(c) for c in node.pod_cidrs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(json_values, mutated(BASE_SERVICE), mutated(BASE_SLICE), mutated(BASE_NODE)), max_size=6))
def test_load_objects_names_every_rejection(objects):
    loaded = load_objects([(f"f.yaml#{i}", o) for i, o in enumerate(objects)])
    assert len(loaded.services) + len(loaded.slices) + len(loaded.nodes) + len(loaded.errors) \
        + len(loaded.skipped) == len(objects)
    for err in loaded.errors:
        assert err.startswith("f.yaml#") and "\n" not in err and len(err) <= MAX_MESSAGE + 20, err
    for svc in loaded.services:
        well_formed_service(svc)
