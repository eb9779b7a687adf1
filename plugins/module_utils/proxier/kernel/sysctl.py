# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Sysctls and kernel module parameters of *this* process's network namespace.

Small, dependency-free helpers shared by modules and the daemon:

* :func:`key_path` maps a sysctl name (``net.netfilter.nf_conntrack_max``, or with
  slashes) to its file under ``/proc/sys``;
* :func:`read_text` / :func:`read_int` / :func:`write_value` do the I/O, turning the
  errors a read-only key gives (EACCES, EPERM, EROFS, EOPNOTSUPP) into
  :class:`ReadOnlyError`, anything else into :class:`SysctlError`;
* :func:`ensure` is upstream's ``EnsureSysctl`` (write a key only when it differs), here or
  in another network namespace;
* :func:`render_lines`, :func:`render_sysctl_conf` and :func:`parse_sysctl_conf` are pure:
  ``key = value`` lines, the way ``sysctl.d(5)`` files and ``sysctl -a`` write them.

Reading or writing another namespace's sysctls means running in it (``ip netns exec``,
or an Ansible interpreter wrapper); ``/proc/sys/net`` always shows the namespace of
the process that opened the file.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

try:
    from ..errors import KernelError
except ImportError:  # loaded by path in another network namespace (_ENSURE_IN_NETNS): no package there
    KernelError = RuntimeError  # type: ignore[misc,assignment]  # pylint: disable=invalid-name

PROC_SYS = "/proc/sys"
# Lets packets to 127.0.0.0/8 be routed off the host after DNAT: localhost NodePorts need it.
ROUTE_LOCALNET = "net.ipv4.conf.all.route_localnet"
READ_ONLY_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EOPNOTSUPP)


class SysctlError(KernelError):
    """A sysctl or module parameter could not be read or written."""


class ReadOnlyError(SysctlError):
    """The key cannot be written here (read-only in this namespace, or a read-only mount)."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


def key_path(key: str, root: str = PROC_SYS) -> str:
    """``net.ipv4.ip_forward`` or ``net/ipv4/ip_forward`` -> ``/proc/sys/net/ipv4/ip_forward``.

    As ``sysctl(8)``: a name with a slash is a path below ``root`` as it is; otherwise
    dots separate the components.
    """
    relative = key.strip("/") if "/" in key else key.replace(".", "/")
    if not relative or ".." in relative.split("/"):
        raise ValueError(f"invalid sysctl name {key!r}")
    return os.path.join(root, relative)


def read_text(path: str) -> Optional[str]:
    """The file's content without the trailing newline; None if it does not exist."""
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SysctlError(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_int(path: str) -> Optional[int]:
    """The integer in ``path`` (sysctl or module parameter); None if it does not exist."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (IndexError, ValueError):
        raise SysctlError(f"{path} does not hold an integer: {text!r}") from None


def write_value(path: str, value: object, key: str = "") -> None:
    """Write ``value`` to a sysctl or module parameter file.

    Raises :class:`ReadOnlyError` (naming ``key``, default the path) when the kernel or
    the mount refuses the write, :class:`SysctlError` on other errors.
    """
    name = key or path
    try:
        with open(path, "w", encoding="ascii") as fh:
            fh.write(f"{value}\n")
    except OSError as exc:
        if exc.errno in READ_ONLY_ERRNOS:
            raise ReadOnlyError(name, f"writing {path} failed: {exc.strerror} (errno {exc.errno})") from exc
        raise SysctlError(f"cannot write {value} to {path}: {exc.strerror or exc}") from exc


def mode_allows_write(path: str) -> bool:
    """Whether the file's mode has any write bit: the kernel registers sysctls that are
    read-only in a namespace with mode 0444 (independently of how /proc is mounted)."""
    try:
        return bool(os.stat(path).st_mode & 0o222)
    except OSError:
        return False


def writable(path: str) -> bool:
    """Whether this process may open ``path`` for writing (mode, mount, and for root the
    kernel's own per-namespace permission check of /proc/sys)."""
    return os.access(path, os.W_OK)


def ensure_here(values: Mapping[str, object], check: bool = False, root: str = PROC_SYS) -> Dict[str, str]:
    """Upstream's EnsureSysctl in this process's namespace: write each key whose value
    differs (nothing with ``check``). Returns {key: "old -> new"} for the keys that were (or
    would be) written; raises :class:`SysctlError` (a missing key) or :class:`ReadOnlyError`."""
    changed: Dict[str, str] = {}
    for key, value in values.items():
        path = key_path(key, root)
        have = read_text(path)
        if have is None:
            hint = " (is the ip_vs kernel module loaded?)" if "/vs/" in path else ""
            raise SysctlError(f"{key}: no such sysctl ({path}){hint}")
        if have.split() == str(value).split():
            continue
        if not check:
            write_value(path, value, key)
        changed[key] = f"{have} -> {value}"
    return changed


# Run by ``ip netns exec NS python3 -I -c`` with this file's path: loads this module by
# path (it needs only the standard library) and calls ensure_here() in that namespace.
_ENSURE_IN_NETNS = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.spec_from_file_location('kubenode_sysctl', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(mod)\n"
    "try:\n"
    "    out = {'changed': mod.ensure_here(dict(a.split('=', 1) for a in sys.argv[3:]), sys.argv[2] == 'check')}\n"
    "except mod.SysctlError as exc:\n"
    "    out = {'error': str(exc)}\n"
    "print(json.dumps(out))\n"
)


def ensure(values: Mapping[str, object], netns: str = "", check: bool = False,
           runner: Callable[..., Any] = subprocess.run) -> Dict[str, str]:
    """:func:`ensure_here` in network namespace ``netns`` ("" = this process's): /proc/sys
    shows the namespace of the process that opens it, so another namespace is reached
    through one ``ip netns exec`` child. Raises :class:`SysctlError`."""
    if not netns:
        return ensure_here(values, check)
    args = [f"{key}={value}" for key, value in values.items()]
    argv = ["ip", "netns", "exec", netns, sys.executable or "python3", "-I", "-c", _ENSURE_IN_NETNS,
            os.path.abspath(__file__), "check" if check else "write", *args]
    proc = runner(argv, capture_output=True, text=True, check=False)
    try:
        out = json.loads(proc.stdout) if proc.returncode == 0 else {}
    except ValueError:
        out = {}
    if "error" in out:
        raise SysctlError(f"network namespace {netns}: {out['error']}")
    if "changed" not in out:
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise SysctlError(f"cannot set {', '.join(args)} in network namespace {netns}: "
                          f"{detail[-1][:200] if detail else f'exit status {proc.returncode}'}")
    return dict(out["changed"])


class Sysctls:
    """:func:`ensure` bound to a network namespace (what a proxier holds; tests pass an
    object with the same ``ensure``)."""

    def __init__(self, netns: str = "", runner: Callable[..., Any] = subprocess.run) -> None:
        self.netns = netns
        self._run = runner

    def ensure(self, values: Mapping[str, object]) -> Dict[str, str]:
        """Set the keys that differ; returns {key: "old -> new"}; raises SysctlError."""
        return ensure(values, self.netns, runner=self._run) if values else {}


def render_lines(values: Iterable[Tuple[str, object]]) -> str:
    """``key = value`` lines in the given order (each ending with a newline)."""
    return "".join(f"{key} = {value}\n" for key, value in values)


def render_sysctl_conf(values: Mapping[str, object], header: str = "") -> str:
    """A ``sysctl.d(5)`` file: optional ``#`` header lines, then the keys sorted."""
    head = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return head + render_lines(sorted(values.items()))


def parse_sysctl_conf(text: str) -> Dict[str, str]:
    """``key = value`` pairs of a ``sysctl.d(5)`` file (comments, blank lines and the
    leading ``-`` that ignores errors are dropped; a later key wins)."""
    out: Dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        out[key.lstrip("-").strip()] = value
    return out


__all__ = [
    "PROC_SYS", "ROUTE_LOCALNET", "ReadOnlyError", "SysctlError", "ensure", "ensure_here", "key_path",
    "mode_allows_write", "parse_sysctl_conf", "read_int", "read_text", "render_lines", "render_sysctl_conf",
    "write_value", "writable",
]
