"""The README's first command: a namespace lab as a node, examples/manifests as the cluster.

Builds a node namespace with two backend pods, a client pod and an outside host; runs
`kubenode-proxy --once` against the manifests inside the node; shows the ClusterIP, the
NodePort and a UDP service answering and a service without endpoints being rejected;
then removes everything (also on failure or Ctrl-C).
"""
import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from lab import Lab  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifests", default=str(ROOT / "examples" / "manifests"))
    args = ap.parse_args()
    with Lab() as lab:
        lab.add_pod("web-a", "10.244.1.1")
        lab.add_pod("web-b", "10.244.1.2")
        lab.add_client("client", "10.244.2.10")
        lab.add_external("laptop", "192.168.50.2")
        node = lab.ns("node")
        print(f"lab: node namespace {node}, node IP {lab.node_ip}")
        cmd = [sys.executable, str(ROOT / "bin" / "kubenode-proxy"), "--netns", node, "--manifests", args.manifests,
               "--hostname-override", "node1", "--cluster-cidr", "10.244.0.0/16", "--once"]
        print("$ " + " ".join(cmd[1:]))
        proc = subprocess.run(cmd, text=True, check=False)
        if proc.returncode != 0:
            return proc.returncode
        checks = [("client", "10.96.0.10", 80, "tcp", "ClusterIP from a pod"),
                  ("laptop", lab.node_ip, 30080, "tcp", "NodePort from outside"),
                  ("client", "10.96.0.53", 53, "udp", "UDP ClusterIP"),
                  ("client", "10.96.0.99", 80, "tcp", "service without endpoints")]
        for origin, ip, port, proto, what in checks:
            replies = lab.request_many(origin, ip, port, proto, count=10, timeout=1.0)
            outcomes = Counter(r.backend if r.ok else r.outcome for r in replies)
            seen = {r.seen_client for r in replies if r.ok}
            print(f"{what:28s} {proto} {ip}:{port} from {origin}: {dict(outcomes)}"
                  + (f", backends saw {sorted(seen)}" if seen else ""))
        print("\nrules in the node (iptables-save -t nat | grep KUBE-SVC):")
        out = lab.exec("node", ["iptables-save", "-t", "nat"]).stdout
        print("\n".join(line for line in out.splitlines() if line.startswith("-A KUBE-SVC")))
    print("\nlab removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
