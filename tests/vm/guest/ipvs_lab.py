"""Guest side of tests/vm/test_ipvs_module.py: a namespace lab for IPVS traffic, kept alive
over an SSH pipe.

Runs INSIDE a VM lab guest (its kernel has ip_vs)::

    ipvs_lab.py VIP [VIP ...]

builds, with tests/integration/lab.py, a node namespace (the IPVS director), backend pods
be1..be3 (10.244.1.1-3) each running echo_server.py on TCP 8080, and a client pod
10.244.2.10; puts every VIP on a dummy link ``ipvs0`` in the node namespace (IPVS takes
connections to local addresses only); prints ONE JSON line describing the lab::

    {"node": NS, "client": NS, "client_ip": IP, "pods": {"be1": {"ns": NS, "ip": IP}, ...},
     "echo_client": PATH}

and then waits until its stdin is closed (or SIGTERM/SIGHUP), and tears everything down
(processes, namespaces). So the host keeps the lab exactly as long as it keeps the pipe.
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from lab import ECHO_CLIENT, Lab, cleanup_stale  # noqa: E402

BACKENDS = {"be1": "10.244.1.1", "be2": "10.244.1.2", "be3": "10.244.1.3"}
CLIENT_IP = "10.244.2.10"


def build(vips: list[str]) -> Lab:
    lab = Lab()
    try:
        for name, ip in BACKENDS.items():
            lab.add_pod(name, ip)
        lab.add_client("client", CLIENT_IP)
        commands = [["ip", "link", "add", "ipvs0", "type", "dummy"], ["ip", "link", "set", "ipvs0", "up"]]
        commands += [["ip", "addr", "add", f"{vip}/32", "dev", "ipvs0"] for vip in vips]
        for argv in commands:
            lab.exec("node", argv)
        return lab
    except BaseException:
        lab.close()
        raise


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cleanup_stale()
    lab = build(argv)

    def stop(*_args: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        info = {
            "node": lab.ns("node"), "client": lab.ns("client"), "client_ip": CLIENT_IP,
            "pods": {name: {"ns": lab.ns(name), "ip": ip} for name, ip in BACKENDS.items()},
            "echo_client": str(ECHO_CLIENT),
        }
        print(json.dumps(info), flush=True)
        sys.stdin.read()  # until the host closes the pipe
    finally:
        lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
