# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The running node service: builds the proxier, the daemon, a source and the node's
servers from the configuration, and runs until SIGTERM/SIGINT (rules stay in place,
as upstream; ``--cleanup`` removes them)."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from . import config as kpconfig
from . import modes
from .daemon import Daemon, Hooks, ManifestsWatcher
from .endpoints import categorize
from .errors import KernelError, Unavailable
from .healthcheck import HealthCheckServers
from .healthz import MetricsServer, ProxyHealthServer, health_timeout
from .kernel.conntrack import ConntrackCleaner, ServiceTarget
from .kernel.iptables import IptablesKernel, RestoreError
from .metrics import ProxyMetrics
from .provider import RECORD_DIR, Proxier, SyncResult
from .state import ProxyState

LogFn = Callable[[str], None]


def iptables_config(cfg: kpconfig.ProxyConfig, state: ProxyState, netns: str) -> Any:
    """The shared iptables options (modes/iptables/options.py); kept here under its old
    name and signature for callers written before the move."""
    from .modes.iptables.options import iptables_config as options

    return options(cfg, netns, node=state.node)


def served_family(cfg: kpconfig.ProxyConfig, netns: str = "") -> int:
    """The node's primary IP family (the first of served_families())."""
    return served_families(cfg, netns)[0]


def served_families(cfg: kpconfig.ProxyConfig, netns: str = "",
                    addresses: Optional[Dict[int, List[str]]] = None) -> Tuple[int, ...]:
    """The IP families this node serves, the primary one first (upstream: the node IP's
    family first, and the other one too when the node can run it).

    From the configuration when it says: ``clusterCIDR`` (one CIDR per family), else the
    CIDRs of ``nodePortAddresses``; otherwise the node's own addresses (loopback and IPv6
    link-local left out), IPv4 first, IPv6 only where iptables-based modes find
    ``ip6tables-restore`` (upstream: dual-stack when both families' iptables are present).
    A family the configured mode does not implement is left out (IPVS: IPv4 only); a node
    with no address at all serves IPv4.
    """
    families: List[int] = []
    configured = list(cfg.cluster_cidrs) or [c for c in cfg.node_port_addresses if c != "primary"]
    for cidr in configured:
        family = 6 if ":" in cidr else 4
        if family not in families:
            families.append(family)
    if not families:
        from .kernel.addresses import node_addresses

        for family in (4, 6):
            try:
                found = addresses[family] if addresses is not None else node_addresses(netns, family, exclude_link="")
            except (KernelError, OSError, KeyError):
                found = []
            if found:
                families.append(family)
        mode = modes.get(cfg.mode)
        if 6 in families and len(families) > 1 and mode is not None and mode.backend == "iptables" \
                and addresses is None and shutil.which("ip6tables-restore") is None:
            families.remove(6)  # not asked for by the configuration: serve what this node can
    mode = modes.get(cfg.mode)
    supported = mode.families if mode is not None else (4,)
    families = [f for f in families if f in supported]
    return tuple(families) or (4,)


def _mode(cfg: kpconfig.ProxyConfig) -> modes.Mode:
    mode = modes.get(cfg.mode)
    if mode is None:
        raise RuntimeError(f"proxy mode {cfg.mode!r} is not implemented yet ({' or '.join(modes.names())})")
    return mode


def proxier_config(cfg: kpconfig.ProxyConfig, state: ProxyState, netns: str, family: int = 4) -> Any:
    """The compiler configuration of the configured mode (IptablesConfig, IpvsConfig, ...)
    for one IP family."""
    return _mode(cfg).make_config(cfg, netns, node=state.node, family=family)


def build_proxier(cfg: kpconfig.ProxyConfig, state: ProxyState, netns: str, kernel: IptablesKernel,
                  log: Optional[LogFn] = None, family: int = 4, remove_others: bool = True) -> Proxier:
    """The configured mode's proxier (the registry's) for one IP family. Like upstream's
    NewProxier, iptables mode sets route_localnet for localhost NodePorts (RuntimeError
    if it cannot)."""
    mode = _mode(cfg)
    ctx = modes.Context(config=cfg, netns=netns, iptables=kernel.for_family(family), log=log or modes.quiet,
                        refresh=lambda: proxier_config(cfg, state, netns, family), family=family)
    if remove_others:
        remove_other_backends(mode, ctx)
    return mode.build(state, proxier_config(cfg, state, netns, family), ctx)


def build_node_proxier(cfg: kpconfig.ProxyConfig, states: Dict[int, ProxyState], netns: str,
                       kernel: IptablesKernel, log: Optional[LogFn] = None) -> Proxier:
    """The node's proxier: one family's, or (dual-stack) a MetaProxier over one proxier
    per family, the primary family first (``states``' order)."""
    proxiers: Dict[int, Proxier] = {}
    for family, state in states.items():
        proxiers[family] = build_proxier(cfg, state, netns, kernel, log, family=family)
    if len(proxiers) == 1:
        return next(iter(proxiers.values()))
    from .metaproxier import MetaProxier

    return MetaProxier(proxiers)


def node_states(cfg: kpconfig.ProxyConfig, hostname: str, netns: str) -> Dict[int, ProxyState]:
    """One state per IP family the node serves, the primary family first."""
    return {family: ProxyState(hostname) for family in served_families(cfg, netns)}


def remove_other_backends(mode: modes.Mode, ctx: modes.Context) -> int:
    """As upstream at start: a node switched from iptables or IPVS mode to nftables mode (or
    back) loses the other modes' rules, which would otherwise still catch its traffic. A
    failure is logged, not fatal (upstream's too): the configured mode still starts."""
    removed = 0
    others = modes.other_backends(mode.name)
    for other in others:
        if ctx.family not in other.families:  # each family's proxier removes its own family's
            continue
        try:
            removed += other.clean(replace(ctx, leftovers_only=True))
        except (KernelError, Unavailable, OSError) as e:
            ctx.log(f"could not remove what {other.name} mode left: {e}")
    if removed:
        # One line: IPVS mode's cleanup removes iptables mode's chains too.
        names = " or ".join(m.name for m in others)
        ctx.log(f"removed {removed} objects left by {names} mode (this node runs {mode.name} mode now)")
    return removed


class NodeHooks(Hooks):
    """Connects the daemon to health, metrics, health check node ports and conntrack."""

    def __init__(self, cfg: kpconfig.ProxyConfig, state: ProxyState, proxier: Proxier, netns: str,
                 log: LogFn, states: Optional[Dict[int, ProxyState]] = None) -> None:
        self.cfg = cfg
        self.state = state
        self.states: Dict[int, ProxyState] = dict(states) if states else {4: state}
        self.proxier = proxier
        self.netns = netns
        self.log = log
        self.metrics = ProxyMetrics()
        self.health = ProxyHealthServer(cfg.healthz_bind_address or "127.0.0.1:0", health_timeout(cfg.sync_period),
                                        metrics=self.metrics, log=log)
        self.metrics_server = MetricsServer(cfg.metrics_bind_address or "127.0.0.1:0", self.metrics,
                                            proxy_mode=cfg.mode, log=log)
        # Health check node ports are probed by the external load balancer, so like
        # NodePorts they listen on the NodePort addresses (all addresses by default).
        # Dual-stack: the NodePort addresses of every family; by default "::", which also
        # takes IPv4 connections (net.ipv6.bindv6only=0, Linux's default).
        family_proxiers = list(getattr(proxier, "proxiers", {0: proxier}).values())
        bind = [ip for ip in cfg.node_port_addresses if ip != "primary"] and [
            ip for p in family_proxiers for ip in p.cfg.node_port_ips]
        self.health_checks = HealthCheckServers(bind or ("::" if 6 in self.states else "0.0.0.0"), self.health,
                                                log=log)
        self.hc_ports: Dict[Tuple[str, str], int] = {}
        self.hc_local: Dict[Tuple[str, str], int] = {}
        # Upstream's rule: a flow to a service IP:port (or NodePort) whose reply comes from
        # no current serving endpoint is stale; flows of services without endpoints stay.
        self.conntrack = ConntrackCleaner(netns) if _has_pyroute2() else None
        if self.conntrack is None:
            log("pyroute2 is not installed: stale UDP conntrack entries will not be removed")
        self.pending: Callable[[], bool] = lambda: False  # set by run(): is the daemon's intake non-empty?

    def start(self) -> None:
        if self.cfg.healthz_bind_address:
            self.health.start()
        if self.cfg.metrics_bind_address:
            self.metrics_server.start()
        self.health.updated()  # as upstream's sync loop: the clock for "syncs keep up" starts now

    def stop(self) -> None:
        self.health_checks.stop()
        self.health.stop()
        self.metrics_server.stop()

    def queued(self, kind: str, count: int) -> None:
        if kind == "Service":
            self.metrics.service_changes_total.inc(count)
        elif kind == "EndpointSlice":
            self.metrics.endpoint_changes_total.inc(count)
        self.metrics.sync_proxy_rules_last_queued_timestamp.set_to_current_time()
        self.health.queued_update()

    def node_seen(self, obj: Dict[str, Any]) -> None:
        self.health.sync_node(obj)

    def node_changed(self, node: Any) -> bool:
        if self.cfg.detect_local_mode != "NodeCIDR":
            return False
        if hasattr(self.proxier, "proxiers"):  # dual-stack: each family its own pod CIDR
            for family, p in self.proxier.proxiers.items():
                p.cfg = proxier_config(self.cfg, p.state, self.netns, family)
        else:
            self.proxier.cfg = proxier_config(self.cfg, self.state, self.netns,
                                              next(iter(self.states)) if self.states else 4)
        return True

    def synced(self, result: SyncResult, latencies: List[float]) -> None:
        # Metrics first: once /healthz reports this sync, /metrics already counts it.
        self.metrics.observe_sync(result.total_seconds, result.full)
        for seconds in latencies:
            self.metrics.network_programming_latency.observe(max(0.0, seconds))
        for table, count in self.proxier.rule_counts().items():
            self.metrics.iptables_rules_total.labels(table=table).set(count)
        self.health.updated()
        if self.pending():
            # Changes queued while this sync ran are not in the kernel yet.
            self.health.queued_update()
        self.partly_synced(result)

    def partly_synced(self, result: SyncResult) -> None:
        """Health check node ports and conntrack cleanup for what ``result`` put in the
        kernel: after every sync, and alone when one IP family synced and another failed
        (healthz and the sync metrics wait for a whole sync)."""
        keys = set().union(*(st.services for st in self.states.values())) if result.full else result.changed
        self._health_checks(keys)
        self._conntrack(keys)

    def sync_failed(self, error: BaseException) -> None:
        # The kernel lags the cluster until a sync succeeds: healthz turns 503 once this
        # has lasted the health timeout.
        self.health.queued_update()
        self.metrics.sync_failures_total.inc()
        # Upstream counts iptables-restore failures only (IPVS and ipset errors are not).
        if iptables_restore_failed(error):
            self.metrics.iptables_restore_failures_total.inc()
            if not self.proxier.last_attempt_full:
                self.metrics.iptables_partial_restore_failures_total.inc()

    def _health_checks(self, keys: Iterable[str]) -> None:
        for key in keys:
            ns, name = key.split("/", 1)
            # Dual-stack: one health check node port per Service, its local endpoints
            # counted over both families.
            per_family = [(st.ports_of(key), st) for st in self.states.values()]
            hc = next((p.health_check_node_port for ports, _st in per_family for p in ports
                       if p.health_check_node_port), 0)
            if not hc:
                self.hc_ports.pop((ns, name), None)
                self.hc_local.pop((ns, name), None)
                continue
            self.hc_ports[(ns, name)] = hc
            local = set()
            for ports, st in per_family:
                eps = st.endpoints_for(key)
                local |= {str(ep) for sp in ports for ep in categorize(eps.get(sp.name, []), sp).local}
            self.hc_local[(ns, name)] = len({e.rsplit(":", 1)[0] for e in local})
        failed = self.health_checks.sync_services(dict(self.hc_ports))
        for nsn, err in (failed or {}).items():
            self.log(f"health check node port for service {nsn[0]}/{nsn[1]}: {err}")
        self.health_checks.sync_endpoints(dict(self.hc_local))

    def _conntrack(self, keys: Iterable[str]) -> None:
        """Stale UDP/SCTP flows of changed services: their endpoints went or changed."""
        if self.conntrack is None:
            return
        targets: List[ServiceTarget] = []
        for key in keys:
            for st in self.states.values():  # IPv6 flows too: the cleaner dumps each family
                targets += udp_targets(st, key)
        if not targets:
            return
        result = self.conntrack.cleanup(targets)
        if result.deleted or result.errors:
            self.log(f"conntrack: removed {result.deleted} stale UDP/SCTP flows in {result.seconds * 1000:.0f} ms"
                     + (f"; errors: {'; '.join(result.errors[:3])}" if result.errors else ""))


def iptables_restore_failed(error: BaseException) -> bool:
    """Whether a failed sync failed (also) in an iptables-restore."""
    return isinstance(error, RestoreError) or bool(getattr(error, "iptables_restore_failed", False))


def _has_pyroute2() -> bool:
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return False
    return True


def udp_targets(state: ProxyState, key: str) -> List[ServiceTarget]:
    out = []
    eps = state.endpoints_for(key)
    for sp in state.ports_of(key):
        if sp.protocol not in ("UDP", "SCTP"):
            continue
        cat = categorize(eps.get(sp.name, []), sp)
        ips = {sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips}
        out.append(ServiceTarget(sp.protocol.lower(), ips, sp.port, sp.node_port,
                                 {(ep.ip, ep.port) for ep in cat.reachable}))
    return out


def run(cfg: kpconfig.ProxyConfig, args: Any, hostname: str, kernel: IptablesKernel, log: LogFn,
        verbose: bool = False, stop: Optional[threading.Event] = None) -> int:
    states = node_states(cfg, hostname, args.netns)
    state = next(iter(states.values()))
    try:
        proxier = build_node_proxier(cfg, states, args.netns, kernel, log)
    except RuntimeError as e:
        log(f"error: cannot start the {cfg.mode} proxier: {e}")
        return 1
    # What a clean shutdown recorded of the rules it left (iptables mode): the first sync
    # can then write only what changed since, instead of rewriting every chain.
    record = (proxier.record_path(getattr(args, "record_dir", None) or RECORD_DIR)
              if hasattr(proxier, "record_path") else "")
    if record:
        found = proxier.load_record(record)
        if found:
            log(found)
        if hasattr(proxier, "prefetch"):
            proxier.prefetch()  # the kernel listing runs while the sources load (below)
    hooks = NodeHooks(cfg, state, proxier, args.netns, log, states=states)
    daemon = Daemon(proxier, state, cfg.min_sync_period, cfg.sync_period, log, hooks, family=next(iter(states)),
                    states=states)
    hooks.pending = daemon.has_pending
    if args.manifests:
        source: Any = ManifestsWatcher(args.manifests, daemon.on_batch, log,
                                       max_file_bytes=getattr(args, "manifests_max_file_bytes", None))
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
    log(f"kubenode-proxy: {cfg.mode} mode ({' and '.join(f'IPv{f}' for f in states)}), node {hostname}, "
        f"source {what}")
    hooks.start()
    log(f"healthz on {hooks.health.address if cfg.healthz_bind_address else '(off)'}, "
        f"metrics on {hooks.metrics_server.address if cfg.metrics_bind_address else '(off)'}")
    # Sources first: the first sync should see the whole cluster, not an empty one
    # (upstream waits for its informers to sync before the first sync too).
    loading, cpu, own = time.monotonic(), time.process_time(), time.thread_time()
    source.start()
    if hasattr(source, "wait_synced"):
        while not stop.is_set() and not source.wait_synced(timeout=1.0):
            pass
    # Where a start's time goes before its first sync (at 10,000 services mostly here), and
    # whether it was this process's work (CPU) or waiting for a CPU (a loaded machine).
    log(f"sources loaded in {time.monotonic() - loading:.1f} s (CPU: this thread {time.thread_time() - own:.1f} s, "
        f"the process {time.process_time() - cpu:.1f} s)")
    daemon.start()
    try:
        stop.wait()
    finally:
        source.stop()
        stopped = daemon.stop()
        hooks.stop()
        if record:
            try:
                log(proxier.save_record(record) if stopped
                    else "no record of the rules written: a sync was still running")
            except Exception as e:  # the rules stay; the next start rewrites them
                log(f"could not record the rules written: {e}")
        log("stopped; rules left in place (kubenode-proxy --cleanup removes them)")
    return 0
