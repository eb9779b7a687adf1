# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""YAML loading for manifests and the config file, strict and bounded.

Strict: a mapping with a repeated key is refused, as the Kubernetes API's strict decoding
and kubectl do (PyYAML keeps the last value silently, so a manifest with two ``kind:``
lines -- two documents run together -- loaded as one mixed object).

Bounded: YAML aliases share one node, so a few hundred bytes can describe a tree of 10^9
nodes ("billion laughs"); whoever walks it (a repr in an error message, a copy) then needs
gigabytes. The composer here counts, while it builds the node graph and before anything is
constructed, how many nodes the document would have once every alias is expanded, and
refuses past ``MAX_ALIAS_NODES``; it also refuses nesting deeper than ``MAX_DEPTH``,
recursive aliases (JSON, and so the API, cannot express them) and more than
``MAX_DOCUMENT_NODES`` nodes in one document or ``MAX_NODES`` in one stream. The Python
composer runs on the events of libyaml's parser when PyYAML has it (CSafeLoader's own
composer is C code that cannot be bounded from here, and recurses on the C stack).
Every refusal is a ``yaml.YAMLError`` with the line and column.

PyYAML is imported on first use: module_utils must import without it (ansible-test's
import sanity test, and modules that never read YAML)."""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Optional, TextIO, Tuple, Union

from .errors import InvalidInput

MAX_DEPTH = 100  # nesting of collections; Kubernetes objects need about 10
MAX_ALIAS_NODES = 100_000  # nodes added by expanding aliases, per stream
MAX_DOCUMENT_NODES = 1_000_000  # per document: ~400 MB of PyYAML nodes at most (a List of 10,000 Services: ~0.5 M)
MAX_NODES = 4_000_000  # per stream (documents are built one at a time): bounds the time, ~30 s


@functools.lru_cache(maxsize=None)  # noqa: UP033 - functools.cache is Python 3.9+
def strict_loader(libyaml: bool = True) -> Any:
    """The loader class; ``libyaml=False`` forces PyYAML's pure-Python parser (tests)."""
    import yaml
    from yaml.composer import Composer, ComposerError
    from yaml.events import AliasEvent

    base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader) if libyaml else yaml.SafeLoader

    class BoundedComposer(Composer):
        """Composer with budgets. Placed before the loader's base in the MRO so that its
        get_node/check_node/get_single_node replace CParser's C composer, while the events
        still come from CParser (or the pure-Python Parser)."""

        def _budget(self) -> Dict[str, Any]:
            b = self.__dict__.get("_kp_budget")
            if b is None:
                b = self.__dict__["_kp_budget"] = {"depth": 0, "aliased": 0, "nodes": 0, "doc_nodes": 0, "weight": {}}
            return b

        def compose_document(self) -> Any:
            b = self._budget()
            b["weight"] = {}  # node -> size once expanded; anchors do not cross documents
            b["doc_nodes"] = 0
            try:
                return super().compose_document()
            finally:
                b["weight"] = {}

        def compose_node(self, parent: Any, index: Any) -> Any:
            b = self._budget()
            weight: Dict[Any, int] = b["weight"]
            if self.check_event(AliasEvent):
                event = self.peek_event()
                target = self.anchors.get(event.anchor)
                if target is not None:  # an undefined alias: the base class reports it
                    size = weight.get(target)
                    if size is None:
                        raise ComposerError(None, None, f"found a recursive alias *{event.anchor}",
                                            event.start_mark)
                    b["aliased"] += size
                    b["nodes"] += size
                    b["doc_nodes"] += size
                    if b["aliased"] > MAX_ALIAS_NODES:
                        raise ComposerError(None, None, f"aliases expand to more than {MAX_ALIAS_NODES} nodes "
                                            "(an alias bomb?)", event.start_mark)
                    self._check_nodes(b, event.start_mark)
                return super().compose_node(parent, index)
            b["depth"] += 1
            if b["depth"] > MAX_DEPTH:
                raise ComposerError(None, None, f"nesting deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            try:
                node = super().compose_node(parent, index)
            finally:
                b["depth"] -= 1
            size = 1
            if isinstance(node.value, list):
                for child in node.value:
                    if isinstance(child, tuple):  # a mapping's (key, value)
                        size += weight.get(child[0], 1) + weight.get(child[1], 1)
                    else:
                        size += weight.get(child, 1)
            weight[node] = size
            b["nodes"] += 1
            b["doc_nodes"] += 1
            self._check_nodes(b, node.start_mark)
            return node

        @staticmethod
        def _check_nodes(b: Dict[str, Any], mark: Any) -> None:
            if b["doc_nodes"] > MAX_DOCUMENT_NODES:
                raise ComposerError(None, None, f"more than {MAX_DOCUMENT_NODES} nodes in one document", mark)
            if b["nodes"] > MAX_NODES:
                raise ComposerError(None, None, f"more than {MAX_NODES} nodes in one file", mark)

    class StrictLoader(BoundedComposer, base):  # type: ignore[misc,valid-type]
        def __init__(self, stream: Any) -> None:
            base.__init__(self, stream)  # CSafeLoader's does not call Composer's: set its state here
            Composer.__init__(self)  # pylint: disable=non-parent-init-called

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict = {}
            for key_node, _value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # "<<: *anchor": its keys may be overridden here, as YAML allows
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the base class reports it
                    break
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {_short(key)} (first at line {first.line + 1})", key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _short(value: Any) -> str:
    text = repr(value)  # a mapping key: a scalar (collections as keys are refused before)
    return text if len(text) <= 200 else text[:197] + "..."


def load(stream: Union[str, TextIO]) -> Any:
    import yaml

    return yaml.load(stream, Loader=strict_loader())  # a SafeLoader subclass


def load_all(stream: Union[str, TextIO]) -> Iterator[Any]:
    import yaml

    return yaml.load_all(stream, Loader=strict_loader())  # a SafeLoader subclass


def load_all_list(stream: Union[str, TextIO]) -> List[Any]:
    """Every document (the stream read to its end, so a late error fails the whole)."""
    return list(load_all(stream))


class JSONDuplicateKey(InvalidInput):
    """A JSON object names a key twice (YAML refuses that too)."""


def _refuse_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONDuplicateKey(f"found duplicate key {key[:200]!r}")
        out[key] = value
    return out


def load_json(text: str) -> Optional[List[Any]]:
    """``text`` as one JSON document, with the YAML path's bounds (no repeated keys, nesting
    at most ``MAX_DEPTH``, at most ``MAX_DOCUMENT_NODES`` nodes), or None when it is not JSON
    (the caller then reads it as YAML, which JSON's syntax is a subset of). Why: the bounded
    composer runs in Python; the json module's C parser reads a 6.6 MB List of 10,000
    Services and their slices ~10x faster, and JSON has no aliases to expand."""
    import json

    try:
        doc = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except JSONDuplicateKey as e:
        raise ValueError(f"while constructing a mapping: {e}") from None
    except RecursionError:
        raise ValueError(f"nesting deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        return None
    nodes = 0
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_DOCUMENT_NODES:
            raise ValueError(f"more than {MAX_DOCUMENT_NODES} nodes in one document")
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)
    return [doc]
