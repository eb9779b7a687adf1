"""Tokenizers that read restore input the way the tools do (written from their documented
behaviour, see kernel/text.py): used to check that a writer's output has exactly the
commands and tokens it should, whatever the values in it."""
from __future__ import annotations

from typing import List


def iptables_line(line: str) -> List[str]:
    """iptables-restore's add_param_to_argv: blanks separate; "..." quotes, with backslash
    escaping inside quotes only; a NUL ends the C string."""
    line = line.split("\0", 1)[0]
    out: List[str] = []
    buf: List[str] = []
    quoted = escaped = started = False
    for ch in line:
        if quoted:
            if escaped:
                buf.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            else:
                buf.append(ch)
            continue
        if ch == '"':
            quoted = started = True
        elif ch in " \t":
            if buf or started:
                out.append("".join(buf))
            buf, started = [], False
        else:
            buf.append(ch)
            started = True
    assert not quoted, f"unterminated quote in {line!r}"
    if buf or started:
        out.append("".join(buf))
    return out


def iptables_restore(text: str) -> List[List[str]]:
    """Commands of an iptables-restore input (fgets: lines end at \\n; # lines are skipped)."""
    return [iptables_line(line) for line in text.split("\n") if line and not line.startswith("#")]


def ipset_line(line: str) -> List[str]:
    """ipset restore's build_argv: space, tab, CR, LF separate; " toggles quoting; no escapes."""
    line = line.split("\0", 1)[0]
    out: List[str] = []
    buf: List[str] = []
    quoted = False
    for ch in line:
        if ch == '"':
            quoted = not quoted
        elif ch in " \t\r\n" and not quoted:
            if buf:
                out.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    assert not quoted, f"missing close quote in {line!r}"
    if buf:
        out.append("".join(buf))
    return out


def ipset_restore(text: str) -> List[List[str]]:
    return [ipset_line(line) for line in text.split("\n") if line.strip() and not line.startswith("#")]
