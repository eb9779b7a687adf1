# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The node's own addresses (for nodePortAddresses), read with ``ip -j addr``."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from typing import List, Sequence, Tuple


def local_addresses(netns: str = "", family: int = 4) -> List[str]:
    argv = (["ip", "netns", "exec", netns] if netns else []) + ["ip", "-j", f"-{family}", "addr", "show"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot list local addresses: {proc.stderr.strip()}")
    out = []
    for link in json.loads(proc.stdout or "[]"):
        for a in link.get("addr_info", []):
            if a.get("local"):
                out.append(a["local"])
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
