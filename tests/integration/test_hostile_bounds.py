"""Hostile input against the real command in a lab namespace: a YAML alias bomb next to a
good manifest (bounded memory, the good Service programmed, exit 3), and 600 idle TCP
connections to /healthz and to a health-check node port while the daemon keeps syncing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import yaml
from proxyctl import BIN, NODE_NAME, eps, save, svc, tcp, write_manifests

HTTP = [tcp(80, "http")]
HTTP_EP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
AS_LIMIT = 1536 * 1024 * 1024  # address-space cap for the command under test: the machine stays safe


def alias_bomb(levels: int = 9) -> str:
    """A Service whose clusterIP is 10^9 strings once its aliases are expanded (a few hundred
    bytes of text); an error message that echoes the value walks all of them."""
    lines = ['  a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]")
    return ("apiVersion: v1\nkind: Service\nmetadata: {name: bomb, namespace: default}\nx:\n" + "\n".join(lines)
            + f"\nspec: {{clusterIP: *a{levels - 1}, ports: [{{name: http, port: 80, protocol: TCP}}]}}\n")


def peak_rss_mb(argv, timeout=120.0):
    """Run argv in a fresh interpreter that reports its own child's ru_maxrss (MB)."""
    code = ("import os, resource, subprocess, sys, time\n"
            "def lim():\n"
            f"    resource.setrlimit(resource.RLIMIT_AS, ({AS_LIMIT}, {AS_LIMIT}))\n"
            "t = time.monotonic()\n"
            "p = subprocess.Popen(sys.argv[1:], preexec_fn=lim, stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
            "out, err = p.communicate()\n"
            "sys.stderr.buffer.write(err)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "
            "time.monotonic() - t)\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          check=False)
    rc, rss, seconds = proc.stdout.split()[-3:]
    return int(rc), proc.stderr, float(rss), float(seconds)


def test_alias_bomb_is_refused_in_bounded_memory_and_the_good_file_is_served(lab, tmp_path):
    manifests = tmp_path / "m"
    manifests.mkdir()
    (manifests / "bomb.yaml").write_text(alias_bomb())
    (manifests / "good.yaml").write_text(yaml.safe_dump_all([svc("web", "10.96.0.10", HTTP),
                                                             eps("web", ["10.244.1.1"], HTTP_EP)]))
    argv = [sys.executable, str(BIN), "--netns", lab.ns("node"), "--hostname-override", NODE_NAME,
            "--cluster-cidr", "10.244.0.0/16", "--manifests", str(manifests), "--once"]
    rc, err, rss, seconds = peak_rss_mb(argv)
    print(f"alias bomb: exit {rc}, peak RSS {rss:.0f} MB, {seconds:.2f} s")
    assert rss < 200, f"peak RSS {rss:.0f} MB"
    assert rc == 3, err
    assert f"{manifests / 'bomb.yaml'}: cannot parse" in err and "alias" in err, err
    nat = save(lab.ns("node"), "nat")
    assert "10.96.0.10/32" in nat and "10.244.1.1:8080" in nat


HOLDER = r"""
import socket, sys, time
conns = []
for address in sys.argv[2:]:
    host, port = address.rsplit(":", 1)
    for _ in range(int(sys.argv[1])):
        s = socket.create_connection((host, int(port)), timeout=5)
        conns.append(s)
print("ready", len(conns), flush=True)
time.sleep(120)
"""


def proc_counts(pid: int):
    """(threads, open fds) of a process."""
    with open(f"/proc/{pid}/status") as fh:
        threads = next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def healthz(lab, port=10256):
    out = lab.exec("node", ["curl", "-s", "-m", "3", "-o", "/dev/null", "-w", "%{http_code} %{time_total}",
                            f"http://127.0.0.1:{port}/healthz"], check=False).stdout.split()
    return (int(out[0]), float(out[1])) if len(out) == 2 else (0, 0.0)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {predicate}")


def test_daemon_syncs_and_answers_with_600_idle_connections(lab, tmp_path):
    lab.add_pod("be1", "10.244.1.1")
    hc = 32100
    lb = svc("lbl", "10.96.0.20", [tcp(80, "http", node_port=30020)], type="LoadBalancer",
             externalTrafficPolicy="Local", healthCheckNodePort=hc,
             status={"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}]}})
    objects = [lb, eps("lbl", ["10.244.1.1"], HTTP_EP, node=NODE_NAME)]
    manifests = tmp_path / "m"
    write_manifests(manifests, objects)
    log = tmp_path / "daemon.log"
    daemon = lab.spawn("node", [sys.executable, str(BIN), "--manifests", str(manifests),
                                "--hostname-override", NODE_NAME, "--cluster-cidr", "10.244.0.0/16",
                                "--iptables-min-sync-period", "100ms", "--healthz-bind-address", "127.0.0.1:10256",
                                "--metrics-bind-address", "127.0.0.1:10249"], stdout=log)
    holder = None
    try:
        wait_for(lambda: healthz(lab)[0] == 200)
        wait_for(lambda: lab.exec("node", ["curl", "-s", "-m", "2", f"http://127.0.0.1:{hc}/"],
                                  check=False).stdout.count('"localEndpoints": 1'))
        base_threads, base_fds = proc_counts(daemon.pid)
        holder = lab.spawn("node", [sys.executable, "-c", HOLDER, "600", "127.0.0.1:10256", f"127.0.0.1:{hc}"])
        assert holder.stdout.readline().split() == ["ready", "1200"]
        # The kernel completes the handshakes; the daemon accepts them from its backlog.
        wait_for(lambda: proc_counts(daemon.pid)[1] >= base_fds + 1200, timeout=5)
        threads, fds = proc_counts(daemon.pid)
        print(f"baseline {base_threads} threads / {base_fds} fds; with 1200 idle: {threads} threads / {fds} fds")
        assert fds >= base_fds + 1200, "the idle connections were not all accepted"
        assert threads <= base_threads + 5, f"{threads} threads (was {base_threads}) for idle connections"
        code, seconds = healthz(lab)
        assert code == 200 and seconds < 2.0, (code, seconds)
        start = time.monotonic()
        write_manifests(manifests, objects + [svc("web", "10.96.0.30", HTTP), eps("web", ["10.244.1.1"], HTTP_EP)])
        wait_for(lambda: "10.96.0.30/32" in save(lab.ns("node"), "nat"), timeout=5)
        latency = time.monotonic() - start
        code, seconds = healthz(lab)
        print(f"edit reached the kernel in {latency:.2f} s; /healthz {code} in {seconds * 1000:.0f} ms")
        assert code == 200 and seconds < 2.0
        assert proc_counts(daemon.pid)[1] >= base_fds + 1200, "the idle connections should still be open"
        assert daemon.poll() is None
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(5)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
