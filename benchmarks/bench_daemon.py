"""The real daemon (bin/kubenode-proxy, through benchmarks/daemon_tap.py) at N services x 3
endpoints, fed by the real `kubernetes` client from the list/watch server of
tests/integration/fake_apiserver.py, in iptables and nftables mode. Not a test; run as root:

    python3 benchmarks/bench_daemon.py --services 10000 --modes iptables,nftables \\
        --rate 50 --duration 300 --plot benchmarks/results/programming_latency_10k.png

Per mode it measures:
  * the start: daemon start -> list -> first full sync done, and the daemon's RSS then
    (VmRSS and VmHWM from /proc/PID/status);
  * network programming latency under sustained churn: ``--rate`` EndpointSlice updates per
    second for ``--duration`` seconds, each stamped with upstream's
    ``endpoints.kubernetes.io/last-change-trigger-time`` when written, so a latency is
    write -> watch -> queue -> sync -> kernel done, as the daemon measures it for
    kubeproxy_network_programming_duration_seconds (p50/p90/p99/max, and the share <= 1 s,
    cross-checked against that histogram's le="1" bucket scraped from /metrics);
  * RSS again after the churn.
Results are appended to benchmarks/results/programming_latency.txt (latency) and
benchmarks/results/daemon_rss.txt (RSS) with the date, the command and the load average.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_programming_latency import endpoint_slice, service  # noqa: E402
from fake_apiserver import FakeApiServer  # noqa: E402


def load_average() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> Tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _sep, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def read_tap(path: Path) -> Tuple[List[Tuple[float, int, float]], List[Tuple[float, float]]]:
    """(syncs as (time, full, seconds), latencies as (sync time, seconds))."""
    syncs, lats = [], []
    last = 0.0
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts[0] == "sync" and len(parts) == 4:
            last = float(parts[1])
            syncs.append((last, int(parts[2]), float(parts[3])))
        elif parts[0] == "lat" and len(parts) == 2:
            lats.append((last, float(parts[1])))
    return syncs, lats


def histogram_le1(url: str) -> Tuple[float, float]:
    """kubeproxy_network_programming_duration_seconds: (count <= 1 s, count)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    le1 = total = 0.0
    for line in text.splitlines():
        if line.startswith('kubeproxy_network_programming_duration_seconds_bucket{le="1.0"}') or \
                line.startswith('kubeproxy_network_programming_duration_seconds_bucket{le="1"}'):
            le1 = float(line.split()[-1])
        elif line.startswith("kubeproxy_network_programming_duration_seconds_count"):
            total = float(line.split()[-1])
    return le1, total


def pct(values: List[float], q: float) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")


def run(mode: str, n: int, rate: float, duration: float, min_sync: str, tmp: Path) -> Dict[str, object]:
    ns = f"kn-bd-{mode[:3]}-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    api = FakeApiServer(bookmark_interval=None).start()
    proc = None
    log = open(tmp / f"daemon-{mode}-{n}.log", "w")
    tap = tmp / f"tap-{mode}-{n}.txt"
    try:
        for i in range(n):
            api.create(service(i))
            api.create(endpoint_slice(i))
        metrics = free_port()
        argv = [sys.executable, str(ROOT / "benchmarks" / "daemon_tap.py"), str(tap),
                "--proxy-mode", mode, "--kubeconfig", str(api.write_kubeconfig(tmp / f"kubeconfig-{mode}")),
                "--netns", ns, "--hostname-override", "node1", "--cluster-cidr", "10.128.0.0/10",
                "--record-dir", str(tmp / f"record-{mode}"),
                "--healthz-bind-address", f"127.0.0.1:{free_port()}", "--metrics-bind-address", f"127.0.0.1:{metrics}"]
        if min_sync:
            argv += ["--iptables-min-sync-period", min_sync]
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        while not tap.exists() or not read_tap(tap)[0]:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}: see {log.name}")
            if time.time() - t0 > 1800:
                raise RuntimeError("no first sync in 30 minutes")
            time.sleep(0.05)
        first = read_tap(tap)[0][0]
        start_s = first[0] - t0
        rss_first = rss(proc.pid)
        time.sleep(2)  # let the settle syncs after the first one pass
        total = int(rate * duration)
        churn0 = time.time()
        late = 0.0
        for k in range(total):
            due = churn0 + k / rate
            now = time.time()
            if due > now:
                time.sleep(due - now)
            else:
                late = max(late, now - due)
            api.update(endpoint_slice((k * 7919) % n, generation=k + 1))
        churn_s = time.time() - churn0
        deadline = time.time() + 60
        while len(read_tap(tap)[1]) < total and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        syncs, lats = read_tap(tap)
        churn_syncs = [s for s in syncs if s[0] >= churn0]
        values = [v for t, v in lats if t >= churn0]
        le1, hist_total = histogram_le1(f"http://127.0.0.1:{metrics}/metrics")
        return {"mode": mode, "n": n, "start": start_s, "first_sync": first[2], "rss_first": rss_first,
                "rss_end": rss(proc.pid), "values": values, "written": total, "churn_s": churn_s, "late": late,
                "syncs": churn_syncs, "t0": churn0, "hist": (le1, hist_total), "log": log.name}
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
        api.stop()
        subprocess.run(["ip", "netns", "del", ns], check=False)


def plot(path: Path, results: List[Dict[str, object]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, line) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        vals = sorted(r["values"])
        if not vals:
            continue
        label = f"{r['mode']} (p50 {pct(vals, 0.5) * 1000:.0f} ms, p99 {pct(vals, 0.99) * 1000:.0f} ms)"
        cdf.plot([v * 1000 for v in vals], [(i + 1) / len(vals) for i in range(len(vals))], label=label)
        syncs = r["syncs"]
        line.plot([s[0] - r["t0"] for s in syncs], [s[2] * 1000 for s in syncs], ".", markersize=3,
                  label=f"{r['mode']}: sync duration")
        lat_by_sync: Dict[float, float] = {}
        for t, v in zip(r["lat_times"], r["values"]):
            lat_by_sync[t] = max(lat_by_sync.get(t, 0.0), v)
        line.plot([t - r["t0"] for t in lat_by_sync], [v * 1000 for v in lat_by_sync.values()], "x", markersize=3,
                  label=f"{r['mode']}: worst latency in the sync")
    cdf.axvline(1000, color="red", linestyle=":", label="target p99 1 s")
    cdf.axhline(0.99, color="grey", linestyle=":")
    cdf.set_xlabel("network programming latency, ms")
    cdf.set_ylabel("share of changes")
    cdf.set_title("CDF of write -> rules in the kernel", fontsize=9)
    cdf.legend(fontsize=8)
    cdf.grid(True, alpha=0.3)
    line.set_xlabel("seconds into the churn")
    line.set_ylabel("ms")
    line.set_title("timeline: each sync", fontsize=9)
    line.legend(fontsize=8)
    line.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--modes", default="iptables,nftables")
    ap.add_argument("--rate", type=float, default=50.0, help="EndpointSlice updates per second")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of churn (0: start and RSS only)")
    ap.add_argument("--min-sync-period", default="", help="--iptables-min-sync-period for the daemon "
                    "(default: the daemon's own, 1s as upstream)")
    ap.add_argument("--plot", type=Path, help="write a PNG (latency CDF and sync timeline) here")
    ap.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results (development)")
    args = ap.parse_args()
    # A SIGTERM unwinds like an error, so the namespaces and processes made are removed.
    signal.signal(signal.SIGTERM, _terminate)
    head = (f"# {time.strftime('%Y-%m-%d %H:%M')} kernel {os.uname().release}, {os.cpu_count()} CPUs; "
            f"{load_average()}; command: python3 benchmarks/bench_daemon.py {' '.join(sys.argv[1:])}")
    print(head, flush=True)
    lat_lines, rss_lines = [head], [head]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            r = run(mode, args.services, args.rate, args.duration, args.min_sync_period, Path(tmp))
            syncs, lats = read_tap(Path(tmp) / f"tap-{mode}-{args.services}.txt")
            r["lat_times"] = [t for t, _v in lats if t >= r["t0"]]
            results.append(r)
            n = args.services
            rl = (f"N={n} {mode}: daemon start -> list -> first full sync done {r['start']:.1f} s "
                  f"(the sync {r['first_sync']:.1f} s); RSS after the first sync VmRSS {r['rss_first'][0]:.0f} MiB, "
                  f"VmHWM {r['rss_first'][1]:.0f} MiB; after the churn VmRSS {r['rss_end'][0]:.0f} MiB, "
                  f"VmHWM {r['rss_end'][1]:.0f} MiB; {load_average()}")
            print(rl, flush=True)
            rss_lines.append(rl)
            vals = r["values"]
            if args.duration > 0:
                partial = [s[2] for s in r["syncs"] if not s[1]]
                mean_partial = sum(partial) / max(1, len(partial))
                within = sum(1 for v in vals if v <= 1.0) / len(vals) if vals else float("nan")
                le1, htotal = r["hist"]
                ll = (f"N={n} {mode}: {r['written']} EndpointSlice updates at {args.rate:g}/s in {r['churn_s']:.0f} s "
                      f"(writer at most {r['late'] * 1000:.0f} ms behind schedule), {len(vals)} latencies: "
                      f"p50 {pct(vals, 0.5) * 1000:.0f} ms, p90 {pct(vals, 0.9) * 1000:.0f} ms, "
                      f"p99 {pct(vals, 0.99) * 1000:.0f} ms, max {max(vals, default=float('nan')) * 1000:.0f} ms; "
                      f"<= 1 s: {within * 100:.1f}% (daemon histogram le=1: {le1:.0f}/{htotal:.0f}); "
                      f"{len(r['syncs'])} syncs ({len(partial)} partial, mean {mean_partial * 1000:.0f} ms, "
                      f"max {max(partial, default=0) * 1000:.0f} ms); min sync period "
                      f"{args.min_sync_period or '1s (default)'}; {load_average()}")
                print(ll, flush=True)
                lat_lines.append(ll)
    if args.plot and args.duration > 0:
        plot(args.plot, results, f"{head[2:18]} network programming latency, {args.services} services, "
             f"{args.rate:g} EndpointSlice updates/s for {args.duration:g} s, min sync period "
             f"{args.min_sync_period or '1s'}, {os.cpu_count()} CPUs")
        print(f"# plot: {args.plot}", flush=True)
        lat_lines.append(f"# plot: {args.plot}")
    if not args.no_save:
        out = ROOT / "benchmarks" / "results"
        if args.duration > 0:
            with (out / "programming_latency.txt").open("a") as fh:
                fh.write("\n".join(lat_lines) + "\n")
        with (out / "daemon_rss.txt").open("a") as fh:
            fh.write("\n".join(rss_lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
