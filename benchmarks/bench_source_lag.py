"""Source lag: an EndpointSlice change (a manifests file written, or an API object updated)
until its rules are in the kernel, under a steady stream of changes, at N Services beside
it. Not a test; run as root:

    python3 benchmarks/bench_source_lag.py --services 1000 10000 --sources manifests api

Per (source, N): a fresh network namespace, the real IptablesProxier and the daemon
in-process. Manifests: one big file (N Services, one EndpointSlice each, JSON documents)
plus web.yaml, rewritten K times; the real ManifestsWatcher follows the directory. API:
tests/integration/fake_apiserver.py with the real `kubernetes` client and KubernetesSource;
the web slice is updated K times. Changes come at --rate per second for --seconds. A change
counts as programmed when the first sync that includes it (or a later version of the same
slice) completes (the daemon's sync-completion hook: the kernel's restore has returned).
A spot check polls the kernel (`iptables -t nat -S` of the web service chain, whose jumps
name the endpoint chains) for a sample of changes and reports how much later the kernel
showed them than the hook said. Prints p50/p99/max and appends them, with the command line, to
benchmarks/results/source_lag.txt.

``--root DIR`` runs another checkout's code (e.g. ``--root /work/main`` for "before").
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parents[1]


def load(root: Path) -> Dict[str, Any]:
    loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", str(root / "bin" / "kubenode-proxy"))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("kubenode_proxy_bin", loader))
    loader.exec_module(mod)
    mod.setup_path()
    sys.path.insert(0, str(HERE / "tests" / "integration"))
    base = "ansible_collections.kubenode.proxy.plugins.module_utils.proxier"
    import importlib as il

    return {
        "IptablesConfig": il.import_module(base + ".modes.iptables.compile").IptablesConfig,
        "sep_chain": il.import_module(base + ".modes.iptables.compile").sep_chain,
        "daemon": il.import_module(base + ".daemon"),
        "IptablesProxier": il.import_module(base + ".modes.iptables.proxier").IptablesProxier,
        "IptablesKernel": il.import_module(base + ".kernel.iptables").IptablesKernel,
        "kubernetes": il.import_module(base + ".sources.kubernetes"),
        "ProxyState": il.import_module(base + ".state").ProxyState,
    }


def service(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"svc{i}", "namespace": f"ns{i % 50}"},
            "spec": {"clusterIP": f"10.{100 + i // 65536}.{(i // 256) % 256}.{i % 256}",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def endpoint_slice(i: int) -> dict:
    base = i * 3
    ips = [f"10.{128 + (base + k) // 65536}.{(base + k) // 256 % 256}.{(base + k) % 256}" for k in range(3)]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"svc{i}-x", "namespace": f"ns{i % 50}",
                         "labels": {"kubernetes.io/service-name": f"svc{i}"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips]}


WEB = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
       "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def gen_ip(g: int) -> str:
    return f"10.250.{g // 256 % 256}.{g % 256}"


def web_slice(g: int) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-x", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [gen_ip(g)], "conditions": {"ready": True}},
                          {"addresses": ["10.249.0.1"], "conditions": {"ready": True}}]}


def generation(ip: str) -> int:
    parts = ip.split(".")
    return int(parts[2]) * 256 + int(parts[3])


class Tracker:
    """Sync completions (the daemon's hook, on the sync thread): which web generation the
    kernel has after each sync, and when."""

    def __init__(self, m: Dict[str, Any], state: Any) -> None:
        base = m["daemon"].Hooks

        outer = self

        class Hooks(base):  # type: ignore[misc, valid-type]
            def synced(self, result: Any, latencies: List[float]) -> None:
                outer.synced(result)

        self.hooks = Hooks()
        self.state = state
        self.cond = threading.Condition()
        self.programmed = 0  # highest web generation in the kernel
        self.done: Dict[int, float] = {}  # generation -> when its sync completed
        self.syncs = 0
        self.full_syncs = 0

    def synced(self, result: Any) -> None:
        now = time.time()
        sl = self.state.slices.get("default/web-x")
        g = max((generation(ep.addresses[0]) for ep in sl.endpoints if ep.addresses[0].startswith("10.250."))
                if sl else [0], default=0)
        with self.cond:
            self.syncs += 1
            self.full_syncs += bool(result.full)
            for k in range(self.programmed + 1, g + 1):
                self.done[k] = now
            self.programmed = max(self.programmed, g)
            self.cond.notify_all()


def kernel_generation(ns: str, svc_chain: str, seps: Dict[str, int]) -> int:
    """The newest web generation the kernel's service chain jumps to, from ONE read of that
    chain (endpoint chain names are hashes of the endpoint: ``seps`` maps them back), so a
    sync between two reads cannot hide what is there."""
    out = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", "-t", "nat", "-S", svc_chain],
                         capture_output=True, text=True, check=False).stdout
    return max((seps.get(line.split()[-1], 0) for line in out.splitlines() if " -j KUBE-SEP-" in line), default=0)


def web_chain(ns: str) -> Optional[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", "-t", "nat", "-S", "KUBE-SERVICES"],
                         capture_output=True, text=True, check=False).stdout
    return next((line.split()[-1] for line in out.splitlines() if '"default/web:http cluster IP"' in line), None)


def pct(vals: List[float], q: float) -> float:
    return vals[min(len(vals) - 1, int(q * len(vals)))] * 1000


def run(m: Dict[str, Any], source_kind: str, n: int, args: argparse.Namespace, tmp: Path) -> str:
    ns = f"kn-srclag-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    source: Any = None
    daemon: Any = None
    api: Any = None
    try:
        state = m["ProxyState"]("node1")
        proxier = m["IptablesProxier"](state, m["IptablesConfig"](local_cidrs=("10.128.0.0/10",)),
                                       m["IptablesKernel"](netns=ns))
        tracker = Tracker(m, state)
        daemon = m["daemon"].Daemon(proxier, state, min_period=args.min_sync_period, sync_period=args.sync_period,
                                    log=lambda msg: None, hooks=tracker.hooks)
        t0 = time.monotonic()
        if source_kind == "manifests":
            d = tmp / f"manifests-{n}"
            d.mkdir()
            docs = []
            for i in range(n):
                docs += [service(i), endpoint_slice(i)]
            (d / "big.json").write_text("\n---\n".join(json.dumps(x) for x in docs))
            small = d / "web.yaml"

            def write(g: int) -> None:
                # Whole-file rewrite, as an editor or a config tool does (json is YAML).
                small.write_text(json.dumps(WEB) + "\n---\n" + json.dumps(web_slice(g)) + "\n")

            write(0)
            on_changes = daemon.on_batch if hasattr(daemon, "on_batch") else daemon.on_relist  # "before": relists
            source = m["daemon"].ManifestsWatcher(str(d), on_changes, lambda msg: None)
        else:
            from fake_apiserver import FakeApiServer

            api = FakeApiServer(bookmark_interval=None).start()
            for i in range(n):
                api.create(service(i))
                api.create(endpoint_slice(i))
            api.create(WEB)
            api.create(web_slice(0))

            def write(g: int) -> None:
                api.update(web_slice(g))

            client = m["kubernetes"].load_client(str(api.write_kubeconfig(tmp / f"kubeconfig-{n}")))
            source = m["kubernetes"].KubernetesSource(client, "node1", daemon.on_event, daemon.on_relist)
        source.start()
        if hasattr(source, "wait_synced"):
            source.wait_synced(600)
        daemon.start()
        with tracker.cond:
            tracker.cond.wait_for(lambda: tracker.syncs >= 1 and not daemon.has_pending(), timeout=900)
        initial = time.monotonic() - t0
        chain = web_chain(ns)
        if chain is None:
            raise RuntimeError("the web service is not in the kernel after the initial sync")
        time.sleep(1.0)
        total = int(args.rate * args.seconds)
        seps = {m["sep_chain"]("default/web:http", "TCP", f"{gen_ip(g)}:8080"): g for g in range(1, total + 1)}
        written: Dict[int, float] = {}
        kernel_seen: Dict[int, float] = {}
        stop = threading.Event()
        sample_every = max(1, total // 30)

        poll_times: List[float] = []

        def spot_check() -> None:
            # Samples a change as soon as it is written (never one written long ago, which
            # a lagging checker would see at once and date late) and polls the kernel until
            # it is there; the time is the end of the first poll that shows it.
            while not stop.is_set():
                latest = max(written, default=0)
                g = (latest // sample_every + 1) * sample_every
                if g > total:
                    return
                while g not in written and not stop.is_set():
                    time.sleep(0.002)
                while not stop.is_set():
                    t = time.time()
                    found = kernel_generation(ns, chain, seps)
                    poll_times.append(time.time() - t)
                    if found >= g:
                        kernel_seen[g] = time.time()
                        break
                    time.sleep(0.005)

        checker = threading.Thread(target=spot_check, daemon=True)
        checker.start()
        start = time.monotonic()
        for g in range(1, total + 1):
            due = start + (g - 1) / args.rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            written[g] = time.time()
            write(g)
        with tracker.cond:
            tracker.cond.wait_for(lambda: tracker.programmed >= total, timeout=120)
        checker.join(30)
        stop.set()
        lags = sorted(tracker.done[g] - written[g] for g in written if g in tracker.done)
        missing = total - len(lags)
        spot = [kernel_seen[g] - tracker.done[g] for g in kernel_seen if g in tracker.done]
        if args.verbose:
            for g in sorted(kernel_seen):
                print(f"  change {g}: hook {(tracker.done.get(g, float('nan')) - written[g]) * 1000:.0f} ms, "
                      f"kernel {(kernel_seen[g] - written[g]) * 1000:.0f} ms after the write", flush=True)
        poll_times.sort()
        spot_txt = (f"kernel spot check ({len(spot)} changes): seen in the kernel {min(spot) * 1000:+.0f}.."
                    f"{max(spot) * 1000:+.0f} ms after the sync hook (one kernel poll: median "
                    f"{pct(poll_times, 0.5):.0f} ms)" if spot else "kernel spot check: no samples")
        return (f"{source_kind:9s} N={n}: initial load+sync {initial:.1f} s; {total} changes at {args.rate:g}/s, "
                f"{tracker.syncs} syncs ({tracker.full_syncs} full); lag change->kernel: "
                f"p50 {pct(lags, 0.5):.0f} ms, p99 {pct(lags, 0.99):.0f} ms, max {lags[-1] * 1000:.0f} ms"
                + (f", {missing} never programmed" if missing else "") + f"; {spot_txt}")
    finally:
        if source is not None:
            source.stop()
        if daemon is not None:
            daemon.stop()
        if api is not None:
            api.stop()
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--sources", nargs="+", choices=["manifests", "api"], default=["manifests", "api"])
    ap.add_argument("--rate", type=float, default=20.0, help="changes per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--min-sync-period", type=float, default=0.1)
    ap.add_argument("--sync-period", type=float, default=30.0)
    ap.add_argument("--root", type=Path, default=HERE, help="checkout whose code to run (default: this one)")
    ap.add_argument("--verbose", action="store_true", help="print each spot-checked change")
    ap.add_argument("--label", default="", help="a note for the results file (e.g. 'before')")
    args = ap.parse_args()
    m = load(args.root.resolve())
    cmd = "python3 " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_source_lag.py"] + sys.argv[1:])
    lines = [f"# {time.strftime('%Y-%m-%d %H:%M')} source lag{' (' + args.label + ')' if args.label else ''}: "
             f"{cmd}  [code: {args.root.resolve()}; minSyncPeriod {args.min_sync_period:g}s, "
             f"syncPeriod {args.sync_period:g}s, iptables mode, fresh namespace]"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for source_kind in args.sources:
            for n in args.services:
                line = run(m, source_kind, n, args, Path(tmp))
                print(line, flush=True)
                lines.append(line)
    results = HERE / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    with (results / "source_lag.txt").open("a") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
