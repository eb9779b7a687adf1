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
  - kubenode.proxy.k8s_service
attributes:
  check_mode:
    description: Computes the change from the kernel's current rules and reports it without applying it.
    support: full
  diff_mode:
    description: Shows the service's rules (and our jumps and node-wide chains) before and after.
    support: full
options:
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
    from ansible_collections.kubenode.proxy.plugins.module_utils.k8s_service import ServiceModule, module_kwargs
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import sysctl
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (
        IptablesKernel,
        KernelError,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import ValidationError
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.options import iptables_config
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (
        localhost_nodeports_on,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.service import plan_service
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by the module
    IMPORT_ERROR = traceback.format_exc()
    ServiceModule = object


class ServiceIptables(ServiceModule):
    name = "k8s_service_iptables"

    def __init__(self, module):
        super().__init__(module)
        self.kernel = IptablesKernel(binary=self.params["iptables_binary"])

    def _config(self):
        """The daemon's translation (modes/iptables/options.py) of the same settings."""
        cfg = self.proxy_config(localhost_nodeports=self.params["localhost_nodeports"])
        return iptables_config(cfg, addresses=self.addresses())

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
        service, slices = self.service()
        state = self.state(service, slices)
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
    module = AnsibleModule(**module_kwargs(
        localhost_nodeports=dict(type="bool", default=True),
        iptables_binary=dict(type="str", default="iptables",
                             choices=["iptables", "iptables-nft", "iptables-legacy"]),
    ))
    if IMPORT_ERROR:
        module.fail_json(msg="cannot import the kubenode.proxy core", exception=IMPORT_ERROR)
    ServiceIptables(module).run()


if __name__ == "__main__":
    main()
