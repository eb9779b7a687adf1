"""Fixtures shared by the unit tests."""
import threading

import pytest


@pytest.fixture
def running():
    """Start BoundedFrequencyRunner loops in threads; stop and join them after the test."""
    started = []

    def start(runner):
        t = threading.Thread(target=runner.loop, daemon=True)
        t.start()
        started.append((runner, t))
        return runner

    yield start
    for runner, t in started:
        runner.stop()
        t.join(5)
        assert not t.is_alive()
