# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one error hierarchy. A leaf: imports nothing of this package.

::

    ProxierError
    +-- InvalidInput (ValueError)     a configuration field, an API object, text unsafe for
    |                                 a kernel tool: the message names the field
    |   +-- ConfigError               config.py, kernel/conntrack_tune.py (TuneError)
    |   +-- validation.ValidationError, kernel.text.UnsafeText, strict_yaml.JSONDuplicateKey
    +-- KernelError (RuntimeError)    the kernel or one of its tools refused or failed
    |   +-- RestoreError              iptables-restore refused its input
    |   |   +-- LockBusy              the xtables lock was held: nothing applied
    |   +-- Unavailable               what a mode needs is missing here (kernel module,
    |   |                             command, Python package): nothing of it can exist
    |   +-- SysctlError, IpsetError, IPVSError, NetlinkError, LinkError, ConntrackError,
    |       IpvsSyncError (the kernel/ modules and the IPVS proxier)
    +-- SourceError                   a source (manifests directory, API server) failed

Each class keeps its built-in base (ValueError, RuntimeError, OSError) so callers that
catch those still do.
"""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 160
_REPR.maxlevel = 3
MAX_SHOWN = 200  # characters of a value echoed in a message


def show(value: Any) -> str:
    """A value for a message: repr bounded in size and cost (reprlib never walks a huge
    tree), at most MAX_SHOWN characters."""
    text = _REPR.repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


class ProxierError(Exception):
    """Every error this package raises on purpose."""


class InvalidInput(ProxierError, ValueError):
    """Input that cannot be used; the message names it and the field."""


class ConfigError(InvalidInput):
    """A KubeProxyConfiguration field (or a flag) that cannot be used."""

    def __init__(self, path: str, problem: str) -> None:
        path = str(path)
        if len(path) > 200:  # a field path built from hostile keys
            path = path[:197] + "..."
        self.path = path
        super().__init__(f"KubeProxyConfiguration: {path}: {problem}")


class KernelError(ProxierError, RuntimeError):
    """The kernel, or a tool that talks to it, refused or failed."""


class RestoreError(KernelError):
    """iptables-restore refused its input (what upstream counts as a restore failure)."""


class LockBusy(RestoreError):
    """Another program held the xtables lock (iptables-legacy) for the whole wait: nothing
    was applied, so what we remember of the kernel is still right and a retry can come at
    once (and needs no full sync)."""

    retry_soon = True


class Unavailable(KernelError):
    """Something a mode needs is not on this node (a kernel module, a command, a Python
    package): nothing of that mode can have been made here."""


class SourceError(ProxierError):
    """A source of cluster objects (manifests directory, API server) failed."""
