# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One Service's objects in a ``kube-proxy`` table that may hold many (the
k8s_service_nftables module's core). Pure: the caller lists the tables.

What belongs to the service: its chains and affinity sets, found by name (upstream's
``service-HASH-ns/name/proto/port`` scheme), and its elements of the shared maps and sets,
found by the element comment ``ns/name`` that only this module writes (upstream comments
its elements the same way). The node-wide objects are kept exact; everything else in the
table (other services, elements without our comment) is left alone, and a key another
owner holds is a conflict, not an overwrite.

Both sides are compared as ``nft list table`` prints them: the wanted table is loaded into
a scratch network namespace and listed by the same nft (kernel/nft.py), so the comparison
and the diff never depend on how this nft version prints a rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import compile as nc

SERVICE_OBJECT = re.compile(r"^(service|external|local|firewall|endpoint|affinity)-[A-Z0-9]{8}-")


@dataclass
class Obj:
    """A chain, set or map as ``nft list table`` prints it."""

    kind: str  # chain, set, map
    name: str
    decl: List[str] = field(default_factory=list)  # type/flags/comment/policy lines
    rules: List[str] = field(default_factory=list)
    elements: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Elem:
    key: str
    comment: str
    text: str  # as listed


def _split_elements(body: str) -> List[str]:
    """``a, b : goto c, d`` -> elements (commas inside quotes or braces do not split)."""
    out: List[str] = []
    depth = 0
    quoted = False
    cur = []
    for ch in body:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "{":
            depth += 1
        elif not quoted and ch == "}":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_table(text: str) -> Dict[str, Obj]:
    """``nft list table`` output -> objects by name, in listed order."""
    objs: Dict[str, Obj] = {}
    cur: Optional[Obj] = None
    pending = ""  # an element list spanning lines
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if pending:
            pending += " " + line
            if pending.count("{") <= pending.count("}"):
                body = pending[pending.index("{") + 1:pending.rindex("}")]
                if cur is not None:
                    cur.elements.extend(_split_elements(body))
                pending = ""
            continue
        head = line.split(" ", 1)[0]
        if cur is None:
            if head in ("chain", "set", "map") and line.endswith("{"):
                name = line[len(head) + 1:-1].strip()
                cur = objs[name] = Obj(head, name)
            continue
        if line == "}":
            cur = None
        elif line.startswith("elements = {"):
            pending = line
            if pending.count("{") <= pending.count("}"):
                cur.elements.extend(_split_elements(pending[pending.index("{") + 1:pending.rindex("}")]))
                pending = ""
        elif cur.kind != "chain" or head in ("type", "comment", "policy"):
            cur.decl.append(line)
        else:
            cur.rules.append(line)
    return objs


_COMMENT = re.compile(r'^(.*?) comment "((?:[^"\\]|\\.)*)"(.*)$')


def parse_element(text: str) -> Elem:
    m = _COMMENT.match(text)
    if m:
        return Elem(m.group(1).strip(), m.group(2), text)
    return Elem(text.split(" : ", 1)[0].strip(), "", text)


def owner(namespace: str, name: str) -> str:
    """The element comment naming the service."""
    return f"{namespace}/{name}"


def owns_object(namespace: str, name: str, obj_name: str) -> bool:
    m = SERVICE_OBJECT.match(obj_name)
    return bool(m) and obj_name[m.end():].startswith(f"{namespace}/{name}/")


def with_comments(svc: nc.ServiceNft, who: str) -> nc.ServiceNft:
    """The service's elements with the owner comment (``key comment "ns/name" : verdict``)."""
    out = nc.ServiceNft(chains=svc.chains, sets=svc.sets, endpoints=svc.endpoints,
                        no_endpoint_ports=svc.no_endpoint_ports)
    for where, elems in svc.elements.items():
        for e in elems:
            key, sep, value = e.partition(" : ")
            out.element(where, f'{key} comment "{who}"' + (f" : {value}" if sep else ""))
    return out


@dataclass
class View:
    """The service's part of a table (and the node-wide objects)."""

    chains: Dict[str, List[str]] = field(default_factory=dict)
    sets: Dict[str, Obj] = field(default_factory=dict)
    elements: Dict[str, Dict[str, Elem]] = field(default_factory=dict)  # map/set -> key -> ours


def view(objs: Dict[str, Obj], namespace: str, name: str) -> View:
    who = owner(namespace, name)
    v = View()
    for obj in objs.values():
        if owns_object(namespace, name, obj.name):
            if obj.kind == "chain":
                v.chains[obj.name] = obj.rules
            else:
                v.sets[obj.name] = obj
            continue
        for text in obj.elements:
            el = parse_element(text)
            if el.comment == who:
                v.elements.setdefault(obj.name, {})[el.key] = el
    return v


@dataclass
class ServicePlan:
    text: str
    changes: List[str]
    before: str
    after: str
    chains: List[str]
    sets: List[str]
    element_counts: Dict[str, int]
    conflicts: List[str]


def render(objs: Optional[Dict[str, Obj]], family: str, v: View, infra: nc.Infrastructure) -> str:
    """The service's objects and the node-wide ones as nft prints them (only the service's
    and the node's own elements of the shared maps; runtime affinity entries left out)."""
    if objs is None:
        return ""
    lines = [f"table {family} {nc.TABLE} {{"]
    for obj in objs.values():
        ours = obj.name in v.chains or obj.name in v.sets
        node_wide = obj.name in infra.sets or obj.name in infra.chains
        if not ours and not node_wide:
            continue
        lines.append(f"\t{obj.kind} {obj.name} {{")
        lines.extend(f"\t\t{d}" for d in obj.decl)
        if node_wide and obj.kind != "chain":
            elems = sorted(e.text for e in v.elements.get(obj.name, {}).values())
            elems += sorted(t for t in obj.elements if not parse_element(t).comment)
            if elems:
                lines.append("\t\telements = { " + ",\n\t\t\t     ".join(elems) + " }")
        lines.extend(f"\t\t{r}" for r in obj.rules)
        lines.append("\t}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def plan_service(head: str, current: Optional[Dict[str, Obj]], wanted: Optional[Dict[str, Obj]],
                 compiled: Optional[nc.ServiceNft], infra: nc.Infrastructure, namespace: str,
                 name: str) -> ServicePlan:
    """``current``: parse_table() of the host's table (None: no table); ``wanted``: of the
    scratch table holding the node-wide objects and this service alone (None: the service
    is to be absent); ``compiled``: with_comments() of the service (the input text of what
    is added); ``infra``: compile.infrastructure() of the same config."""
    family = head.split(" ", 1)[0]
    cur_objs = current or {}
    cur = view(cur_objs, namespace, name)
    want = view(wanted, namespace, name) if wanted is not None else View()
    compiled = compiled or nc.ServiceNft()
    changes: List[str] = []
    conflicts: List[str] = []
    declare: List[str] = []
    del_elems: Dict[str, List[str]] = {}
    flush: List[str] = []
    reset_sets: List[str] = []
    rules: List[str] = []
    add_elems: Dict[str, List[str]] = {}
    delete_end: List[str] = []

    if wanted is not None:
        # The node-wide objects: created when missing, their rules and elements kept exact.
        if current is None:
            declare.append(f'add table {head} {{ comment "rules for kube-proxy" ; }}')
            changes.append(f"+table {head}")
        for sname, decl in infra.sets.items():
            if sname not in cur_objs:
                declare.append(f"add {nc.set_kind(decl)} {head} {sname} {{ {decl} }}")
                changes.append(f"+set {sname}")
        for cname, decl in infra.chains.items():
            have = cur_objs.get(cname)
            if have is None:
                declare.append(f"add chain {head} {cname}" + (f" {{ {decl} }}" if decl else ""))
                changes.append(f"+chain {cname}")
            elif cname in wanted and have.rules == wanted[cname].rules:
                continue
            else:
                flush.append(f"flush chain {head} {cname}")
                changes.append(f"~chain {cname}")
            rules.extend(f"add rule {head} {cname} {r}" for r in infra.rules.get(cname, []))
        for sname in infra.sets:
            want_own = {parse_element(t).key: t for t in (wanted[sname].elements if sname in wanted else ())
                        if not parse_element(t).comment}
            have_own = {} if sname not in cur_objs else {
                parse_element(t).key: t for t in cur_objs[sname].elements if not parse_element(t).comment}
            if sname not in infra.elements and not have_own:
                continue  # a set of the services' elements only
            gone = [k for k in have_own if k not in want_own]
            if gone and sname in infra.elements:
                del_elems.setdefault(sname, []).extend(gone)
                changes.append(f"-{sname} {', '.join(gone)}")
            added = [e for e in infra.elements.get(sname, []) if parse_element(e).key not in have_own]
            if added:
                add_elems.setdefault(sname, []).extend(added)
                changes.append(f"+{sname} {', '.join(added)}")

    # The service's elements: its own (by comment) deleted or added by key; a key that
    # someone else holds is a conflict.
    inputs = {where: {parse_element(e).key: e for e in elems} for where, elems in compiled.elements.items()}
    for where in sorted(set(cur.elements) | set(want.elements)):
        have = cur.elements.get(where, {})
        wants = want.elements.get(where, {})
        for key, el in have.items():
            if key not in wants or wants[key].text != el.text:
                del_elems.setdefault(where, []).append(key)
                changes.append(f"-{where} {el.text}")
        others = {}
        if where in cur_objs:
            for t in cur_objs[where].elements:
                e = parse_element(t)
                others[e.key] = e
        for key, el in wants.items():
            if key in have and have[key].text == el.text:
                continue
            other = others.get(key)
            if other is not None and key not in have:
                conflicts.append(f"{where} {key} is held by {other.comment or 'an element without owner comment'}")
                continue
            add_elems.setdefault(where, []).append(inputs.get(where, {}).get(key, el.text))
            changes.append(f"+{where} {el.text}")

    # Affinity sets: a changed declaration is deleted and re-added, after every chain of the
    # service (which may refer to it) was flushed.
    changed_sets = [s for s in want.sets if s in cur.sets and cur.sets[s].decl != want.sets[s].decl]
    for sname in want.sets:
        if sname not in cur.sets:
            declare.append(f"add set {head} {sname} {{ {compiled.sets[sname]} }}")
            changes.append(f"+set {sname}")
    for sname in changed_sets:
        reset_sets += [f"delete set {head} {sname}", f"add set {head} {sname} {{ {compiled.sets[sname]} }}"]
        changes.append(f"~set {sname}")
    for cname, body in want.chains.items():
        was = cur.chains.get(cname)
        if was == body and not changed_sets:
            continue
        if was is None:
            declare.append(f"add chain {head} {cname}")
            changes.append(f"+chain {cname}")
        else:
            flush.append(f"flush chain {head} {cname}")
            if was != body:
                changes.append(f"~chain {cname}")
        rules.extend(f"add rule {head} {cname} {r}" for r in compiled.chains.get(cname, []))
    for cname in cur.chains:
        if cname not in want.chains:
            flush.append(f"flush chain {head} {cname}")
            delete_end.append(f"delete chain {head} {cname}")
            changes.append(f"-chain {cname}")
    for sname in cur.sets:
        if sname not in want.sets:
            delete_end.append(f"delete set {head} {sname}")
            changes.append(f"-set {sname}")

    lines = list(declare)
    for where in sorted(del_elems):
        lines.extend(nc.elements_text(head, "delete", where, del_elems[where]))
    lines += flush + reset_sets + rules
    for where in sorted(add_elems):
        lines.extend(nc.elements_text(head, "add", where, add_elems[where]))
    lines += delete_end
    text = "\n".join(lines) + "\n" if lines and not conflicts else ""
    after_objs = wanted if wanted is not None else _without(current, cur)
    after_view = want if wanted is not None else View()
    return ServicePlan(
        text=text, changes=changes if not conflicts else [], conflicts=conflicts,
        before=render(current, family, cur, infra), after=render(after_objs, family, after_view, infra),
        chains=sorted(after_view.chains), sets=sorted(after_view.sets),
        element_counts={w: len(e) for w, e in sorted(after_view.elements.items())})


def _without(current: Optional[Dict[str, Obj]], v: View) -> Optional[Dict[str, Obj]]:
    """The table once the service's objects are gone."""
    if current is None:
        return None
    return {n: o for n, o in current.items() if n not in v.chains and n not in v.sets}
