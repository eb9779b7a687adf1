# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""``kubenode-proxy``: the proxy daemon's command line (upstream flag names).

Exit codes: 0 success; 1 a sync or the cleanup failed (kernel left as it was);
2 bad flags or configuration; 3 (with --once) the sync succeeded but some objects
were rejected and left out (each one is named on stderr).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import List, Optional

from . import config as kpconfig
from .backends.iptables import IptablesConfig
from .iptables_proxier import IptablesProxier
from .kernel.addresses import local_addresses, match_node_port_addresses
from .kernel.iptables import IptablesKernel, KernelError
from .sources.manifests import load_dir
from .state import ProxyState


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubenode-proxy", description="Kubernetes service proxy for bare-metal nodes.")
    p.add_argument("--config", help="KubeProxyConfiguration YAML file")
    p.add_argument("--proxy-mode", choices=kpconfig.MODES, help="proxy mode (default iptables)")
    p.add_argument("--hostname-override", help="this node's name as the cluster knows it")
    p.add_argument("--cluster-cidr", help="pod CIDR(s), comma-separated: traffic from elsewhere is masqueraded")
    p.add_argument("--masquerade-all", action="store_true", default=None,
                   help="masquerade all traffic sent to service cluster IPs")
    p.add_argument("--nodeport-addresses", help="CIDRs (or 'primary') whose local addresses accept NodePorts")
    p.add_argument("--cleanup", action="store_true", help="remove every rule and chain this proxy creates, then exit")
    p.add_argument("--manifests", metavar="DIR", help="static source: a directory of Service/EndpointSlice/Node YAML")
    p.add_argument("--once", action="store_true", help="one sync, then exit (0 on success)")
    p.add_argument("--netns", default="", help="operate inside this named network namespace (labs, tests)")
    p.add_argument("--iptables", default="iptables", metavar="BINARY",
                   help="iptables binary family: iptables, iptables-nft or iptables-legacy")
    p.add_argument("-v", "--verbose", action="store_true", help="print every rule change")
    return p


def load_config(args: argparse.Namespace) -> kpconfig.ProxyConfig:
    if args.config:
        import yaml

        try:
            with open(args.config, encoding="utf-8") as fh:
                doc = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError) as e:
            raise kpconfig.ConfigError("(file)", f"cannot read {args.config}: {e}") from None
        cfg = kpconfig.parse(doc)
    else:
        cfg = kpconfig.ProxyConfig()
    # Flags override the file, as upstream.
    if args.proxy_mode:
        cfg.mode = args.proxy_mode
    if args.hostname_override:
        cfg.hostname_override = args.hostname_override
    if args.cluster_cidr:
        cfg.cluster_cidrs = kpconfig._cidrs(args.cluster_cidr, "--cluster-cidr")
    if args.masquerade_all:
        cfg.masquerade_all = True
    if args.nodeport_addresses is not None:
        cfg.node_port_addresses = kpconfig.node_port_addresses(args.nodeport_addresses, "--nodeport-addresses")
    return cfg


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


def _log(msg: str) -> None:
    _out(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}")


def _out(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def _err(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args)
    except kpconfig.ConfigError as e:
        _err(f"error: {e}")
        return 2
    if cfg.mode != "iptables":
        _err(f"error: proxy mode {cfg.mode!r} is not implemented yet (only iptables)")
        return 2
    hostname = (cfg.hostname_override or socket.gethostname()).strip().lower()
    state = ProxyState(hostname)
    kernel = IptablesKernel(netns=args.netns, binary=args.iptables)

    if args.cleanup:
        proxier = IptablesProxier(state, IptablesConfig(masquerade_bit=cfg.masquerade_bit), kernel)
        try:
            n = proxier.cleanup()
        except KernelError as e:
            _err(f"error: cleanup failed: {e}")
            return 1
        _log(f"cleanup: removed {n} chains and their jumps")
        return 0

    if not args.manifests:
        _err("error: no source: pass --manifests DIR (the Kubernetes API source comes with the watch loop)")
        return 2

    rejected = _reload(state, args.manifests, hostname)
    try:
        proxier = IptablesProxier(state, iptables_config(cfg, state, args.netns), kernel)
    except RuntimeError as e:
        _err(f"error: {e}")
        return 1
    if args.once:
        try:
            result = proxier.sync(force_full=True)
        except KernelError as e:
            _err(f"error: sync failed: {e}")
            return 1
        _report(result, args.verbose)
        return 3 if rejected else 0
    return _loop(proxier, state, args, cfg, hostname)


def _reload(state: ProxyState, directory: str, hostname: str) -> int:
    loaded = load_dir(directory)
    for err in loaded.errors:
        _err(f"rejected: {err}")
    state.replace_all(loaded.services, loaded.slices)
    state.node = loaded.node(hostname)
    return len(loaded.errors)


def _report(result, verbose: bool) -> None:
    _log(result.summary())
    if verbose:
        for change in result.changes:
            _out(f"  {change}")


def _loop(proxier: IptablesProxier, state: ProxyState, args: argparse.Namespace, cfg: kpconfig.ProxyConfig,
          hostname: str) -> int:
    """Poll the manifests directory (the watch-based engine replaces this loop)."""
    last_full = 0.0
    while True:
        now = time.monotonic()
        full = now - last_full >= cfg.sync_period
        try:
            result = proxier.sync(force_full=full)
            if full or result.changes:
                _report(result, args.verbose)
            if result.full:
                last_full = now
        except KernelError as e:
            _err(f"error: sync failed, will retry with a full sync: {e}")
        time.sleep(max(cfg.min_sync_period, 0.1))
        _reload(state, args.manifests, hostname)
