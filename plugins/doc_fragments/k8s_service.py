# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)


class ModuleDocFragment:
    # The options of the modules that program one Service (k8s_service_iptables,
    # k8s_service_nftables): the Service (as API objects or flat options) and the node-side
    # settings every mode shares. plugins/module_utils/k8s_service.py has their argument spec.
    DOCUMENTATION = r"""
options:
  state:
    description: Whether the service's kernel objects are present or absent.
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
      - The node-side options (O(node_name), O(cluster_cidr), O(node_port_addresses),
        O(masquerade_all), O(masquerade_bit), O(state) and the module's own options) apply to
        both forms.
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
"""
