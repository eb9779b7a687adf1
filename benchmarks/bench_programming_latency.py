"""Network programming latency: an EndpointSlice change written to the API server until its
rules are in the kernel, at N services (3 endpoints each). Not a test; run as root:

    python3 benchmarks/bench_programming_latency.py --services 1000 10000

The daemon runs in-process (the real KubernetesSource with the real `kubernetes` client
against tests/integration/fake_apiserver.py, the real proxier against a fresh network
namespace). Each change carries upstream's `endpoints.kubernetes.io/last-change-trigger-time`
annotation set when it is written, so the measured time is write -> watch -> queue ->
sync -> iptables-restore done (what kubeproxy_network_programming_duration_seconds
measures upstream). Changes are spaced more than minSyncPeriod apart so each one is a
separate sync. Prints p50/p99/max and appends them to benchmarks/results/programming_latency.txt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchpath import ROOT  # noqa: E402  (sets up the collection path)

sys.path.insert(0, str(ROOT / "tests" / "integration"))

from fake_apiserver import FakeApiServer  # noqa: E402

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.daemon import Daemon, Hooks  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (  # noqa: E402
    IptablesKernel,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import (  # noqa: E402
    IptablesConfig,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (  # noqa: E402
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.kubernetes import (  # noqa: E402
    KubernetesSource,
    load_client,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState  # noqa: E402


def service(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"svc{i}", "namespace": f"ns{i % 50}"},
            "spec": {"clusterIP": f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def endpoint_slice(i: int, generation: int = 0) -> dict:
    base = i * 3
    ips = [f"10.{128 + (base + k) // 65536}.{(base + k) // 256 % 256}.{(base + k) % 256}" for k in range(3)]
    meta = {"name": f"svc{i}-x", "namespace": f"ns{i % 50}", "labels": {"kubernetes.io/service-name": f"svc{i}"}}
    if generation:
        ips[0] = f"10.250.{generation // 256 % 256}.{generation % 256}"
        now = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")  # noqa: UP017
        meta["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": now}
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": meta, "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips]}


class Latencies(Hooks):
    def __init__(self) -> None:
        self.values: List[float] = []
        self.syncs = 0
        self.cond = threading.Condition()

    def synced(self, result, latencies):
        with self.cond:
            self.syncs += 1
            if not result.full:
                self.values.extend(latencies)
            self.cond.notify_all()


def run(n: int, changes: int, tmp: Path) -> str:
    ns = f"kn-lat-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    api = FakeApiServer(bookmark_interval=None).start()
    source = daemon = None
    try:
        for i in range(n):
            api.create(service(i))
            api.create(endpoint_slice(i))
        state = ProxyState("node1")
        proxier = IptablesProxier(state, IptablesConfig(local_cidrs=("10.128.0.0/10",)), IptablesKernel(netns=ns))
        hooks = Latencies()
        daemon = Daemon(proxier, state, min_period=0.05, sync_period=3600, log=lambda m: None, hooks=hooks)
        client = load_client(str(api.write_kubeconfig(tmp / f"kubeconfig-{n}")))
        source = KubernetesSource(client, "node1", daemon.on_event, daemon.on_relist)
        t0 = time.monotonic()
        source.start()
        source.wait_synced(600)
        daemon.start()
        with hooks.cond:
            hooks.cond.wait_for(lambda: hooks.syncs >= 1 and not daemon.has_pending(), timeout=900)
        initial = time.monotonic() - t0
        for g in range(1, changes + 1):
            with hooks.cond:
                before = len(hooks.values)
            api.update(endpoint_slice((g * 7919) % n, generation=g))
            with hooks.cond:
                hooks.cond.wait_for(lambda b=before: len(hooks.values) > b, timeout=60)
            time.sleep(0.06)  # > minSyncPeriod: one change per sync
        vals = sorted(hooks.values)

        def p(q: float) -> float:
            return vals[min(len(vals) - 1, int(q * len(vals)))] * 1000

        return (f"N={n}: initial list+full sync {initial:.1f} s; programming latency over {len(vals)} changes: "
                f"p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max {vals[-1] * 1000:.1f} ms, "
                f"mean {statistics.mean(vals) * 1000:.1f} ms")
    finally:
        if source is not None:
            source.stop()
        if daemon is not None:
            daemon.stop()
        api.stop()
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main() -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--changes", type=int, default=100)
    args = ap.parse_args()
    lines = [f"# {time.strftime('%Y-%m-%d %H:%M')} programming latency"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.services:
            line = run(n, args.changes, Path(tmp))
            print(line, flush=True)
            lines.append(line)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    with (results / "programming_latency.txt").open("a") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
