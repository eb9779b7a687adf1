"""In-memory stand-ins for the kernel parts IPVS mode writes: IPVS, the dummy link,
ipset (``ipset save``/``restore`` semantics), iptables (``iptables-save``/``-restore``)
and sysctls. They interpret exactly what the proxier sends, so tests can check both
the commands and the state they leave."""
from __future__ import annotations

import shlex
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs as k
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import IPSet, parse_save
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (
    KernelError,
    RestoreError,
    Snapshot,
)

BUILTIN = {"filter": ["INPUT", "FORWARD", "OUTPUT"], "nat": ["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]}


class FakeIPVS:
    def __init__(self) -> None:
        self.table: Dict[tuple, k.ServiceState] = {}
        self.applied: List[k.Op] = []
        self.fail: Set[str] = set()  # op kinds to refuse (EINVAL)
        self.flushed = 0
        self.timeout_values = (900, 120, 300)  # the kernel's defaults
        self.timeout_calls: List[tuple] = []

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        """As the kernel's ip_vs_set_timeout: a 0 keeps that value."""
        self.timeout_calls.append((tcp, tcp_fin, udp))
        self.timeout_values = tuple(new or old for new, old in zip((tcp, tcp_fin, udp), self.timeout_values))

    def timeouts(self):
        return self.timeout_values

    def info(self):
        return "1.2.1", 4096

    def close(self) -> None:
        pass

    def services(self) -> List[k.ServiceState]:
        return list(self.table.values())

    def virtual_servers(self):
        return [s.virtual for s in self.table.values()]

    def get(self, vs: k.VirtualServer) -> Optional[k.ServiceState]:
        return self.table.get(vs.key)

    def flush(self) -> None:
        self.flushed += 1
        self.table.clear()

    def set_connections(self, vs_key: tuple, address: str, active: int) -> None:
        s = self.table[vs_key]
        self.table[vs_key] = k.ServiceState(s.virtual, tuple(
            k.RealServer(r.address, r.port, r.weight, active_connections=active) if r.address == address else r
            for r in s.real_servers))

    def apply(self, ops) -> k.ApplyResult:
        result = k.ApplyResult()
        for op in ops:
            if op.kind in self.fail:
                result.errors.append((op, k.IPVSError(f"{op}: Invalid argument", 22)))
                continue
            self.applied.append(op)
            key = op.virtual.key
            s = self.table.get(key)
            if op.kind == k.ADD_SERVICE:
                self.table[key] = k.ServiceState(op.virtual, ())
            elif op.kind == k.EDIT_SERVICE:
                self.table[key] = k.ServiceState(op.virtual, s.real_servers)
            elif op.kind == k.DELETE_SERVICE:
                del self.table[key]
            else:
                rs = op.real_server
                others = tuple(r for r in s.real_servers if r.key != rs.key)
                old = s.real_server(rs.key)
                if op.kind == k.EDIT_DEST and old is not None:
                    rs = k.RealServer(rs.address, rs.port, rs.weight, active_connections=old.active_connections)
                if op.kind in (k.ADD_DEST, k.EDIT_DEST):
                    others += (rs,)
                self.table[key] = k.ServiceState(s.virtual, others)
            result.applied += 1
        return result

    def summary(self) -> Dict[str, List[str]]:
        return {f"{s.virtual.address}:{s.virtual.port}/{s.virtual.protocol}":
                sorted(f"{r.address}:{r.port}" + ("" if r.weight == 1 else f" w{r.weight}") for r in s.real_servers)
                for s in self.table.values()}


class FakeLink:
    def __init__(self) -> None:
        self.exists = False
        self.addrs: Set[str] = set()
        self.calls: List[str] = []

    def index(self):
        return 7 if self.exists else None  # DummyLink.index(): the ifindex, None when gone

    def ensure(self) -> bool:
        created = not self.exists
        self.exists = True
        return created

    def delete(self) -> bool:
        existed = self.exists
        self.exists = False
        self.addrs.clear()
        return existed

    def addresses(self) -> Set[str]:
        return set(self.addrs)

    def add(self, ips):
        new = sorted(set(ips) - self.addrs)
        self.addrs |= set(new)
        self.calls += [f"add {ip}" for ip in new]
        return new

    def remove(self, ips):
        gone = sorted(set(ips) & self.addrs)
        self.addrs -= set(gone)
        self.calls += [f"del {ip}" for ip in gone]
        return gone

    def close(self) -> None:
        pass


class FakeIpset:
    """``ipset save`` / ``restore`` over an in-memory table of sets (text lines)."""

    def __init__(self) -> None:
        self.sets: Dict[str, Tuple[str, Set[str]]] = {}  # name -> (create line tail, entries)
        self.restores: List[List[str]] = []

    def save_text(self) -> str:
        out = []
        for name, (header, entries) in self.sets.items():
            out.append(f"create {name} {header}")
            out += [f"add {name} {e}" for e in sorted(entries)]
        return "\n".join(out) + "\n"

    def save(self, name: Optional[str] = None) -> Dict[str, IPSet]:
        sets = parse_save(self.save_text())
        return {n: s for n, s in sets.items() if name is None or n == name}

    def names(self) -> List[str]:
        return list(self.sets)

    def restore(self, lines) -> float:
        lines = list(lines)
        self.restores.append(lines)
        for line in lines:
            words = shlex.split(line)
            verb, name = words[0], words[1]
            if verb == "create":
                if name in self.sets:
                    raise KernelError(f"set {name} exists")
                self.sets[name] = (" ".join(words[2:]), set())
            elif verb == "add":
                self.sets[name][1].add(words[2])
            elif verb == "del":
                self.sets[name][1].discard(words[2])
            elif verb == "swap":
                a, b = words[1], words[2]
                self.sets[a], self.sets[b] = self.sets[b], self.sets[a]
            elif verb == "destroy":
                del self.sets[name]
        return 0.0

    def entries(self, name: str) -> Set[str]:
        return set(self.sets[name][1])


class FakeIptables:
    """iptables-save / iptables-restore --noflush over in-memory tables."""

    def __init__(self) -> None:
        self.tables: Dict[str, Dict[str, List[str]]] = {t: {c: [] for c in cs} for t, cs in BUILTIN.items()}
        self.restores: List[str] = []
        self.fail_restore = ""  # when set: every restore fails with this message

    def snapshot(self, tables=("filter", "nat")) -> Snapshot:
        rules, chains = {}, set()
        for t in tables:
            for c, lines in self.tables[t].items():
                chains.add((t, c))
                if c.startswith("KUBE-") or c in BUILTIN[t]:
                    rules[(t, c)] = list(lines)
        return Snapshot(rules, chains)

    snapshot_for_full_sync = snapshot

    def restore(self, text: str) -> float:
        if self.fail_restore:
            raise RestoreError(self.fail_restore)
        self.restores.append(text)
        work = {t: {c: list(r) for c, r in cs.items()} for t, cs in self.tables.items()}
        table = None
        for n, line in enumerate(text.splitlines(), 1):
            if line.startswith("*"):
                table = work[line[1:]]
            elif line == "COMMIT":
                table = None
            elif line.startswith(":"):
                table[line[1:].split()[0]] = []
            else:
                verb, chain, *rest = line.split(" ", 2)
                rule = rest[0] if rest else ""
                if verb == "-A":
                    table[chain].append(rule)
                elif verb == "-I":
                    pos, rule = rule.split(" ", 1)
                    table[chain].insert(int(pos) - 1, rule)
                elif verb == "-D":
                    if rule not in table[chain]:
                        raise RestoreError(f"line {n}: no such rule")
                    table[chain].remove(rule)
                elif verb == "-X":
                    refs = [c for c, rs in table.items() for r in rs if r.endswith(f"-j {chain}")]
                    if refs or table[chain]:
                        raise RestoreError(f"line {n}: chain {chain} in use or not empty")
                    del table[chain]
        self.tables = work
        return 0.0

    def rules(self, table: str, chain: str) -> List[str]:
        return list(self.tables[table].get(chain, []))

    # The canary and dispatch checks of IptablesKernel (kernel/iptables.py), in memory.
    def missing_canaries(self, tables=("mangle", "nat", "filter")) -> List[str]:
        return [t for t in tables if "KUBE-PROXY-CANARY" not in self.tables.get(t, {})]

    def create_canaries(self, tables) -> None:
        for t in tables:
            self.tables.setdefault(t, {})["KUBE-PROXY-CANARY"] = []

    def first_rule(self, table: str, chain: str):
        rules = self.tables.get(table, {}).get(chain)
        return None if rules is None else (rules[0] if rules else "")


class FakeSysctls:
    def __init__(self) -> None:
        self.values: Dict[str, str] = defaultdict(lambda: "0")

    def ensure(self, values):
        out = {}
        for key, value in values.items():
            if self.values[key] != value:
                out[key] = f"{self.values[key]} -> {value}"
                self.values[key] = value
        return out
