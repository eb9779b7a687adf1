"""Recovery of the iptables-mode daemon at N services, with real TCP traffic.

A namespace lab (tests/integration/lab.py) holds two backend pods and a client; the
node gets N generated services x 3 endpoints plus one "probe" service backed by a real
pod. The daemon (sync thread, canary check, periodic sync) runs in this process; a
prober in the client namespace connects to the probe service every 50 ms. Scenarios:

  A  nat KUBE-SERVICES flushed and the KUBE-PROXY-CANARY chains deleted
  B  whole nat table flushed (``iptables -t nat -F`` then ``-X``: a firewall reload)
  C  nat KUBE-SERVICES flushed alone, canaries intact (caught by the periodic check)
  L  iptables-legacy, the xtables lock held for --lock-hold seconds (a private
     XTABLES_LOCKFILE) while the probe service's endpoint moves to the other pod
  R  restart (iptables-nft): the daemon stops, the probe service's endpoint moves to the
     other pod, a new daemon starts; once without the record a clean shutdown writes
     (every chain rewritten), once with it (only what changed written). Compared with
     the cold start of the same run: the first sync's duration, from ``Daemon.start()``

Printed per scenario: detection (break -> repair started), the repair sync's duration,
and traffic back (break, or lock release, -> first good connection). Run as root:

    python3 benchmarks/bench_recovery.py --services 10000

Bounds (issue 11): A and B repaired within syncPeriod + 1.5 s; L caught up within 5 s
of the release; R reconciled within the cold start's time. Results are appended to benchmarks/results/recovery.txt.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_iptables_sync as gen  # noqa: E402  (sets up the collection import path)
from lab import Lab  # noqa: E402
from proxyctl import poll as _poll  # noqa: E402

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon, Hooks  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (  # noqa: E402
    IptablesKernel,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (  # noqa: E402
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState  # noqa: E402

PROBER = ROOT / "tests" / "integration" / "prober.py"
PROBE_IP = "10.111.255.250"  # inside the service CIDR, outside the generated services' range
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}
CANARY = "KUBE-PROXY-CANARY"


def probe_objects(backend: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    svc = {"kind": "Service", "metadata": {"name": "probe", "namespace": "default"},
           "spec": {"clusterIP": PROBE_IP, "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}
    eps = {"kind": "EndpointSlice",
           "metadata": {"name": "probe-x", "namespace": "default", "labels": {"kubernetes.io/service-name": "probe"}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
           "endpoints": [{"addresses": [PODS[backend]], "conditions": {"ready": True}}]}
    return svc, eps


def poll(predicate: Any, timeout: float) -> Any:
    return _poll(predicate, timeout, interval=0.05)  # 50 ms: the times it reports are this fine


class Recorder(Hooks):
    def __init__(self) -> None:
        self.syncs: List[Tuple[float, Any]] = []  # (wall clock at the end, SyncResult)
        self.lines: List[Tuple[float, str]] = []

    def synced(self, result: Any, latencies: List[float]) -> None:
        self.syncs.append((time.time(), result))

    def log(self, msg: str) -> None:
        self.lines.append((time.time(), msg))


class Node:
    """The daemon on a lab node with N services, and a prober against the probe service."""

    def __init__(self, lab: Lab, n: int, binary: str, sync_period: float, backend: str = "be1",
                 record: str = "") -> None:
        self.lab = lab
        self.rec = Recorder()
        state = ProxyState("node1")
        cfg = ipt.IptablesConfig(local_cidrs=("10.244.0.0/16",), node_ips=(lab.node_ip,))
        self.kernel = IptablesKernel(netns=lab.ns("node"), binary=binary)
        self.proxier = IptablesProxier(state, cfg, self.kernel)
        self.daemon = Daemon(self.proxier, state, 1.0, sync_period, self.rec.log, self.rec)
        if record:
            self.proxier.load_record(record)
        svc, eps = probe_objects(backend)
        self.daemon.on_relist("Service", [gen.service(i) for i in range(n)] + [svc])
        self.daemon.on_relist("EndpointSlice", [gen.endpoint_slice(i) for i in range(n)] + [eps])
        t0 = time.time()
        self.daemon.start()
        poll(lambda: self.rec.syncs, 600)
        self.cold = self.rec.syncs[0][0] - t0
        self.out = Path(tempfile.mkdtemp(prefix="kn-recovery-")) / f"probe-{binary}.jsonl"
        self.prober = lab.spawn("client", [sys.executable, str(PROBER), PROBE_IP, "80"], stdout=self.out)
        poll(lambda: self.ok_after(time.time() - 0.5), 30)

    def probes(self) -> List[Dict[str, Any]]:
        lines = self.out.read_text().splitlines()
        return [json.loads(x) for x in lines[:-1] if x.strip()]  # the last line may be half written

    def ok_after(self, t: float, backend: Optional[str] = None) -> Optional[float]:
        for p in self.probes():
            if p["t"] >= t and p["ok"] and (backend is None or p["backend"] == backend):
                return p["t"]
        return None

    def failed_after(self, t: float) -> bool:
        return any(p["t"] >= t and not p["ok"] for p in self.probes())

    def iptables(self, *argv: str) -> None:
        self.lab.exec("node", [self.kernel.binary, "-w", "5", *argv])

    def stop(self) -> None:
        self.prober.kill()
        self.prober.wait(5)
        self.daemon.stop(60)


VERBOSE = False


def _echo_log(node: Node, since: float, duration: float) -> None:
    seen = 0
    end = time.time() + duration
    while time.time() < end:
        lines = [x for x in node.rec.lines if x[0] >= since]
        for t, msg in lines[seen:]:
            print(f"    +{t - since:.2f}s {msg[:300]}", flush=True)
        seen = len(lines)
        time.sleep(0.2)


def flush_scenario(node: Node, name: str, commands: List[List[str]], timeout: float) -> str:
    # Break while the sync thread is idle (a break during a running sync costs that sync
    # first: its plan trusted a listing taken before the break), at some phase of the 1 s
    # check: after the next sync ends, wait a little.
    count = len(node.rec.syncs)
    poll(lambda: len(node.rec.syncs) > count, 30)
    time.sleep(1.3)
    before = len(node.rec.syncs)
    t_break = time.time()
    for argv in commands:
        node.iptables(*argv)
    t_broken = time.time()
    if VERBOSE:
        threading.Thread(target=_echo_log, args=(node, t_break, timeout), daemon=True).start()
    # A repair, or (small tables, whose periodic full sync diffs everything) any sync that wrote.
    repaired = poll(lambda: next((s for s in node.rec.syncs[before:] if s[1].repair or s[1].rules_written), None),
                    timeout)
    if repaired is None:
        return f"{name}: NOT repaired within {timeout:.0f} s (break commands took {t_broken - t_break:.2f} s)"
    t_end, result = repaired
    back = poll(lambda: node.ok_after(t_end - result.total_seconds), 10)
    detected = t_end - result.total_seconds - t_break
    outage = (back - t_break) if back else float("nan")
    return (f"{name}: break commands {t_broken - t_break:.2f} s; detected after {detected:.2f} s; "
            f"repair sync {result.total_seconds:.2f} s ({result.rules_written} rules written, "
            f"{len(result.changes)} chains/changes: {result.repair}); traffic back {outage:.2f} s after the break"
            + ("" if node.failed_after(t_broken) else " (no probe failed after the break)"))


def lock_scenario(node: Node, hold: float) -> str:
    lockfile = os.environ["XTABLES_LOCKFILE"]
    time.sleep(1.3)
    with open(lockfile, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        t_hold = time.time()
        time.sleep(1.0)
        svc, eps = probe_objects("be2")
        node.daemon.on_event("EndpointSlice", "MODIFIED", eps)
        time.sleep(max(0.0, hold - (time.time() - t_hold)))
        fcntl.flock(f, fcntl.LOCK_UN)
        t_release = time.time()
    back = poll(lambda: node.ok_after(t_release, "be2"), 30)
    if VERBOSE:
        for t, msg in node.rec.lines:
            if t >= t_hold - 2:
                print(f"    {t - t_release:+.2f}s {msg[:300]}", flush=True)
    # The sync that applied the change ends after its restore (canaries, bookkeeping).
    caught = poll(lambda: next(((t, r) for t, r in node.rec.syncs if t >= t_release), None), 30)
    during = [(t, r) for t, r in node.rec.syncs if t_hold <= t < t_release]
    fails = sum(1 for t, m in node.rec.lines if t_hold <= t and "sync failed" in m)
    return (f"L: lock held {t_release - t_hold:.1f} s, {fails} failed attempts (lock), {len(during)} syncs during"
            f" the hold; caught up {caught[0] - t_release:.2f} s after the release by a "
            f"{'full' if caught[1].full else 'partial'} sync ({caught[1].total_seconds:.2f} s); "
            f"traffic on the new backend {back - t_release:.2f} s after the release"
            if caught and back else f"L: NOT caught up within 30 s of the release ({fails} failed attempts)")


def restart_scenario(lab: Lab, n: int, sp: float, say: Any) -> None:
    record = str(Path(tempfile.mkdtemp(prefix="kn-record-")) / "applied.json")
    node = Node(lab, n, "iptables", sp)
    say(f"R: cold start (first full sync, into empty tables) {node.cold:.2f} s: {node.rec.syncs[0][1].summary()}")
    backend = "be1"
    try:
        for use in (False, True):
            node.stop()
            t_saved = time.time()
            saved = node.proxier.save_record(record) if use else "no record"
            took = time.time() - t_saved
            backend = "be2" if backend == "be1" else "be1"
            node = Node(lab, n, "iptables", sp, backend=backend, record=record if use else "")
            first = node.rec.syncs[0][1]
            moved = poll(lambda node=node, backend=backend: node.ok_after(time.time() - 0.5, backend), 10)
            say(f"R {'with' if use else 'without'} the record ({saved}; {took:.2f} s at stop): first sync "
                f"{node.cold:.2f} s: {first.summary()}; traffic on the moved endpoint: {'yes' if moved else 'NO'}")
    finally:
        node.stop()
        node.proxier.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--sync-period", type=float, default=5.0)
    ap.add_argument("--lock-hold", type=float, default=10.0)
    ap.add_argument("--scenarios", default="ABCLR")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print the daemon's log during each scenario")
    args = ap.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    n, sp = args.services, args.sync_period
    out = [f"# {time.strftime('%Y-%m-%d %H:%M')} N={n} syncPeriod={sp:g}s "
           f"cmd: python3 benchmarks/bench_recovery.py --services {n} --sync-period {sp:g} "
           f"--lock-hold {args.lock_hold:g} --scenarios {args.scenarios}"]

    def say(line: str) -> None:
        print(line, flush=True)
        out.append(line)

    with Lab() as lab:
        for name, ip in PODS.items():
            lab.add_pod(name, ip)
        lab.add_client("client", "10.244.2.10")
        if set(args.scenarios) & set("ABC"):
            version = subprocess.run(["iptables", "--version"], capture_output=True, text=True,
                                     check=False).stdout.strip()
            node = Node(lab, n, "iptables", sp)
            say(f"{version}: cold start (first full sync) {node.cold:.2f} s")
            try:
                timeout = sp + 20
                if "A" in args.scenarios:
                    say(flush_scenario(node, "A (nat KUBE-SERVICES flushed + canaries deleted)", [
                        ["-t", "nat", "-F", "KUBE-SERVICES"],
                        *[["-t", t, "-X", CANARY] for t in ("mangle", "nat", "filter")]], timeout))
                if "B" in args.scenarios:
                    say(flush_scenario(node, "B (whole nat table flushed: -F, -X)", [
                        ["-t", "nat", "-F"], ["-t", "nat", "-X"]], timeout))
                if "C" in args.scenarios:
                    say(flush_scenario(node, "C (nat KUBE-SERVICES flushed, canaries intact)", [
                        ["-t", "nat", "-F", "KUBE-SERVICES"]], timeout))
            finally:
                node.stop()
                node.proxier.cleanup()
        if "L" in args.scenarios:
            lockfile = Path(tempfile.mkdtemp(prefix="kn-xtables-")) / "xtables.lock"
            lockfile.touch()
            os.environ["XTABLES_LOCKFILE"] = str(lockfile)  # never the host's /run/xtables.lock
            node = Node(lab, n, "iptables-legacy", sp)
            say(f"iptables-legacy: cold start {node.cold:.2f} s")
            try:
                say(lock_scenario(node, args.lock_hold))
            finally:
                node.stop()
                node.proxier.cleanup()
        if "R" in args.scenarios:
            restart_scenario(lab, n, sp, say)
    if not args.no_save:
        with (ROOT / "benchmarks" / "results" / "recovery.txt").open("a") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
