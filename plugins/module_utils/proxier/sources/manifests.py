# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The static source: a directory of YAML/JSON files holding Services, EndpointSlices
and Nodes (one or many documents per file, or ``kind: List``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Mapping, Optional, Tuple

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


def _documents(path: str) -> Iterator[Tuple[int, Any]]:
    from ..strict_yaml import load_all

    with open(path, encoding="utf-8") as fh:
        for i, doc in enumerate(load_all(fh)):
            if isinstance(doc, Mapping) and doc.get("kind") == "List" or (
                isinstance(doc, Mapping) and str(doc.get("kind", "")).endswith("List") and "items" in doc
            ):
                for item in doc.get("items") or []:
                    yield i, item
            elif doc is not None:
                yield i, doc


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


def read_file(path: str) -> List[Tuple[str, Any]]:
    """One file's documents as (origin, object); raises on a syntax error or a repeated key."""
    return [(f"{path}#{i}", doc) for i, doc in _documents(path)]


def read_dir(directory: str) -> Tuple[List[Tuple[str, Any]], List[str]]:
    """Every document under ``directory`` as (origin, object), and per-file errors."""
    objects: List[Tuple[str, Any]] = []
    errors: List[str] = []
    for path in manifest_files(directory):
        try:
            objects.extend(read_file(path))
        except Exception as e:  # a YAML syntax error names the file; other files still load
            errors.append(f"{path}: cannot parse: {e}")
    return objects, errors


def load_dir(directory: str, proxy_name: str = "", family: int = 4) -> Loaded:
    objects, errors = read_dir(directory)
    out = load_objects(objects, proxy_name, family)
    out.errors[:0] = errors
    return out
