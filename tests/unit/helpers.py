"""Builders for Kubernetes API dicts, shaped as the API (and kubernetes.core.k8s_info) returns them."""
from typing import Any, Dict, List, Optional


def service(ns: str, name: str, cluster_ip: str, ports: List[Dict[str, Any]], **spec: Any) -> Dict[str, Any]:
    status = spec.pop("status", {})
    labels = spec.pop("labels", None)
    obj: Dict[str, Any] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": cluster_ip, "ports": ports, **spec},
    }
    if labels:
        obj["metadata"]["labels"] = labels
    if status:
        obj["status"] = status
    return obj


def port(name: str = "p80", port: int = 80, protocol: str = "TCP", node_port: Optional[int] = None) -> Dict[str, Any]:
    p: Dict[str, Any] = {"name": name, "port": port, "protocol": protocol}
    if node_port:
        p["nodePort"] = node_port
    return p


def endpoint(ip: str, node: Optional[str] = None, ready: Optional[bool] = None,
             serving: Optional[bool] = None, terminating: Optional[bool] = None) -> Dict[str, Any]:
    ep: Dict[str, Any] = {"addresses": [ip]}
    if node:
        ep["nodeName"] = node
    cond = {k: v for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating)) if v is not None}
    if cond:
        ep["conditions"] = cond
    return ep


def endpoint_slice(ns: str, svc: str, endpoints: List[Dict[str, Any]], ports: List[Dict[str, Any]],
                   name: Optional[str] = None, address_type: str = "IPv4") -> Dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name or f"{svc}-1", "namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports,
    }


def slice_port(name: str = "p80", port: int = 80, protocol: str = "TCP") -> Dict[str, Any]:
    return {"name": name, "port": port, "protocol": protocol}
