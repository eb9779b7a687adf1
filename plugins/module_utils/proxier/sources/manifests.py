# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The static source: a directory of YAML/JSON files holding Services, EndpointSlices
and Nodes (one or many documents per file, or ``kind: List``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Tuple

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
from ..validation import shown

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
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
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
    from ..strict_yaml import load_all_list

    objects: List[Tuple[str, Any]] = []
    errors: List[str] = []
    for i, doc in enumerate(load_all_list(read_text(path, max_bytes))):
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
