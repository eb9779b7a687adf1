# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The node's own addresses (nodePortAddresses, IPVS mode's NodePort and VIP addresses),
read with ``ip -j addr``: one reader for every mode."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from typing import Any, Callable, List, Sequence, Tuple

from ..errors import KernelError
from ..names import DUMMY_DEVICE


def _links(netns: str, family: int, runner: Callable[..., Any]) -> List[Any]:
    """``ip -j addr show``: one entry per link, with its ``addr_info``. Raises KernelError
    (a RuntimeError) when ip fails."""
    argv = (["ip", "netns", "exec", netns] if netns else []) + ["ip", "-j", f"-{family}", "addr", "show"]
    proc = runner(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KernelError(f"cannot list local addresses: {proc.stderr.strip()}")
    return json.loads(proc.stdout or "[]")


def local_addresses(netns: str = "", family: int = 4, runner: Callable[..., Any] = subprocess.run) -> List[str]:
    """Every address of the node, loopback included (iptables mode's nodePortAddresses)."""
    return [a["local"] for link in _links(netns, family, runner) for a in link.get("addr_info", []) if a.get("local")]


def node_addresses(netns: str = "", family: int = 4, exclude_link: str = DUMMY_DEVICE,
                   runner: Callable[..., Any] = subprocess.run) -> List[str]:
    """This node's addresses except loopback, IPv6 link-local and those on ``exclude_link``
    (upstream's GetAllLocalAddressesExcept + isValidForSet: IPVS mode's NodePort addresses)."""
    out: List[str] = []
    for link in _links(netns, family, runner):
        if link.get("ifname") == exclude_link:
            continue
        for a in link.get("addr_info", []):
            ip = a.get("local")
            if not ip:
                continue
            addr = ipaddress.ip_address(ip)
            if addr.is_loopback or (addr.version == 6 and addr.is_link_local) or ip in out:
                continue
            out.append(ip)
    return out


def primary_address(addresses: Sequence[str]) -> str:
    for a in addresses:
        if not ipaddress.ip_address(a).is_loopback:
            return a
    return addresses[0] if addresses else ""


def match_node_port_addresses(spec: Sequence[str], addresses: Sequence[str]) -> Tuple[bool, Tuple[str, ...]]:
    """(match all?, the addresses NodePorts listen on) for nodePortAddresses ``spec``."""
    if not spec:
        return True, tuple(addresses)
    out: List[str] = []
    for item in spec:
        if item == "primary":
            p = primary_address(addresses)
            if p and p not in out:
                out.append(p)
            continue
        net = ipaddress.ip_network(item, strict=False)
        if net.prefixlen == 0:
            return True, tuple(addresses)
        for a in addresses:
            if ipaddress.ip_address(a).version == net.version and ipaddress.ip_address(a) in net and a not in out:
                out.append(a)
    return False, tuple(out)
