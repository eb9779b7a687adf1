"""Pytest fixtures for the VM lab (``vmlab.py``): real Debian guests under qemu.

* ``vm_lab`` (session): one booted :class:`vmlab.VMLab` with a single VM ``vm1``; built
  from the cached image (the first run on a machine builds it: a few minutes). Always torn
  down, also when the session fails.
* ``vm`` (session): that lab's :class:`vmlab.VM`.
* ``vm_repo`` (session): the repository checkout copied into ``vm`` (returns its path).

The tests are skipped, with the reason, only when qemu/debootstrap (or root, to build the
image) are missing here. Under CI (``CI`` set) a missing tool is an error instead: CI
installs them, so a skip there would hide a broken lab.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import vmlab

# guest/ holds tests that run inside the VM (test_ipvs_proxy_mode.py starts them there over
# SSH); on this host's kernel they could only skip.
collect_ignore = ["guest"]


def pytest_sessionstart(session: pytest.Session) -> None:
    vmlab.cleanup_stale()  # VMs left by crashed earlier runs (their owner is gone)


@pytest.fixture(scope="session")
def vm_lab() -> Iterator[vmlab.VMLab]:
    reason = vmlab.unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"VM lab unavailable under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    lab = vmlab.VMLab(1, image=vmlab.ensure_image())
    try:
        lab.start()
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="session")
def vm(vm_lab: vmlab.VMLab) -> vmlab.VM:
    return vm_lab.vms[0]


@pytest.fixture(scope="session")
def vm_repo(vm: vmlab.VM) -> str:
    return vm.put_repo()
