"""How TF reads a StridedSlice(Grad)'s masks and begin: which dims the slice keeps, which
spec entry names each dim, and the first element it reads. Shared by the graph rewrites
(rotate.py) and the slicing rules (propagation/rules/slices.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gspmd_tf.graph.ir import Node


@dataclass(frozen=True)
class SliceMasks:
    """A StridedSlice(Grad)'s masks normalized: `kept` has, per dim of the slice, the dim
    of the sliced tensor it is (None for a new axis); `spec` has, per dim of the sliced
    tensor, its entry in begin/end/strides (None for a dim taken whole: inside the
    ellipsis or past the spec)."""

    kept: tuple
    spec: tuple


def slice_masks(node: Node, rank: int, spec_len: int) -> SliceMasks:
    """StridedSlice(Grad)'s ellipsis, new-axis and shrink masks for a sliced tensor of
    rank `rank` and a begin/end/strides spec of `spec_len` entries.

    As TF reads the masks: the ellipsis stands for every dim the other entries do not
    name (a spec without one has it implicitly at its end); a new-axis entry adds a
    size-1 dim and names no input dim (a shrink bit on it is ignored); a shrink entry
    names an input dim and removes it."""
    ellipsis = node.attr("ellipsis_mask") or 0
    new_axis = node.attr("new_axis_mask") or 0
    shrink = node.attr("shrink_axis_mask") or 0
    naming = sum(1 for s in range(spec_len) if not (ellipsis | new_axis) >> s & 1)
    kept, spec, dim = [], [None] * rank, 0
    for s in range(spec_len):
        if ellipsis >> s & 1:
            kept += range(dim, dim + rank - naming)
            dim += rank - naming
            ellipsis = 0  # only the first ellipsis bit counts
        elif new_axis >> s & 1:
            kept.append(None)
        elif dim < rank:
            spec[dim] = s
            if not shrink >> s & 1:
                kept.append(dim)
            dim += 1
    kept += range(dim, rank)
    return SliceMasks(tuple(kept), tuple(spec))


def first_read(node: Node, x: tuple, masks: SliceMasks, begin, strides) -> np.ndarray:
    """Per spec entry, the index of x a StridedSlice reads first on that dim (as TF
    clamps begin: begin_mask, negative and out-of-range begins)."""
    begin_mask = node.attr("begin_mask") or 0
    first = np.zeros(len(strides), np.int64)
    for d, s in enumerate(masks.spec):
        if s is None or strides[s] <= 0:
            continue
        b = 0 if begin_mask >> s & 1 else int(np.atleast_1d(begin)[s])
        first[s] = min(max(b + x[d] if b < 0 else b, 0), x[d])
    return first
