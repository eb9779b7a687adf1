# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A tiny Prometheus registry (text exposition format 0.0.4) and kube-proxy's metrics.

No prometheus_client: Counter, Gauge and Histogram, with or without labels, thread
safe, rendered the way Go's client_golang renders them (what kube-proxy serves):

- families sorted by name; a labelled family with no series is left out entirely;
- series sorted by label values, label pairs sorted by name, ``le`` last;
- numbers as Go's ``strconv.FormatFloat(v, 'g', -1, 64)``: ``0.001``, ``60``,
  ``1.7e+09``, ``+Inf``, ``NaN``;
- histograms as cumulative ``_bucket{le=...}`` lines (``+Inf`` included), ``_sum``
  and ``_count``.

:class:`ProxyMetrics` defines kube-proxy's metrics (pkg/proxy/metrics/metrics.go)
with upstream's names, help texts (with component-base's ``[ALPHA]`` stability
prefix, as kube-proxy prints them) and buckets, our own ``kubenode_proxy_*``
metrics, and the process collector's ``process_*`` gauges.
"""

from __future__ import annotations

import bisect
import math
import os
import re
import threading
import time
from decimal import Decimal
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelValues = Tuple[str, ...]
Sample = Tuple[str, List[Tuple[str, str]], float]  # (name suffix, label pairs, value)


# --- formatting ------------------------------------------------------------------------

def format_float(value: float) -> str:
    """Go's ``strconv.FormatFloat(v, 'g', -1, 64)``, as client_golang writes numbers."""
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == 0:
        return "0"  # client_golang writes "0" for -0 too
    sign, digits, exponent = Decimal(repr(v)).normalize().as_tuple()  # shortest round-trip digits
    ds = "".join(map(str, digits))
    nd = len(ds)
    dp = nd + int(exponent)  # position of the decimal point relative to the digits
    exp10 = dp - 1
    prefix = "-" if sign else ""
    if exp10 < -4 or exp10 >= 6:  # Go's %e rule for the shortest representation
        mant = ds[0] + ("." + ds[1:] if nd > 1 else "")
        return f"{prefix}{mant}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    if dp <= 0:
        return f"{prefix}0.{'0' * -dp}{ds}"
    if dp >= nd:
        return f"{prefix}{ds}{'0' * (dp - nd)}"
    return f"{prefix}{ds[:dp]}.{ds[dp:]}"


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


# --- bucket helpers (component-base/metrics) ------------------------------------------

def exponential_buckets(start: float, factor: float, count: int) -> List[float]:
    if count < 1 or start <= 0 or factor <= 1:
        raise ValueError("exponential_buckets needs count >= 1, start > 0, factor > 1")
    out = []
    for _unused in range(count):
        out.append(start)
        start *= factor
    return out


def linear_buckets(start: float, width: float, count: int) -> List[float]:
    if count < 1:
        raise ValueError("linear_buckets needs count >= 1")
    out = []
    for _unused in range(count):
        out.append(start)
        start += width
    return out


def merge_buckets(*buckets: Sequence[float]) -> List[float]:
    """component-base's MergeBuckets: ``result := make([]float64, 1)`` then append, so
    the merged list starts with an extra 0 bucket (kube-proxy serves ``le="0"``)."""
    out: List[float] = [0.0]
    for b in buckets:
        out.extend(b)
    return out


# --- metrics ---------------------------------------------------------------------------

class _CounterValue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only increase")
        with self._lock:
            self._value += amount

    def get(self) -> float:
        with self._lock:
            return self._value

    def _samples(self) -> List[Tuple[str, List[Tuple[str, str]], float]]:
        return [("", [], self.get())]


class _GaugeValue:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._lock = threading.Lock()
        self._value = 0.0
        self._clock = clock

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value -= amount

    def set_to_current_time(self) -> None:
        self.set(self._clock())

    def get(self) -> float:
        with self._lock:
            return self._value

    def _samples(self) -> List[Tuple[str, List[Tuple[str, str]], float]]:
        return [("", [], self.get())]


class _HistogramValue:
    def __init__(self, bounds: Tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds  # ends with +Inf
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        v = float(value)
        # first bound >= v (v <= le); NaN counts in +Inf only, as in client_golang
        i = len(self._bounds) - 1 if math.isnan(v) else bisect.bisect_left(self._bounds, v)
        with self._lock:
            self._counts[i] += 1
            self._sum += v
            self._count += 1

    def snapshot(self) -> Tuple[List[Tuple[float, int]], float, int]:
        """(cumulative buckets [(le, count)], sum, count), consistent with each other."""
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        cumulative, acc = [], 0
        for le, c in zip(self._bounds, counts):
            acc += c
            cumulative.append((le, acc))
        return cumulative, total, n

    def _samples(self) -> List[Tuple[str, List[Tuple[str, str]], float]]:
        buckets, total, n = self.snapshot()
        out: List[Tuple[str, List[Tuple[str, str]], float]] = [
            ("_bucket", [("le", format_float(le))], float(c)) for le, c in buckets]
        out.append(("_sum", [], total))
        out.append(("_count", [], float(n)))
        return out


class Metric:
    """A metric family; without label names it is also its own single series."""

    typ = "untyped"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Optional[Registry] = None) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for ln in labelnames:
            if not _LABEL_NAME.match(ln) or ln.startswith("__"):
                raise ValueError(f"invalid label name {ln!r} for {name}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names for {name}")
        self.name = name
        self.documentation = documentation
        self.labelnames: Tuple[str, ...] = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: Dict[LabelValues, object] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> object:
        raise NotImplementedError

    def labels(self, *values: str, **kwargs: str):
        """The series for these label values (positional in label order, or by name)."""
        if not self.labelnames:
            raise ValueError(f"{self.name} has no labels")
        if values and kwargs:
            raise ValueError("pass label values either positionally or by name")
        if kwargs:
            if set(kwargs) != set(self.labelnames):
                raise ValueError(f"{self.name} labels are {self.labelnames}, got {sorted(kwargs)}")
            values = tuple(kwargs[ln] for ln in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} needs {len(self.labelnames)} label values, got {len(values)}")
        key = tuple(str(v) for v in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
            return child

    def remove(self, *values: str) -> None:
        with self._lock:
            self._children.pop(tuple(str(v) for v in values), None)

    def clear(self) -> None:
        """Drop every labelled series (an unlabelled metric keeps its one series)."""
        if self.labelnames:
            with self._lock:
                self._children.clear()

    def _only(self):
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use .labels(...)")
        return self._children[()]

    def collect(self) -> List[Sample]:
        with self._lock:
            children = sorted(self._children.items())
        out: List[Sample] = []
        for key, child in children:
            base = list(zip(self.labelnames, key))
            for suffix, extra, value in child._samples():  # type: ignore[attr-defined]
                pairs = sorted(base) + extra  # label pairs sorted by name, "le" last
                out.append((suffix, pairs, value))
        return out


class Counter(Metric):
    typ = "counter"

    def _new_child(self) -> _CounterValue:
        return _CounterValue()

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def get(self) -> float:
        return self._only().get()


class Gauge(Metric):
    typ = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Optional[Registry] = None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _GaugeValue:
        return _GaugeValue(self._clock)

    def set(self, value: float) -> None:
        self._only().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._only().dec(amount)

    def set_to_current_time(self) -> None:
        self._only().set_to_current_time()

    def get(self) -> float:
        return self._only().get()


class Histogram(Metric):
    typ = "histogram"
    DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)  # client_golang DefBuckets

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Optional[Registry] = None, buckets: Iterable[float] = DEFAULT_BUCKETS) -> None:
        if "le" in labelnames:
            raise ValueError("'le' is reserved for histogram buckets")
        bounds = [float(b) for b in buckets]
        if bounds and math.isinf(bounds[-1]) and bounds[-1] > 0:
            bounds.pop()
        if any(b >= c for b, c in zip(bounds, bounds[1:])) or any(math.isnan(b) for b in bounds):
            raise ValueError(f"histogram buckets must be strictly increasing: {bounds}")
        self.buckets: Tuple[float, ...] = tuple(bounds) + (math.inf,)
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramValue:
        return _HistogramValue(self.buckets)

    def observe(self, value: float) -> None:
        self._only().observe(value)

    def snapshot(self) -> Tuple[List[Tuple[float, int]], float, int]:
        return self._only().snapshot()


class CallbackGauge(Metric):
    """A gauge (or counter, with ``typ``) read from ``fn`` at each render; left out
    when ``fn`` returns None or raises."""

    def __init__(self, name: str, documentation: str, fn: Callable[[], Optional[float]], typ: str = "gauge",
                 registry: Optional[Registry] = None) -> None:
        self._fn = fn
        self.typ = typ
        super().__init__(name, documentation, (), registry)

    def _new_child(self) -> object:
        return None

    def collect(self) -> List[Sample]:
        try:
            value = self._fn()
        except Exception:
            return []
        return [] if value is None else [("", [], float(value))]


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: Dict[str, Metric] = {}

    def register(self, metric: Metric) -> Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} already registered")
            self._metrics[metric.name] = metric
        return metric

    def unregister(self, metric: Metric) -> None:
        with self._lock:
            if self._metrics.get(metric.name) is metric:
                del self._metrics[metric.name]

    def get(self, name: str) -> Optional[Metric]:
        with self._lock:
            return self._metrics.get(name)

    def render(self) -> str:
        with self._lock:
            metrics = sorted(self._metrics.values(), key=lambda m: m.name)
        lines: List[str] = []
        for m in metrics:
            samples = m.collect()
            if not samples:
                continue
            lines.append(f"# HELP {m.name} {escape_help(m.documentation)}")
            lines.append(f"# TYPE {m.name} {m.typ}")
            for suffix, pairs, value in samples:
                labels = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs)
                lines.append(f"{m.name}{suffix}{{{labels}}} {format_float(value)}" if labels
                             else f"{m.name}{suffix} {format_float(value)}")
        return "\n".join(lines) + "\n" if lines else ""


# --- process metrics (client_golang's process collector) ------------------------------

def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def process_start_time(default: Optional[float] = None) -> float:
    """Seconds since the epoch when this process started (from /proc like Go's procfs:
    boot time + starttime ticks / CLK_TCK), else ``default`` or now."""
    stat, proc_stat = _read("/proc/self/stat"), _read("/proc/stat")
    if stat and proc_stat:
        try:
            fields = stat[stat.rindex(")") + 2:].split()
            ticks = int(fields[19])  # field 22 (starttime), counted after "pid (comm)"
            btime = next(int(ln.split()[1]) for ln in proc_stat.splitlines() if ln.startswith("btime "))
            return btime + ticks / os.sysconf("SC_CLK_TCK")
        except (ValueError, IndexError, StopIteration, OSError):
            pass
    return time.time() if default is None else default


def _statm(index: int) -> Optional[float]:
    statm = _read("/proc/self/statm")
    if not statm:
        return None
    return float(int(statm.split()[index]) * os.sysconf("SC_PAGE_SIZE"))


def _open_fds() -> Optional[float]:
    try:
        return float(len(os.listdir("/proc/self/fd")))
    except OSError:
        return None


def _max_fds() -> Optional[float]:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return math.inf if soft == resource.RLIM_INFINITY else float(soft)


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# --- kube-proxy's metrics ----------------------------------------------------------------

ALPHA = "[ALPHA] "  # component-base prefixes help texts with the stability level
SYNC_BUCKETS = exponential_buckets(0.001, 2, 15)
NETWORK_PROGRAMMING_BUCKETS = merge_buckets(
    linear_buckets(0.25, 0.25, 2),  # 0.25s, 0.50s
    linear_buckets(1, 1, 59),  # 1s, 2s, 3s, ... 59s
    linear_buckets(60, 5, 12),  # 60s, 65s, 70s, ... 115s
    linear_buckets(120, 30, 7),  # 2min, 2.5min, 3min, ..., 5min
)


class ProxyMetrics:
    """kube-proxy's metrics (upstream names and help texts) plus ours, on their own registry."""

    def __init__(self, clock: Callable[[], float] = time.time, process: bool = True) -> None:
        r = self.registry = Registry()
        self.clock = clock

        def hist(name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
            return Histogram(name, ALPHA + doc, labels, registry=r, buckets=buckets)

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(name, ALPHA + doc, labels, registry=r, clock=clock)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, ALPHA + doc, labels, registry=r)

        # Upstream: pkg/proxy/metrics/metrics.go (iptables mode registers all of these).
        self.sync_proxy_rules_latency = hist(
            "kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", SYNC_BUCKETS)
        self.sync_full_proxy_rules_latency = hist(
            "kubeproxy_sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs",
            SYNC_BUCKETS)
        self.sync_partial_proxy_rules_latency = hist(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs", SYNC_BUCKETS)
        self.sync_proxy_rules_last_timestamp = gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced")
        self.sync_proxy_rules_last_queued_timestamp = gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued")
        self.network_programming_latency = hist(
            "kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds",
            NETWORK_PROGRAMMING_BUCKETS)
        self.endpoint_changes_pending = gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes")
        self.endpoint_changes_total = counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes_total", "Cumulative proxy rules Endpoint changes")
        self.service_changes_pending = gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes")
        self.service_changes_total = counter(
            "kubeproxy_sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes")
        self.iptables_restore_failures_total = counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", "Cumulative proxy iptables restore failures")
        self.iptables_partial_restore_failures_total = counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
            "Cumulative proxy iptables partial restore failures")
        self.iptables_rules_total = gauge(
            "kubeproxy_sync_proxy_rules_iptables_total", "Total number of iptables rules owned by kube-proxy",
            ("table",))
        self.iptables_rules_last_sync = gauge(
            "kubeproxy_sync_proxy_rules_iptables_last", "Number of iptables rules written by kube-proxy in last sync",
            ("table",))
        # A gauge despite its name, upstream; labels traffic_policy="internal" | "external".
        self.sync_proxy_rules_no_local_endpoints_total = gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints", ("traffic_policy",))
        self.proxy_healthz_total = counter(
            "kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status", ("code",))
        self.proxy_livez_total = counter(
            "kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status", ("code",))

        # Ours.
        self.syncs_total = Counter("kubenode_proxy_syncs_total", "Successful proxy rule syncs, by kind (full, partial)",
                                   ("kind",), registry=r)
        for kind in ("full", "partial"):
            self.syncs_total.labels(kind)
        self.sync_failures_total = Counter("kubenode_proxy_sync_failures_total", "Failed proxy rule syncs",
                                           registry=r)

        # The process collector (upstream's registry has it, with the go_* collector).
        self.process_start_time_seconds = Gauge(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", registry=r)
        self.process_start_time_seconds.set(process_start_time())
        if process:
            CallbackGauge("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                          _cpu_seconds, typ="counter", registry=r)
            CallbackGauge("process_resident_memory_bytes", "Resident memory size in bytes.",
                          lambda: _statm(1), registry=r)
            CallbackGauge("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                          lambda: _statm(0), registry=r)
            CallbackGauge("process_open_fds", "Number of open file descriptors.", _open_fds, registry=r)
            CallbackGauge("process_max_fds", "Maximum number of open file descriptors.", _max_fds, registry=r)

    def observe_sync(self, seconds: float, full: bool) -> None:
        """A successful sync, as upstream's syncProxyRules records it (plus our counter)."""
        self.sync_proxy_rules_latency.observe(seconds)
        (self.sync_full_proxy_rules_latency if full else self.sync_partial_proxy_rules_latency).observe(seconds)
        self.sync_proxy_rules_last_timestamp.set_to_current_time()
        self.syncs_total.labels("full" if full else "partial").inc()

    def render(self) -> str:
        return self.registry.render()
