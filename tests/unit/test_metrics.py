"""The tiny Prometheus registry: text format 0.0.4 as client_golang writes it, and kube-proxy's metrics."""
import math
import re
import threading
import time

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.metrics import (
    CONTENT_TYPE,
    NETWORK_PROGRAMMING_BUCKETS,
    SYNC_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    ProxyMetrics,
    Registry,
    exponential_buckets,
    format_float,
    linear_buckets,
    merge_buckets,
)

# --- a strict parser for the text exposition format 0.0.4 -----------------------------

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
VALUE = r"(?:[+-]Inf|NaN|-?[0-9]+(?:\.[0-9]+)?(?:e[+-][0-9]{2,3})?)"
HELP_RE = re.compile(rf"^# HELP ({NAME}) ((?:[^\\\n]|\\[\\n])*)$")
TYPE_RE = re.compile(rf"^# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)$")
SAMPLE_RE = re.compile(rf"^({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? ({VALUE})$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def unescape(s):
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], s)


def parse(text):
    """{family: {"help", "type", "samples": [(name, {labels}, value)]}}; asserts the format."""
    assert text.endswith("\n")
    families, current, order = {}, None, []
    for line in text[:-1].split("\n"):
        if m := HELP_RE.match(line):
            name = m.group(1)
            assert name not in families, f"family {name} twice"
            current = families[name] = {"help": unescape(m.group(2)), "type": None, "samples": []}
            order.append(name)
            continue
        if m := TYPE_RE.match(line):
            assert m.group(1) == order[-1] and current["type"] is None and not current["samples"]
            current["type"] = m.group(2)
            continue
        m = SAMPLE_RE.match(line)
        assert m, f"not a valid sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        fam = order[-1]
        suffixes = ("_bucket", "_sum", "_count") if current["type"] == "histogram" else ("",)
        assert any(name == fam + s for s in suffixes), f"{name} outside its family {fam}"
        pairs = [(k, unescape(v)) for k, v in LABEL_RE.findall(labels)]
        assert len({k for k, _unused in pairs}) == len(pairs)
        current["samples"].append((name, dict(pairs), float(value)))
    assert order == sorted(order), "families must be sorted by name"
    return families


# --- number formatting ----------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (0, "0"), (-0.0, "0"), (1, "1"), (-1, "-1"), (0.001, "0.001"), (16.384, "16.384"), (60, "60"),
    (0.25, "0.25"), (123456, "123456"), (1e6, "1e+06"), (1234567, "1.234567e+06"), (0.0001, "0.0001"),
    (0.00001, "1e-05"), (1.5e-7, "1.5e-07"), (1712345678.5, "1.7123456785e+09"), (2.5e100, "2.5e+100"),
    (math.inf, "+Inf"), (-math.inf, "-Inf"), (math.nan, "NaN"),
])
def test_format_float_matches_go(value, text):
    assert format_float(value) == text


def test_bucket_helpers_match_component_base():
    assert SYNC_BUCKETS == exponential_buckets(0.001, 2, 15)
    assert [format_float(b) for b in SYNC_BUCKETS] == [
        "0.001", "0.002", "0.004", "0.008", "0.016", "0.032", "0.064", "0.128", "0.256", "0.512",
        "1.024", "2.048", "4.096", "8.192", "16.384"]
    assert linear_buckets(60, 5, 12)[-1] == 115
    assert merge_buckets([1, 2], [3]) == [0, 1, 2, 3]  # MergeBuckets starts from make([]float64, 1)
    b = NETWORK_PROGRAMMING_BUCKETS
    assert len(b) == 1 + 2 + 59 + 12 + 7
    assert b[:5] == [0, 0.25, 0.5, 1, 2] and b[61:64] == [59, 60, 65]
    assert b[-8:] == [115, 120, 150, 180, 210, 240, 270, 300]


# --- the registry -----------------------------------------------------------------------

def test_render_format_counter_gauge():
    r = Registry()
    c = Counter("demo_requests_total", "Requests.\nSecond line with \\ backslash", ("code", "method"), registry=r)
    g = Gauge("demo_temperature", "A gauge", registry=r)
    c.labels("200", "GET").inc()
    c.labels(method="POST", code="503").inc(2)
    g.set(-3.5)
    text = r.render()
    fams = parse(text)
    assert list(fams) == ["demo_requests_total", "demo_temperature"]
    assert fams["demo_requests_total"]["help"] == "Requests.\nSecond line with \\ backslash"
    assert "# HELP demo_requests_total Requests.\\nSecond line with \\\\ backslash\n" in text
    assert fams["demo_requests_total"]["type"] == "counter"
    assert fams["demo_requests_total"]["samples"] == [
        ("demo_requests_total", {"code": "200", "method": "GET"}, 1.0),
        ("demo_requests_total", {"code": "503", "method": "POST"}, 2.0)]
    assert 'demo_requests_total{code="200",method="GET"} 1\n' in text
    assert "demo_temperature -3.5\n" in text


def test_label_escaping_round_trips():
    r = Registry()
    g = Gauge("demo_info", "Escapes", ("path",), registry=r)
    nasty = 'C:\\dir "quoted"\nnext'
    g.labels(nasty).set(1)
    text = r.render()
    assert 'demo_info{path="C:\\\\dir \\"quoted\\"\\nnext"} 1\n' in text
    assert parse(text)["demo_info"]["samples"][0][1] == {"path": nasty}


def test_labels_sorted_by_name_and_series_by_value():
    r = Registry()
    g = Gauge("demo_sorted", "Sorted", ("zone", "app"), registry=r)
    g.labels("b", "x").set(1)
    g.labels("a", "y").set(2)
    lines = [ln for ln in r.render().splitlines() if not ln.startswith("#")]
    assert lines == ['demo_sorted{app="y",zone="a"} 2', 'demo_sorted{app="x",zone="b"} 1']


def test_empty_vector_is_left_out_and_unlabelled_is_always_there():
    r = Registry()
    Counter("demo_vec_total", "Vec", ("code",), registry=r)
    Counter("demo_plain_total", "Plain", registry=r)
    assert r.render() == "# HELP demo_plain_total Plain\n# TYPE demo_plain_total counter\ndemo_plain_total 0\n"


def test_histogram_buckets_are_cumulative():
    r = Registry()
    h = Histogram("demo_seconds", "Latency", registry=r, buckets=[0.1, 0.5, 1])
    for v in (0.05, 0.1, 0.3, 0.7, 2, 5):
        h.observe(v)
    fams = parse(r.render())
    assert fams["demo_seconds"]["type"] == "histogram"
    samples = fams["demo_seconds"]["samples"]
    buckets = [(s[1]["le"], s[2]) for s in samples if s[0] == "demo_seconds_bucket"]
    assert buckets == [("0.1", 2), ("0.5", 3), ("1", 4), ("+Inf", 6)]  # v <= le, cumulative
    counts = [c for _unused, c in buckets]
    assert counts == sorted(counts)
    assert samples[-2] == ("demo_seconds_sum", {}, pytest.approx(8.15))
    assert samples[-1] == ("demo_seconds_count", {}, 6)


def test_labelled_histogram_puts_le_last():
    r = Registry()
    h = Histogram("demo_h", "H", ("kind",), registry=r, buckets=[1])
    h.labels("full").observe(0.5)
    text = r.render()
    assert 'demo_h_bucket{kind="full",le="1"} 1\n' in text
    assert 'demo_h_bucket{kind="full",le="+Inf"} 1\n' in text
    assert 'demo_h_sum{kind="full"} 0.5\n' in text
    assert 'demo_h_count{kind="full"} 1\n' in text


def test_misuse_is_rejected():
    r = Registry()
    c = Counter("demo_total", "C", registry=r)
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        Counter("demo_total", "again", registry=r)
    with pytest.raises(ValueError):
        Counter("bad-name", "C")
    with pytest.raises(ValueError):
        Histogram("demo_h", "H", buckets=[1, 1])
    with pytest.raises(ValueError):
        Histogram("demo_h", "H", ("le",))
    v = Counter("demo_vec_total", "V", ("code",))
    with pytest.raises(ValueError):
        v.inc()
    with pytest.raises(ValueError):
        v.labels("1", "2")
    with pytest.raises(ValueError):
        c.labels("x")


def test_thread_safe_updates():
    r = Registry()
    c = Counter("demo_total", "C", ("t",), registry=r)
    h = Histogram("demo_h", "H", registry=r, buckets=[0.5])
    stop = threading.Event()

    def render_loop():
        while not stop.is_set():
            parse(r.render())

    def work():
        for i in range(2000):
            c.labels("x").inc()
            h.observe(i % 2)

    renderer = threading.Thread(target=render_loop)
    renderer.start()
    workers = [threading.Thread(target=work) for _unused in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    renderer.join()
    assert c.labels("x").get() == 16000
    buckets, total, n = h.snapshot()
    assert n == 16000 and buckets == [(0.5, 8000), (math.inf, 16000)] and total == 8000


# --- kube-proxy's metrics ----------------------------------------------------------------

UPSTREAM = {
    "kubeproxy_sync_proxy_rules_duration_seconds": ("histogram", "[ALPHA] SyncProxyRules latency in seconds"),
    "kubeproxy_sync_full_proxy_rules_duration_seconds":
        ("histogram", "[ALPHA] SyncProxyRules latency in seconds for full resyncs"),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds":
        ("histogram", "[ALPHA] SyncProxyRules latency in seconds for partial resyncs"),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds":
        ("gauge", "[ALPHA] The last time proxy rules were successfully synced"),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds":
        ("gauge", "[ALPHA] The last time a sync of proxy rules was queued"),
    "kubeproxy_network_programming_duration_seconds":
        ("histogram", "[ALPHA] In Cluster Network Programming Latency in seconds"),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": ("gauge", "[ALPHA] Pending proxy rules Endpoint changes"),
    "kubeproxy_sync_proxy_rules_endpoint_changes_total":
        ("counter", "[ALPHA] Cumulative proxy rules Endpoint changes"),
    "kubeproxy_sync_proxy_rules_service_changes_pending": ("gauge", "[ALPHA] Pending proxy rules Service changes"),
    "kubeproxy_sync_proxy_rules_service_changes_total": ("counter", "[ALPHA] Cumulative proxy rules Service changes"),
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total":
        ("counter", "[ALPHA] Cumulative proxy iptables restore failures"),
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total":
        ("counter", "[ALPHA] Cumulative proxy iptables partial restore failures"),
    "kubeproxy_sync_proxy_rules_iptables_total":
        ("gauge", "[ALPHA] Total number of iptables rules owned by kube-proxy"),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total":
        ("gauge", "[ALPHA] Number of services with a Local traffic policy and no endpoints"),
    "kubeproxy_proxy_healthz_total": ("counter", "[ALPHA] Cumulative proxy healthz HTTP status"),
    "kubenode_proxy_syncs_total": ("counter", None),
    "kubenode_proxy_sync_failures_total": ("counter", None),
    "process_start_time_seconds": ("gauge", "Start time of the process since unix epoch in seconds."),
}


def test_proxy_metrics_names_types_help():
    m = ProxyMetrics(clock=lambda: 1700000000.25)
    m.observe_sync(0.003, full=True)
    m.observe_sync(0.02, full=False)
    m.sync_proxy_rules_last_queued_timestamp.set_to_current_time()
    m.network_programming_latency.observe(0.3)
    m.endpoint_changes_total.inc(3)
    m.iptables_rules_total.labels(table="nat").set(42)
    m.iptables_rules_total.labels(table="filter").set(7)
    m.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="internal").set(0)
    m.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="external").set(1)
    m.proxy_healthz_total.labels("200").inc()
    m.sync_failures_total.inc()
    fams = parse(m.render())
    for name, (typ, help_text) in UPSTREAM.items():
        assert name in fams, name
        assert fams[name]["type"] == typ, name
        if help_text:
            assert fams[name]["help"] == help_text, name

    def value(name, **labels):
        return next(v for n, lb, v in fams[name.rsplit("{")[0]]["samples"] if n == name and lb == labels)

    assert value("kubeproxy_sync_proxy_rules_last_timestamp_seconds") == 1700000000.25
    assert value("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") == 1700000000.25
    assert value("kubeproxy_sync_proxy_rules_iptables_total", table="nat") == 42
    assert value("kubenode_proxy_syncs_total", kind="full") == 1
    assert value("kubenode_proxy_syncs_total", kind="partial") == 1
    assert value("kubenode_proxy_sync_failures_total") == 1
    assert value("kubeproxy_sync_proxy_rules_no_local_endpoints_total", traffic_policy="external") == 1
    sync = [(lb["le"], v) for n, lb, v in fams["kubeproxy_sync_proxy_rules_duration_seconds"]["samples"]
            if n.endswith("_bucket")]
    assert sync[:6] == [("0.001", 0), ("0.002", 0), ("0.004", 1), ("0.008", 1), ("0.016", 1), ("0.032", 2)]
    assert sync[-1] == ("+Inf", 2) and len(sync) == 16
    full = fams["kubeproxy_sync_full_proxy_rules_duration_seconds"]["samples"]
    assert full[-1] == ("kubeproxy_sync_full_proxy_rules_duration_seconds_count", {}, 1)
    npl = [(lb["le"], v) for n, lb, v in fams["kubeproxy_network_programming_duration_seconds"]["samples"]
           if n.endswith("_bucket")]
    assert npl[:4] == [("0", 0), ("0.25", 0), ("0.5", 1), ("1", 1)] and npl[-2:] == [("300", 1), ("+Inf", 1)]
    start = value("process_start_time_seconds")
    assert time.time() - 86400 * 365 < start <= time.time() + 1


def test_content_type():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
