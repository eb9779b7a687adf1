# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""YAML loading that refuses a mapping with a repeated key, as the Kubernetes API's strict
decoding and kubectl do. PyYAML keeps the last value silently, so a manifest with two
``kind:`` lines (two documents run together) loaded as one mixed object.

PyYAML is imported on first use: module_utils must import without it (ansible-test's
import sanity test, and modules that never read YAML)."""

from __future__ import annotations

import functools
from typing import Any, Iterator, TextIO


@functools.lru_cache(maxsize=None)  # noqa: UP033 - functools.cache is Python 3.9+
def strict_loader() -> Any:
    import yaml

    base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when present

    class StrictLoader(base):  # type: ignore[misc,valid-type]
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
                        f"found duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def load(stream: TextIO) -> Any:
    import yaml

    return yaml.load(stream, Loader=strict_loader())  # a SafeLoader subclass


def load_all(stream: TextIO) -> Iterator[Any]:
    import yaml

    return yaml.load_all(stream, Loader=strict_loader())  # a SafeLoader subclass
