"""nftables mode at scale: N services x 3 endpoints, each design in a fresh network namespace.

Prints, per N and per endpoint-selection design (``chained``: our default, chained
``numgen random mod k == 0 goto`` rules; ``vmap``: upstream's anonymous
``numgen random mod N vmap {...}`` per service):
  * cold full sync: nft text build time (compile + render) and ``nft -f`` time;
  * one endpoint change: partial sync end to end (compile + plan + ``nft -f``), median;
  * ``nft -f`` of the same full text by hand (the tool's own cost, no Python around it);
and, measured in the same run, iptables mode's cold full sync and one-endpoint change,
with the ratios. Not a test: run it by hand as root,

    python3 benchmarks/bench_nftables.py --services 10000

Results are appended to benchmarks/results/nftables.txt with the date and the command.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
_loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", str(ROOT / "bin" / "kubenode-proxy"))
_bin = importlib.util.module_from_spec(importlib.util.spec_from_loader("kubenode_proxy_bin", _loader))
_loader.exec_module(_bin)
_bin.setup_path()
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_iptables_sync import endpoint_slice, service  # noqa: E402

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (  # noqa: E402
    IptablesKernel,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.nft import NftKernel  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (  # noqa: E402
    parse_endpoint_slice,
    parse_service,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import (  # noqa: E402
    IptablesConfig,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (  # noqa: E402
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import (  # noqa: E402
    compile as nc,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import (  # noqa: E402
    NftablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState  # noqa: E402

BASE = IptablesConfig(local_cidrs=("10.128.0.0/10",), localhost_nodeports=False)


def new_state(n: int) -> ProxyState:
    state = ProxyState("node1")
    for i in range(n):
        state.set_service(parse_service(service(i)))
        state.set_slice(parse_endpoint_slice(endpoint_slice(i)))
    state.take_changes()
    return state


class Netns:
    def __init__(self, tag: str) -> None:
        self.name = f"kn-bench-{tag}-{os.getpid()}"

    def __enter__(self) -> str:
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        return self.name

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def one_change_times(state: ProxyState, proxier, n: int, changes: int, applies: Optional[List[float]] = None
                     ) -> List[float]:
    times = []
    for g in range(1, changes + 1):
        state.set_slice(parse_endpoint_slice(endpoint_slice(g * 7 % n, generation=g)))
        t0 = time.perf_counter()
        result = proxier.sync()
        times.append(time.perf_counter() - t0)
        if applies is not None:
            applies.append(result.apply_seconds)
        assert not result.full and result.changes, result.summary()
    return times


def design_config(design: str) -> nc.NftablesConfig:
    """"inline" (the default: chained numgen rules, no endpoint-* chains), "chained"
    (upstream's endpoint-* chains, chained numgen rules), "vmap" (upstream's layout and
    anonymous numgen vmaps)."""
    if design == "inline":
        return nc.NftablesConfig(base=BASE, endpoint_chains=False)
    return nc.NftablesConfig(base=BASE, endpoint_selection=design, endpoint_chains=True)


def bench_nft(n: int, design: str, changes: int) -> Dict[str, float]:
    state = new_state(n)
    cfg = design_config(design)
    with Netns(design) as ns:
        proxier = NftablesProxier(state, cfg, NftKernel(ns))
        full = proxier.sync(force_full=True)
        text = nc.render_full(proxier.applied, cfg)
        applies: List[float] = []
        part = one_change_times(state, proxier, n, changes, applies)
        # The tool alone: the same full text again (a replace of the loaded table).
        t0 = time.perf_counter()
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, text=True, check=True)
        by_hand = time.perf_counter() - t0
        return {"build": full.compile_seconds, "apply": full.apply_seconds, "total": full.total_seconds,
                "partial": statistics.median(part), "partial_max": max(part), "by_hand": by_hand,
                "partial_nft": statistics.median(applies),
                "bytes": len(text), "lines": text.count("\n")}


def bench_iptables(n: int, changes: int) -> Dict[str, float]:
    state = new_state(n)
    with Netns("ipt") as ns:
        proxier = IptablesProxier(state, BASE, IptablesKernel(netns=ns))
        full = proxier.sync(force_full=True)
        part = one_change_times(state, proxier, n, changes)
        return {"total": full.total_seconds, "apply": full.apply_seconds, "partial": statistics.median(part)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, nargs="+", default=[10000])
    ap.add_argument("--changes", type=int, default=9)
    ap.add_argument("--designs", nargs="+", default=["inline", nc.ENDPOINT_CHAINED, nc.ENDPOINT_VMAP],
                    choices=["inline", nc.ENDPOINT_CHAINED, nc.ENDPOINT_VMAP])
    args = ap.parse_args()
    nft_version = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    out = [f"# {time.strftime('%Y-%m-%d %H:%M')} {nft_version}, kernel {os.uname().release}, "
           f"{os.cpu_count()} CPUs; command: python3 benchmarks/bench_nftables.py {' '.join(sys.argv[1:])}"]
    print(out[0], flush=True)

    def say(line: str) -> None:
        print(line, flush=True)
        out.append(line)

    for n in args.services:
        ipt = bench_iptables(n, args.changes)
        say(f"N={n} iptables: cold full sync {ipt['total']:.2f} s (iptables-restore {ipt['apply']:.2f} s); "
            f"one endpoint change {ipt['partial'] * 1000:.1f} ms (median of {args.changes})")
        results = {}
        for design in args.designs:
            r = results[design] = bench_nft(n, design, args.changes)
            say(f"N={n} nftables/{design}: cold full sync {r['total']:.2f} s = nft text build {r['build']:.2f} s "
                f"+ nft -f {r['apply']:.2f} s ({r['lines']} lines, {r['bytes'] / 1e6:.1f} MB); same text by hand "
                f"(replacing the loaded table) {r['by_hand']:.2f} s; one endpoint change {r['partial'] * 1000:.1f} ms "
                f"median (kernel write, netlink batch or nft -f, {r['partial_nft'] * 1000:.1f} ms of it), "
                f"{r['partial_max'] * 1000:.1f} ms max; "
                f"vs iptables: cold {r['total'] / ipt['total']:.2f}x, "
                f"one change {r['partial'] / ipt['partial']:.2f}x")
        if nc.ENDPOINT_CHAINED in results and nc.ENDPOINT_VMAP in results:
            c, v = results[nc.ENDPOINT_CHAINED], results[nc.ENDPOINT_VMAP]
            say(f"N={n} design ratio: upstream vmap nft -f {v['apply']:.2f} s / chained {c['apply']:.2f} s = "
                f"{v['apply'] / c['apply']:.1f}x")
    path = ROOT / "benchmarks" / "results" / "nftables.txt"
    path.parent.mkdir(exist_ok=True)
    with path.open("a") as fh:
        fh.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
