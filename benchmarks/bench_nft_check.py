"""The cost of nftables mode's every-second check (NftablesProxier.check(): the canary set
listed with nft, the node-wide chains' rule counts over netlink) against the table's size,
next to what a chain listing with nft costs (the alternative it replaces).

    python3 benchmarks/bench_nft_check.py --services 10 10000

Per N: a full sync of N services x 3 endpoints (the default layout) in a fresh network
namespace, then the medians of ``--rounds`` checks, of the netlink counts alone, and of
``nft list chain ip kube-proxy services`` / ``nft -t list chain``. Appends to
benchmarks/results/nftables_check.txt with the date and the command.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_nftables import Netns, design_config, new_state  # noqa: E402 (sets the import path up)

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.nft import NftKernel  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import (  # noqa: E402
    compile as nc,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import (  # noqa: E402
    NftablesProxier,
)

RESULTS = Path(__file__).resolve().parent / "results" / "nftables_check.txt"


def median_ms(fn, rounds: int) -> float:
    times = []
    for _round in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def bench(n: int, rounds: int) -> str:
    cfg = design_config("inline")
    with Netns("check") as ns:
        proxier = NftablesProxier(new_state(n), cfg, NftKernel(ns))
        proxier.sync(force_full=True)
        if proxier.check():
            raise SystemExit(f"check failed on an intact table: {proxier.pending_repair}")
        chains = list(nc.infrastructure(cfg).rules)
        check = median_ms(proxier.check, rounds)
        counts = median_ms(lambda: proxier.kernel.rule_counts("ip", nc.TABLE, chains), rounds)
        listing = {}
        for flags in ([], ["-t"]):
            argv = ["ip", "netns", "exec", ns, "nft", *flags, "list", "chain", "ip", nc.TABLE, "services"]
            listing[" ".join(flags)] = median_ms(
                lambda argv=argv: subprocess.run(argv, capture_output=True, check=True), max(3, rounds // 10))
        return (f"N={n}: check() {check:.1f} ms (netlink counts of {len(chains)} chains {counts:.2f} ms); "
                f"nft list chain services {listing['']:.0f} ms, nft -t list chain {listing['-t']:.0f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, nargs="+", default=[10, 10000])
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    lines = [bench(n, args.rounds) for n in args.services]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [f"# {stamp}, load {load}: python3 benchmarks/bench_nft_check.py --services "
           f"{' '.join(map(str, args.services))} --rounds {args.rounds}"] + lines
    print("\n".join(out))
    with open(RESULTS, "a") as f:
        f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
