"""The bounded-frequency runner: rate limit, periodic full syncs, retry after failure."""
import threading
import time

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sync import BoundedFrequencyRunner


class Recorder:
    def __init__(self, fail_first=0):
        self.calls = []
        self.fail_first = fail_first

    def __call__(self, full):
        self.calls.append((time.monotonic(), full))
        if len(self.calls) <= self.fail_first:
            raise RuntimeError("kernel said no")


def test_first_sync_is_full_and_bursts_are_rate_limited(running):
    rec = Recorder()
    runner = running(BoundedFrequencyRunner(rec, min_period=0.3, sync_period=60))
    time.sleep(0.1)
    assert rec.calls[0][1] is True
    start = time.monotonic()
    for _unused in range(50):
        runner.request()
        time.sleep(0.01)
    time.sleep(0.5)
    elapsed = time.monotonic() - start
    # 50 requests, but syncs at most once per 0.3 s, all partial.
    later = rec.calls[1:]
    assert 1 <= len(later) <= elapsed / 0.3 + 1 and not any(full for _unused, full in later)
    gaps = [b[0] - a[0] for a, b in zip(rec.calls, rec.calls[1:])]
    assert all(g >= 0.29 for g in gaps), gaps


def test_periodic_full_sync_without_requests(running):
    rec = Recorder()
    running(BoundedFrequencyRunner(rec, min_period=0.05, sync_period=0.3))
    time.sleep(1.0)
    assert len(rec.calls) >= 3 and all(full for _unused, full in rec.calls)


def test_failure_is_retried_as_full_sync_before_the_sync_period(running):
    rec = Recorder(fail_first=2)
    errors = []
    runner = running(BoundedFrequencyRunner(rec, min_period=0.05, sync_period=30, on_error=errors.append))
    time.sleep(0.1)
    runner.request()
    time.sleep(2.0)
    assert len(errors) == 2 and len(rec.calls) == 3, rec.calls
    assert all(full for _unused, full in rec.calls)  # each retry is a full sync
    gaps = [b[0] - a[0] for a, b in zip(rec.calls, rec.calls[1:])]
    assert 0.45 <= gaps[0] < 0.8 and 0.95 <= gaps[1] < 1.4, gaps  # backoff 0.5 s, then 1 s


def test_stop_returns_promptly(running):
    runner = BoundedFrequencyRunner(Recorder(), min_period=1, sync_period=3600)
    t = threading.Thread(target=runner.loop)
    t.start()
    time.sleep(0.1)
    start = time.monotonic()
    runner.stop()
    t.join(3)
    assert not t.is_alive() and time.monotonic() - start < 1.5


def test_state_endpoint_count_follows_slice_changes():
    """endpoint_count() is kept incrementally (it decides upstream's large-cluster mode)."""
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import parse_endpoint_slice
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState

    def sl(name, ips, ports=1):
        return parse_endpoint_slice({
            "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": "web"}},
            "ports": [{"name": f"p{i}", "port": 8080 + i, "protocol": "TCP"} for i in range(ports)],
            "endpoints": [{"addresses": [ip]} for ip in ips]})

    state = ProxyState("node1")
    state.set_slice(sl("a", ["10.0.0.1", "10.0.0.2"], ports=2))
    state.set_slice(sl("b", ["10.0.0.3"]))
    assert state.endpoint_count() == 5
    state.set_slice(sl("a", ["10.0.0.1"], ports=2))
    assert state.endpoint_count() == 3
    state.delete_slice("ns", "b")
    state.delete_slice("ns", "b")
    assert state.endpoint_count() == 2 == sum(len(s.endpoints) * max(1, len(s.ports)) for s in state.slices.values())
