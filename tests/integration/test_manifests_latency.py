"""A small manifests file beside one of 10,000 Services: its edits reach the kernel within
~1.5 s (the daemon in the node namespace, iptables mode). Before the manifests source
worked on per-file deltas, each edit re-read the 6 MB file and relisted every object
(several seconds per change)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter

import yaml
from proxyctl import BIN, eps, svc, tcp

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
PODS = {"be1": "10.244.1.1", "be2": "10.244.1.2"}
N = 10000


def big_file(path):
    docs = []
    for i in range(N):
        ns = f"ns{i % 50}"
        docs.append(svc(f"svc{i}", f"10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}", HTTP, ns=ns))
        docs.append(eps(f"svc{i}", [f"10.128.{i // 256 % 256}.{i % 256}"], HTTP_EP, ns=ns, node=None))
    path.write_text("\n---\n".join(json.dumps(d) for d in docs))


def chain_rules(lab, chain):
    return lab.exec("node", ["iptables", "-w", "-t", "nat", "-S", chain], check=False).stdout


def web_backends(lab, svc_chain):
    """The DNAT destinations the kernel has for the service (above 1,000 endpoints the rules
    carry no comments, so follow the service chain's jumps to its endpoint chains)."""
    seps = [line.split()[-1] for line in chain_rules(lab, svc_chain).splitlines()
            if line.startswith("-A ") and " -j KUBE-SEP-" in line]
    out = set()
    for sep in seps:
        for line in chain_rules(lab, sep).splitlines():
            if "--to-destination" in line:
                out.add(line.split("--to-destination ")[1].split()[0])
    return out


def test_small_file_edit_reaches_the_kernel_beside_10000_services(lab, tmp_path):
    for name, ip in PODS.items():
        lab.add_pod(name, ip)
    lab.add_client("client", "10.244.2.10")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    big_file(manifests / "big.json")
    small = manifests / "web.yaml"
    small.write_text(yaml.safe_dump_all([svc("web", "10.96.0.10", HTTP), eps("web", [PODS["be1"]], HTTP_EP)]))
    log = tmp_path / "daemon.log"
    proc = lab.spawn("node", [sys.executable, str(BIN), "--manifests", str(manifests), "--hostname-override", "node1",
                              "--cluster-cidr", "10.244.0.0/16", "--iptables-min-sync-period", "100ms",
                              "--iptables-sync-period", "300s"], stdout=log)
    try:
        deadline = time.monotonic() + 240
        while "full sync: 10001 services" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        services = chain_rules(lab, "KUBE-SERVICES")
        chain = next(line.split()[-1] for line in services.splitlines() if '"default/web:http cluster IP"' in line)
        assert web_backends(lab, chain) == {f"{PODS['be1']}:8080"}
        lags = []
        for k in range(6):
            time.sleep(0.5)  # idle between edits: each edit is a change of its own
            target = PODS["be2"] if k % 2 == 0 else PODS["be1"]
            small.write_text(yaml.safe_dump_all([svc("web", "10.96.0.10", HTTP), eps("web", [target], HTTP_EP)]))
            written = os.stat(small).st_mtime
            while web_backends(lab, chain) != {f"{target}:8080"}:
                assert time.time() - written < 10, f"edit {k} not in the kernel after 10 s"
                time.sleep(0.02)
            lags.append(time.time() - written)
        assert max(lags) < 1.5, lags
        # Traffic follows (the last edit put be2 back... or be1: whichever it was).
        replies = lab.request_many("client", "10.96.0.10", 80, count=5, timeout=1.0)
        assert Counter(r.backend for r in replies if r.ok) == Counter({"be1": 5}), replies
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
