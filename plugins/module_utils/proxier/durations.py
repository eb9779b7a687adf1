# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Go duration strings ("1m30s"), as KubeProxyConfiguration and conntrack settings write
them. A leaf: imports only errors.py."""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import ConfigError, show

# time.Duration's range: a larger value does not parse in Go either.
MAX_DURATION = float(2 ** 63 - 1) / 1e9

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, path: str) -> float:
    """A Go duration string ("1m30s", "500ms", "0s") in seconds (a number is seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            total = float(value)
        except OverflowError:
            total = math.inf
    elif not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a duration like '30s', got {show(value)}")
    else:
        pos, total = 0, 0.0
        for m in _DURATION.finditer(value):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNIT[m.group(2)]
            pos = m.end()
        if pos != len(value) and value != "0":
            raise ConfigError(path, f"{show(value)} is not a duration (examples: 30s, 1m0s, 500ms)")
    if not -MAX_DURATION <= total <= MAX_DURATION:  # also NaN
        raise ConfigError(path, f"{show(value)} is out of range")
    return total
