"""iptables mode at scale: N services x 3 endpoints in a fresh network namespace.

Prints, per N: the full sync's compile time, kernel apply time and their ratio, and the
end-to-end time of a partial sync after one endpoint change (compile + plan + restore),
as the median of several changes. Not a test: run it by hand as root,

    python3 benchmarks/bench_iptables_sync.py --services 1000 10000

Targets (issue 2): compile under 10% of apply at 10k; one-change sync at 10k under 100 ms.
Results are appended to benchmarks/results/iptables_sync.txt with the date.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchpath import ROOT  # noqa: E402  (sets up the collection path)

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (  # noqa: E402
    IptablesKernel,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (  # noqa: E402
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (  # noqa: E402
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState  # noqa: E402


def service(i: int) -> dict:
    return {"kind": "Service", "metadata": {"name": f"svc{i}", "namespace": f"ns{i % 50}"},
            "spec": {"clusterIP": f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def endpoint_slice(i: int, generation: int = 0) -> dict:
    base = (i * 3) % 60000
    ips = [f"10.{128 + (base + k) // 65536 % 64}.{(base + k) // 256 % 256}.{(base + k) % 256 + 0}" for k in range(3)]
    if generation:
        ips[0] = f"10.250.{generation // 256 % 256}.{generation % 256}"
    return {"kind": "EndpointSlice",
            "metadata": {"name": f"svc{i}-x", "namespace": f"ns{i % 50}",
                         "labels": {"kubernetes.io/service-name": f"svc{i}"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips]}


def run(n: int, changes: int) -> List[str]:
    ns = f"kn-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        state = ProxyState("node1")
        for i in range(n):
            state.set_service(parse_service(service(i)))
            state.set_slice(parse_endpoint_slice(endpoint_slice(i)))
        cfg = ipt.IptablesConfig(local_cidrs=("10.128.0.0/10",))
        proxier = IptablesProxier(state, cfg, IptablesKernel(netns=ns))

        # Compile alone: what a full sync computes before it reads the kernel, cold (nothing
        # compiled before, so nothing to reuse), through the proxier's own code.
        t0 = time.perf_counter()
        proxier.compile_all(proxier._config(), set())
        compile_s = time.perf_counter() - t0

        full = proxier.sync(force_full=True)
        lines = [f"N={n}: full sync {full.total_seconds:.2f} s: compile {compile_s:.3f} s, "
                 f"kernel apply {full.apply_seconds:.2f} s, compile/apply = {compile_s / full.apply_seconds:.1%} "
                 f"({full.rules} rules, {full.rules_written} written)"]
        times, applies = [], []
        for g in range(1, changes + 1):
            state.set_slice(parse_endpoint_slice(endpoint_slice(g * 7 % n, generation=g)))
            t0 = time.perf_counter()
            result = proxier.sync()
            times.append(time.perf_counter() - t0)
            applies.append(result.apply_seconds)
            assert not result.full and result.changes, result.summary()
        floor = kernel_floor(ns)
        lines.append(f"N={n}: one-endpoint-change sync end to end: median {statistics.median(times) * 1000:.1f} ms "
                     f"(iptables-restore {statistics.median(applies) * 1000:.1f} ms of it), "
                     f"max {max(times) * 1000:.1f} ms over {changes} changes; kernel floor (one `iptables -A` "
                     f"into this table) {floor * 1000:.1f} ms")
        check = proxier.sync(force_full=True)
        lines.append(f"N={n}: periodic resync ({'full' if check.full else 'chain listing verified, partial'}): "
                     f"{check.total_seconds:.2f} s, {check.rules_written} rules written")
        proxier.rewrite_period = 0  # what the hourly rewrite of a large table (or a small one's resync) costs
        check = proxier.sync(force_full=True)
        lines.append(f"N={n}: full resync: {check.total_seconds:.2f} s (compile {check.compile_seconds:.3f} s "
                     f"with unchanged services reused, kernel {check.total_seconds - check.compile_seconds:.2f} s), "
                     f"{check.rules_written} rules written")
        return lines
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def kernel_floor(ns: str, reps: int = 5) -> float:
    """Median time of the smallest rule change the kernel accepts in this namespace: adding
    one rule makes nf_tables re-validate the whole table, whoever writes it."""
    ipt_ = ["ip", "netns", "exec", ns, "iptables", "-t", "nat"]
    subprocess.run(ipt_ + ["-N", "BENCH-FLOOR"], check=True)
    times = []
    try:
        for _rep in range(reps):
            t0 = time.perf_counter()
            subprocess.run(ipt_ + ["-A", "BENCH-FLOOR", "-j", "RETURN"], check=True)
            times.append(time.perf_counter() - t0)
            subprocess.run(ipt_ + ["-D", "BENCH-FLOOR", "-j", "RETURN"], check=True)
    finally:
        subprocess.run(ipt_ + ["-X", "BENCH-FLOOR"], check=False)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--changes", type=int, default=9)
    args = ap.parse_args()
    out = [f"# {time.strftime('%Y-%m-%d %H:%M')} iptables {subprocess.run(['iptables', '--version'], capture_output=True, text=True, check=False).stdout.strip()}"]  # noqa: E501
    print(out[0], flush=True)
    for n in args.services:
        for line in run(n, args.changes):
            print(line, flush=True)
            out.append(line)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    with (results / "iptables_sync.txt").open("a") as fh:
        fh.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
