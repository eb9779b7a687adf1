"""IPVS proxy mode on a real node kernel (the build machine's has no IPVS and no dummy
links): boots the VM lab guest, copies the checkout in, and runs the IPVS cases of
tests/integration/test_traffic.py (the traffic scenarios every mode shares) there as root
with the guest's test venv. They build tests/integration/lab.py's namespace lab inside the
guest and drive ``kubenode-proxy --proxy-mode ipvs`` against it with real connections."""
from __future__ import annotations

import re
import shlex

import vmlab

GUEST_TEST = "tests/integration/test_traffic.py -k ipvs"
GUEST_TIMEOUT = 3600.0  # ~15 min under software emulation; the rest is headroom


def test_ipvs_proxy_mode_traffic_in_the_guest(vm, vm_repo):
    script = (f"cd {shlex.quote(vm_repo)} && exec {vmlab.GUEST_PYTHON} -m pytest -q -rs -p no:cacheprovider "
              f"{GUEST_TEST}")
    proc = vm.sh(script, check=False, timeout=GUEST_TIMEOUT)
    out = f"{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, out[-20000:]
    summary = out.strip().splitlines()[-1]
    # Every scenario ran: a skip in the guest means its kernel lost IPVS or dummy links.
    assert re.search(r"\b\d+ passed\b", summary) and "skipped" not in summary and "failed" not in summary, out[-5000:]


def test_ipvs_netlink_layer_in_the_guest(vm, vm_repo):
    """tests/vm/guest/test_ipvs_kernel.py: the netlink IPVS layer against the guest's real
    ip_vs (listing equals ``ipvsadm -Ln``, batched apply, graceful removal)."""
    script = (f"cd {shlex.quote(vm_repo)} && exec {vmlab.GUEST_PYTHON} -m pytest -q -rs -p no:cacheprovider "
              "tests/vm/guest/test_ipvs_kernel.py")
    proc = vm.sh(script, check=False, timeout=GUEST_TIMEOUT)
    out = f"{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, out[-20000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and "skipped" not in summary and "failed" not in summary, out[-5000:]
