"""IPVS mode at scale in the VM lab: N services x 3 endpoints through IpvsProxier.

The build machine's kernel has no IPVS, so this boots one VM lab guest (tests/vm/vmlab.py,
cached image), copies the checkout in and runs itself there with ``--guest`` (as root, in
a fresh network namespace of the guest). Printed, in one run:

* a cold full sync (empty kernel), a warm full sync (everything already right: writes
  nothing) and one-endpoint-change (partial) syncs (median), each with the time of every
  kernel phase (listing and writing IPVS, ipsets, kube-ipvs0 addresses, iptables);
* with ``--profile``, the top functions of the warm full sync.

    python3 benchmarks/bench_ipvs_scale.py --services 5000          # boots a VM (~1 min)
    python3 benchmarks/bench_ipvs_scale.py --guest --services 5000  # inside a guest, as root

Target (issue 12, item 8): a sync at 5,000 services x 3 endpoints within 2 s in the VM lab.
Results are appended to benchmarks/results/ipvs_scale.txt with the command.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "ipvs_scale.txt"
NODE_IP = "192.168.77.1"


def guest(n: int, changes: int, profile: bool) -> List[str]:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", str(ROOT / "bin" / "kubenode-proxy"))
    binmod = importlib.util.module_from_spec(importlib.util.spec_from_loader("kubenode_proxy_bin", loader))
    loader.exec_module(binmod)
    binmod.setup_path()
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import IptablesKernel
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
        parse_endpoint_slice,
        parse_service,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs.proxier import (
        IpvsProxier,
        ipvs_config,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_iptables_sync import endpoint_slice, service

    ns = f"kn-ipvsbench-{os.getpid()}"
    ip = ["ip", "-n", ns]
    subprocess.run(["modprobe", "ip_vs"], check=True)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    lines: List[str] = []
    proxier = None
    try:
        subprocess.run(ip + ["link", "set", "lo", "up"], check=True)
        subprocess.run(ip + ["link", "add", "eth0", "type", "dummy"], check=True)
        subprocess.run(ip + ["addr", "add", f"{NODE_IP}/24", "dev", "eth0"], check=True)
        subprocess.run(ip + ["link", "set", "eth0", "up"], check=True)
        state = ProxyState("node1")
        for i in range(n):
            state.set_service(parse_service(service(i)))
            state.set_slice(parse_endpoint_slice(endpoint_slice(i)))
        cfg = kpconfig.parse({"apiVersion": kpconfig.API_VERSION, "kind": kpconfig.KIND, "mode": "ipvs"})
        ipvs_cfg = ipvs_config(cfg, IptablesConfig(local_cidrs=("10.128.0.0/10",)), ns, addresses=[NODE_IP])
        proxier = IpvsProxier(state, ipvs_cfg, IptablesKernel(netns=ns), ns)
        kernel = proxier.ipvs
        timed: Dict[str, float] = {}

        def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timed[name] = timed.get(name, 0.0) + time.perf_counter() - t0
            return wrapped

        # every kernel step of a sync, timed by phase (the rest is planning in Python)
        link, ipset, iptables = proxier.link, proxier.ipset, proxier.iptables
        for obj, names, label in ((kernel, ("info",), "setup"), (proxier.sysctls, ("ensure",), "setup"),
                                  (link, ("ensure",), "setup"),
                                  (kernel, ("services", "get"), "ipvs listing"), (kernel, ("apply",), "ipvs apply"),
                                  (link, ("addresses", "add", "remove"), "kube-ipvs0 addresses"),
                                  (ipset, ("save",), "ipset listing"), (ipset, ("restore",), "ipset restore"),
                                  (iptables, ("snapshot", "missing_canaries"), "iptables listing"),
                                  (iptables, ("restore",), "iptables restore")):
            for name in names:
                setattr(obj, name, timer(label, getattr(obj, name)))

        def report(label: str, r: Any) -> float:
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(timed.items(), key=lambda kv: -kv[1]))
            rest = r.total_seconds - r.compile_seconds - sum(timed.values())
            lines.append(f"N={n}: {label}: {r.total_seconds:.2f} s (compile {r.compile_seconds:.2f} s, {parts}, "
                         f"other {rest:.2f} s; {r.virtual_servers} virtual servers, {r.real_servers} real servers, "
                         f"{r.addresses} addresses, {len(r.changes)} changes)")
            print(lines[-1], flush=True)
            return r.total_seconds

        def full(label: str) -> float:
            timed.clear()
            return report(label, proxier.sync(force_full=True))

        full("cold full sync (empty kernel)")
        warm = [full("warm full sync (nothing to change)") for _round in range(2)]
        lines.append(f"N={n}: warm full sync, best of 2: {min(warm):.2f} s")
        print(lines[-1], flush=True)
        times = []
        for g in range(1, changes + 1):
            state.set_slice(parse_endpoint_slice(endpoint_slice(g * 7 % n, generation=g)))
            timed.clear()
            t0 = time.perf_counter()
            r = proxier.sync()
            times.append(time.perf_counter() - t0)
            if r.full or not r.changes:
                raise RuntimeError(f"expected a partial sync with changes: {r.summary()}")
            if g == 1:
                report("one-endpoint-change sync (first)", r)
        lines.append(f"N={n}: one-endpoint-change sync: median {statistics.median(times) * 1000:.0f} ms, "
                     f"max {max(times) * 1000:.0f} ms over {changes} changes")
        print(lines[-1], flush=True)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            proxier.sync(force_full=True)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            lines.append(f"N={n}: profile of a warm full sync (top 15 by own time; the profiler slows it):")
            lines += ["    " + ln for ln in out.getvalue().splitlines() if ln.strip()][2:]
            print("\n".join(lines[-17:]), flush=True)
        return lines
    finally:
        if proxier is not None:
            try:
                proxier.cleanup()
            finally:
                proxier.close()
        subprocess.run(["ip", "netns", "del", ns], check=False)


def host(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "tests" / "vm"))
    import vmlab

    command = "python3 benchmarks/bench_ipvs_scale.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lab = vmlab.VMLab(1, image=vmlab.ensure_image())
    try:
        lab.start()
        vm = lab.vms[0]
        repo = vm.put_repo()
        argv = ["--guest", "--services", *map(str, args.services), "--changes", str(args.changes)]
        if args.profile:
            argv.append("--profile")
        proc = vm.sh(f"cd {shlex.quote(repo)} && {vmlab.GUEST_PYTHON} benchmarks/bench_ipvs_scale.py "
                     + " ".join(argv) + "; echo; uname -r; nproc", check=False, timeout=7200)
    finally:
        lab.close()
    print(proc.stdout, end="")
    if proc.returncode != 0:
        print(proc.stderr[-5000:], file=sys.stderr)
        return proc.returncode
    body = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    header = (f"# {time.strftime('%Y-%m-%d %H:%M')} VM lab guest (qemu TCG, {vmlab.SMP} vCPUs, {vmlab.MEMORY_MB} MB), "
              f"kernel {body[-2] if len(body) >= 2 else '?'}; host load avg {os.getloadavg()[0]:.1f}\n# $ {command}\n")
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as fh:
        fh.write(header + "\n".join(body[:-2]) + "\n\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--services", type=int, nargs="+", default=[5000])
    ap.add_argument("--changes", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--guest", action="store_true", help="run here (inside a VM lab guest, as root)")
    args = ap.parse_args()
    if not args.guest:
        return host(args)
    for n in args.services:
        guest(n, args.changes, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
