"""Layout maps: variable-path regexes -> PartitionSpecs, read as keras.distribution.LayoutMap
reads them. gt.keras.shard_model and gt.function(layout_map=...) (which takes plain
tf.Variables over) look variables up here."""

from __future__ import annotations

import re
from typing import Optional, Tuple

from gspmd_tf.autoshard.spec import AUTO, is_auto
from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import PartitionSpec


def variable_path(variable) -> str:
    """The path a layout map matches: a Keras 3 variable's `path` ("dense_1/kernel"),
    else a tf.Variable's name without its output index ("dense_1/kernel:0" of Keras 2
    layers gives "dense_1/kernel")."""
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    name = variable.name
    return name[:-2] if name.endswith(":0") else name


class LayoutRules:
    """layout_map as Keras' LayoutMap reads it: an exact key wins; otherwise every key is
    a regex tried with re.fullmatch on the variable path, and two matching keys are an
    error. Values: PartitionSpec, tuple/list of axis names, keras TensorLayout, None
    (replicated) or gt.AUTO (gt.keras.shard_model: the auto-sharding search chooses)."""

    def __init__(self, layout_map):
        self.items = []
        if layout_map is None:
            return
        if not hasattr(layout_map, "items"):
            raise ShardingError(
                f"layout_map must be a dict or keras.distribution.LayoutMap mapping variable "
                f"path regexes to PartitionSpecs, got {type(layout_map).__name__}")
        for key, value in layout_map.items():
            if not isinstance(key, str):
                raise ShardingError(f"layout_map key {key!r} is not a string (a regex on "
                                    "variable paths such as 'dense_1/kernel')")
            try:
                re.compile(key)
            except re.error as e:
                raise ShardingError(f"layout_map key {key!r} is not a valid regex: {e}") \
                    from None
            self.items.append((key, as_spec(key, value)))

    def lookup(self, variable) -> Tuple[Optional[str], Optional[PartitionSpec]]:
        """(key, spec) for a variable by its path (variable_path), or (None, None) when
        no key matches."""
        return self.lookup_path(variable_path(variable))

    def lookup_path(self, path: str) -> Tuple[Optional[str], Optional[PartitionSpec]]:
        """(key, spec) for a path, or (None, None) when no key matches."""
        for key, spec in self.items:
            if key == path:
                return key, spec
        hits = [(key, spec) for key, spec in self.items if re.fullmatch(key, path)]
        if len(hits) > 1:
            raise ShardingError(
                f"variable {path!r} matches several layout_map keys {[k for k, _ in hits]}; "
                "make each variable path match at most one key")
        return hits[0] if hits else (None, None)


def as_spec(key, value) -> PartitionSpec:
    """A PartitionSpec from a layout_map value (`key` names it in errors); gt.AUTO
    stays gt.AUTO."""
    if is_auto(value):
        return AUTO
    if value is None:
        return PartitionSpec()
    if isinstance(value, PartitionSpec):
        return value
    if hasattr(value, "axes") and not isinstance(value, (tuple, list)):  # TensorLayout
        return PartitionSpec(*value.axes)
    if isinstance(value, (tuple, list)):
        return PartitionSpec(*value)
    raise ShardingError(f"layout_map[{key!r}] = {value!r}: expected a PartitionSpec, a tuple "
                        "of mesh axis names, a keras TensorLayout, None or gt.AUTO")
