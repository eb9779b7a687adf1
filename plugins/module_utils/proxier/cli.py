# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""``kubenode-proxy``: the proxy daemon's command line (upstream flag names).

Exit codes: 0 success (objects ignored by design - headless, ExternalName, another IP
family or service proxy - are not rejections); 1 a sync or the cleanup failed (kernel left
as it was); 2 bad flags or configuration; 3 (with --once) the sync succeeded but some
objects were rejected and left out (each one is named on stderr with the field).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from typing import Dict, List, Optional

from . import config as kpconfig
from . import modes
from .app import build_node_proxier, node_states
from .kernel.iptables import IptablesKernel, KernelError
from .provider import RECORD_DIR
from .sources.manifests import DEFAULT_MAX_FILE_BYTES
from .state import ProxyState


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be greater than 0")
    return value


def _record_dir(text: str) -> str:
    """``--record-dir``: an absolute path (the daemon runs as root under systemd, whose
    working directory says nothing), not a file."""
    if not text or "\0" in text or not os.path.isabs(text):
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is not an absolute path")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text[:200]} exists and is not a directory")
    return os.path.normpath(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubenode-proxy", description="Kubernetes service proxy for bare-metal nodes.")
    p.add_argument("--config", help="KubeProxyConfiguration YAML file")
    p.add_argument("--proxy-mode", choices=modes.UPSTREAM_MODES, help="proxy mode (default iptables)")
    p.add_argument("--hostname-override", help="this node's name as the cluster knows it")
    p.add_argument("--cluster-cidr", help="pod CIDR(s), comma-separated: traffic from elsewhere is masqueraded")
    p.add_argument("--masquerade-all", action="store_true", default=None,
                   help="masquerade all traffic sent to service cluster IPs")
    p.add_argument("--nodeport-addresses", help="CIDRs (or 'primary') whose local addresses accept NodePorts")
    p.add_argument("--cleanup", action="store_true", help="remove every rule and chain this proxy creates, then exit")
    p.add_argument("--manifests", metavar="DIR", help="static source: a directory of Service/EndpointSlice/Node YAML")
    p.add_argument("--manifests-max-file-bytes", type=_positive_int, default=DEFAULT_MAX_FILE_BYTES, metavar="BYTES",
                   help="refuse a manifests file larger than this (default 16 MiB; 10,000 Services take ~6 MB)")
    p.add_argument("--once", action="store_true", help="one sync, then exit (0 on success)")
    p.add_argument("--record-dir", type=_record_dir, default=RECORD_DIR, metavar="DIR",
                   help="where a clean shutdown records the rules it leaves, for the next start "
                        f"(iptables mode; created 0700; default {RECORD_DIR}, which a reboot clears)")
    p.add_argument("--kubeconfig", help="kubeconfig for the API server (default: the config file's, or in-cluster)")
    p.add_argument("--master", help="API server address, overrides the kubeconfig's")
    p.add_argument("--healthz-bind-address", help="host:port of /healthz and /livez (default 127.0.0.1:10256)")
    p.add_argument("--metrics-bind-address", help="host:port of /metrics (default 127.0.0.1:10249)")
    p.add_argument("--iptables-min-sync-period", help="minimum interval between syncs (Go duration, e.g. 1s)")
    p.add_argument("--iptables-sync-period", help="maximum interval between full syncs (Go duration, e.g. 30s)")
    p.add_argument("--ipvs-scheduler", help="IPVS scheduler (default rr)")
    p.add_argument("--ipvs-min-sync-period", help="IPVS mode: minimum interval between syncs (Go duration)")
    p.add_argument("--ipvs-sync-period", help="IPVS mode: maximum interval between full syncs (Go duration)")
    p.add_argument("--netns", default="", help="operate inside this named network namespace (labs, tests)")
    p.add_argument("--iptables", default="iptables", metavar="BINARY",
                   help="iptables binary family: iptables, iptables-nft or iptables-legacy")
    p.add_argument("-v", "--verbose", action="store_true", help="print every rule change")
    return p


# A KubeProxyConfiguration is a few KB; anything much larger is not one.
CONFIG_MAX_BYTES = 1024 * 1024


def read_config_file(path: str) -> object:
    """The config file's one YAML document; ConfigError("(file)") when it cannot be read,
    is too large, binary (NUL bytes, not UTF-8) or not YAML (strict_yaml's bounds)."""
    import yaml

    from .strict_yaml import load

    try:
        with open(path, "rb") as fh:
            data = fh.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise kpconfig.ConfigError("(file)", f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise kpconfig.ConfigError("(file)", f"{path} is larger than {CONFIG_MAX_BYTES} bytes")
    if b"\0" in data:
        raise kpconfig.ConfigError("(file)", f"{path} is binary (a NUL byte at {data.index(bytes(1))}), not YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise kpconfig.ConfigError("(file)", f"{path} is not UTF-8 text (byte {e.start})") from None
    try:
        return load(text)
    except yaml.YAMLError as e:
        raise kpconfig.ConfigError("(file)", f"cannot parse {path}: {' '.join(str(e).split())}") from None


def load_config(args: argparse.Namespace) -> kpconfig.ProxyConfig:
    if args.config:
        cfg = kpconfig.parse(read_config_file(args.config))
    else:
        cfg = kpconfig.ProxyConfig()
    # Flags override the file, as upstream.
    if args.proxy_mode:
        cfg.mode = args.proxy_mode
        kpconfig.apply_mode_sync_periods(cfg)
    if args.hostname_override:
        cfg.hostname_override = args.hostname_override
    if args.cluster_cidr:
        cfg.cluster_cidrs = kpconfig._cidrs(args.cluster_cidr, "--cluster-cidr")
    if args.masquerade_all:
        cfg.masquerade_all = True
    if args.kubeconfig:
        cfg.kubeconfig = args.kubeconfig
    if args.healthz_bind_address is not None:
        cfg.healthz_bind_address = kpconfig.bind_address(args.healthz_bind_address, "--healthz-bind-address")
    if args.metrics_bind_address is not None:
        cfg.metrics_bind_address = kpconfig.bind_address(args.metrics_bind_address, "--metrics-bind-address")
    if args.iptables_min_sync_period:
        cfg.min_sync_period = kpconfig.period(args.iptables_min_sync_period, "--iptables-min-sync-period", zero=True)
    if args.iptables_sync_period:
        cfg.sync_period = kpconfig.period(args.iptables_sync_period, "--iptables-sync-period")
    if args.ipvs_scheduler is not None:
        cfg.ipvs.scheduler = kpconfig.ipvs_scheduler(args.ipvs_scheduler, "--ipvs-scheduler")
    # The mode's own --<section>-[min-]sync-period flags (--ipvs-sync-period in IPVS mode).
    section = modes.sync_section(cfg.mode)
    if section and getattr(args, f"{section}_min_sync_period", None):
        cfg.min_sync_period = kpconfig.period(getattr(args, f"{section}_min_sync_period"),
                                              f"--{section}-min-sync-period", zero=True)
    if section and getattr(args, f"{section}_sync_period", None):
        cfg.sync_period = kpconfig.period(getattr(args, f"{section}_sync_period"), f"--{section}-sync-period")
    if cfg.min_sync_period > cfg.sync_period:
        raise kpconfig.ConfigError("--iptables-min-sync-period", "must not be greater than the sync period")
    if args.nodeport_addresses is not None:
        cfg.node_port_addresses = kpconfig.node_port_addresses(args.nodeport_addresses, "--nodeport-addresses")
    return cfg


def _raise_fd_limit() -> None:
    """Raise the soft open-files limit to the hard one, as Go programs (kube-proxy) do at
    start: the servers hold one descriptor per client, and 1024 is a common soft default."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass  # keep the limit we have


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
    mode = modes.get(cfg.mode)
    if mode is None:
        _err(f"error: proxy mode {cfg.mode!r} is not implemented yet ({' or '.join(modes.names())})")
        return 2
    hostname = (cfg.hostname_override or socket.gethostname()).strip().lower()
    kernel = IptablesKernel(netns=args.netns, binary=args.iptables)

    if args.cleanup:
        return _cleanup(mode, modes.Context(config=cfg, netns=args.netns, iptables=kernel, log=_log))

    if not args.once:
        from .app import run

        _raise_fd_limit()
        return run(cfg, args, hostname, kernel, log=_log, verbose=args.verbose)
    if not args.manifests:
        _err("error: --once needs --manifests DIR")
        return 2

    states = node_states(cfg, hostname, args.netns)
    try:
        rejected = _reload(next(iter(states.values())), args.manifests, next(iter(states)),
                           args.manifests_max_file_bytes, states=states)
    except OSError as e:  # the directory is missing or unreadable: program nothing
        _err(f"error: cannot read the manifests: {e}")
        return 1
    try:
        proxier = build_node_proxier(cfg, states, args.netns, kernel, _log)
    except RuntimeError as e:
        _err(f"error: {e}")
        return 1
    try:
        result = proxier.sync(force_full=True)
    except KernelError as e:
        _err(f"error: sync failed: {e}")
        return 1
    _report(result, args.verbose)
    for key in sorted(result.rejected):
        _err(f"rejected: {result.rejected[key]}")
    return 3 if rejected or result.rejected else 0


def _cleanup(mode: modes.Mode, ctx: modes.Context) -> int:
    """Remove what every mode leaves in the kernel, as upstream's --cleanup: a node switched
    from IPVS to iptables mode still has KUBE-IPVS-FILTER, kube-ipvs0 and the ipsets. The
    modes run in the registry's cleanup order (IPVS first: its chains use iptables mode's
    KUBE-MARK-MASQ; then the configured one last); a mode whose tools are missing never ran here."""
    removed = []
    failed = []
    for each in modes.cleanup_order(mode.name):
        try:
            n = each.clean(dataclasses.replace(ctx, leftovers_only=each is not mode))
        except KernelError as e:
            failed.append(f"{each.name} mode: {e}")
            continue
        if n:
            removed.append(f"{n} of {each.name} mode")
    # IPv6: what a dual-stack or IPv6-only node left (ip6tables chains, the ip6 table).
    # A node without IPv6 (tools, or the kernel's IPv6 tables) never ran an IPv6 proxier:
    # a failure to look is said, not an error.
    ctx6 = dataclasses.replace(ctx, family=6, leftovers_only=True,
                               iptables=ctx.iptables.for_family(6) if ctx.iptables is not None else None)
    for each in modes.cleanup_order(mode.name):
        if 6 not in each.families:
            continue
        try:
            n = each.clean(ctx6)
        except (KernelError, OSError) as e:
            _log(f"cleanup: could not look for {each.name} mode's IPv6 rules: {e}")
            continue
        if n:
            removed.append(f"{n} of {each.name} mode (IPv6)")
    for err in failed:
        _err(f"error: cleanup failed: {err}")
    _log(f"cleanup: removed {' and '.join(removed) or 'nothing'} (objects: chains, virtual services, links, sets)")
    return 1 if failed else 0


def _reload(state: ProxyState, directory: str, family: int = 4,
            max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, states: Optional[Dict[int, ProxyState]] = None) -> int:
    """Load the manifests as the daemon does (its directory reader, then its intake rules
    for objects and this node's Node); returns how many objects or files were rejected
    (each named on stderr). Objects ignored by design (headless, ExternalName, another IP
    family or proxy) are not rejections."""
    from .daemon import Daemon
    from .sources.manifests import DirectoryTracker

    def say(msg: str) -> None:
        if msg.startswith("rejected "):
            _err("rejected: " + msg[len("rejected "):])
        else:
            _log(msg)

    tracker = DirectoryTracker(directory, say, max_file_bytes)
    changes = tracker.poll()
    intake = Daemon(None, state, 0.0, 1.0, say, family=family, states=states)  # its intake only: no proxier, no thread
    intake.on_batch(changes.events, changes.triggers)
    intake.drain()
    files = sum(1 for f in tracker.files() if f.errors)
    return files + len(intake.rejected)


def _report(result, verbose: bool) -> None:
    _log(result.summary())
    if verbose:
        for change in result.changes:
            _out(f"  {change}")
