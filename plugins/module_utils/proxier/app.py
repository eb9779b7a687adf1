# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The running node service: builds the proxier, the daemon, a source and the node's
servers from the configuration, and runs until SIGTERM/SIGINT (rules stay in place,
as upstream; ``--cleanup`` removes them)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, List, Optional

from . import config as kpconfig
from .backends.iptables import IptablesConfig
from .daemon import Daemon, Hooks, ManifestsWatcher
from .iptables_proxier import IptablesProxier, SyncResult
from .kernel.addresses import local_addresses, match_node_port_addresses
from .kernel.iptables import IptablesKernel
from .state import ProxyState

LogFn = Callable[[str], None]


def iptables_config(cfg: kpconfig.ProxyConfig, state: ProxyState, netns: str) -> IptablesConfig:
    addresses = local_addresses(netns)
    match_all, np_ips = match_node_port_addresses(cfg.node_port_addresses, addresses)
    local_cidrs: tuple = ()
    iface = ""
    mode = cfg.detect_local_mode
    if mode == "ClusterCIDR":
        local_cidrs = tuple(c for c in cfg.cluster_cidrs if ":" not in c)
    elif mode == "NodeCIDR":
        local_cidrs = tuple(c for c in (state.node.pod_cidrs if state.node else ()) if ":" not in c)
    elif mode == "BridgeInterface":
        iface = cfg.bridge_interface
    else:
        iface = cfg.interface_name_prefix
    return IptablesConfig(
        masquerade_bit=cfg.masquerade_bit, masquerade_all=cfg.masquerade_all, local_mode=mode,
        local_cidrs=local_cidrs, local_interface=iface, node_port_ips=np_ips, node_port_match_all=match_all,
        localhost_nodeports=cfg.localhost_nodeports, node_ips=tuple(addresses),
    )


class NodeHooks(Hooks):
    """Connects sync results to the parts of the node that follow them."""

    def __init__(self, cfg: kpconfig.ProxyConfig, state: ProxyState, proxier: IptablesProxier, netns: str,
                 log: LogFn) -> None:
        self.cfg = cfg
        self.state = state
        self.proxier = proxier
        self.netns = netns
        self.log = log

    def node_changed(self, node: Any) -> bool:
        if self.cfg.detect_local_mode != "NodeCIDR":
            return False
        self.proxier.cfg = iptables_config(self.cfg, self.state, self.netns)
        return True

    def synced(self, result: SyncResult, latencies: List[float]) -> None:
        pass


def run(cfg: kpconfig.ProxyConfig, args: Any, hostname: str, kernel: IptablesKernel, log: LogFn,
        verbose: bool = False, stop: Optional[threading.Event] = None) -> int:
    state = ProxyState(hostname)
    proxier = IptablesProxier(state, iptables_config(cfg, state, args.netns), kernel)
    hooks = NodeHooks(cfg, state, proxier, args.netns, log)
    daemon = Daemon(proxier, state, cfg.min_sync_period, cfg.sync_period, log, hooks)
    if args.manifests:
        source: Any = ManifestsWatcher(args.manifests, daemon.on_relist, log)
        what = f"manifests directory {args.manifests}"
    else:
        from .sources.kubernetes import KubernetesSource, load_client

        client = load_client(cfg.kubeconfig, getattr(args, "master", "") or "")
        source = KubernetesSource(client, hostname, daemon.on_event, daemon.on_relist, log)
        what = f"API server {client.configuration.host}"
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_args: stop.set())
    log(f"kubenode-proxy: iptables mode, node {hostname}, source {what}")
    # Sources first: the first sync should see the whole cluster, not an empty one
    # (upstream waits for its informers to sync before the first sync too).
    source.start()
    if hasattr(source, "wait_synced"):
        while not stop.is_set() and not source.wait_synced(timeout=1.0):
            pass
    daemon.start()
    try:
        stop.wait()
    finally:
        source.stop()
        daemon.stop()
        log("stopped; rules left in place (kubenode-proxy --cleanup removes them)")
    return 0
