# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Upstream's bounded-frequency sync runner, with a change intake that never blocks.

- ``request()`` (any thread) asks for a sync; syncs run at most once per
  ``min_period`` and at least once per ``sync_period`` (then as a full sync).
- A failed sync is retried as a full sync after a capped backoff (``min_period``
  doubling up to ``sync_period``); upstream waits a whole syncPeriod, which leaves a
  node broken for 30 s after a transient failure.
- An error with ``retry_soon`` set (the xtables lock was held: nothing was applied)
  is retried after ``min_period``, as the same kind of sync, without backoff growth:
  the failed attempt already waited for the lock.
- ``check`` (optional) runs in this thread every ``check_period`` while no sync is due;
  when it returns True a full sync runs at once (upstream's canary Monitor calls its
  reload the same way). Running it here keeps it from ever seeing a half-done sync.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class BoundedFrequencyRunner:
    def __init__(self, sync_fn: Callable[[bool], object], min_period: float, sync_period: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[BaseException], None] = lambda e: None,
                 check: Optional[Callable[[], bool]] = None, check_period: float = 1.0,
                 on_check_error: Callable[[BaseException], None] = lambda e: None) -> None:
        self.sync_fn = sync_fn
        self.min_period = max(0.0, min_period)
        self.sync_period = max(self.min_period, sync_period)
        self.clock = clock
        self.on_error = on_error
        self._cond = threading.Condition()
        self._pending = False
        self._stop = False
        self._last_run = float("-inf")
        self._last_full = float("-inf")
        self._failures = 0
        self._retry_at: Optional[float] = None
        self._retry_full = True
        self._force = False  # a check asked for a full sync now
        self.check = check
        self.check_period = check_period
        self.on_check_error = on_check_error
        self._next_check = float("-inf")
        self.runs = 0

    def request(self) -> None:
        with self._cond:
            self._pending = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _next_due(self, now: float) -> float:
        """When the next sync may or must run. After a failure only the retry counts:
        changes arriving meanwhile ride on it instead of hammering a failing kernel."""
        if self._force:
            return now
        if self._retry_at is not None:
            return self._retry_at
        due = self._last_full + self.sync_period
        if self._pending:
            due = min(due, self._last_run + self.min_period)
        return due

    def loop(self) -> None:
        """Run until stop(); call from the thread that owns the proxier."""
        while True:
            run_check = False
            with self._cond:
                while not self._stop:
                    now = self.clock()
                    due = self._next_due(now)
                    if due <= now:
                        break
                    if self.check is not None and self._retry_at is None:
                        if now >= self._next_check:
                            run_check = True
                            break
                        due = min(due, self._next_check)
                    self._cond.wait(min(due - now, 1.0))
                if self._stop:
                    return
                now = self.clock()
                if run_check:
                    self._next_check = now + self.check_period
                else:
                    retry = self._retry_at is not None
                    full = (now - self._last_full >= self.sync_period or self._force
                            or (retry and self._retry_full))
                    self._pending = False
                    self._retry_at = None
                    self._force = False
                    self._last_run = now
                    self._next_check = now + self.check_period  # a sync just looked at the kernel
            if run_check:
                self._run_check()
                continue
            if full:
                self._last_full = now  # the period counts from the attempt, failed or not
            try:
                self.sync_fn(full)
            except Exception as e:  # the proxier keeps the kernel's last good state
                if getattr(e, "retry_soon", False):
                    delay = max(self.min_period, 0.1)
                    retry_full = full
                else:
                    self._failures += 1
                    delay = min(self.sync_period, max(self.min_period, 0.5) * (2 ** (self._failures - 1)))
                    retry_full = True
                with self._cond:
                    self._retry_at = self.clock() + delay
                    self._retry_full = retry_full
                self.on_error(e)
            else:
                self._failures = 0
            self.runs += 1

    def _run_check(self) -> None:
        try:
            needed = bool(self.check())  # type: ignore[misc]
        except Exception as e:  # a failing check must not stop the syncs
            self.on_check_error(e)
            return
        if needed:
            with self._cond:
                self._force = True
