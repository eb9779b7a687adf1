# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Upstream's KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1), strictly parsed.

Unknown fields and bad values are rejected with the field's path; fields that exist
upstream but do not apply to this proxy are accepted and ignored (listed in IGNORED).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .durations import MAX_DURATION, parse_duration  # noqa: F401 pylint: disable=unused-import
from .errors import MAX_SHOWN, ConfigError, show  # noqa: F401 pylint: disable=unused-import

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")


@dataclass
class ConntrackConfig:
    max_per_core: Optional[int] = 32768
    min: Optional[int] = 131072
    tcp_established_timeout: Optional[float] = 86400.0
    tcp_close_wait_timeout: Optional[float] = 3600.0
    tcp_be_liberal: bool = False
    udp_timeout: Optional[float] = None
    udp_stream_timeout: Optional[float] = None


@dataclass
class IPVSConfig:
    """The ``ipvs:`` section. The sync periods are None unless set: in IPVS mode a set one
    replaces the proxy's sync period (upstream's v1alpha1 conversion does the same)."""

    scheduler: str = ""  # "" = rr
    sync_period: Optional[float] = None
    min_sync_period: Optional[float] = None
    exclude_cidrs: Tuple[str, ...] = ()
    strict_arp: bool = False
    tcp_timeout: float = 0.0
    tcp_fin_timeout: float = 0.0
    udp_timeout: float = 0.0


@dataclass
class ProxyConfig:
    mode: str = "iptables"
    hostname_override: str = ""
    cluster_cidrs: Tuple[str, ...] = ()
    detect_local_mode: str = "ClusterCIDR"
    bridge_interface: str = ""
    interface_name_prefix: str = ""
    masquerade_all: bool = False
    masquerade_bit: int = 14
    localhost_nodeports: bool = True
    node_port_addresses: Tuple[str, ...] = ()
    sync_period: float = 30.0
    min_sync_period: float = 1.0
    healthz_bind_address: str = "127.0.0.1:10256"
    metrics_bind_address: str = "127.0.0.1:10249"
    kubeconfig: str = ""
    config_sync_period: float = 900.0
    conntrack: ConntrackConfig = field(default_factory=ConntrackConfig)
    ipvs: IPVSConfig = field(default_factory=IPVSConfig)
    ignored: List[str] = field(default_factory=list)


def period(value: Any, path: str, zero: bool = False) -> float:
    """A duration that must be positive (upstream's validation of syncPeriod and
    configSyncPeriod), or with ``zero`` at least 0 (minSyncPeriod, timeouts)."""
    seconds = parse_duration(value, path)
    if seconds < 0 or (seconds == 0 and not zero):
        raise ConfigError(path, f"must be greater than {'or equal to ' if zero else ''}0, got {show(value)}")
    return seconds


def _expect(obj: Any, path: str, kind: type) -> Any:
    if not isinstance(obj, kind) or (kind is int and isinstance(obj, bool)):
        raise ConfigError(path, f"expected {kind.__name__}, got {type(obj).__name__} {show(obj)}")
    return obj


def _cidrs(value: Any, path: str) -> Tuple[str, ...]:
    if value in (None, ""):
        return ()
    parts = value.split(",") if isinstance(value, str) else value
    if not isinstance(parts, list):
        raise ConfigError(path, "expected a comma-separated string or a list of CIDRs")
    out = []
    for i, c in enumerate(parts):
        c = str(c).strip()
        try:
            out.append(str(ipaddress.ip_network(c, strict=False)))
        except ValueError:
            raise ConfigError(f"{path}[{i}]" if isinstance(value, list) else path,
                              f"{show(c)} is not a CIDR") from None
    return tuple(out)


def node_port_addresses(value: Any, path: str) -> Tuple[str, ...]:
    if value in (None, ""):
        return ()
    items = value if isinstance(value, list) else str(value).split(",")
    out = []
    for i, item in enumerate(items):
        item = str(item).strip()
        if item == "primary":
            out.append(item)
            continue
        out.extend(_cidrs([item], f"{path}[{i}]"))
    return tuple(out)


# Upstream fields that are valid but have no effect here.
IGNORED = {
    "featureGates", "bindAddress", "bindAddressHardFail", "enableProfiling", "showHiddenMetricsForVersion",
    "oomScoreAdj", "portRange", "logging", "windowsRunAsService", "winkernel", "nftables",
    "udpIdleTimeout",
}


def parse(doc: Mapping[str, Any]) -> ProxyConfig:
    if not isinstance(doc, Mapping):
        what = "an empty document" if doc is None else f"a {type(doc).__name__}"
        raise ConfigError("(document)", f"expected a mapping, got {what}")
    if doc.get("apiVersion") != API_VERSION:
        raise ConfigError("apiVersion", f"must be {API_VERSION}, got {show(doc.get('apiVersion'))}")
    if doc.get("kind") != KIND:
        raise ConfigError("kind", f"must be {KIND}, got {show(doc.get('kind'))}")
    cfg = ProxyConfig()
    handlers = {
        "apiVersion": None, "kind": None,
        "mode": _mode, "hostnameOverride": _str_field("hostname_override"),
        "clusterCIDR": _cluster_cidr, "detectLocalMode": _detect_mode, "detectLocal": _detect_local,
        "nodePortAddresses": _npa, "healthzBindAddress": _addr("healthz_bind_address"),
        "metricsBindAddress": _addr("metrics_bind_address"), "iptables": _iptables,
        "clientConnection": _client, "conntrack": _conntrack, "configSyncPeriod": _dur("config_sync_period"),
        "syncPeriod": _dur("sync_period"), "minSyncPeriod": _dur("min_sync_period", zero=True), "ipvs": _ipvs,
    }
    for key, value in doc.items():
        if key in IGNORED:
            cfg.ignored.append(key)
            continue
        if not isinstance(key, str) or key not in handlers:
            raise ConfigError(key if isinstance(key, str) else show(key), "unknown field")
        h = handlers[key]
        if h is not None:
            h(cfg, value, key)
    if cfg.detect_local_mode == "BridgeInterface" and not cfg.bridge_interface:
        raise ConfigError("detectLocal.bridgeInterface", "required when detectLocalMode is BridgeInterface")
    if cfg.detect_local_mode == "InterfaceNamePrefix" and not cfg.interface_name_prefix:
        raise ConfigError("detectLocal.interfaceNamePrefix", "required when detectLocalMode is InterfaceNamePrefix")
    if cfg.min_sync_period > cfg.sync_period:
        raise ConfigError("iptables.minSyncPeriod", "must not be greater than syncPeriod")
    apply_mode_sync_periods(cfg)
    return cfg


def apply_mode_sync_periods(cfg: ProxyConfig) -> None:
    """The mode's own section's sync periods (when set) are the proxy's: in IPVS mode the
    ``ipvs:`` section's (the registry names the section)."""
    from .modes import sync_section

    section = sync_section(cfg.mode)
    own = getattr(cfg, section, None) if section else None
    if own is None:
        return
    if own.sync_period is not None:
        cfg.sync_period = own.sync_period
    if own.min_sync_period is not None:
        cfg.min_sync_period = own.min_sync_period
    if cfg.min_sync_period > cfg.sync_period:
        raise ConfigError(f"{section}.minSyncPeriod", "must not be greater than syncPeriod")


def _mode(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = v or "iptables"
    from .modes import UPSTREAM_MODES

    if v not in UPSTREAM_MODES:
        raise ConfigError(path, f"must be one of {', '.join(UPSTREAM_MODES)}, got {show(v)}")
    cfg.mode = v


def _str_field(attr: str):
    def h(cfg: ProxyConfig, v: Any, path: str) -> None:
        setattr(cfg, attr, _expect(v or "", path, str))
    return h


def bind_address(v: Any, path: str) -> str:
    """host:port (empty disables the server)."""
    v = _expect(v or "", path, str)
    if v:
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(path, f"{show(v)} must be host:port")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ConfigError(path, f"{show(host)} is not an IP address") from None
    return v


def _addr(attr: str):
    def h(cfg: ProxyConfig, v: Any, path: str) -> None:
        setattr(cfg, attr, bind_address(v, path))
    return h


def _dur(attr: str, zero: bool = False):
    def h(cfg: ProxyConfig, v: Any, path: str) -> None:
        setattr(cfg, attr, period(v, path, zero))
    return h


def _cluster_cidr(cfg: ProxyConfig, v: Any, path: str) -> None:
    cfg.cluster_cidrs = _cidrs(v, path)


def _detect_mode(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = v or "ClusterCIDR"
    if v not in DETECT_LOCAL_MODES:
        raise ConfigError(path, f"must be one of {', '.join(DETECT_LOCAL_MODES)}, got {show(v)}")
    cfg.detect_local_mode = v


def _iface(value: str, path: str, prefix: bool = False) -> str:
    """An interface name (or, with ``prefix``, the part before iptables' ``+``) that can go into
    rule text: refused here (exit 2) rather than failing every sync later."""
    from .kernel.text import UnsafeText, iface

    if value:
        try:
            iface(value + "+" if prefix else value, path)
        except UnsafeText as e:
            raise ConfigError(path, e.problem) from None
    return value


def _detect_local(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = _expect(v or {}, path, dict)
    for key, val in v.items():
        if key == "bridgeInterface":
            cfg.bridge_interface = _iface(_expect(val or "", f"{path}.{key}", str), f"{path}.{key}")
        elif key == "interfaceNamePrefix":
            cfg.interface_name_prefix = _iface(_expect(val or "", f"{path}.{key}", str), f"{path}.{key}", prefix=True)
        else:
            raise ConfigError(f"{path}.{key}", "unknown field")


def _npa(cfg: ProxyConfig, v: Any, path: str) -> None:
    cfg.node_port_addresses = node_port_addresses(v, path)


def _iptables(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = _expect(v or {}, path, dict)
    for key, val in v.items():
        p = f"{path}.{key}"
        if key == "masqueradeAll":
            cfg.masquerade_all = _expect(val, p, bool)
        elif key == "masqueradeBit":
            if val is None:
                continue
            bit = _expect(val, p, int)
            if not 0 <= bit <= 31:
                raise ConfigError(p, f"{bit} must be between 0 and 31")
            cfg.masquerade_bit = bit
        elif key == "localhostNodePorts":
            if val is not None:
                cfg.localhost_nodeports = _expect(val, p, bool)
        elif key == "syncPeriod":
            cfg.sync_period = period(val, p)
        elif key == "minSyncPeriod":
            cfg.min_sync_period = period(val, p, zero=True)
        else:
            raise ConfigError(p, "unknown field")


IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh",
                   "twos")


def ipvs_scheduler(value: Any, path: str) -> str:
    value = _expect(value or "", path, str)
    if value and value not in IPVS_SCHEDULERS:
        raise ConfigError(path, f"unknown IPVS scheduler {show(value)} (one of {', '.join(IPVS_SCHEDULERS)})")
    return value


def _ipvs(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = _expect(v or {}, path, dict)
    ipvs = cfg.ipvs
    for key, val in v.items():
        p = f"{path}.{key}"
        if key == "scheduler":
            ipvs.scheduler = ipvs_scheduler(val, p)
        elif key in ("syncPeriod", "minSyncPeriod"):
            # 0s (what kubeadm writes for an unset duration) means "not set".
            seconds = parse_duration(val, p) if val is not None else 0.0
            if seconds < 0:
                raise ConfigError(p, "must not be negative")
            setattr(ipvs, "sync_period" if key == "syncPeriod" else "min_sync_period", seconds or None)
        elif key == "excludeCIDRs":
            ipvs.exclude_cidrs = _cidrs(val, p)
        elif key == "strictARP":
            ipvs.strict_arp = bool(_expect(val, p, bool)) if val is not None else False
        elif key in ("tcpTimeout", "tcpFinTimeout", "udpTimeout"):
            attr = {"tcpTimeout": "tcp_timeout", "tcpFinTimeout": "tcp_fin_timeout", "udpTimeout": "udp_timeout"}[key]
            seconds = 0.0 if val is None else parse_duration(val, p)
            if seconds < 0:
                raise ConfigError(p, "must not be negative")
            setattr(ipvs, attr, seconds)
        else:
            raise ConfigError(p, "unknown field")


def _client(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = _expect(v or {}, path, dict)
    for key, val in v.items():
        if key == "kubeconfig":
            cfg.kubeconfig = _expect(val or "", f"{path}.{key}", str)
        elif key not in ("acceptContentTypes", "contentType", "qps", "burst"):
            raise ConfigError(f"{path}.{key}", "unknown field")


def _conntrack(cfg: ProxyConfig, v: Any, path: str) -> None:
    v = _expect(v or {}, path, dict)
    ct = cfg.conntrack
    for key, val in v.items():
        p = f"{path}.{key}"
        if key in ("maxPerCore", "min"):
            if val is not None and (_expect(val, p, int) < 0):
                raise ConfigError(p, "must not be negative")
            setattr(ct, "max_per_core" if key == "maxPerCore" else "min", val)
        elif key == "tcpBeLiberal":
            ct.tcp_be_liberal = bool(_expect(val, p, bool))
        elif key in ("tcpEstablishedTimeout", "tcpCloseWaitTimeout", "udpTimeout", "udpStreamTimeout"):
            attr = {"tcpEstablishedTimeout": "tcp_established_timeout", "tcpCloseWaitTimeout": "tcp_close_wait_timeout",
                    "udpTimeout": "udp_timeout", "udpStreamTimeout": "udp_stream_timeout"}[key]
            setattr(ct, attr, None if val is None else period(val, p, zero=True))
        else:
            raise ConfigError(p, "unknown field")


def to_dict(cfg: ProxyConfig) -> Dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)
