# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pause Python's cyclic garbage collector around allocation-heavy pure computations.

Compiling 10,000 services allocates a few hundred thousand lists, dicts and strings while
the state (tens of thousands of tracked objects) is alive, so the collector's generation
scans took half of a cold compile (0.26 s of 0.5 s, benchmarks/bench_iptables_sync.py).
What the compiler and planner build has no reference cycles, so reference counting frees
it all the same; cycles elsewhere are collected once the collector runs again.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0  # nested or concurrent pauses: the collector comes back after the last one
_was_enabled = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
