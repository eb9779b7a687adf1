# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the modules that program one Service (k8s_service_iptables, k8s_service_nftables)
share: the options (documented in plugins/doc_fragments/k8s_service.py), their checks, the
Service and EndpointSlice objects they describe, and the translation of the node-side
options into the daemon's configuration (config.ProxyConfig: each mode's own translation
starts from it, as the daemon's does)."""

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.addresses import local_addresses
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Service,
    Skipped,
    ValidationError,
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.validation import (
    Fields,
    dns1035_label,
    dns1123_label,
    dns1123_subdomain,
)

# The options that describe the Service itself. With service= the object is used as given, so
# each of these fails next to it (by name) rather than being silently ignored. Defaults do not
# count: AnsibleModule checks mutually_exclusive on the options the task gave.
FLAT_OPTIONS = ("namespace", "cluster_ip", "type", "ports", "endpoints", "external_ips", "load_balancer_ips",
                "load_balancer_source_ranges", "external_traffic_policy", "internal_traffic_policy",
                "health_check_node_port", "session_affinity", "session_affinity_timeout")


def argument_spec(**extra):
    """The shared options plus the module's own (``extra``)."""
    spec = dict(
        state=dict(type="str", default="present", choices=["present", "absent"]),
        service=dict(type="dict"),
        endpoint_slices=dict(type="list", elements="dict", default=[]),
        name=dict(type="str"),
        namespace=dict(type="str", default="default"),
        cluster_ip=dict(type="str"),
        type=dict(type="str", default="ClusterIP", choices=["ClusterIP", "NodePort", "LoadBalancer"]),
        ports=dict(type="list", elements="dict", default=[], options=dict(
            name=dict(type="str", default=""),
            port=dict(type="int", required=True),
            protocol=dict(type="str", default="TCP", choices=["TCP", "UDP", "SCTP"]),
            target_port=dict(type="int"),
            node_port=dict(type="int"),
        )),
        endpoints=dict(type="list", elements="dict", default=[], options=dict(
            address=dict(type="str", required=True),
            node_name=dict(type="str"),
            ready=dict(type="bool", default=True),
            serving=dict(type="bool"),
            terminating=dict(type="bool", default=False),
        )),
        external_ips=dict(type="list", elements="str", default=[]),
        load_balancer_ips=dict(type="list", elements="str", default=[]),
        load_balancer_source_ranges=dict(type="list", elements="str", default=[]),
        external_traffic_policy=dict(type="str", default="Cluster", choices=["Cluster", "Local"]),
        internal_traffic_policy=dict(type="str", default="Cluster", choices=["Cluster", "Local"]),
        health_check_node_port=dict(type="int"),
        session_affinity=dict(type="str", default="None", choices=["None", "ClientIP"]),
        session_affinity_timeout=dict(type="int", default=10800),
        node_name=dict(type="str"),
        cluster_cidr=dict(type="str"),
        masquerade_all=dict(type="bool", default=False),
        masquerade_bit=dict(type="int", default=14),
        node_port_addresses=dict(type="list", elements="str", default=[]),
    )
    spec.update(extra)
    return spec


def module_kwargs(**extra):
    """AnsibleModule's keyword arguments for a one-Service module."""
    return dict(
        argument_spec=argument_spec(**extra),
        mutually_exclusive=[("service", "name")] + [("service", o) for o in FLAT_OPTIONS],
        required_one_of=[("service", "name")],
        supports_check_mode=True,
    )


def flat_objects(p):
    """Service and EndpointSlice dicts from the flat options."""
    ports = []
    slice_ports = []
    for sp in p["ports"]:
        port = {"name": sp["name"] or "", "port": sp["port"], "protocol": sp["protocol"]}
        if sp.get("node_port"):
            port["nodePort"] = sp["node_port"]
        ports.append(port)
        slice_ports.append({"name": sp["name"] or "", "port": sp.get("target_port") or sp["port"],
                            "protocol": sp["protocol"]})
    spec = {
        "type": p["type"], "clusterIP": p["cluster_ip"], "ports": ports,
        "externalIPs": p["external_ips"], "loadBalancerSourceRanges": p["load_balancer_source_ranges"],
        "externalTrafficPolicy": p["external_traffic_policy"],
        "internalTrafficPolicy": p["internal_traffic_policy"],
        "sessionAffinity": p["session_affinity"],
    }
    if p["session_affinity"] == "ClientIP":
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": p["session_affinity_timeout"]}}
    if p.get("health_check_node_port"):
        spec["healthCheckNodePort"] = p["health_check_node_port"]
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": p["name"], "namespace": p["namespace"]},
        "spec": spec,
        "status": {"loadBalancer": {"ingress": [{"ip": ip} for ip in p["load_balancer_ips"]]}},
    }
    endpoints = []
    for ep in p["endpoints"]:
        cond = {"ready": ep["ready"], "terminating": ep["terminating"]}
        if ep.get("serving") is not None:
            cond["serving"] = ep["serving"]
        item = {"addresses": [ep["address"]], "conditions": cond}
        if ep.get("node_name"):
            item["nodeName"] = ep["node_name"]
        endpoints.append(item)
    family = "IPv6" if ":" in (p["cluster_ip"] or "") else "IPv4"
    eps = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "%s-flat" % p["name"], "namespace": p["namespace"],
                     "labels": {"kubernetes.io/service-name": p["name"]}},
        "addressType": family, "ports": slice_ports, "endpoints": endpoints,
    }
    return service, [eps]


class ServiceModule:
    """The shared half of a one-Service module: options -> checked Service, its endpoints
    (a ProxyState holding only it) and the daemon's ProxyConfig. ``name`` prefixes the
    messages about options."""

    name = "k8s_service"

    def __init__(self, module):
        self.module = module
        self.params = module.params

    def check_options(self):
        """The options that do not go through parse_service(), by the same rules (the
        flat form's objects, and the service and slices given as objects, do)."""
        p = self.params
        f = Fields(self.name)
        try:
            if p["name"] is not None:
                f.named(p["name"], "name", dns1035_label)
                f.named(p["namespace"], "namespace", dns1123_label)
            if p["node_name"]:
                f.named(p["node_name"], "node_name", dns1123_subdomain)
            if p["cluster_cidr"]:
                f.cidr(p["cluster_cidr"], "cluster_cidr")
            f.integer(p["masquerade_bit"], "masquerade_bit", 0, 31)
            for i, sp in enumerate(p["ports"] or []):
                if sp.get("target_port") is not None:
                    f.integer(sp["target_port"], "ports[%d].target_port" % i, 1, 65535)
        except ValidationError as e:
            self.module.fail_json(msg=str(e), field=e.path)

    def objects(self):
        p = self.params
        self.check_options()
        if p["service"] is not None:
            return p["service"], p["endpoint_slices"]
        if not p["name"]:
            self.module.fail_json(msg="one of service or name is required")
        if p["state"] == "present" and not p["cluster_ip"]:
            self.module.fail_json(msg="cluster_ip is required with state=present (flat form)")
        if p["state"] == "absent" and not p["cluster_ip"]:
            return None, []
        return flat_objects(p)

    def service(self):
        """(model.Service, parsed EndpointSlices); a Service without ports for an absent
        flat-form service given by name only."""
        svc_obj, slices = self.objects()
        if svc_obj is None:
            return Service(self.params["namespace"], self.params["name"], ()), []
        try:
            service = parse_service(svc_obj)
            parsed = [parse_endpoint_slice(s) for s in slices]
        except ValidationError as e:
            self.module.fail_json(msg=str(e), object=e.name, field=e.path)
        except Skipped as e:
            self.module.fail_json(msg="this service is not proxied: %s" % e)
        for sl in parsed:
            if sl.namespace != service.namespace or sl.service != service.name:
                self.module.fail_json(msg="EndpointSlice %s/%s belongs to service %s, not %s/%s" % (
                    sl.namespace, sl.name, sl.service, service.namespace, service.name))
        return service, parsed

    def state(self, service, slices):
        """A ProxyState holding only this service and its slices."""
        state = ProxyState(self.params["node_name"] or "")
        state.set_service(service)
        for sl in slices:
            state.set_slice(sl)
        return state

    def proxy_config(self, **extra):
        """The daemon's ProxyConfig from the node-side options (``extra``: the module's own
        fields of it); each mode translates it as the daemon does."""
        p = self.params
        try:
            npa = kpconfig.node_port_addresses(list(p["node_port_addresses"]), "node_port_addresses")
        except kpconfig.ConfigError as e:
            self.module.fail_json(msg=str(e))
        return kpconfig.ProxyConfig(cluster_cidrs=(p["cluster_cidr"],) if p["cluster_cidr"] else (),
                                    masquerade_bit=p["masquerade_bit"], masquerade_all=p["masquerade_all"],
                                    node_port_addresses=npa, **extra)

    @staticmethod
    def addresses():
        """The node's addresses (NodePort addresses, LB self-access); none without ``ip``."""
        try:
            return local_addresses()
        except RuntimeError:  # no ip command: no LB self-access rules, every address for NodePorts
            return []
