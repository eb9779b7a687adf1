# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What was applied vs what is wanted -> one ``nft -f`` transaction.

A full sync replaces the table (compile.render_full). A partial sync touches only the
services that changed: map and set elements are deleted/added one by one, a service chain
whose rules changed is flushed and rewritten, new chains and affinity sets are declared
first (rules refer to them), and objects that went are flushed, then deleted at the end of
the same transaction, once no element or rule of the transaction refers to them any more
(the kernel checks references at commit: measured by the partial-sync tests). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .compile import SHARED_ELEMENT_SETS, ServiceNft, elements_text, set_kind

Refs = Dict[str, Dict[str, int]]  # shared set -> element -> how many services add it


@dataclass
class Plan:
    text: str = ""
    changes: List[str] = field(default_factory=list)  # one line per object touched
    rules_written: int = 0
    # How the counts of shared-set elements change once this plan is applied (apply_refs()).
    ref_delta: Refs = field(default_factory=dict)
    # When the transaction is element updates only (an endpoint replaced): (verb, set,
    # elements) in the text's order, for a writer that needs no nft (kernel/nft_netlink.py).
    element_ops: List[Tuple[str, str, List[str]]] = field(default_factory=list)


def count_refs(compiled: Dict[str, ServiceNft]) -> Refs:
    refs: Refs = {}
    for svc in compiled.values():
        for where in SHARED_ELEMENT_SETS:
            counts = refs.setdefault(where, {})
            for e in svc.elements.get(where, ()):
                counts[e] = counts.get(e, 0) + 1
    return refs


def apply_refs(refs: Refs, delta: Refs) -> None:
    """``refs`` after a plan's transaction was applied (only the touched elements: a copy
    of 40,000 counts per sync would cost more than the plan)."""
    for where, changes in delta.items():
        counts = refs.setdefault(where, {})
        for e, d in changes.items():
            n = counts.get(e, 0) + d
            if n > 0:
                counts[e] = n
            else:
                counts.pop(e, None)


def plan_partial(head: str, old: Dict[str, Optional[ServiceNft]], new: Dict[str, Optional[ServiceNft]],
                 refs: Optional[Refs] = None) -> Plan:
    """``old``/``new``: per changed service key, what the kernel has and what is wanted
    (None: nothing); ``refs``: count_refs() of what the kernel has (not changed here).
    Returns the transaction ("" when nothing differs)."""
    refs = refs or {}
    delta: Refs = {where: {} for where in SHARED_ELEMENT_SETS}
    declare: List[str] = []
    delete_elems: Dict[str, List[str]] = {}
    add_elems: Dict[str, List[str]] = {}
    rules: List[str] = []
    flush_gone: List[str] = []
    delete_gone: List[str] = []
    changes: List[str] = []
    written = 0
    empty = ServiceNft()
    for key in sorted(set(old) | set(new)):
        o = old.get(key) or empty
        n = new.get(key) or empty
        for where in sorted(set(o.elements) | set(n.elements)):
            before = o.elements.get(where, [])
            after = n.elements.get(where, [])
            if before == after:
                continue
            after_set = set(after)
            before_set = set(before)
            gone = [e for e in before if e not in after_set]
            added = [e for e in after if e not in before_set]
            if where in delta:
                d = delta[where]
                for e in gone:
                    d[e] = d.get(e, 0) - 1
                for e in added:
                    d[e] = d.get(e, 0) + 1
                continue
            if gone:
                # A map element is deleted by its key alone.
                delete_elems.setdefault(where, []).extend(e.split(" : ", 1)[0] for e in gone)
                changes.append(f"-{where} {len(gone)} element(s) of {key}")
            if added:
                add_elems.setdefault(where, []).extend(added)
                changes.append(f"+{where} {len(added)} element(s) of {key}")
        for name, decl in n.sets.items():
            if name not in o.sets:
                declare.append(f"add {set_kind(decl)} {head} {name} {{ {decl} }}")
                changes.append(f"+set {name}")
        for name, body in n.chains.items():
            was = o.chains.get(name)
            if was == body:
                continue
            if was is None:
                declare.append(f"add chain {head} {name}")
                changes.append(f"+chain {name}")
            else:
                rules.append(f"flush chain {head} {name}")
                changes.append(f"~chain {name}")
            rules.extend(f"add rule {head} {name} {r}" for r in body)
            written += len(body)
        for name in o.chains:
            if name not in n.chains:
                flush_gone.append(f"flush chain {head} {name}")
                delete_gone.append(f"delete chain {head} {name}")
                changes.append(f"-chain {name}")
        for name in o.sets:
            if name not in n.sets:
                delete_gone.append(f"delete {set_kind(o.sets[name])} {head} {name}")
                changes.append(f"-set {name}")
    for where, d in delta.items():
        was = refs.get(where, {})
        for e in sorted(d):
            before = was.get(e, 0)
            after = before + d[e]
            if after > 0 and before <= 0:
                add_elems.setdefault(where, []).append(e)
                changes.append(f"+{where} {e}")
            elif after <= 0 and before > 0:
                delete_elems.setdefault(where, []).append(e)
                changes.append(f"-{where} {e}")
    lines = list(declare)
    for where in sorted(delete_elems):
        lines.extend(elements_text(head, "delete", where, delete_elems[where]))
    lines.extend(rules)
    for where in sorted(add_elems):
        lines.extend(elements_text(head, "add", where, add_elems[where]))
    lines.extend(flush_gone)
    lines.extend(delete_gone)
    ops: List[Tuple[str, str, List[str]]] = []
    if not declare and not rules and not flush_gone and not delete_gone:
        ops = [("delete", w, delete_elems[w]) for w in sorted(delete_elems)]
        ops += [("add", w, add_elems[w]) for w in sorted(add_elems)]
    return Plan("\n".join(lines) + "\n" if lines else "", changes, written, delta, ops)
