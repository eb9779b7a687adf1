"""Pytest fixtures for the network-namespace integration lab (see ``lab.py``).

* Integration tests are skipped, with the reason, unless the run is root and
  ``ip netns`` works (a probe namespace is created and deleted once).
* Namespaces left by crashed earlier runs are removed once per session
  (``pytest_sessionstart`` and, in case this conftest was not loaded at
  session start, the first integration test).
* ``lab`` yields a fresh :class:`lab.Lab` per test and always closes it.
* ``slow`` marks scale tests that take minutes (the default run, and so CI, includes them
  once; ``-m "not slow"`` leaves them out locally). Lines a test appends to the
  ``measurements`` fixture are printed in a "measured" section of the summary, so CI logs
  carry the numbers even when the test passes.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from lab import Lab, cleanup_stale, new_prefix


@functools.cache
def skip_reason() -> str | None:
    """Why the lab cannot run here, or None if it can (computed once)."""
    if os.geteuid() != 0:
        return "integration lab needs root (network namespaces)"
    for tool in ("ip", "iptables-restore", "sysctl"):
        if shutil.which(tool) is None:
            return f"integration lab needs {tool!r} in PATH"
    probe = f"{new_prefix()}probe"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        return f"'ip netns add' is unavailable: {str(detail).strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)
    return None


MEASUREMENTS: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a scale test of minutes; included by default, -m 'not slow' skips it")


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    if MEASUREMENTS:
        terminalreporter.section("measured")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def measurements() -> list[str]:
    """Append human-readable measured numbers; printed at the end of the run."""
    return MEASUREMENTS


@functools.cache
def cleanup_once() -> list[str]:
    return cleanup_stale()


def pytest_sessionstart(session: pytest.Session) -> None:
    if skip_reason() is None:
        cleanup_once()


@pytest.fixture(scope="session", autouse=True)
def _lab_environment() -> None:
    reason = skip_reason()
    if reason:
        if os.environ.get("CI"):  # CI runs as root on a kernel with namespaces: never skip there
            pytest.fail(f"namespace lab unavailable under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    cleanup_once()


@pytest.fixture
def lab() -> Iterator[Lab]:
    """A fresh, empty lab (node + lan namespaces); closed after the test."""
    instance = Lab()
    try:
        yield instance
    finally:
        instance.close()
