"""Connects to HOST:PORT (TCP) again and again, one fresh socket each time, and prints one
JSON line per attempt: {"t": wall clock at the start, "ok": bool, "backend": name or null}.
Used to see when a service stops and starts working again (recovery tests, benchmarks).

    prober.py HOST PORT [--interval 0.05] [--timeout 0.25]
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=0.25)
    args = ap.parse_args()
    while True:
        start = time.time()
        backend = None
        try:
            with socket.create_connection((args.host, args.port), timeout=args.timeout) as sock:
                data = sock.recv(4096).decode(errors="replace").split()
                backend = data[0] if data else None
        except OSError:
            pass
        sys.stdout.write(json.dumps({"t": start, "ok": backend is not None, "backend": backend}) + "\n")
        sys.stdout.flush()
        left = args.interval - (time.time() - start)
        if left > 0:
            time.sleep(left)


if __name__ == "__main__":
    sys.exit(main())
