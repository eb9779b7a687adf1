# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Upstream kube-proxy's kernel object names: iptables tables and chains, the IPVS dummy
link, the IPVS mode's ipsets and the rules that match them.

A leaf: imports nothing of this package, so kernel/ (I/O) and modes/ (compile, plan)
both take the names from here and neither imports the other for a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

# --- iptables --------------------------------------------------------------------------

FILTER = "filter"
NAT = "nat"
TABLES = (FILTER, NAT)  # the tables the proxier's rules live in (the canaries also use mangle)

KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
KUBE_FIREWALL = "KUBE-FIREWALL"

# Per-service chain prefixes; only chains with these prefixes are ever garbage-collected.
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")
# Chains every service adds rules to: diffed rule by rule, never rewritten for one service.
SHARED_CHAINS = frozenset({KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL})
OWN_STATIC_CHAINS = frozenset({
    KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ, KUBE_FORWARD,
    KUBE_PROXY_FIREWALL, KUBE_FIREWALL,
})
BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})

ChainKey = Tuple[str, str]  # (table, chain)

# --- IPVS mode ---------------------------------------------------------------------------

DUMMY_DEVICE = "kube-ipvs0"

# The ipsets of IPVS mode (upstream's pkg/proxy/ipvs/ipset.go; kernel/ipset_specs.py
# builds the kernel's IPSet objects from these).
IPSET_MAXNAMELEN = 31  # IPSET_MAXNAMELEN is 32 in the kernel, including the NUL


@dataclass(frozen=True)
class KubeIPSetSpec:
    name: str
    type: str
    comment: str


@dataclass(frozen=True)
class KubeIPSetMatch:
    """``iptables -t TABLE -A CHAIN [-p PROTOCOL] -m set --match-set SET MATCH -j TARGET``."""

    set: str
    table: str
    chain: str
    target: str
    match: str  # the --match-set flags, e.g. "dst,dst"
    protocol: str = ""


KUBE_LOOP_BACK = "KUBE-LOOP-BACK"
KUBE_CLUSTER_IP = "KUBE-CLUSTER-IP"
KUBE_EXTERNAL_IP = "KUBE-EXTERNAL-IP"
KUBE_EXTERNAL_IP_LOCAL = "KUBE-EXTERNAL-IP-LOCAL"
KUBE_LOAD_BALANCER = "KUBE-LOAD-BALANCER"
KUBE_LOAD_BALANCER_LOCAL = "KUBE-LOAD-BALANCER-LOCAL"
KUBE_LOAD_BALANCER_FW = "KUBE-LOAD-BALANCER-FW"
KUBE_LOAD_BALANCER_SOURCE_IP = "KUBE-LOAD-BALANCER-SOURCE-IP"
KUBE_LOAD_BALANCER_SOURCE_CIDR = "KUBE-LOAD-BALANCER-SOURCE-CIDR"
KUBE_NODE_PORT_TCP = "KUBE-NODE-PORT-TCP"
KUBE_NODE_PORT_LOCAL_TCP = "KUBE-NODE-PORT-LOCAL-TCP"
KUBE_NODE_PORT_UDP = "KUBE-NODE-PORT-UDP"
KUBE_NODE_PORT_LOCAL_UDP = "KUBE-NODE-PORT-LOCAL-UDP"
KUBE_NODE_PORT_SCTP = "KUBE-NODE-PORT-SCTP-HASH"
KUBE_NODE_PORT_LOCAL_SCTP = "KUBE-NODE-PORT-LOCAL-SCTP-HASH"
KUBE_HEALTH_CHECK_NODE_PORT = "KUBE-HEALTH-CHECK-NODE-PORT"
KUBE_IPVS_IPS = "KUBE-IPVS-IPS"

# Upstream's ipsetInfo, in its order (current kubernetes master).
KUBE_IPSETS: Tuple[KubeIPSetSpec, ...] = (
    KubeIPSetSpec(KUBE_LOOP_BACK, "hash:ip,port,ip",
                  "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"),
    KubeIPSetSpec(KUBE_CLUSTER_IP, "hash:ip,port", "Kubernetes service cluster ip + port for masquerade purpose"),
    KubeIPSetSpec(KUBE_EXTERNAL_IP, "hash:ip,port",
                  "Kubernetes service external ip + port for masquerade and filter purpose"),
    KubeIPSetSpec(KUBE_EXTERNAL_IP_LOCAL, "hash:ip,port",
                  "Kubernetes service external ip + port with externalTrafficPolicy=local"),
    KubeIPSetSpec(KUBE_LOAD_BALANCER, "hash:ip,port", "Kubernetes service lb portal"),
    KubeIPSetSpec(KUBE_LOAD_BALANCER_FW, "hash:ip,port",
                  "Kubernetes service load balancer ip + port for load balancer with sourceRange"),
    KubeIPSetSpec(KUBE_LOAD_BALANCER_LOCAL, "hash:ip,port",
                  "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"),
    KubeIPSetSpec(KUBE_LOAD_BALANCER_SOURCE_IP, "hash:ip,port,ip",
                  "Kubernetes service load balancer ip + port + source IP for packet filter purpose"),
    KubeIPSetSpec(KUBE_LOAD_BALANCER_SOURCE_CIDR, "hash:ip,port,net",
                  "Kubernetes service load balancer ip + port + source cidr for packet filter purpose"),
    KubeIPSetSpec(KUBE_NODE_PORT_TCP, "bitmap:port", "Kubernetes nodeport TCP port for masquerade purpose"),
    KubeIPSetSpec(KUBE_NODE_PORT_LOCAL_TCP, "bitmap:port",
                  "Kubernetes nodeport TCP port with externalTrafficPolicy=local"),
    KubeIPSetSpec(KUBE_NODE_PORT_UDP, "bitmap:port", "Kubernetes nodeport UDP port for masquerade purpose"),
    KubeIPSetSpec(KUBE_NODE_PORT_LOCAL_UDP, "bitmap:port",
                  "Kubernetes nodeport UDP port with externalTrafficPolicy=local"),
    KubeIPSetSpec(KUBE_NODE_PORT_SCTP, "hash:ip,port",
                  "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'"),
    KubeIPSetSpec(KUBE_NODE_PORT_LOCAL_SCTP, "hash:ip,port",
                  "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'"),
    KubeIPSetSpec(KUBE_HEALTH_CHECK_NODE_PORT, "bitmap:port", "Kubernetes health check node port"),
    # added upstream later (the addresses of kube-ipvs0, matched by KUBE-IPVS-FILTER)
    KubeIPSetSpec(KUBE_IPVS_IPS, "hash:ip", "Addresses on the ipvs interface"),
)
KUBE_IPSETS_BY_NAME: Dict[str, KubeIPSetSpec] = {s.name: s for s in KUBE_IPSETS}

# Upstream's ipsetWithIptablesChain: the rules that match on the sets, in order (a LOCAL
# set's RETURN comes before the set's mark-for-masquerade). Other sets (KUBE-CLUSTER-IP,
# KUBE-EXTERNAL-IP, ...) are matched by rules built individually in the proxier.
KUBE_IPSET_MATCHES: Tuple[KubeIPSetMatch, ...] = (
    KubeIPSetMatch(KUBE_LOOP_BACK, "nat", "KUBE-POSTROUTING", "MASQUERADE", "dst,dst,src"),
    KubeIPSetMatch(KUBE_LOAD_BALANCER, "nat", "KUBE-SERVICES", "KUBE-LOAD-BALANCER", "dst,dst"),
    KubeIPSetMatch(KUBE_LOAD_BALANCER_LOCAL, "nat", "KUBE-LOAD-BALANCER", "RETURN", "dst,dst"),
    KubeIPSetMatch(KUBE_NODE_PORT_LOCAL_TCP, "nat", "KUBE-NODE-PORT", "RETURN", "dst", "tcp"),
    KubeIPSetMatch(KUBE_NODE_PORT_TCP, "nat", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "tcp"),
    KubeIPSetMatch(KUBE_NODE_PORT_LOCAL_UDP, "nat", "KUBE-NODE-PORT", "RETURN", "dst", "udp"),
    KubeIPSetMatch(KUBE_NODE_PORT_UDP, "nat", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "udp"),
    KubeIPSetMatch(KUBE_NODE_PORT_LOCAL_SCTP, "nat", "KUBE-NODE-PORT", "RETURN", "dst,dst", "sctp"),
    KubeIPSetMatch(KUBE_NODE_PORT_SCTP, "nat", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst,dst", "sctp"),
    KubeIPSetMatch(KUBE_LOAD_BALANCER_FW, "filter", "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL", "dst,dst"),
    KubeIPSetMatch(KUBE_LOAD_BALANCER_SOURCE_CIDR, "filter", "KUBE-SOURCE-RANGES-FIREWALL", "RETURN", "dst,dst,src"),
    KubeIPSetMatch(KUBE_LOAD_BALANCER_SOURCE_IP, "filter", "KUBE-SOURCE-RANGES-FIREWALL", "RETURN", "dst,dst,src"),
)


def kube_ipset_name(name: str, ipv6: bool = False) -> str:
    """Upstream's set name for the family: ``KUBE-`` -> ``KUBE-6-`` for IPv6, cut to 31."""
    if ipv6 and name.startswith("KUBE-"):
        name = "KUBE-6-" + name[len("KUBE-"):]
    return name[:IPSET_MAXNAMELEN]
