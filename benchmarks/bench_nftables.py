"""nftables mode at scale: N services x 3 endpoints, each design in a fresh network namespace.

Prints, per N and per endpoint-selection design (``chained``: our default, chained
``numgen random mod k == 0 goto`` rules; ``vmap``: upstream's anonymous
``numgen random mod N vmap {...}`` per service):
  * cold full sync: nft text build time (compile + render) and ``nft -f`` time;
  * one endpoint change: partial sync end to end (compile + plan + ``nft -f``), median;
  * ``nft -f`` of the same full text by hand (the tool's own cost, no Python around it);
  * ``nft -f`` of the table's own dump (``nft list table``) into a fresh namespace: the
    floor a cold sync is measured against (target: cold sync <= 1.1x of it);
and, measured in the same run, iptables mode's cold full sync and one-endpoint change,
with the ratios. Not a test: run it by hand as root,

    python3 benchmarks/bench_nftables.py --services 1000,10000,30000 --designs inline vmap \
        --changes 5 --no-replace --plot benchmarks/results/nftables_cold.png

Results are appended to benchmarks/results/nftables.txt with the date, the command and the
load average; ``--plot`` draws cold-sync seconds against N per design and mode.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchpath import ROOT  # noqa: E402  (sets up the collection path)

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


def load_fresh_seconds(text: str) -> float:
    """``nft -f`` of ``text`` into a fresh namespace, by hand (no Python around it)."""
    with Netns("fresh") as fresh:
        t0 = time.perf_counter()
        subprocess.run(["ip", "netns", "exec", fresh, "nft", "-f", "-"], input=text, text=True, check=True)
        return time.perf_counter() - t0


def dump_load_seconds(ns: str, family: str) -> float:
    """``nft -f`` of the loaded table's own dump into a fresh namespace: what the kernel and
    nft alone take to create this ruleset, with no Python and no plan around them."""
    dump = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", family, "kube-proxy"],
                          capture_output=True, text=True, check=True).stdout
    return load_fresh_seconds(dump)


def _median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_nft(n: int, design: str, changes: int, replace: bool = True, dump: bool = True) -> Dict[str, float]:
    state = new_state(n)
    cfg = design_config(design)
    with Netns(design) as ns:
        proxier = NftablesProxier(state, cfg, NftKernel(ns))
        full = proxier.sync(force_full=True)
        text = nc.render_full(proxier.applied, cfg)
        dump_load = dump_load_seconds(ns, cfg.family) if dump else float("nan")
        # Our own text by hand into a fresh namespace: splits the gap to the dump between
        # the text's form (statements vs the dump's blocks) and what runs around nft.
        text_load = load_fresh_seconds(text) if dump else float("nan")
        applies: List[float] = []
        part = one_change_times(state, proxier, n, changes, applies)
        by_hand = float("nan")
        if replace:
            # The tool alone: the same full text again (a replace of the loaded table).
            t0 = time.perf_counter()
            subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, text=True, check=True)
            by_hand = time.perf_counter() - t0
        return {"build": full.compile_seconds, "apply": full.apply_seconds, "total": full.total_seconds,
                "partial": _median(part), "partial_max": max(part, default=float("nan")), "by_hand": by_hand,
                "partial_nft": _median(applies), "dump_load": dump_load, "text_load": text_load,
                "bytes": len(text), "lines": text.count("\n")}


def bench_iptables(n: int, changes: int) -> Dict[str, float]:
    state = new_state(n)
    with Netns("ipt") as ns:
        proxier = IptablesProxier(state, BASE, IptablesKernel(netns=ns))
        full = proxier.sync(force_full=True)
        part = one_change_times(state, proxier, n, changes)
        return {"total": full.total_seconds, "apply": full.apply_seconds, "partial": _median(part)}


def load_average() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


def services_list(values: List[str]) -> List[int]:
    """``--services 1000,10000 30000``: commas and spaces both separate."""
    return [int(v) for value in values for v in value.split(",") if v]


def plot(path: Path, points: Dict[str, Dict[int, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, series in points.items():
        ns = sorted(series)
        ax.plot(ns, [series[n] for n in ns], marker="o", label=label, linestyle="--" if "dump" in label else "-")
        for n in ns:
            ax.annotate(f"{series[n]:.1f}", (n, series[n]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("services (x 3 endpoints)")
    ax.set_ylabel("cold full sync, seconds")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", nargs="+", default=["10000"], help="N, comma- or space-separated")
    ap.add_argument("--changes", type=int, default=9)
    ap.add_argument("--designs", nargs="+", default=["inline", nc.ENDPOINT_CHAINED, nc.ENDPOINT_VMAP],
                    choices=["inline", nc.ENDPOINT_CHAINED, nc.ENDPOINT_VMAP])
    ap.add_argument("--no-iptables", action="store_true", help="skip iptables mode")
    ap.add_argument("--no-replace", action="store_true",
                    help="skip the by-hand nft -f of the full text over the loaded table (slow for vmap)")
    ap.add_argument("--plot", type=Path, help="write a PNG of cold-sync seconds vs N here")
    ap.add_argument("--dump-designs", nargs="+", default=["inline"],
                    help="designs whose dump is loaded into a fresh netns (default: ours only)")
    ap.add_argument("--vmap-max", type=int, default=0,
                    help="skip the vmap layout above this N (its nft -f grows faster than linearly); 0: no limit")
    ap.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results (development)")
    args = ap.parse_args()
    nft_version = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    out = [f"# {time.strftime('%Y-%m-%d %H:%M')} {nft_version}, kernel {os.uname().release}, "
           f"{os.cpu_count()} CPUs; {load_average()}; "
           f"command: python3 benchmarks/bench_nftables.py {' '.join(sys.argv[1:])}"]
    print(out[0], flush=True)

    def say(line: str) -> None:
        print(line, flush=True)
        out.append(line)

    points: Dict[str, Dict[int, float]] = {}
    for n in services_list(args.services):
        ipt = {"total": float("nan"), "partial": float("nan")}
        if not args.no_iptables:
            ipt = bench_iptables(n, args.changes)
            points.setdefault("iptables mode (iptables-restore)", {})[n] = ipt["total"]
            say(f"N={n} iptables: cold full sync {ipt['total']:.2f} s (iptables-restore {ipt['apply']:.2f} s); "
                f"one endpoint change {ipt['partial'] * 1000:.1f} ms (median of {args.changes}); {load_average()}")
        results = {}
        for design in args.designs:
            if design == nc.ENDPOINT_VMAP and args.vmap_max and n > args.vmap_max:
                say(f"N={n} nftables/{design}: skipped (--vmap-max {args.vmap_max})")
                continue
            r = results[design] = bench_nft(n, design, args.changes, replace=not args.no_replace,
                                            dump=design in args.dump_designs)
            label = "nftables mode (ours)" if design == "inline" else f"nftables, upstream's {design} layout"
            points.setdefault(label, {})[n] = r["total"]
            if design in args.dump_designs:
                points.setdefault(f"nft -f of the {design} dump (fresh netns)", {})[n] = r["dump_load"]
            say(f"N={n} nftables/{design}: cold full sync {r['total']:.2f} s = nft text build {r['build']:.2f} s "
                f"+ nft -f {r['apply']:.2f} s ({r['lines']} lines, {r['bytes'] / 1e6:.1f} MB); nft -f of its own "
                f"dump into a fresh netns {r['dump_load']:.2f} s (cold sync / dump load = "
                f"{r['total'] / r['dump_load']:.2f}x); our text by hand into a fresh netns {r['text_load']:.2f} s; "
                f"same text by hand "
                f"(replacing the loaded table) {r['by_hand']:.2f} s; one endpoint change {r['partial'] * 1000:.1f} ms "
                f"median (kernel write, netlink batch or nft -f, {r['partial_nft'] * 1000:.1f} ms of it), "
                f"{r['partial_max'] * 1000:.1f} ms max; "
                f"vs iptables: cold {r['total'] / ipt['total']:.2f}x, "
                f"one change {r['partial'] / ipt['partial']:.2f}x; {load_average()}")
        if "inline" in results and nc.ENDPOINT_VMAP in results:
            i, v = results["inline"], results[nc.ENDPOINT_VMAP]
            say(f"N={n} ours vs upstream's layout: vmap cold {v['total']:.2f} s / ours {i['total']:.2f} s = "
                f"{v['total'] / i['total']:.1f}x")
        if nc.ENDPOINT_CHAINED in results and nc.ENDPOINT_VMAP in results:
            c, v = results[nc.ENDPOINT_CHAINED], results[nc.ENDPOINT_VMAP]
            say(f"N={n} design ratio: upstream vmap nft -f {v['apply']:.2f} s / chained {c['apply']:.2f} s = "
                f"{v['apply'] / c['apply']:.1f}x")
    if args.plot:
        plot(args.plot, points, out[0].lstrip("# ")[:16] + f" cold full sync, N services x 3 endpoints, "
             f"{os.cpu_count()} CPUs")
        say(f"# plot: {args.plot}")
    if args.no_save:
        return 0
    path = ROOT / "benchmarks" / "results" / "nftables.txt"
    path.parent.mkdir(exist_ok=True)
    with path.open("a") as fh:
        fh.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
