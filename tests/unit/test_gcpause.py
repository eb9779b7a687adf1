"""paused_gc(): the collector is off inside, back to its previous state after, nesting and
threads included, and an exception inside does not leave it off."""
import gc
import threading

import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.gcpause import paused_gc


def test_pauses_and_restores():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner pause ending must not re-enable the outer one"
    assert gc.isenabled()


def test_exception_inside_restores():
    with pytest.raises(RuntimeError):
        with paused_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_in_two_threads():
    inside, release = threading.Event(), threading.Event()

    def other():
        with paused_gc():
            inside.set()
            release.wait(5)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    with paused_gc():
        pass
    assert not gc.isenabled(), "the other thread's pause is still on"
    release.set()
    t.join(5)
    assert gc.isenabled()
