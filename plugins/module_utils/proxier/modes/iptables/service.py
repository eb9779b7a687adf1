# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One Service's rules on a host that may hold many: what the kernel has for it, what it
should have, and the plan between them (the k8s_service_iptables module's core).

A service's rules are found in the kernel by their comments in the shared chains
(``"ns/name:port ..."``) and by following jumps from there, so other services' rules and
other software's rules are never in scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Set

from ...kernel.iptables import Snapshot, jump_targets
from ...model import Service
from ...state import ProxyState
from . import compile as ipt
from .plan import Plan, Rules, plan, render

# Owned node-wide chains the module keeps exact; shared chains are only touched for the
# service's own rules.
INFRA_OWNED = (ipt.KUBE_MARK_MASQ, ipt.KUBE_POSTROUTING, ipt.KUBE_FORWARD, ipt.KUBE_FIREWALL)


def _belongs(rule: str, prefix: str) -> bool:
    marker = f'--comment "{prefix}'
    i = rule.find(marker)
    if i < 0:
        return False
    nxt = rule[i + len(marker):i + len(marker) + 1]
    return nxt in (":", " ", '"')


def current_for_service(snapshot: Snapshot, namespace: str, name: str, known_chains: Set[str]) -> Rules:
    """The kernel's rules for one service: its rules in shared chains and its own chains."""
    prefix = f"{namespace}/{name}"
    out: Rules = {}
    frontier: List[ipt.ChainKey] = []
    for key, rules in snapshot.rules.items():
        table, chain = key
        if chain not in ipt.SHARED_CHAINS:
            continue
        mine = [r for r in rules if _belongs(r, prefix)]
        if mine:
            out[key] = mine
            frontier += [(table, t) for t in jump_targets({key: mine}, key)]
    frontier += [(ipt.NAT, c) for c in known_chains]
    seen: Set[ipt.ChainKey] = set()
    while frontier:
        key = frontier.pop()
        if key in seen or not key[1].startswith(ipt.SERVICE_CHAIN_PREFIXES) or key not in snapshot.rules:
            continue
        seen.add(key)
        out[key] = list(snapshot.rules[key])
        frontier += [(key[0], t) for t in jump_targets(snapshot.rules, key)]
    return out


@dataclass
class ServicePlan:
    plan: Plan
    before: Rules
    after: Rules

    @property
    def chains(self) -> List[str]:
        return sorted({chain for (_table, chain) in self.after if chain.startswith(ipt.SERVICE_CHAIN_PREFIXES)})

    @property
    def rule_counts(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for (table, chain), rules in self.after.items():
            if chain not in ipt.BUILTIN_CHAINS:
                counts[f"{table}/{chain}"] = len(rules)
        return counts

    def diff(self) -> Dict[str, str]:
        return {"before": render(self.before, include_builtin=True), "after": render(self.after, include_builtin=True)}


def plan_service(snapshot: Snapshot, service: Service, state: ProxyState, cfg: ipt.IptablesConfig,
                 present: bool) -> ServicePlan:
    key = f"{service.namespace}/{service.name}"
    known = set()
    for sp in service.ports:
        n, proto = str(sp.name), sp.protocol
        known |= {ipt.svc_chain(n, proto), ipt.svl_chain(n, proto), ipt.ext_chain(n, proto), ipt.fw_chain(n, proto)}
    before = current_for_service(snapshot, service.namespace, service.name, known)
    after: Rules = {}
    if present:
        infra = ipt.infrastructure(cfg)
        for k, rules in infra.items():
            if k[1] in ipt.BUILTIN_CHAINS:
                after[k] = rules
                have = set(snapshot.rules.get(k, []))
                before[k] = [r for r in rules if r in have]  # our jumps only, in our order
            elif k[1] in ipt.SHARED_CHAINS:
                after.setdefault(k, [])  # must exist: the built-in jumps point at it
                if k in snapshot.chains:
                    before.setdefault(k, [])
            elif k[1] in INFRA_OWNED:
                after[k] = rules
                if k in snapshot.rules:
                    before[k] = list(snapshot.rules[k])
        compiled = ipt.compile_service(state.ports_of(key), state.endpoints_for(key), cfg)
        for k, rules in compiled.chains.items():
            after[k] = rules
        for k, rules in compiled.shared.items():
            after.setdefault(k, []).extend(rules)
        tail_key = (ipt.NAT, ipt.KUBE_SERVICES)
        tail = ipt.nodeports_tail(cfg)
        have_tail = [r for r in snapshot.rules.get(tail_key, []) if r in tail]
        after.setdefault(tail_key, []).extend(tail)
        if have_tail:
            before.setdefault(tail_key, []).extend(have_tail)
    p = plan(before, after, merge=True, existing=snapshot.chains)
    return ServicePlan(p, before, after)
