#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: k8s_service_iptables
short_description: Program one Kubernetes Service's kube-proxy iptables rules on a host
version_added: 0.1.0
description:
  - Writes (O(state=present)) or removes (O(state=absent)) the iptables rules that kube-proxy's
    iptables mode would program for one Service, using upstream's chain layout and names
    (C(KUBE-SERVICES), C(KUBE-SVC-*), C(KUBE-SEP-*), ...).
  - Other services' rules and rules owned by other software are left alone. The change is
    applied in one C(iptables-restore --noflush) transaction, all of it or none of it.
  - The Service is given either as API objects (O(service) and O(endpoint_slices), as
    M(kubernetes.core.k8s_info) returns them) or with flat options (O(name), O(cluster_ip), O(ports), ...).
author:
  - kubenode.proxy developers (@kubenode)
extends_documentation_fragment:
  - kubenode.proxy.attributes.platform
attributes:
  check_mode:
    description: Computes the change from the kernel's current rules and reports it without applying it.
    support: full
  diff_mode:
    description: Shows the service's rules (and our jumps and node-wide chains) before and after.
    support: full
options:
  state:
    description: Whether the service's rules are present or absent.
    type: str
    choices: [present, absent]
    default: present
  service:
    description:
      - A v1 Service object, as the API returns it (for example an item of M(kubernetes.core.k8s_info)'s
        C(resources)).
      - The object is used as given. The options that describe a Service (O(name), O(namespace),
        O(cluster_ip), O(type), O(ports), O(endpoints), O(external_ips), O(load_balancer_ips),
        O(load_balancer_source_ranges), O(external_traffic_policy), O(internal_traffic_policy),
        O(health_check_node_port), O(session_affinity), O(session_affinity_timeout)) cannot be given
        with it; the module fails with a message that names both options.
        To change a field, change the object, for example with P(ansible.builtin.combine#filter)
        (see EXAMPLES).
      - The node-side options (O(node_name), O(cluster_cidr), O(masquerade_all), O(masquerade_bit),
        O(localhost_nodeports), O(iptables_binary), O(state)) apply to both forms.
    type: dict
  endpoint_slices:
    description:
      - discovery.k8s.io/v1 EndpointSlice objects of the service (used with O(service)).
    type: list
    elements: dict
    default: []
  name:
    description: Service name (flat form).
    type: str
  namespace:
    description: Service namespace (flat form).
    type: str
    default: default
  cluster_ip:
    description: The service's cluster IP (flat form; required with O(state=present)).
    type: str
  type:
    description: Service type (flat form).
    type: str
    choices: [ClusterIP, NodePort, LoadBalancer]
    default: ClusterIP
  ports:
    description: Service ports (flat form).
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description: Port name.
        type: str
        default: ""
      port:
        description: Service port.
        type: int
        required: true
      protocol:
        description: Protocol.
        type: str
        choices: [TCP, UDP, SCTP]
        default: TCP
      target_port:
        description: Port on the endpoints (defaults to O(ports[].port)).
        type: int
      node_port:
        description: NodePort (with O(type=NodePort) or O(type=LoadBalancer)).
        type: int
  endpoints:
    description: Backends (flat form); each serves every port at its O(ports[].target_port).
    type: list
    elements: dict
    default: []
    suboptions:
      address:
        description: Endpoint IP address.
        type: str
        required: true
      node_name:
        description: Node the endpoint runs on (decides Local traffic policy).
        type: str
      ready:
        description: Endpoint is ready.
        type: bool
        default: true
      serving:
        description: Endpoint is serving (defaults to O(endpoints[].ready)).
        type: bool
      terminating:
        description: Endpoint is terminating.
        type: bool
        default: false
  external_ips:
    description: externalIPs (flat form).
    type: list
    elements: str
    default: []
  load_balancer_ips:
    description: Load balancer ingress IPs (flat form).
    type: list
    elements: str
    default: []
  load_balancer_source_ranges:
    description: CIDRs allowed to reach the load balancer IPs (flat form).
    type: list
    elements: str
    default: []
  external_traffic_policy:
    description: externalTrafficPolicy (flat form).
    type: str
    choices: [Cluster, Local]
    default: Cluster
  internal_traffic_policy:
    description: internalTrafficPolicy (flat form).
    type: str
    choices: [Cluster, Local]
    default: Cluster
  health_check_node_port:
    description: healthCheckNodePort (flat form; LoadBalancer with Local policy).
    type: int
  session_affinity:
    description: Session affinity (flat form).
    type: str
    choices: [None, ClientIP]
    default: None
  session_affinity_timeout:
    description: ClientIP affinity timeout in seconds (flat form).
    type: int
    default: 10800
  node_name:
    description: This node's name as the cluster knows it (endpoints with this O(endpoints[].node_name) are local).
    type: str
  cluster_cidr:
    description: Pod CIDR; traffic to a cluster IP from outside it is masqueraded.
    type: str
  node_port_addresses:
    description:
      - nodePortAddresses, as the daemon's configuration has it - CIDRs, or V(primary) for the
        node's primary address, whose local addresses accept NodePorts. Empty means every
        local address.
      - The options are translated as the daemon translates its configuration (the same
        function), so a service programmed by this module gets the daemon's rules.
    type: list
    elements: str
    default: []
  masquerade_all:
    description: Masquerade all traffic to cluster IPs.
    type: bool
    default: false
  masquerade_bit:
    description: The fwmark bit that marks packets for masquerading.
    type: int
    default: 14
  localhost_nodeports:
    description:
      - Accept NodePort connections on 127.0.0.1.
      - As kube-proxy does, the module then sets C(net.ipv4.conf.all.route_localnet=1) (when the
        service has an IPv4 NodePort and O(state=present)); the change is reported in RV(sysctls).
    type: bool
    default: true
  iptables_binary:
    description: iptables family to use.
    type: str
    choices: [iptables, iptables-nft, iptables-legacy]
    default: iptables
requirements:
  - iptables (iptables-save and iptables-restore) on the managed host
notes:
  - Run with root privileges. Kernel state is per network namespace.
"""

EXAMPLES = r"""
- name: A ClusterIP service with two backends
  kubenode.proxy.k8s_service_iptables:
    name: web
    namespace: shop
    cluster_ip: 10.96.0.10
    cluster_cidr: 10.244.0.0/16
    ports:
      - {name: http, port: 80, target_port: 8080}
    endpoints:
      - {address: 10.244.1.5, node_name: node1}
      - {address: 10.244.2.7, node_name: node2}

# With kubernetes.core (on the controller): read the Service and its EndpointSlices,
# then program them on the node. playbooks/k8s_info_services.yml does this for every
# Service of a namespace.
- name: Read the Service
  kubernetes.core.k8s_info:
    kind: Service
    namespace: shop
    name: web
  delegate_to: localhost
  run_once: true
  register: svc_info

- name: Read its EndpointSlices (the label the EndpointSlice controller sets)
  kubernetes.core.k8s_info:
    api_version: discovery.k8s.io/v1
    kind: EndpointSlice
    namespace: shop
    label_selectors:
      - kubernetes.io/service-name=web
  delegate_to: localhost
  run_once: true
  register: slices_info

- name: Program a service straight from the cluster's objects
  kubenode.proxy.k8s_service_iptables:
    service: "{{ svc_info.resources | first }}"
    endpoint_slices: "{{ slices_info.resources }}"
    node_name: "{{ inventory_hostname }}"
    cluster_cidr: 10.244.0.0/16

- name: The same service with an extra external IP (change the object; external_ips would fail next to service)
  kubenode.proxy.k8s_service_iptables:
    service: "{{ svc_info.resources | first | combine({'spec': {'externalIPs': ['203.0.113.9']}}, recursive=true) }}"
    endpoint_slices: "{{ slices_info.resources }}"
    node_name: "{{ inventory_hostname }}"

- name: Remove the service's rules
  kubenode.proxy.k8s_service_iptables:
    name: web
    namespace: shop
    state: absent
"""

RETURN = r"""
chains:
  description: The per-service chains (KUBE-SVC-*, KUBE-SEP-*, ...) the service has after the run.
  returned: always
  type: list
  elements: str
  sample: [KUBE-SEP-UIQK3OSOSTRHRPBX, KUBE-SVC-CDGGSHYLG3RE2FKL]
rule_counts:
  description: Rules per C(table/chain) for this service (shared chains count only its rules).
  returned: always
  type: dict
  sample: {"nat/KUBE-SERVICES": 1, "nat/KUBE-SVC-CDGGSHYLG3RE2FKL": 3}
changes:
  description: One line per chain or rule added, changed or removed.
  returned: always
  type: list
  elements: str
  sample:
    - "+ nat chain KUBE-SVC-CDGGSHYLG3RE2FKL (3 rules)"
    - "+ nat KUBE-SERVICES: -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"shop/web:http cluster IP\"
      -m tcp --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL"
restore_input:
  description: The iptables-restore input that was (or in check mode would be) applied.
  returned: always
  type: str
  sample: "*nat\n:KUBE-SVC-CDGGSHYLG3RE2FKL - [0:0]\n-A KUBE-SVC-CDGGSHYLG3RE2FKL ...
    -j KUBE-SEP-UIQK3OSOSTRHRPBX\nCOMMIT\n"
sysctls:
  description: Sysctls that were (or in check mode would be) changed, as C(old -> new).
  returned: always
  type: dict
  sample: {"net.ipv4.conf.all.route_localnet": "0 -> 1"}
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import sysctl
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.addresses import local_addresses
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (
        IptablesKernel,
        KernelError,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
        Service,
        Skipped,
        ValidationError,
        parse_endpoint_slice,
        parse_service,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.options import iptables_config
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (
        localhost_nodeports_on,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.service import plan_service
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.validation import (
        Fields,
        dns1035_label,
        dns1123_label,
        dns1123_subdomain,
    )
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by the module
    IMPORT_ERROR = traceback.format_exc()

# The options that describe the Service itself. With service= the object is used as given, so
# each of these fails next to it (by name) rather than being silently ignored. Defaults do not
# count: AnsibleModule checks mutually_exclusive on the options the task gave.
FLAT_OPTIONS = ("namespace", "cluster_ip", "type", "ports", "endpoints", "external_ips", "load_balancer_ips",
                "load_balancer_source_ranges", "external_traffic_policy", "internal_traffic_policy",
                "health_check_node_port", "session_affinity", "session_affinity_timeout")


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


class ServiceIptables(object):
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.kernel = IptablesKernel(binary=self.params["iptables_binary"])

    def _check_options(self):
        """The options that do not go through parse_service(), by the same rules (the
        flat form's objects, and the service and slices given as objects, do)."""
        p = self.params
        f = Fields("k8s_service_iptables")
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

    def _objects(self):
        p = self.params
        self._check_options()
        if p["service"] is not None:
            return p["service"], p["endpoint_slices"]
        if not p["name"]:
            self.module.fail_json(msg="one of service or name is required")
        if p["state"] == "present" and not p["cluster_ip"]:
            self.module.fail_json(msg="cluster_ip is required with state=present (flat form)")
        if p["state"] == "absent" and not p["cluster_ip"]:
            return None, []
        return flat_objects(p)

    def _service(self):
        svc_obj, slices = self._objects()
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

    def _config(self):
        """The daemon's translation (modes/iptables/options.py) of the same settings."""
        p = self.params
        try:
            npa = kpconfig.node_port_addresses(list(p["node_port_addresses"]), "node_port_addresses")
        except kpconfig.ConfigError as e:
            self.module.fail_json(msg=str(e))
        cfg = kpconfig.ProxyConfig(cluster_cidrs=(p["cluster_cidr"],) if p["cluster_cidr"] else (),
                                   masquerade_bit=p["masquerade_bit"], masquerade_all=p["masquerade_all"],
                                   localhost_nodeports=p["localhost_nodeports"], node_port_addresses=npa)
        try:
            addresses = local_addresses()
        except RuntimeError:  # no ip command: no LB self-access rules, every address for NodePorts
            addresses = []
        return iptables_config(cfg, addresses=addresses)

    def _route_localnet(self, service, config):
        """As kube-proxy: localhost NodePorts need route_localnet=1 (set before the rules)."""
        p = self.params
        if p["state"] != "present" or not localhost_nodeports_on(config):
            return {}
        if not any(sp.node_port and ":" not in sp.cluster_ip for sp in service.ports):
            return {}
        try:
            return sysctl.ensure({sysctl.ROUTE_LOCALNET: 1}, check=self.module.check_mode)
        except sysctl.SysctlError as e:
            self.module.fail_json(msg="cannot enable localhost NodePorts: %s (or set localhost_nodeports=false)" % e)

    def run(self):
        service, slices = self._service()
        state = ProxyState(self.params["node_name"] or "")
        state.set_service(service)
        for sl in slices:
            state.set_slice(sl)
        config = self._config()
        sysctls = self._route_localnet(service, config)
        try:
            snapshot = self.kernel.snapshot()
            sp = plan_service(snapshot, service, state, config, self.params["state"] == "present")
            text = sp.plan.text()
            if text and not self.module.check_mode:
                self.kernel.restore(text)
        except ValidationError as e:  # a field the compiler cannot write into restore input
            self.module.fail_json(msg=str(e), object=e.name, field=e.path)
        except KernelError as e:
            self.module.fail_json(msg=str(e))
        result = dict(
            changed=not sp.plan.empty or bool(sysctls), chains=sp.chains, rule_counts=sp.rule_counts,
            changes=sp.plan.changes, restore_input=text, sysctls=sysctls,
        )
        if self.module._diff:
            result["diff"] = sp.diff()
        self.module.exit_json(**result)


def main():
    module = AnsibleModule(
        argument_spec=dict(
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
            localhost_nodeports=dict(type="bool", default=True),
            node_port_addresses=dict(type="list", elements="str", default=[]),
            iptables_binary=dict(type="str", default="iptables",
                                 choices=["iptables", "iptables-nft", "iptables-legacy"]),
        ),
        mutually_exclusive=[("service", "name")] + [("service", o) for o in FLAT_OPTIONS],
        required_one_of=[("service", "name")],
        supports_check_mode=True,
    )
    if IMPORT_ERROR:
        module.fail_json(msg="cannot import the kubenode.proxy core", exception=IMPORT_ERROR)
    ServiceIptables(module).run()


if __name__ == "__main__":
    main()
