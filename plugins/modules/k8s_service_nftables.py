#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: k8s_service_nftables
short_description: Program one Kubernetes Service's kube-proxy nftables objects on a host
version_added: 0.1.0
description:
  - Writes (O(state=present)) or removes (O(state=absent)) the nftables objects that kube-proxy's
    nftables mode would program for one Service in the C(ip kube-proxy) table, with upstream's
    names (the C(service-ips) and C(service-nodeports) maps, C(service-*), C(external-*),
    C(endpoint-*) chains, C(affinity-*) sets, ...).
  - The node-wide chains, maps and sets of the table are created when missing and kept exact.
    Other services' chains and map elements, and objects outside the table, are left alone.
    The change is applied in one C(nft -f) transaction, all of it or none of it.
  - The service's map and set elements carry the comment C(namespace/name) (as upstream's do); a
    key that another owner holds (another service, or the daemon, which writes no comments) makes
    the module fail naming the holder, rather than overwrite it.
  - The Service is given either as API objects (O(service) and O(endpoint_slices), as
    M(kubernetes.core.k8s_info) returns them) or with flat options (O(name), O(cluster_ip), O(ports), ...),
    the options of M(kubenode.proxy.k8s_service_iptables).
  - As upstream's nftables mode, NodePorts are not served on 127.0.0.1 (there is no
    C(localhost_nodeports) option), and each endpoint has its own C(endpoint-*) chain.
author:
  - kubenode.proxy developers (@kubenode)
extends_documentation_fragment:
  - kubenode.proxy.attributes.platform
  - kubenode.proxy.k8s_service
attributes:
  check_mode:
    description: Computes the change from the kernel's current table, checks it with C(nft -c) and reports it
      without applying it.
    support: full
  diff_mode:
    description: Shows the service's objects (and the node-wide chains and sets) before and after, as C(nft list
      table) prints them.
    support: full
options: {}
requirements:
  - nftables (the nft command line tool) on the managed host; unshare (util-linux, present on every Linux host)
notes:
  - Run with root privileges. Kernel state is per network namespace.
  - The wanted objects are loaded into a throw-away network namespace (C(unshare --net)) and listed there,
    so the comparison with the host's table and the diff are in the host's own C(nft) syntax.
  - The module lists the whole table (C(nft list table)); on a node with thousands of services
    that costs seconds per task.
"""

EXAMPLES = r"""
- name: A ClusterIP service with two backends
  kubenode.proxy.k8s_service_nftables:
    name: web
    namespace: shop
    cluster_ip: 10.96.0.10
    cluster_cidr: 10.244.0.0/16
    ports:
      - {name: http, port: 80, target_port: 8080}
    endpoints:
      - {address: 10.244.1.5, node_name: node1}
      - {address: 10.244.2.7, node_name: node2}

- name: A NodePort service with client IP affinity, only on the node's 192.168.50.0/24 address
  kubenode.proxy.k8s_service_nftables:
    name: api
    namespace: shop
    type: NodePort
    cluster_ip: 10.96.0.20
    node_port_addresses: [192.168.50.0/24]
    session_affinity: ClientIP
    session_affinity_timeout: 600
    ports:
      - {name: http, port: 80, target_port: 8080, node_port: 30080}
    endpoints:
      - {address: 10.244.1.5}

- name: Read the Service
  kubernetes.core.k8s_info:
    kind: Service
    namespace: shop
    name: web
  delegate_to: localhost
  run_once: true
  register: svc_info

- name: Read its EndpointSlices
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
  kubenode.proxy.k8s_service_nftables:
    service: "{{ svc_info.resources | first }}"
    endpoint_slices: "{{ slices_info.resources }}"
    node_name: "{{ inventory_hostname }}"
    cluster_cidr: 10.244.0.0/16

- name: Remove the service's objects
  kubenode.proxy.k8s_service_nftables:
    name: web
    namespace: shop
    state: absent
"""

RETURN = r"""
chains:
  description: The service's chains (C(service-*), C(external-*), C(endpoint-*), ...) after the run.
  returned: always
  type: list
  elements: str
  sample: [endpoint-5OJB2KTY-shop/web/tcp/http__10.244.1.5/8080, service-ULMVA6XW-shop/web/tcp/http]
sets:
  description: The service's own sets (C(affinity-*)) after the run.
  returned: always
  type: list
  elements: str
  sample: []
elements:
  description: The service's elements per shared map or set after the run.
  returned: always
  type: dict
  sample: {"cluster-ips": 1, "service-ips": 1}
changes:
  description: One line per object or element added, changed or removed.
  returned: always
  type: list
  elements: str
  sample:
    - "+chain service-ULMVA6XW-shop/web/tcp/http"
    - "+service-ips 10.96.0.10 . tcp . 80 comment \"shop/web\" : goto service-ULMVA6XW-shop/web/tcp/http"
nft_input:
  description: The C(nft -f) input that was (or in check mode would be) applied.
  returned: always
  type: str
  sample: "add chain ip kube-proxy service-ULMVA6XW-shop/web/tcp/http\n..."
"""

import traceback
from dataclasses import replace

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.kubenode.proxy.plugins.module_utils.k8s_service import ServiceModule, module_kwargs
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.errors import KernelError
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.nft import NftKernel
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import ValidationError
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.options import iptables_config
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import compile as nc
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import service as ns
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import nftables_config
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by the module
    IMPORT_ERROR = traceback.format_exc()
    ServiceModule = object


class ServiceNftables(ServiceModule):
    name = "k8s_service_nftables"

    def __init__(self, module):
        super().__init__(module)
        self.kernel = NftKernel()

    def _config(self):
        """The daemon's translation of the same settings (the mode registry's hooks, imported
        by name: Ansible ships only what a module imports), with upstream's endpoint-*
        chains: no element shared between services."""
        cfg = self.proxy_config(localhost_nodeports=False)
        mode_cfg = nftables_config(cfg, iptables_config(cfg, addresses=self.addresses()), "")
        return replace(mode_cfg, endpoint_chains=True)

    def run(self):
        service, slices = self.service()
        state = self.state(service, slices)
        cfg = self._config()
        key = "%s/%s" % (service.namespace, service.name)
        head = nc.table_head(cfg)
        compiled = wanted = None
        try:
            if self.params["state"] == "present":
                raw = nc.compile_service(state.ports_of(key), state.endpoints_for(key), cfg)
                compiled = ns.with_comments(raw, ns.owner(service.namespace, service.name))
                script = nc.render_full({key: compiled}, cfg)
                wanted = ns.parse_table(self.kernel.scratch_listing(script, cfg.family, nc.TABLE))
            listing = self.kernel.list_table(cfg.family, nc.TABLE)
            current = ns.parse_table(listing) if listing is not None else None
            plan = ns.plan_service(head, current, wanted, compiled, nc.infrastructure(cfg),
                                   service.namespace, service.name)
            if plan.conflicts:
                self.module.fail_json(msg="Service %s: %s" % (key, "; ".join(plan.conflicts)),
                                      conflicts=plan.conflicts)
            if plan.text:
                self.kernel.apply(plan.text, check_only=self.module.check_mode)
        except ValidationError as e:  # a field the compiler cannot write into nft input
            self.module.fail_json(msg=str(e), object=e.name, field=e.path)
        except KernelError as e:
            self.module.fail_json(msg=str(e))
        result = dict(changed=bool(plan.text), chains=plan.chains, sets=plan.sets, elements=plan.element_counts,
                      changes=plan.changes, nft_input=plan.text)
        if self.module._diff:
            result["diff"] = dict(before=plan.before, after=plan.after)
        self.module.exit_json(**result)


def main():
    module = AnsibleModule(**module_kwargs())
    if IMPORT_ERROR:
        module.fail_json(msg="cannot import the kubenode.proxy core", exception=IMPORT_ERROR)
    ServiceNftables(module).run()


if __name__ == "__main__":
    main()
