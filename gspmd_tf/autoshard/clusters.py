"""Clustering: the nodes of repeated layers share one decision.

A stack of L identical layers repeats the same ops on the same shapes L times; giving
each copy its own variables makes the integer program L times larger for nothing (the
copies want the same plan), so, as meta-pytorch's autoparallel clusters repeated layers,
nodes are grouped into classes and a class takes one strategy: the number of variables
does not grow with the number of layers.

Two nodes fall in one class when they agree on their label (search.py): the same op type
and rule factors (so the same candidates and costs), the same name up to layer numbers
(`layer_3/dense/MatMul_2` and `layer_7/dense/MatMul` are both `layer/dense/MatMul`) and
the same user sharding. Ops of one layer that share type, shapes and name up to numbers
(a layer's query and key projections in one unnamed scope) share a decision too: give
them name scopes (tf.name_scope, Keras layer names) to decide them apart.
"""

from __future__ import annotations

import re
from typing import Hashable, Sequence

_UNIQUIFIER = re.compile(r"_\d+$")  # TF's suffix for a repeated name: MatMul_3
_NUMBER = re.compile(r"\d+")


def layer_free_name(name: str) -> str:
    """`name` without the numbers that tell repeated layers apart, per scope component:
    TF's `_N` suffixes dropped, other digits removed (`layer3/MatMul_1` -> `layer/MatMul`)."""
    return "/".join(_NUMBER.sub("", _UNIQUIFIER.sub("", part)) for part in name.split("/"))


def cluster(labels: Sequence[Hashable]) -> list[int]:
    """The class id of every node (0, 1, ... in order of first appearance): nodes with
    equal `labels` share one."""
    ids = {}
    return [ids.setdefault(label, len(ids)) for label in labels]
