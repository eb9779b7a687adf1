"""bin/kubenode-proxy with one observer added: every sync and every network programming
latency the daemon itself measures (the values it feeds to
kubeproxy_network_programming_duration_seconds) is also appended to a file, exactly
rather than in the histogram's 0.25 s / 0.5 s / 1 s buckets. Used by bench_daemon.py:

    python3 benchmarks/daemon_tap.py TAPFILE [kubenode-proxy arguments...]

Lines written: ``sync <unix time> <1 if full else 0> <seconds of the sync>`` once per sync,
then ``lat <seconds>`` per change that sync programmed.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    tap_path, argv = sys.argv[1], sys.argv[2:]
    loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", str(ROOT / "bin" / "kubenode-proxy"))
    binmod = importlib.util.module_from_spec(importlib.util.spec_from_loader("kubenode_proxy_bin", loader))
    loader.exec_module(binmod)
    binmod.setup_path()
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import app, cli

    tap = open(tap_path, "a", buffering=1)  # line-buffered: the bench reads it while we run
    original = app.NodeHooks.synced

    def synced(self, result, latencies):
        original(self, result, latencies)
        tap.write(f"sync {time.time():.6f} {int(result.full)} {result.total_seconds:.6f}\n"
                  + "".join(f"lat {v:.6f}\n" for v in latencies))

    app.NodeHooks.synced = synced
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
