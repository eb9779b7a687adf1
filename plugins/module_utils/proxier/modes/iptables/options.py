# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The configuration -> iptables options translation: one function for the daemon, the
command line and the k8s_service_iptables module. Every mode starts from these options
(masquerade bit, local-traffic detection, NodePort addresses): IPVS mode keeps iptables
rules for masquerading, and nftables mode writes the same decisions."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ...kernel.addresses import local_addresses, match_node_port_addresses
from .compile import IptablesConfig


def iptables_config(cfg: Any, netns: str = "", node: Any = None,
                    addresses: Optional[Sequence[str]] = None, family: int = 4) -> IptablesConfig:
    """IptablesConfig from a ProxyConfig ``cfg`` for one IP ``family`` (4 or 6); ``node``
    (its podCIDRs) for detectLocalMode NodeCIDR; the node's addresses of that family are
    read now unless given (given ones of the other family are left out)."""
    v6 = family == 6
    addresses = [a for a in (local_addresses(netns, family) if addresses is None else addresses)
                 if (":" in a) == v6]
    match_all, np_ips = match_node_port_addresses(cfg.node_port_addresses, addresses)
    local_cidrs: tuple = ()
    iface = ""
    mode = cfg.detect_local_mode
    if mode == "ClusterCIDR":
        local_cidrs = tuple(c for c in cfg.cluster_cidrs if (":" in c) == v6)
    elif mode == "NodeCIDR":
        local_cidrs = tuple(c for c in (node.pod_cidrs if node else ()) if (":" in c) == v6)
    elif mode == "BridgeInterface":
        iface = cfg.bridge_interface
    else:
        iface = cfg.interface_name_prefix
    return IptablesConfig(
        masquerade_bit=cfg.masquerade_bit, masquerade_all=cfg.masquerade_all, local_mode=mode,
        local_cidrs=local_cidrs, local_interface=iface, node_port_ips=np_ips, node_port_match_all=match_all,
        # IPv6 has no route_localnet: upstream serves no NodePort on ::1.
        localhost_nodeports=cfg.localhost_nodeports and not v6, node_ips=tuple(addresses), family=family,
    )
