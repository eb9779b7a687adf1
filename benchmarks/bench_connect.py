"""New-connection latency through a service IP at N services x 3 endpoints, iptables and
nftables mode: how each mode's data plane grows with N. Not a test; run as root:

    python3 benchmarks/bench_connect.py --services 1000,10000,30000 --connections 5000 \\
        --plot benchmarks/results/connect_latency.png

Three namespaces per run: a client, the node (the proxier's rules, IP forwarding) and a
backend that owns all of 10.128.0.0/10 (a local route: every endpoint address of every
service answers there, so each connection can go to any of the N services). The client
times connect() of a TCP socket -- its SYN, the node's first-packet NAT decision (the rule
walk, or the verdict-map lookup), the backend's SYN-ACK -- for ``--connections``
connections, each to a service drawn at random among the N, closed with a RST so no
TIME_WAIT piles up. The baseline is the same connect() to an endpoint address with no
proxy rules at all. Prints p50/p99 per mode and N and the ratio to the smallest N, and
appends them to benchmarks/results/connect_latency.txt with the date, the command and the
load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchpath import ROOT  # noqa: E402  (sets up the collection path)

sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_iptables_sync import service  # noqa: E402
from bench_nftables import BASE, design_config, load_average, new_state, services_list  # noqa: E402

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import (  # noqa: E402
    IptablesKernel,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.nft import NftKernel  # noqa: E402
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import (  # noqa: E402
    IptablesProxier,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables.proxier import (  # noqa: E402
    NftablesProxier,
)

SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen(4096)
print("ready", flush=True)
while True:
    c, _addr = s.accept()
    c.close()
"""

# The client: connect() timed with perf_counter around the call alone (the socket is made
# before the clock starts); RST on close (SO_LINGER 0) so ports are reused at once.
CLIENT = """
import json, socket, struct, sys, time
targets = json.loads(sys.stdin.read())
linger = struct.pack("ii", 1, 0)
times, failures = [], 0
for ip, port in targets:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    s.settimeout(5)
    t0 = time.perf_counter()
    try:
        s.connect((ip, port))
        times.append(time.perf_counter() - t0)
    except OSError:
        failures += 1
    s.close()
print(json.dumps({"times": times, "failures": failures}))
"""


class Topology:
    """client 10.0.0.2 -- 10.0.0.1 node 10.1.0.1 -- 10.1.0.2 backend (+ all of 10.128.0.0/10)."""

    def __init__(self, tag: str) -> None:
        p = f"kn-cx{os.getpid() % 10000}{tag}"
        self.client, self.node, self.backend = f"{p}-c", f"{p}-n", f"{p}-b"
        self.server: Optional[subprocess.Popen] = None

    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self) -> None:
        c, n, b = self.client, self.node, self.backend
        for ns in (c, n, b):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", n, "link", "add", "n0", "type", "veth", "peer", "name", "c0", "netns", c],
                       check=True)
        subprocess.run(["ip", "-n", n, "link", "add", "n1", "type", "veth", "peer", "name", "b0", "netns", b],
                       check=True)
        cmds = [
            (c, ["addr", "add", "10.0.0.2/24", "dev", "c0"]), (c, ["link", "set", "c0", "up"]),
            (c, ["route", "add", "default", "via", "10.0.0.1"]),
            (n, ["addr", "add", "10.0.0.1/24", "dev", "n0"]), (n, ["link", "set", "n0", "up"]),
            (n, ["addr", "add", "10.1.0.1/24", "dev", "n1"]), (n, ["link", "set", "n1", "up"]),
            (n, ["route", "add", "10.128.0.0/10", "via", "10.1.0.2"]),
            (b, ["addr", "add", "10.1.0.2/24", "dev", "b0"]), (b, ["link", "set", "b0", "up"]),
            (b, ["route", "add", "default", "via", "10.1.0.1"]),
            (b, ["route", "add", "local", "10.128.0.0/10", "dev", "lo"]),
        ]
        for ns, argv in cmds:
            subprocess.run(["ip", "-n", ns, *argv], check=True)
        for key, value in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                           ("net.ipv4.conf.default.rp_filter", "0")):
            subprocess.run(["ip", "netns", "exec", n, "sysctl", "-qw", f"{key}={value}"], check=True)
        subprocess.run(["ip", "netns", "exec", c, "sysctl", "-qw", "net.ipv4.ip_local_port_range=10000 60999"],
                       check=True)
        self.server = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", SERVER],
                                       stdout=subprocess.PIPE, text=True)
        if self.server.stdout.readline().strip() != "ready":
            raise RuntimeError("backend server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            self.server.stdout.close()
        for ns in (self.client, self.node, self.backend):
            subprocess.run(["ip", "netns", "del", ns], check=False, stderr=subprocess.DEVNULL)

    def connect_times(self, targets: List[Tuple[str, int]]) -> Tuple[List[float], int]:
        out = subprocess.run(["ip", "netns", "exec", self.client, sys.executable, "-c", CLIENT],
                             input=json.dumps(targets), capture_output=True, text=True, check=True).stdout
        data = json.loads(out)
        return data["times"], data["failures"]


def pct(values: List[float], q: float) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")


def measure(mode: str, n: int, connections: int, seed: int) -> Dict[str, float]:
    rng = random.Random(seed)
    with Topology(mode[:3]) as topo:
        sync_s = 0.0
        if mode == "baseline":
            targets = [(f"10.128.{rng.randrange(0, 234)}.{rng.randrange(1, 255)}", 8080) for _n in range(connections)]
        else:
            state = new_state(n)
            if mode == "iptables":
                proxier = IptablesProxier(state, BASE, IptablesKernel(netns=topo.node))
            else:
                proxier = NftablesProxier(state, design_config("inline"), NftKernel(topo.node))
            sync_s = proxier.sync(force_full=True).total_seconds
            ips = [service(i)["spec"]["clusterIP"] for i in range(n)]
            targets = [(rng.choice(ips), 80) for _n in range(connections)]
        topo.connect_times(targets[:200])  # warm-up: neighbours, route caches, the server's accept loop
        times, failures = topo.connect_times(targets)
        return {"p50": pct(times, 0.5), "p90": pct(times, 0.9), "p99": pct(times, 0.99),
                "mean": sum(times) / max(1, len(times)), "count": len(times), "failures": failures, "sync": sync_s}


def plot(path: Path, points: Dict[str, Dict[int, Dict[str, float]]], baseline: Optional[Dict[str, float]],
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"iptables": "tab:blue", "nftables": "tab:orange"}
    for ax, q in zip(axes, ("p50", "p99")):
        for mode, series in points.items():
            ns = sorted(series)
            ys = [series[n][q] * 1e6 for n in ns]
            ax.plot(ns, ys, marker="o", color=colors.get(mode), label=f"{mode} mode")
            for n, y in zip(ns, ys):
                ax.annotate(f"{y:.0f}", (n, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if baseline:
            ax.axhline(baseline[q] * 1e6, color="grey", linestyle=":", label="no proxy rules (direct to an endpoint)")
        ax.set_xlabel("services (x 3 endpoints)")
        ax.set_ylabel(f"connect() time {q}, microseconds")
        ax.set_title(f"{q}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_results(text: str) -> Tuple[str, Dict[str, Dict[int, Dict[str, float]]], Dict[str, float]]:
    """The last run in a connect_latency.txt: (its head line, points, baseline), to redraw a plot."""
    block = text[text.rindex("# 20"):]
    points: Dict[str, Dict[int, Dict[str, float]]] = {}
    baseline: Dict[str, float] = {}
    for line in block.splitlines():
        words = line.replace(",", "").split()
        vals = {words[i]: float(words[i + 1]) / 1e6 for i in range(len(words) - 1) if words[i] in ("p50", "p99")
                and words[i + 1].replace(".", "").isdigit()}
        if line.startswith("baseline"):
            baseline = vals
        elif line.startswith("N="):
            points.setdefault(words[1].rstrip(":"), {})[int(words[0][2:])] = vals
    return block.splitlines()[0], points, baseline


def title_for(head: str, connections: int) -> str:
    return (f"{head[2:18]} new-connection latency: connect() of a TCP socket through a random service IP, "
            f"{connections} connections per point, {os.cpu_count()} CPUs, {head.split('; ')[-2]}")


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", nargs="+", default=["1000,10000,30000"], help="N, comma- or space-separated")
    ap.add_argument("--modes", default="iptables,nftables")
    ap.add_argument("--connections", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--plot", type=Path, help="write a PNG of p50/p99 vs N per mode here")
    ap.add_argument("--replot", type=Path, help="only redraw --plot from this results file's last run")
    ap.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results (development)")
    args = ap.parse_args()
    # A SIGTERM unwinds like an error, so the namespaces and processes made are removed.
    signal.signal(signal.SIGTERM, _terminate)
    if args.replot:
        head, points, baseline = parse_results(args.replot.read_text())
        plot(args.plot, points, baseline, title_for(head, args.connections))
        return 0
    head = (f"# {time.strftime('%Y-%m-%d %H:%M')} kernel {os.uname().release}, {os.cpu_count()} CPUs, "
            f"{subprocess.run(['iptables', '--version'], capture_output=True, text=True, check=False).stdout.strip()}; "
            f"{load_average()}; command: python3 benchmarks/bench_connect.py {' '.join(sys.argv[1:])}")
    lines = [head]
    print(head, flush=True)

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    base = measure("baseline", 0, args.connections, args.seed)
    say(f"baseline (no proxy rules, straight to an endpoint address): p50 {base['p50'] * 1e6:.0f} us, "
        f"p99 {base['p99'] * 1e6:.0f} us over {base['count']} connections; {load_average()}")
    points: Dict[str, Dict[int, Dict[str, float]]] = {}
    ns_list = services_list(args.services)
    for mode in args.modes.split(","):
        for n in ns_list:
            r = points.setdefault(mode, {})[n] = measure(mode, n, args.connections, args.seed)
            first = points[mode][ns_list[0]]
            say(f"N={n} {mode}: p50 {r['p50'] * 1e6:.0f} us, p90 {r['p90'] * 1e6:.0f} us, p99 {r['p99'] * 1e6:.0f} us, "
                f"mean {r['mean'] * 1e6:.0f} us over {r['count']} connections ({r['failures']} failed); "
                f"p50 vs N={ns_list[0]}: {r['p50'] / first['p50']:.2f}x, p99 {r['p99'] / first['p99']:.2f}x; "
                f"(rules loaded by a cold sync of {r['sync']:.1f} s); {load_average()}")
    if args.plot:
        plot(args.plot, points, base, title_for(head, args.connections))
        say(f"# plot: {args.plot}")
    if not args.no_save:
        with (ROOT / "benchmarks" / "results" / "connect_latency.txt").open("a") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
