# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""IPVS mode: state -> compile (per service, modes/ipvs/compile.py) -> apply to five kernel
parts: sysctls, the ``kube-ipvs0`` dummy link, upstream's ipsets, IPVS virtual services
with their real servers, and the iptables rules IPVS mode keeps (one iptables-restore
through the iptables planner).

Same interface as :class:`~..iptables.proxier.IptablesProxier` (``sync``, ``cleanup``,
``rule_counts``, ``cfg``, ``last_attempt_full``), so the daemon and the command line
drive either.

- A full sync reads the kernel (virtual services, sets, rules, link addresses) and
  reconciles everything: sets whose content differs are rebuilt in a temporary set and
  swapped in (rules see the old or the new content, never a mix); virtual services
  nobody wants are deleted (except inside ``ipvs.excludeCIDRs``, as upstream); chains
  and jumps another mode left behind are removed.
- A partial sync recompiles only the changed services and applies the difference:
  their virtual services (read back from the kernel one by one), set entries added and
  deleted in one ``ipset restore``, link addresses, and iptables rules only when which
  sets are empty changed.
- Removed real servers go gracefully, as upstream's graceful termination manager does:
  a TCP real server with connections is set to weight 0 and deleted once its
  connections are gone (checked at every full sync); UDP/SCTP ones go at once.
- Any failure: the error is raised after the remaining steps ran, and the next sync is
  a full one; what the kernel had stays in place where a step failed.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ...gcpause import paused_gc
from ...kernel import ipvs as kipvs
from ...kernel.addresses import match_node_port_addresses, node_addresses, primary_address
from ...kernel.dummy_link import DummyLink, LinkUnavailable
from ...kernel.ipset import IPSet, IpsetKernel, IpsetToolMissing, temp_name
from ...kernel.ipset import plan as ipset_plan
from ...kernel.ipset_specs import kube_ipset
from ...kernel.iptables import CANARY_CHAIN, CANARY_TABLES, IptablesKernel, KernelError, RestoreError, Snapshot
from ...kernel.sysctl import Sysctls
from ...provider import ProxierBase, SyncResult
from ...state import ProxyState
from ..iptables.compile import BUILTIN_CHAINS, OWN_STATIC_CHAINS, SERVICE_CHAIN_PREFIXES, ChainKey, IptablesConfig
from ..iptables.plan import TABLES, Plan, plan
from . import compile as ipvsc

# Chains this proxy may own in either mode. KUBE-FIREWALL (iptables mode's localnet
# guard, also written by older kubelets) is only removed by --cleanup, never by a sync.
IPTABLES_MODE_CHAINS = frozenset(OWN_STATIC_CHAINS)
OURS = IPTABLES_MODE_CHAINS | ipvsc.CHAIN_NAMES
SYNC_LEFTOVERS = OURS - {"KUBE-FIREWALL"}


class IpvsSyncError(KernelError):
    """One or more steps of an IPVS-mode sync failed (all steps were tried).
    ``iptables_restore_failed``: one of them was an iptables-restore (for the metric)."""

    def __init__(self, message: str, iptables_restore_failed: bool = False) -> None:
        super().__init__(message)
        self.iptables_restore_failed = iptables_restore_failed


@dataclass
class IpvsSyncResult(SyncResult):
    virtual_servers: int = 0
    real_servers: int = 0
    addresses: int = 0
    pending_removals: int = 0  # real servers at weight 0 waiting for their connections

    def summary(self) -> str:
        kind = "full" if self.full else "partial"
        return (f"{kind} sync (ipvs): {self.services} services, {self.virtual_servers} virtual servers, "
                f"{self.real_servers} real servers, {self.addresses} addresses on {ipvsc.DUMMY_DEVICE}, "
                f"{self.rules} rules ({self.rules_written} written, {len(self.changes)} changes) in "
                f"{self.total_seconds * 1000:.0f} ms (compile {self.compile_seconds * 1000:.0f} ms, "
                f"apply {self.apply_seconds * 1000:.0f} ms)")


# --- configuration ------------------------------------------------------------------------


def ipvs_config(cfg: Any, iptables: IptablesConfig, netns: str = "",
                addresses: Optional[Sequence[str]] = None) -> ipvsc.IpvsConfig:
    """The compiler's configuration from a ProxyConfig (``cfg``) and the iptables settings
    IPVS mode shares (masquerade bit, local-traffic detection), with the node's addresses
    read now unless ``addresses`` is given."""
    node_ips = list(node_addresses(netns) if addresses is None else addresses)
    match_all, np_ips = match_node_port_addresses(cfg.node_port_addresses, node_ips)
    node_port_ips = tuple(node_ips) if match_all else tuple(
        ip for ip in np_ips if not ipaddress.ip_address(ip).is_loopback)
    ipvs = cfg.ipvs
    return ipvsc.IpvsConfig(
        iptables=iptables, scheduler=ipvs.scheduler or ipvsc.DEFAULT_SCHEDULER, node_ips=tuple(node_ips),
        node_port_ips=node_port_ips, primary_node_ip=primary_address(node_ips),
        exclude_cidrs=tuple(c for c in ipvs.exclude_cidrs if ":" not in c), strict_arp=ipvs.strict_arp,
        tcp_timeout=ipvs.tcp_timeout, tcp_fin_timeout=ipvs.tcp_fin_timeout, udp_timeout=ipvs.udp_timeout,
    )


# --- sysctls ------------------------------------------------------------------------------------


def ipvs_sysctls(cfg: ipvsc.IpvsConfig, kernel_release: Optional[str] = None) -> Dict[str, str]:
    values = ipvsc.sysctls(cfg.strict_arp)
    reuse = ipvsc.conn_reuse_mode(kernel_release or os.uname().release)
    if reuse is not None:
        values["net/ipv4/vs/conn_reuse_mode"] = reuse
    return values


# --- iptables leftovers of the other mode ---------------------------------------------------


def _ours(chain: str, names: frozenset) -> bool:
    return chain in names or chain.startswith(SERVICE_CHAIN_PREFIXES)


def leftover_lines(snapshot: Snapshot, desired: Mapping[ChainKey, List[str]], names: frozenset = SYNC_LEFTOVERS,
                   ) -> Tuple[Dict[str, List[str]], Dict[str, List[str]], List[str]]:
    """Restore lines that remove our chains ``desired`` does not have, and jumps from
    built-in chains to chains of ours that ``desired`` does not list: (flush declarations
    per table, deletions per table, readable changes). With ``desired={}`` and all names,
    this is ``--cleanup``."""
    decls: Dict[str, List[str]] = {t: [] for t in TABLES}
    deletes: Dict[str, List[str]] = {t: [] for t in TABLES}
    changes: List[str] = []
    for (table, chain), rules in sorted(snapshot.rules.items()):
        if chain not in BUILTIN_CHAINS or table not in decls:
            continue
        want = set(desired.get((table, chain), ()))
        for r in rules:
            target = f" {r}".split(" -j ", 1)[1].split(" ", 1)[0] if " -j " in f" {r}" else ""
            if _ours(target, names) and r not in want:
                deletes[table].append(f"-D {chain} {r}")
                changes.append(f"- {table} {chain}: {r}")
    drops: Dict[str, List[str]] = {t: [] for t in TABLES}
    for table, chain in sorted(snapshot.chains):
        if table in decls and _ours(chain, names) and (table, chain) not in desired:
            decls[table].append(f":{chain} - [0:0]")
            drops[table].append(f"-X {chain}")
            changes.append(f"- {table} chain {chain} ({len(snapshot.rules.get((table, chain), []))} rules)")
    for t in TABLES:
        deletes[t] += drops[t]
    return decls, deletes, changes


def _with_leftovers(p: Plan, decls: Mapping[str, List[str]], deletes: Mapping[str, List[str]],
                    changes: List[str]) -> Plan:
    for t in TABLES:
        if decls[t] or deletes[t]:
            p.lines[t] = list(decls[t]) + p.lines[t] + list(deletes[t])
    p.changes += changes
    return p


# --- the proxier ----------------------------------------------------------------------------


def _kernel_vs(vs: ipvsc.VirtualServer) -> kipvs.VirtualServer:
    return kipvs.VirtualServer(address=vs.ip, port=vs.port, protocol=vs.protocol, scheduler=vs.scheduler,
                               flags=vs.flags, timeout=vs.timeout)


def _kernel_state(dest: ipvsc.Destination) -> kipvs.ServiceState:
    return kipvs.ServiceState(_kernel_vs(dest.service),
                              tuple(kipvs.RealServer(address=r.ip, port=r.port, weight=r.weight) for r in dest.reals))


def _excluded(address: str, cidrs: Sequence[str]) -> bool:
    if not address:
        return True  # fwmark services are never ours
    ip = ipaddress.ip_address(address)
    return any(ip in ipaddress.ip_network(c, strict=False) for c in cidrs
               if ipaddress.ip_network(c, strict=False).version == ip.version)


def _ipset(name: str, entries: Iterable[str]) -> IPSet:
    return kube_ipset(name, entries=sorted(entries))  # created as upstream creates it


class IpvsProxier(ProxierBase):
    name = "ipvs"

    def __init__(self, state: ProxyState, cfg: ipvsc.IpvsConfig, iptables: IptablesKernel, netns: str = "", *,
                 ipvs_kernel: Any = None, ipset_kernel: Any = None, link: Any = None,
                 sysctls: Optional[Sysctls] = None, clock: Callable[[], float] = time.monotonic,
                 refresh: Optional[Callable[[], ipvsc.IpvsConfig]] = None) -> None:
        super().__init__(state, cfg)
        self.iptables = iptables
        self.netns = netns
        self._ipvs = ipvs_kernel
        self._ipset = ipset_kernel
        self._link = link
        self.sysctls = sysctls or Sysctls(netns)
        self.clock = clock
        # Called at every full sync: the node's addresses decide where NodePorts listen and
        # which VIPs are bound (upstream reads them at every sync).
        self.refresh = refresh
        self.agg = ipvsc.Aggregate()
        self._canaries_made = False
        self._restore_failed = False  # an iptables-restore of the current sync failed
        self.pending: Dict[Any, float] = {}  # graceful removals: (service key, dest key) -> since
        self._sets: Dict[str, Any] = {}  # ipset name -> kernel IPSet as last applied
        self._rules: Dict[ChainKey, List[str]] = {}  # iptables rules as last applied
        self._timeouts_done = False
        # compiled destination -> its kernel form, from the last full sync (building and
        # validating 20,000 kernel objects cost seconds of every full sync at 5,000 services)
        self._kernel_states: Dict[ipvsc.Destination, kipvs.ServiceState] = {}
        # service key -> (ports, endpoints, config, result) of its last successful compile
        self._compiled: Dict[str, Tuple[Any, Any, ipvsc.IpvsConfig, ipvsc.ServiceIPVS]] = {}

    @classmethod
    def create(cls, state: ProxyState, cfg: ipvsc.IpvsConfig, ctx: Any) -> IpvsProxier:
        return cls(state, cfg, ctx.iptables, ctx.netns, refresh=ctx.refresh)

    # --- kernel handles (created on first use: pyroute2 and IPVS are only needed then) ---

    @property
    def ipvs(self) -> Any:
        if self._ipvs is None:
            self._ipvs = kipvs.IPVSKernel(self.netns)
        return self._ipvs

    @property
    def ipset(self) -> Any:
        if self._ipset is None:
            self._ipset = IpsetKernel(self.netns)
        return self._ipset

    @property
    def link(self) -> Any:
        if self._link is None:
            self._link = DummyLink(self.netns)
        return self._link

    def close(self) -> None:
        for handle in (self._ipvs, self._link):
            if handle is not None:
                handle.close()

    # --- sync ------------------------------------------------------------------------

    def _compile(self, key: str) -> Optional[ipvsc.ServiceIPVS]:
        """One service's state; a service the compiler refuses is named in ``rejected`` and
        keeps its last good state (self.agg holds what was applied), or is left out.

        compile_service is pure: a service whose ports, endpoints and config equal those
        of its last successful compile gets that result again (a full sync at 5,000
        services spent seconds in the VM lab recompiling what had not changed)."""
        ports, eps = self.state.ports_of(key), self.state.endpoints_for(key)
        memo = self._compiled.get(key)
        if (memo is not None and key in self.state.services and (memo[2] is self.cfg or memo[2] == self.cfg)
                and memo[0] == ports and memo[1] == eps):
            self.rejected.pop(key, None)
            return memo[3]
        self._compiled.pop(key, None)

        def compile_fn() -> ipvsc.ServiceIPVS:
            result = ipvsc.compile_service(ports, eps, self.cfg)
            self._compiled[key] = (ports, eps, self.cfg, result)
            return result
        return self._compile_checked(key, compile_fn, self.agg.services.get(key))

    def sync(self, force_full: bool = False) -> IpvsSyncResult:
        start = time.monotonic()
        changed = self.state.take_changes()
        full = self._begin(force_full)
        self._restore_failed = False
        try:
            if full:
                # the whole sync, not only the compile: parsing 10,000+ listed kernel objects
                # with the collector on cost as much again (nothing here makes cycles)
                with paused_gc():
                    result = self._full_sync(start)
            else:
                result = self._partial_sync(changed, start)
        except Exception:
            self._requeue(changed)
            raise
        return self._done(result, changed)

    def check(self) -> bool:
        """The every-second check (as iptables mode's, and upstream's IPVS Monitor): True when
        a KUBE-PROXY-CANARY chain or the kube-ipvs0 link is gone, i.e. something flushed our
        iptables rules or deleted the link, and the next sync must be a full one. Costs the
        same at 1 or 10,000 services (three ``iptables -S`` and one netlink lookup)."""
        if self.need_full or not self._canaries_made:
            return False  # a full sync is due anyway, or none has run: no canaries to look at
        missing = self.iptables.missing_canaries()
        if missing:  # None: undecided (lock held): look again next time
            self.pending_repair = f"canary KUBE-PROXY-CANARY missing in {', '.join(missing)}"
        elif self.link.index() is None:
            self.pending_repair = f"link {ipvsc.DUMMY_DEVICE} missing"
        return bool(self.pending_repair)

    def _full_sync(self, start: float) -> IpvsSyncResult:
        t0 = time.monotonic()
        kept = ""
        if self.refresh is not None:
            try:
                self.cfg = self.refresh()
            except (KernelError, ValueError) as e:  # keep the addresses we know; the sync may still work
                kept = f"! node addresses not re-read ({e}): keeping the last ones"
        agg = ipvsc.Aggregate()
        self._forget_gone_rejections()
        with paused_gc():  # see gcpause.py: the collector's scans were half of a large compile
            for key in self.state.service_keys():
                agg.add(key, self._compile(key))
            self._compiled = {k: v for k, v in self._compiled.items() if k in self.state.services}
            desired = agg.desired(self.cfg)
        compile_s = time.monotonic() - t0
        self.agg = agg
        errors: List[str] = []
        changes: List[str] = [kept] if kept else []
        t1 = time.monotonic()

        # 1. sysctls and the dummy link; without them nothing else works.
        try:
            self.ipvs.info()  # loads ip_vs (generic netlink family lookup) or says why not
            for key, change in self.sysctls.ensure(ipvs_sysctls(self.cfg)).items():
                changes.append(f"~ sysctl {key}: {change}")
            if self.link.ensure():
                changes.append(f"+ link {ipvsc.DUMMY_DEVICE}")
        except Exception as e:
            raise IpvsSyncError(f"IPVS mode cannot start: {e}") from e
        self._ipvs_timeouts(changes, errors)

        # 2. ipsets: every set exists; a set whose content differs is swapped in whole.
        rules_written = 0
        try:
            current = self.ipset.save()
            ours = {n: s for n, s in current.items()
                    if n in ipvsc.IPSET_BY_NAME or n in {temp_name(x) for x in ipvsc.IPSET_NAMES}}
            p = ipset_plan(ours, [_ipset(n, desired.ipsets[n]) for n in ipvsc.IPSET_NAMES],
                           exclusive=True, atomic=True)
            if not p.empty:
                self.ipset.restore(p.lines)
            changes += [f"~ ipset {c}" for c in p.changes]
            self._sets = {n: c.after for n, c in p.sets.items() if c.after is not None}
        except Exception as e:
            self._sets = {}
            errors.append(f"ipsets: {e}")

        # 3. virtual services and real servers.
        try:
            current_vs = self.ipvs.services()
            known = self._kernel_states
            self._kernel_states = {d: known.get(d) or _kernel_state(d) for d in desired.virtual_servers.values()}
            want = list(self._kernel_states.values())
            changes += self._apply_ipvs(current_vs, want, lambda vs: not _excluded(vs.address, self.cfg.exclude_cidrs)
                                        and vs.family == (6 if self.cfg.ipv6 else 4), errors)
        except Exception as e:
            errors.append(f"IPVS: {e}")

        # 4. bind the VIPs (after their virtual services exist).
        bound: Set[str] = set()
        try:
            bound = self.link.addresses()
            for ip in self.link.add(desired.addresses - bound):
                changes.append(f"+ {ipvsc.DUMMY_DEVICE} {ip}")
        except Exception as e:
            errors.append(f"{ipvsc.DUMMY_DEVICE} addresses: {e}")

        # 5. iptables: reconcile with what the kernel has; remove the other mode's leftovers.
        try:
            snap = self.iptables.snapshot()
            ip_plan = plan(snap.rules, desired.rules, merge=False, existing=snap.chains, collect_stale=False)
            ip_plan = _with_leftovers(ip_plan, *leftover_lines(snap, desired.rules))
            if not ip_plan.empty:
                self.iptables.restore(ip_plan.text())
            rules_written = ip_plan.rules_written
            changes += ip_plan.changes
            self._rules = {k: list(v) for k, v in desired.rules.items()}
        except Exception as e:
            self._rules = {}
            self._restore_failed |= isinstance(e, RestoreError)
            errors.append(f"iptables: {e}")

        # 6. the canaries mark rules that are all there (check() looks for them).
        if not errors:
            try:
                missing = self.iptables.missing_canaries(CANARY_TABLES)
                if missing:
                    self.iptables.create_canaries(missing)
                self._canaries_made = True
            except Exception as e:
                errors.append(f"canary: {e}")

        # 7. unbind what no service uses any more.
        return self._finish(True, bound - desired.addresses, changes, errors, rules_written, compile_s, t1, start)

    def _partial_sync(self, changed: Set[str], start: float) -> IpvsSyncResult:
        t0 = time.monotonic()
        deltas = [self.agg.set(key, self._compile(key)) for key in sorted(changed)]
        compile_s = time.monotonic() - t0
        t1 = time.monotonic()
        errors: List[str] = []
        changes: List[str] = []
        rules_written = 0

        vs_changes: Dict[ipvsc.VSKey, Optional[ipvsc.Destination]] = {}
        added: Dict[str, Set[str]] = {}
        removed: Dict[str, Set[str]] = {}
        addr_added: Set[str] = set()
        addr_removed: Set[str] = set()
        rules_changed = False
        for d in deltas:
            vs_changes.update(d.virtual_servers)
            for name, entries in d.entries_added.items():
                added.setdefault(name, set()).update(entries)
                removed.get(name, set()).difference_update(entries)
            for name, entries in d.entries_removed.items():
                removed.setdefault(name, set()).update(entries)
                added.get(name, set()).difference_update(entries)
            addr_added = (addr_added - d.addresses_removed) | d.addresses_added
            addr_removed = (addr_removed - d.addresses_added) | d.addresses_removed
            rules_changed = rules_changed or d.rules_inputs_changed
        if addr_added or addr_removed:
            added.setdefault(ipvsc.KUBE_IPVS_IPS, set()).update(addr_added)
            removed.setdefault(ipvsc.KUBE_IPVS_IPS, set()).update(addr_removed)

        # ipset entries first (rules may start to use a set that becomes non-empty).
        try:
            names = sorted(n for n in set(added) | set(removed) if added.get(n) or removed.get(n))
            if names:
                p = ipset_plan({n: self._sets[n] for n in names if n in self._sets},
                               [_ipset(n, added.get(n, ())) for n in names], exclusive=False,
                               remove={n: sorted(removed.get(n, ())) for n in names if removed.get(n)})
                if not p.empty:
                    self.ipset.restore(p.lines)
                for n, c in p.sets.items():
                    if c.after is not None:
                        self._sets[n] = c.after
                changes += [f"~ ipset {n}: +{len(added.get(n, ()))} -{len(removed.get(n, ()))}" for n in names]
        except Exception as e:
            errors.append(f"ipsets: {e}")

        try:
            if vs_changes:
                current = []
                for vk in sorted(vs_changes):
                    found = self.ipvs.get(_kernel_vs(ipvsc.VirtualServer(*vk)))
                    if found is not None:
                        current.append(found)
                want = [_kernel_state(d) for d in vs_changes.values() if d is not None]
                gone = {(6 if ":" in ip else 4, proto, ip, port, 0) for (proto, ip, port), d in vs_changes.items()
                        if d is None}
                changes += self._apply_ipvs(
                    current, want, lambda vs: vs.key in gone and not _excluded(vs.address, self.cfg.exclude_cidrs),
                    errors)
        except Exception as e:
            errors.append(f"IPVS: {e}")

        try:
            for ip in self.link.add(addr_added):
                changes.append(f"+ {ipvsc.DUMMY_DEVICE} {ip}")
        except Exception as e:
            errors.append(f"{ipvsc.DUMMY_DEVICE} addresses: {e}")

        if rules_changed:
            try:
                rules = self.agg.rules(self.cfg)
                ip_plan = plan(self._rules, rules, merge=False, existing=set(self._rules), collect_stale=False)
                if not ip_plan.empty:
                    self.iptables.restore(ip_plan.text())
                rules_written = ip_plan.rules_written
                changes += ip_plan.changes
                self._rules = {k: list(v) for k, v in rules.items()}
            except Exception as e:
                self._restore_failed |= isinstance(e, RestoreError)
                errors.append(f"iptables: {e}")

        return self._finish(False, addr_removed, changes, errors, rules_written, compile_s, t1, start)

    def _finish(self, full: bool, unbind: Iterable[str], changes: List[str], errors: List[str],
                rules_written: int, compile_s: float, apply_start: float, start: float) -> IpvsSyncResult:
        """The last step of both syncs: unbind addresses no service uses any more (after the
        virtual services and rules that used them are gone), then report or fail."""
        try:
            for ip in self.link.remove(unbind):
                changes.append(f"- {ipvsc.DUMMY_DEVICE} {ip}")
        except Exception as e:
            errors.append(f"{ipvsc.DUMMY_DEVICE} addresses: {e}")
        apply_s = time.monotonic() - apply_start
        if errors:
            raise IpvsSyncError(f"{'full' if full else 'partial'} sync failed: " + "; ".join(errors),
                                iptables_restore_failed=self._restore_failed)
        return self._result(full, changes, rules_written, compile_s, apply_s, start)

    def _apply_ipvs(self, current: List[Any], want: List[Any], delete: Callable[[Any], bool],
                    errors: List[str]) -> List[str]:
        p = kipvs.plan(current, want, delete_services=delete, graceful=kipvs.Graceful(), pending=self.pending,
                       now=self.clock())
        result = self.ipvs.apply(p.ops)
        self.pending = dict(p.pending)
        for op, err in result.errors:
            errors.append(f"ipvsadm {op}: {err}")
        return [f"ipvs {op}" for op in p.ops]

    def _ipvs_timeouts(self, changes: List[str], errors: List[str]) -> None:
        """ipvs.tcpTimeout/tcpFinTimeout/udpTimeout (netlink, as ``ipvsadm --set``; 0 keeps a value)."""
        cfg = self.cfg
        if self._timeouts_done or not (cfg.tcp_timeout or cfg.tcp_fin_timeout or cfg.udp_timeout):
            return
        try:
            self.ipvs.set_timeouts(int(cfg.tcp_timeout), int(cfg.tcp_fin_timeout), int(cfg.udp_timeout))
        except (kipvs.IPVSError, ValueError) as e:
            errors.append(f"IPVS timeouts: {e}")
            return
        self._timeouts_done = True
        changes.append(f"~ ipvs timeouts tcp {int(cfg.tcp_timeout)} tcpfin {int(cfg.tcp_fin_timeout)} "
                       f"udp {int(cfg.udp_timeout)}")

    def _result(self, full: bool, changes: List[str], rules_written: int, compile_s: float, apply_s: float,
                start: float) -> IpvsSyncResult:
        vss = self.agg.virtual_servers()
        return IpvsSyncResult(
            full=full, services=len(self.state.services),
            endpoints=sum(s.endpoints for s in self.agg.services.values()),
            rules=sum(n for n in self.rule_counts().values()), rules_written=rules_written, changes=changes,
            compile_seconds=compile_s, apply_seconds=apply_s, total_seconds=time.monotonic() - start,
            no_endpoint_ports=sum(s.no_endpoint_ports for s in self.agg.services.values()),
            virtual_servers=len(vss), real_servers=sum(len(d.reals) for d in vss.values()),
            addresses=len(self.agg.addresses()), pending_removals=len(self.pending),
        )

    def rule_counts(self) -> Dict[str, int]:
        """iptables rules we own per table (built-in chains' jumps not counted)."""
        rules = self._rules or self.agg.rules(self.cfg)
        counts: Dict[str, int] = {}
        for (table, chain), lines in rules.items():
            if chain not in BUILTIN_CHAINS:
                counts[table] = counts.get(table, 0) + len(lines)
        return counts

    # --- cleanup -------------------------------------------------------------------------

    def cleanup(self, leftovers_only: bool = False) -> int:
        """Remove what IPVS mode (and iptables mode) creates: virtual services (those inside
        ``excludeCIDRs`` stay), ``kube-ipvs0``, our chains and jumps in both tables, then our
        ipsets (a set still used by a rule cannot go, so rules go first). Returns the number
        of objects removed. IPVS missing from the kernel is not an error here; with
        ``leftovers_only`` (another mode is configured) neither are a missing pyroute2 or
        ipset command: IPVS mode needs both, so it never ran here. Nor, then, are virtual
        services ours unless ``kube-ipvs0`` exists (IPVS mode always makes it): virtual
        services of a host's own load balancer (keepalived) stay."""
        removed = 0
        errors: List[str] = []
        try:
            if leftovers_only and self.link.index() is None:
                pass  # IPVS mode never ran here (or was cleaned up): no virtual service is ours
            elif self.cfg.exclude_cidrs:
                services = [s for s in self.ipvs.services() if not _excluded(s.virtual.address, self.cfg.exclude_cidrs)]
                result = self.ipvs.apply([kipvs.Op(kipvs.DELETE_SERVICE, s.virtual) for s in services])
                removed += result.applied
                errors += [str(err) for _op, err in result.errors]
            else:
                removed += len(self.ipvs.virtual_servers())
                self.ipvs.flush()
        except (kipvs.IPVSUnavailable, LinkUnavailable):
            pass  # no IPVS in this kernel, or no pyroute2: IPVS mode cannot have run
        except Exception as e:
            errors.append(f"IPVS: {e}")
        try:
            if self.link.delete():
                removed += 1
        except LinkUnavailable as e:
            if not leftovers_only:
                errors.append(f"{ipvsc.DUMMY_DEVICE}: {e}")
        except Exception as e:
            if getattr(e, "code", None) != errno.EOPNOTSUPP:
                errors.append(f"{ipvsc.DUMMY_DEVICE}: {e}")
        try:
            snap = self.iptables.snapshot()
            decls, deletes, _changes = leftover_lines(snap, {}, OURS)
            p = _with_leftovers(Plan(), decls, deletes, [])
            if not p.empty:
                self.iptables.restore(p.text())
            removed += sum(line.startswith("-X ") for t in TABLES for line in p.lines[t])
            present = [t for t in CANARY_TABLES if t not in (self.iptables.missing_canaries(CANARY_TABLES) or ())]
            if present:  # the canaries (both modes make them), after the rules above
                self.iptables.restore("".join(f"*{t}\n:{CANARY_CHAIN} - [0:0]\n-X {CANARY_CHAIN}\nCOMMIT\n"
                                              for t in present))
                removed += len(present)
        except Exception as e:
            errors.append(f"iptables: {e}")
        self._canaries_made = False
        try:
            existing = set(self.ipset.names())
            candidates = [x for name in ipvsc.IPSET_NAMES for x in (name, temp_name(name))]
            names = [n for n in candidates if n in existing]
            if names:
                self.ipset.restore([f"destroy {n}" for n in names])
                removed += len(names)
        except IpsetToolMissing as e:
            if not leftovers_only:
                errors.append(f"ipsets: {e}")
        except Exception as e:
            errors.append(f"ipsets: {e}")
        self.agg = ipvsc.Aggregate()
        self._compiled = {}
        self._kernel_states = {}
        self._sets = {}
        self._rules = {}
        self.pending = {}
        self.need_full = True
        if errors:
            raise IpvsSyncError("cleanup incomplete: " + "; ".join(errors))
        return removed


# --- the mode registry's hook (modes/__init__.py) -----------------------------------------


def cleanup_ipvs(ctx: Any) -> int:
    """Upstream's IPVS-mode cleanup: virtual services (those inside ``ipvs.excludeCIDRs``
    stay), kube-ipvs0, the KUBE chains of both modes and their jumps, the ipsets."""
    exclude = tuple(ctx.config.ipvs.exclude_cidrs) if ctx.config is not None else ()
    proxier = IpvsProxier(ProxyState(""), ipvsc.IpvsConfig(iptables=IptablesConfig(), exclude_cidrs=exclude),
                          ctx.iptables, ctx.netns)
    try:
        return proxier.cleanup(leftovers_only=ctx.leftovers_only)
    finally:
        proxier.close()
