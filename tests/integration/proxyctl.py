"""Drive kubenode-proxy against a Lab: write manifests, run the command, read rules."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "bin" / "kubenode-proxy"
NODE_NAME = "node1"


def poll(predicate: Any, timeout: float, interval: float = 0.1) -> Any:
    """``predicate()``'s first truthy value within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def wait_for(predicate: Any, timeout: float = 15.0, interval: float = 0.1, what: str = "") -> Any:
    """As poll(), but a timeout fails the test, naming what was awaited."""
    value = poll(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what or predicate.__doc__ or predicate}")
    return value


def svc(name: str, cluster_ip: str, ports: List[Dict[str, Any]], ns: str = "default", **spec: Any) -> Dict[str, Any]:
    status = spec.pop("status", None)
    obj: Dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
                           "spec": {"clusterIP": cluster_ip, "ports": ports, **spec}}
    if status:
        obj["status"] = status
    return obj


def eps(service: str, ips: Iterable[str], ports: List[Dict[str, Any]], ns: str = "default",
        node: Optional[str] = NODE_NAME, name: Optional[str] = None, **cond: Any) -> Dict[str, Any]:
    endpoints = []
    for ip in ips:
        ep: Dict[str, Any] = {"addresses": [ip]}
        if node:
            ep["nodeName"] = node
        if cond:
            ep["conditions"] = dict(cond)
        endpoints.append(ep)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name or f"{service}-abc", "namespace": ns,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": ports, "endpoints": endpoints}


def tcp(port: int = 80, name: str = "http", node_port: Optional[int] = None, protocol: str = "TCP") -> Dict[str, Any]:
    p: Dict[str, Any] = {"name": name, "port": port, "protocol": protocol}
    if node_port:
        p["nodePort"] = node_port
    return p


def write_manifests(directory: Path, objects: List[Dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in directory.glob("*.yaml"):
        f.unlink()
    (directory / "cluster.yaml").write_text(yaml.safe_dump_all(objects))


def run_proxy(netns: str, *args: str, manifests: Optional[Path] = None,
              check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(BIN), "--netns", netns, "--hostname-override", NODE_NAME,
            "--cluster-cidr", "10.244.0.0/16"]
    if manifests is not None:
        argv += ["--manifests", str(manifests)]
    argv += list(args)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ}, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubenode-proxy failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")
    return proc


def save(netns: str, table: Optional[str] = None) -> str:
    argv = ["ip", "netns", "exec", netns, "iptables-save"] + (["-t", table] if table else [])
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def kube_chains(netns: str) -> List[str]:
    return [line[1:].split()[0] for line in save(netns).splitlines() if line.startswith(":KUBE-")]
