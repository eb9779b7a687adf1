# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# pylint: disable=unidiomatic-typecheck  # `type(v) is int` on purpose: bool and subclasses are refused
"""The one place that decides what may go into kernel tool input text: ``iptables-restore``,
``ipset restore`` and (prepared for the nftables mode) ``nft -f``. Leaf module: imports
nothing of the project.

Every value a writer takes from outside (an object, a module option) goes through one of
these functions, which return it in the form the tool reads back as exactly that one token,
or raise :class:`UnsafeText` naming the field. How the tools read their input:

* ``iptables-restore`` (``add_param_to_argv``): a line (``\\n``) is one command; blanks
  (space, tab) separate tokens; ``"`` opens and closes a quoted token, inside which ``\\``
  escapes the next character; outside quotes ``\\`` is literal. A line that starts with
  ``#`` is ignored, ``*table`` starts a table, ``COMMIT`` ends it. A token is at most 1023
  bytes; a comment match's text at most 255 (``XT_MAX_COMMENT_LEN`` incl. NUL), or the
  whole restore fails. ``iptables-save`` quotes a comment unless it is only ``[A-Za-z0-9_-]``
  and escapes ``"``, ``\\`` and ``'`` with a backslash: comments here are written the same
  way, so what we want and what the kernel has compare as plain strings.
* ``ipset restore`` (``build_argv``): a line is one command; space, tab, CR and LF
  separate tokens; ``"`` toggles quoting (there is no escape character at all), so a
  comment cannot contain ``"``; ``#`` starts a comment line. Comments are at most 255 bytes.
* ``nft -f``: a string in double quotes cannot contain ``"`` or a newline; identifiers are
  ``[A-Za-z][A-Za-z0-9/\\_.-]*``.

Everything outside printable ASCII (controls, DEL, and any non-ASCII character, which
Python's ``str.splitlines`` may also treat as a line break) is refused everywhere: no
Kubernetes name contains one.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any

from ..errors import InvalidInput

MAX_SHOWN = 200  # characters of a refused value quoted in a message
IPT_MAX_COMMENT = 255  # bytes, xt_comment's limit without the NUL
IPT_MAX_TOKEN = 1023  # add_param_to_argv's buffer, without the NUL
IPSET_MAX_COMMENT = 255
IPSET_MAX_NAME = 31  # IPSET_MAXNAMELEN without the NUL
IPT_MAX_CHAIN = 28  # XT_EXTENSION_MAXNAMELEN/xt_chain name (29 with NUL) as iptables-nft accepts
IFNAMSIZ = 15  # without the NUL

# Printable ASCII that needs no escaping inside an iptables-restore quoted token.
_IPT_PLAIN = re.compile(r"[ !#-&(-\[\]-~]*")
_IPT_ESCAPE = re.compile(r"([\"'\\])")
_PRINTABLE = re.compile(r"[ -~]*")
_BARE_TOKEN = re.compile(r"[!#-&(-\[\]-~]+")  # printable ASCII, no blank or quote or backslash
_CHAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
# No leading "-": the restore parsers would read such a name as an option.
_IFACE = re.compile(r"[A-Za-z0-9_.:@][A-Za-z0-9_.:@-]*\+?")
_IPSET_NAME = re.compile(r"[A-Za-z0-9_.:+][A-Za-z0-9_.:+-]*")
_NFT_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9/\\_.-]*")
_PORT_PROTOCOLS = frozenset(("TCP", "UDP", "SCTP", "tcp", "udp", "sctp"))


class UnsafeText(InvalidInput):
    """A value that cannot be written into kernel tool input as the one token it must be."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        self.field = field
        self.value = value
        self.problem = f"{problem}: {shown(value)}"
        super().__init__(f"{field}: {self.problem}")


def shown(value: Any) -> str:
    """``repr`` of a value, cut to MAX_SHOWN characters (controls stay escaped)."""
    if isinstance(value, str) and len(value) > MAX_SHOWN:
        return repr(value[:MAX_SHOWN]) + "..."
    text = repr(value)
    return text if len(text) <= MAX_SHOWN + 2 else text[:MAX_SHOWN] + "..."


def _printable(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise UnsafeText(field, value, f"expected a string, got {type(value).__name__}")
    if _PRINTABLE.fullmatch(value) is None:
        raise UnsafeText(field, value, "contains a control or non-ASCII character")
    return value


# --- values that are one bare token in every format ------------------------------------


def ip(value: Any, field: str) -> str:
    """An IP address in canonical form (as the kernel tools print it back)."""
    if type(value) is str and ":" not in value:
        try:
            socket.inet_pton(socket.AF_INET, value)  # strict dotted quad: no leading zeros, no blanks
            return value
        except (OSError, ValueError, UnicodeError):
            raise UnsafeText(field, value, "not an IPv4 address") from None
    _printable(value, field)
    try:
        canonical = str(ipaddress.ip_address(value))
    except ValueError:
        raise UnsafeText(field, value, "not an IP address") from None
    if canonical != value:
        raise UnsafeText(field, value, f"not in canonical form ({canonical})")
    return value


def cidr(value: Any, field: str) -> str:
    """A network (host bits allowed, as the API server allows them): returned as given;
    callers write the normalised form ipaddress gives."""
    _printable(value, field)
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise UnsafeText(field, value, "not a CIDR") from None
    return value


def port(value: Any, field: str, allow_zero: bool = False) -> int:
    """A port number (an int, not a bool or a string)."""
    if type(value) is int and (0 if allow_zero else 1) <= value <= 65535:
        return value
    raise UnsafeText(field, value, "not a port number 1-65535" + (" (or 0)" if allow_zero else ""))


def number(value: Any, field: str, lo: int, hi: int) -> int:
    if type(value) is int and lo <= value <= hi:
        return value
    raise UnsafeText(field, value, f"not an integer {lo}-{hi}")


def protocol(value: Any, field: str) -> str:
    if type(value) is str and value in _PORT_PROTOCOLS:
        return value
    raise UnsafeText(field, value, "not TCP, UDP or SCTP")


def bare_token(value: Any, field: str, max_len: int = IPT_MAX_TOKEN) -> str:
    """Any other unquoted token: printable ASCII without blanks, quotes or backslashes."""
    if type(value) is str and 0 < len(value) <= max_len and _BARE_TOKEN.fullmatch(value):
        return value
    _printable(value, field)
    raise UnsafeText(field, value, f"not a single token (1-{max_len} characters, no blanks, quotes or backslashes)")


# --- iptables-restore ----------------------------------------------------------------


def ipt_comment_text(value: Any, field: str, max_bytes: int = IPT_MAX_COMMENT) -> str:
    """``value`` escaped for the inside of an iptables-restore quoted token, as
    iptables-save writes it (``\\"``, ``\\\\``, ``\\'``). ``max_bytes`` bounds the
    unescaped text: a caller that writes it into a longer comment passes what is left."""
    if type(value) is str and len(value) <= max_bytes and _IPT_PLAIN.fullmatch(value) is not None:
        return value  # the common case: nothing to escape (ASCII, so characters are bytes)
    _printable(value, field)
    if len(value) > max_bytes:
        raise UnsafeText(field, value, f"{len(value)} characters, longer than {max_bytes}")
    return _IPT_ESCAPE.sub(r"\\\1", value)


def ipt_comment(value: Any, field: str) -> str:
    """A whole ``--comment`` argument: the escaped text in double quotes."""
    return '"' + ipt_comment_text(value, field) + '"'


def ipt_chain(value: Any, field: str) -> str:
    if type(value) is str and len(value) <= IPT_MAX_CHAIN and _CHAIN.fullmatch(value):
        return value
    raise UnsafeText(field, value, f"not a chain name (1-{IPT_MAX_CHAIN} of A-Z a-z 0-9 _ . : -)")


def iface(value: Any, field: str) -> str:
    """An interface name, or a prefix ending in ``+`` (iptables' wildcard)."""
    if type(value) is str and len(value.rstrip("+")) <= IFNAMSIZ and _IFACE.fullmatch(value) \
            and value not in (".", ".."):
        return value
    raise UnsafeText(field, value,
                     f"not an interface name (1-{IFNAMSIZ} of A-Z a-z 0-9 _ . : @ -, not starting with -)")


# --- ipset restore ----------------------------------------------------------------------


def ipset_name(value: Any, field: str) -> str:
    if type(value) is str and len(value) <= IPSET_MAX_NAME and _IPSET_NAME.fullmatch(value):
        return value
    raise UnsafeText(field, value,
                     f"not a set name (1 to {IPSET_MAX_NAME} characters of A-Z a-z 0-9 _ . : + -, not starting with -)")


def ipset_token(value: Any, field: str) -> str:
    """An unquoted ipset restore token (set type, entry, option value)."""
    return bare_token(value, field)


def ipset_comment(value: Any, field: str) -> str:
    """An ipset comment in double quotes: ipset has no escape character, so ``"`` is refused."""
    _printable(value, field)
    if '"' in value:
        raise UnsafeText(field, value, 'an ipset comment cannot contain "')
    if len(value) > IPSET_MAX_COMMENT:
        raise UnsafeText(field, value, f"{len(value)} characters, longer than {IPSET_MAX_COMMENT}")
    return '"' + value + '"'


# --- nft -f (for the nftables mode; not used yet) --------------------------------------------


def nft_string(value: Any, field: str, max_bytes: int = 127) -> str:
    """A quoted nft string (comments: NFT_USERDATA_MAXLEN is 256; element comments 128)."""
    _printable(value, field)
    if '"' in value or "\\" in value:
        raise UnsafeText(field, value, 'an nft string cannot contain " or \\')
    if len(value) > max_bytes:
        raise UnsafeText(field, value, f"{len(value)} characters, longer than {max_bytes}")
    return '"' + value + '"'


def nft_identifier(value: Any, field: str, max_len: int = 255) -> str:
    if type(value) is str and len(value) <= max_len and _NFT_IDENT.fullmatch(value):
        return value
    raise UnsafeText(field, value, "not an nft identifier (a letter, then A-Z a-z 0-9 / \\ _ . -)")
