# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""IPVS connection timeouts (``ipvs.tcpTimeout/tcpFinTimeout/udpTimeout``), set as
upstream's ``ipvs.SetTimeout`` does, here with ``ipvsadm --set`` (0 keeps a value).
The IPVS mode's only I/O that is not netlink yet: IPVS_CMD_SET_CONFIG would belong in
kernel/ipvs_netlink.py."""

from __future__ import annotations

import subprocess
from typing import Any, Callable

from ..errors import KernelError


def set_timeouts(netns: str, tcp: float, tcp_fin: float, udp: float,
                 runner: Callable[..., Any] = subprocess.run) -> None:
    """Raises KernelError when ipvsadm cannot be run or refuses."""
    argv = (["ip", "netns", "exec", netns] if netns else []) + [
        "ipvsadm", "--set", str(int(tcp)), str(int(tcp_fin)), str(int(udp))]
    try:
        proc = runner(argv, capture_output=True, text=True, check=False)
    except OSError as e:
        raise KernelError(f"cannot run ipvsadm: {e}") from e
    if proc.returncode != 0:
        raise KernelError(f"ipvsadm --set failed: {proc.stderr.strip()}")
