# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The static source: a directory of YAML/JSON files holding Services, EndpointSlices
and Nodes (one or many documents per file, or ``kind: List``)."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..model import (
    EndpointSlice,
    Node,
    Service,
    Skipped,
    ValidationError,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)
from ..validation import object_key, shown

SUFFIXES = (".yaml", ".yml", ".json")


@dataclass
class Loaded:
    services: List[Service] = field(default_factory=list)
    slices: List[EndpointSlice] = field(default_factory=list)
    nodes: List[Node] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)  # object or file, and what is wrong
    skipped: List[str] = field(default_factory=list)

    def node(self, name: str) -> Optional[Node]:
        return next((n for n in self.nodes if n.name == name), None)


# One file of 10,000 Services is about 6 MB; a bigger file is refused unread.
DEFAULT_MAX_FILE_BYTES = 16 * 1024 * 1024


def _what(value: Any) -> str:
    """What a non-object document is, without echoing it (it may be huge or hostile)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def read_text(path: str, max_bytes: int) -> str:
    """A file's text, refused (ValueError naming the file's problem) when it is larger than
    ``max_bytes`` or not UTF-8. Reads at most ``max_bytes + 1`` bytes, whatever the size."""
    # O_NONBLOCK: a FIFO or device put where a manifest belongs must not hang the reader.
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        size = st.st_size
        if size > max_bytes:
            raise ValueError(f"{size} bytes, more than the limit of {max_bytes} (--manifests-max-file-bytes)")
        data = fh.read(max_bytes + 1)  # the file may grow between the stat and the read
    if len(data) > max_bytes:
        raise ValueError(f"more than the limit of {max_bytes} bytes (--manifests-max-file-bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None


def _documents(path: str, max_bytes: int) -> Tuple[List[Tuple[str, Any]], List[str]]:
    from ..strict_yaml import load_all_list, load_json

    objects: List[Tuple[str, Any]] = []
    errors: List[str] = []
    text = read_text(path, max_bytes)
    # JSON first where the name says JSON (the C parser; same bounds), YAML otherwise or
    # when a .json file turns out not to be JSON (YAML reads it as before).
    docs = load_json(text) if path.endswith(".json") else None
    for i, doc in enumerate(docs if docs is not None else load_all_list(text)):
        origin = f"{path}#{i}"
        if doc is None:  # an empty document (a trailing "---"): nothing, as kubectl
            continue
        if not isinstance(doc, Mapping):
            errors.append(f"{origin}: the document is {_what(doc)}, not an object")
            continue
        if doc.get("kind") == "List" or str(doc.get("kind", "")).endswith("List") and "items" in doc:
            items = doc.get("items")
            if items is None:
                continue
            if not isinstance(items, list):
                errors.append(f"{origin}: items: expected a list, got {_what(items)}")
                continue
            for j, item in enumerate(items):
                if isinstance(item, Mapping):
                    objects.append((origin, item))
                else:
                    errors.append(f"{origin}: items[{j}]: expected an object, got {_what(item)}")
            continue
        objects.append((origin, doc))
    return objects, errors


def load_objects(objects: List[Tuple[str, Any]], proxy_name: str = "", family: int = 4) -> Loaded:
    """Parse (origin, object) pairs; bad objects are reported and left out, objects the
    proxy does not serve (another IP family, headless, ...) are listed as skipped."""
    out = Loaded()
    for origin, obj in objects:
        kind = obj.get("kind") if isinstance(obj, Mapping) else None
        try:
            if kind == "Service":
                out.services.append(parse_service(obj, proxy_name, family))
            elif kind == "EndpointSlice":
                out.slices.append(parse_endpoint_slice(obj, proxy_name, family))
            elif kind == "Node":
                out.nodes.append(parse_node(obj))
            else:
                out.skipped.append(f"{origin}: kind {shown(kind)} is not used by the proxy")
        except ValidationError as e:
            out.errors.append(f"{origin}: {e}")
        except Skipped as e:
            out.skipped.append(f"{origin}: {e}")
    return out


def manifest_files(directory: str) -> List[str]:
    """The files under ``directory`` that hold manifests, in load order."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"manifests directory {directory!r} does not exist")
    paths: List[str] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        paths.extend(os.path.join(root, name) for name in sorted(files)
                     if not name.startswith(".") and name.endswith(SUFFIXES))
    return paths


def read_file_checked(path: str, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Tuple[List[Tuple[str, Any]], List[str]]:
    """One file's objects as (origin, object), and its rejected documents (a list, a
    string, ... where an object belongs), each named ``file#index``. Raises (naming the
    problem) when the file is too large, not UTF-8, or not YAML within strict_yaml's bounds."""
    return _documents(path, max_bytes)


def read_file(path: str, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> List[Tuple[str, Any]]:
    """One file's objects as (origin, object); raises as read_file_checked. Rejected
    documents are left out: use read_file_checked to report them."""
    return _documents(path, max_bytes)[0]


def read_dir(directory: str, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Tuple[List[Tuple[str, Any]], List[str]]:
    """Every document under ``directory`` as (origin, object), and per-file errors."""
    objects: List[Tuple[str, Any]] = []
    errors: List[str] = []
    for path in manifest_files(directory):
        try:
            found, rejected = read_file_checked(path, max_bytes)
        except Exception as e:  # a YAML syntax error names the file; other files still load
            errors.append(f"{path}: cannot parse: {e}")
            continue
        objects.extend(found)
        errors.extend(rejected)
    return objects, errors


def load_dir(directory: str, proxy_name: str = "", family: int = 4,
             max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Loaded:
    objects, errors = read_dir(directory, max_bytes)
    out = load_objects(objects, proxy_name, family)
    out.errors[:0] = errors
    return out


# --- following a directory: per-file fingerprints and object deltas -------------------

KINDS = ("Service", "EndpointSlice", "Node")
# A file whose mtime is this close to when it was read may be rewritten within the same
# timestamp tick (the kernel's file clock is coarse, ~1-10 ms) with the same size and
# inode; such a "racy" file is read once more at the next scan ("racy git").
RACY_NS = 100_000_000

Fingerprint = Tuple[int, int, int]  # size, mtime_ns, inode (of the target, for symlinks)
Ident = Tuple[str, str]  # (kind, "namespace/name"), or (kind, "?origin") when unreadable
Event = Tuple[str, str, Any]  # (kind, ADDED/MODIFIED/DELETED, object)


def scan(directory: str) -> Dict[str, Fingerprint]:
    """Every manifest file under ``directory`` (as manifest_files, same order) with its
    fingerprint: os.scandir and one stat per file, nothing is read. Symlinks to files are
    followed (a ConfigMap volume swaps its ``..data`` link: the target's inode changes);
    hidden entries and symlinked directories are skipped, as os.walk does."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"manifests directory {directory!r} does not exist")
    out: Dict[str, Fingerprint] = {}
    _scan(directory, out)
    return out


def _scan(directory: str, out: Dict[str, Fingerprint]) -> None:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:  # vanished or unreadable meanwhile: as os.walk, nothing from it
        return
    subdirs = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.path)
                continue
            if not entry.name.endswith(SUFFIXES):
                continue
            st = entry.stat()  # follows a symlink
        except OSError:  # removed between the listing and the stat, or a dangling link
            continue
        out[entry.path] = (st.st_size, st.st_mtime_ns, st.st_ino)
    for sub in subdirs:  # os.walk's order: a directory's files, then its subdirectories
        _scan(sub, out)


@dataclass
class _File:
    fingerprint: Optional[Fingerprint]  # None: read it again at the next scan (racy)
    objects: Dict[Ident, Any]  # its objects as last parsed, or its last good ones
    order: int  # position in load order (precedence: a later file wins)
    errors: List[str] = field(default_factory=list)


@dataclass
class Changes:
    events: List[Event] = field(default_factory=list)
    # When each file change that produced events happened: the file's mtime (for a
    # removed file, when the scan noticed): what network programming latency counts from.
    triggers: List[float] = field(default_factory=list)
    parsed: List[str] = field(default_factory=list)  # files read by this poll


def _ident(kind: str, obj: Any, origin: str) -> Ident:
    key = object_key(obj, kind)
    if "?" in key.split("/"):
        # No readable identity: it cannot be valid (the daemon names and skips it); key it
        # by where it is, so that two such objects do not hide each other.
        return (kind, "?" + origin)
    return (kind, key)


class DirectoryTracker:
    """The objects of a manifests directory, followed by polling.

    ``poll()`` stats every file and reads only those whose name, size, mtime or inode
    changed; it returns the object deltas (ADDED/MODIFIED/DELETED by kind and
    namespace/name) against what it returned before. Each changed file's objects are
    compared with that file's previous objects, so a change to a small file costs the
    same whatever the other files hold.

    - A file that stops parsing keeps its last good objects; the problem is logged once,
      by file name. A removed file removes its objects.
    - An object defined in two files: the file later in load order (``manifest_files``:
      sorted, a directory's files before its subdirectories) wins, as ``kubectl apply`` of
      the files in that order would leave it; the overlap is logged once. When the winning
      file drops it, the other file's version takes over (a MODIFIED, or nothing if equal).
      Within one file, the last document wins.
    - Objects are not validated here: the daemon's intake names and skips bad ones and
      keeps the last good version of a known object.
    """

    def __init__(self, directory: str, log: Any, max_file_bytes: Optional[int] = None) -> None:
        self.directory = directory
        self.log = log
        self.max_file_bytes = DEFAULT_MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes
        self._files: Dict[str, _File] = {}
        self._holders: Dict[Ident, Dict[str, Any]] = {}  # ident -> {path: object}
        self._overlaps: Dict[Ident, Tuple[str, ...]] = {}  # already logged

    def effective(self, ident: Ident) -> Any:
        """The object the node should have for ``ident`` (None when no file has it)."""
        holders = self._holders.get(ident)
        if not holders:
            return None
        if len(holders) == 1:
            return next(iter(holders.values()))
        return holders[max(holders, key=lambda p: self._files[p].order)]

    def files(self) -> List[_File]:
        """The files as last read (each with the errors of its last read)."""
        return list(self._files.values())

    def objects(self) -> List[Any]:
        return [obj for obj in (self.effective(i) for i in self._holders) if obj is not None]

    def poll(self) -> Changes:
        read_start = time.time_ns()
        found = scan(self.directory)
        changed = [p for p, fp in found.items() if p not in self._files or self._files[p].fingerprint != fp]
        removed = [p for p in self._files if p not in found]
        out = Changes()
        if not changed and not removed:
            return out
        for path in changed:
            if path not in self._files:
                self._files[path] = _File(None, {}, len(self._files))
        touched: Dict[Ident, Any] = {}  # ident -> its effective object before this poll
        triggers: Dict[Ident, float] = {}
        new_objects: Dict[str, Dict[Ident, Any]] = {}
        for path in changed:
            f = self._files[path]
            prev = f.objects
            objects = self._read(path, f)
            out.parsed.append(path)
            new_objects[path] = objects
            size, mtime_ns, ino = found[path]
            racy = read_start - RACY_NS <= mtime_ns <= read_start + RACY_NS
            f.fingerprint = None if racy else (size, mtime_ns, ino)
            when = mtime_ns / 1e9
            for ident in set(prev) | set(objects):
                if prev.get(ident, _ABSENT) is not objects.get(ident, _ABSENT):
                    touched.setdefault(ident, self.effective(ident))
                    triggers[ident] = max(triggers.get(ident, 0.0), when)
        now = time.time()
        for path in removed:
            for ident in self._files[path].objects:
                touched.setdefault(ident, self.effective(ident))
                triggers[ident] = max(triggers.get(ident, 0.0), now)
        # Apply: precedence may change with the order, so update it before resolving.
        for path in removed:
            for ident in self._files.pop(path).objects:
                self._unhold(ident, path)
        for i, path in enumerate(found):
            self._files[path].order = i
        for path, objects in new_objects.items():
            f = self._files[path]
            for ident in f.objects:
                if ident not in objects:
                    self._unhold(ident, path)
            for ident, obj in objects.items():
                self._holders.setdefault(ident, {})[path] = obj
            f.objects = objects
        when_changed = set()
        for ident, before in touched.items():
            after = self.effective(ident)
            self._note_overlap(ident)
            if after is None:
                if before is not None:
                    out.events.append((ident[0], "DELETED", before))
            elif before is None:
                out.events.append((ident[0], "ADDED", after))
            elif after is not before and after != before:
                out.events.append((ident[0], "MODIFIED", after))
            else:
                continue
            when_changed.add(triggers[ident])
        out.triggers = sorted(when_changed)
        return out

    def _unhold(self, ident: Ident, path: str) -> None:
        holders = self._holders.get(ident)
        if holders is not None:
            holders.pop(path, None)
            if not holders:
                del self._holders[ident]
                self._overlaps.pop(ident, None)

    def _note_overlap(self, ident: Ident) -> None:
        holders = self._holders.get(ident, {})
        paths = tuple(sorted(holders, key=lambda p: self._files[p].order)) if len(holders) > 1 else ()
        if paths and self._overlaps.get(ident) != paths:
            self.log(f"{ident[0]} {ident[1]} is defined in {len(paths)} files ({', '.join(paths)}); "
                     f"using {paths[-1]} (the last in load order)")
        if paths:
            self._overlaps[ident] = paths
        else:
            self._overlaps.pop(ident, None)

    def _read(self, path: str, old: _File) -> Dict[Ident, Any]:
        """The file's objects by identity; on failure, its last good objects (logged once)."""
        errors: List[str] = []
        try:
            found, errors = read_file_checked(path, self.max_file_bytes)
        except Exception as e:  # too big, not UTF-8, not YAML: name the file, keep going
            errors = [f"{path}: cannot parse: {e}; "
                      + ("keeping its last good version" if old.objects else "skipped")]
            objects = old.objects
        else:
            objects = {}
            for origin, obj in found:
                kind = obj.get("kind")
                if kind in KINDS:
                    objects[_ident(kind, obj, origin)] = obj  # a repeat in the file: the last wins
        for err in errors:
            if err not in old.errors:
                self.log(f"rejected {err}")
        old.errors = errors
        return objects


_ABSENT = object()
