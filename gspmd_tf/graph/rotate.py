"""Rotations written with slices and a concat become Roll (one collective-permute).

`tf.concat([x[a:], x[:a]], axis)` is `tf.roll(x, n - a, axis)` (how jnp.roll and many
pipeline shifts are written). Partitioned as written, the slices of a split dim are
windows of other sizes and the concat needs its dim whole: all-gathers. As a Roll
(spmd/handlers/roll.py) it is one collective-permute of blocks. TF's gradient of that
concat is the mirror image, an AddN of the pieces of dy (Slice) each put back in place
(StridedSliceGrad for a strided slice, Pad for tf.slice), which is a Roll of dy the other
way; that sum is rewritten too.

Both are recognised the same way: parts (source tensor, first element read, where it
goes, length) along one axis, every other dim whole; they are a roll by k when they
share the source, fill [0, n) of the result once, and each moves by k (mod n). Like
sparse_rows.py this rewrites TF's own graphs (forward and gradient) after fold, where
every bound is a constant; anything else is left as written.
"""

from __future__ import annotations

from collections import defaultdict, namedtuple

import numpy as np
import tensorflow as tf

from gspmd_tf.graph.ir import Node, Ref, attr_value
from gspmd_tf.graph.sparse_rows import renumber
from gspmd_tf.graph.strided_slice import first_read, slice_masks

Part = namedtuple("Part", "source axis start dest length")
Part.__doc__ = """Elements [start, start + length) of `source` along `axis` at
[dest, dest + length) of the result (every other dim whole)."""

# the ops a rewrite may leave unused: dropped when nothing else reads them
_PIECE_OPS = frozenset({"Slice", "StridedSlice", "StridedSliceGrad", "Pad", "Const"})


def rotations_as_rolls(graph):
    """Rewrite (in place) rotations of one tensor by slices and a ConcatV2, and AddNs
    summing such pieces put back in place, as Roll ops; returns the graph."""
    new = _NewNodes()
    replaced = []  # the refs rewritten nodes no longer read
    for i, node in enumerate(graph.nodes):
        if node.op == "ConcatV2":
            parts = _concat_parts(graph, node)
            shift = _roll_shift(graph, parts)
            if shift is not None:
                replaced += node.inputs
                _make_roll(graph, node, i, parts[0], shift, new)
        elif node.op == "AddN":
            replaced += _roll_summed_pieces(graph, i, node, new)
    if new.nodes:
        _insert_and_drop(graph, new, replaced)
    return graph


class _NewNodes:
    """Nodes to insert, each before an existing node (its host); until then they are
    referred to by Ref(-(k + 1), 0), k their number here."""

    def __init__(self):
        self.nodes = []
        self.before = defaultdict(list)  # host node index -> numbers of new nodes

    def add(self, host, node):
        self.nodes.append(node)
        self.before[host].append(len(self.nodes) - 1)
        return Ref(-len(self.nodes), 0)


def _make_roll(graph, node, host, part, shift, new):
    """Turn `node` into Roll(part.source, shift, part.axis), its two constants new
    nodes inserted before `host`."""
    consts = [new.add(host, Node(f"{node.name}/roll_{what}", "Const", [],
                                 attrs={"value": attr_value(np.int32(value)),
                                        "dtype": attr_value(tf.int32)},
                                 out_shapes=[()], out_dtypes=[tf.int32]))
              for value, what in ((shift, "shift"), (part.axis, "axis"))]
    node.op = "Roll"
    node.inputs = [part.source] + consts
    node.attrs = {"T": node.attrs["T"], "Tshift": attr_value(tf.int32),
                  "Taxis": attr_value(tf.int32)}
    node.out_shapes = [graph.shape(part.source)]
    node.out_dtypes = [graph.dtype(part.source)]


def _roll_summed_pieces(graph, index, node, new):
    """An AddN whose terms include pieces of one tensor put back in place that together
    are a roll of it: those terms become one Roll (the AddN itself when nothing else is
    summed). Returns the refs no longer read."""
    groups = defaultdict(list)
    for k, ref in enumerate(node.inputs):
        part = _placed_part(graph, ref)
        if part is not None:
            groups[(part.source, part.axis)].append((k, part))
    for terms in groups.values():
        parts = [p for _, p in terms]
        shift = _roll_shift(graph, parts)
        if shift is None:
            continue
        summed = {k for k, _ in terms}
        replaced = [node.inputs[k] for k in summed]
        if len(summed) == len(node.inputs):
            _make_roll(graph, node, index, parts[0], shift, new)
            return replaced
        roll = Node(f"{node.name}/roll", "Roll", attrs={"T": node.attrs["T"]})
        _make_roll(graph, roll, index, parts[0], shift, new)
        others = [r for k, r in enumerate(node.inputs) if k not in summed]
        node.inputs = others + [new.add(index, roll)]
        node.attrs = dict(node.attrs, N=attr_value(len(node.inputs)))
        return replaced
    return []


def _roll_shift(graph, parts):
    """k when the parts are x rolled by k (see the module docstring), else None."""
    if not parts or None in parts or len(parts) < 2:
        return None
    source, axis = parts[0].source, parts[0].axis
    n = graph.shape(source)[axis]
    if any(p.source != source or p.axis != axis for p in parts):
        return None
    shifts = {(p.dest - p.start) % n for p in parts}
    ends = 0
    for p in sorted(parts, key=lambda p: p.dest):
        if p.dest != ends:
            return None
        ends += p.length
    return shifts.pop() if len(shifts) == 1 and ends == n else None


def _concat_parts(graph, node):
    """The parts of a ConcatV2 whose operands are all slices along its axis."""
    axis = graph.const_value(node.inputs[-1])
    if axis is None:
        return None
    rank = len(node.out_shapes[0])
    axis = int(axis) % rank
    parts, dest = [], 0
    for ref in node.inputs[:-1]:
        piece = _slice_part(graph, ref)
        if piece is None or piece.axis != axis:
            return None
        parts.append(piece._replace(dest=dest))
        dest += piece.length
    return parts


def _slice_part(graph, ref):
    """A Slice/StridedSlice (stride 1, no new/shrunk axes) changing one dim only."""
    node = graph.nodes[ref.node]
    if node.op not in ("Slice", "StridedSlice"):
        return None
    x = graph.shape(node.inputs[0])
    starts = _slice_starts(graph, node, x)
    return None if starts is None else _one_axis_part(node.inputs[0], x, starts,
                                                      node.out_shapes[0], 0)


def _placed_part(graph, ref):
    """A piece of a tensor (Slice of it) put in place in zeros: Pad (of tf.slice's
    gradient) or StridedSliceGrad (of a strided slice's), along one dim."""
    node = graph.nodes[ref.node]
    if node.op == "Pad":
        pads = graph.const_value(node.inputs[1])
        piece_ref = node.inputs[0]
        if pads is None:
            return None
        placed_at = np.asarray(pads, np.int64)[:, 0]
    elif node.op == "StridedSliceGrad":
        shape = graph.const_value(node.inputs[0])
        piece_ref = node.inputs[4]
        if shape is None:
            return None
        placed_at = _slice_starts(graph, node, tuple(int(s) for s in shape))
        if placed_at is None:
            return None
    else:
        return None
    piece = _slice_part(graph, piece_ref)
    dims = len(node.out_shapes[0])
    moved = [d for d in range(dims) if placed_at[d] or graph.shape(piece_ref)[d]
             != node.out_shapes[0][d]]
    if piece is None or moved != [piece.axis]:
        return None
    return piece._replace(dest=int(placed_at[piece.axis]))


def _slice_starts(graph, node, x):
    """Per dim of x, the first element a Slice/StridedSlice(Grad) `node` reads (None
    unless the bounds are constants, strides 1, and no ellipsis/new-axis/shrink mask).
    Begin is input 1 and strides input 3 of all three."""
    begin = graph.const_value(node.inputs[1])
    if begin is None:
        return None
    if node.op == "Slice":
        return np.asarray(begin, np.int64)
    strides = graph.const_value(node.inputs[3])
    if strides is None or np.any(np.asarray(strides) != 1):
        return None
    if any(node.attr(m) for m in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")):
        return None
    masks = slice_masks(node, len(x), len(np.atleast_1d(strides)))
    spec_first = first_read(node, x, masks, begin, np.atleast_1d(strides))
    return np.array([0 if s is None else spec_first[s] for s in masks.spec], np.int64)


def _one_axis_part(source, x, starts, out, dest):
    """The Part of a slice of x starting at `starts` with result shape `out`, when it
    changes exactly one dim."""
    changed = [d for d in range(len(x)) if starts[d] or out[d] != x[d]]
    if len(changed) != 1:
        return None
    d = changed[0]
    return Part(source, d, int(starts[d]), dest, int(out[d]))


def _insert_and_drop(graph, new, replaced):
    """Insert the new nodes before their hosts, drop the pieces nothing reads any more
    (transitively), renumber."""
    readers = defaultdict(set)  # node -> nodes reading it, new ones as -(k + 1)
    for i, node in enumerate(graph.nodes):
        for r in node.inputs:
            readers[r.node].add(i)
    for k, node in enumerate(new.nodes):
        for r in node.inputs:
            readers[r.node].add(-(k + 1))
    kept = {r.node for r in graph.outputs} | {r.node for r in graph.inputs}
    dead = set()
    todo = [r.node for r in replaced]
    while todo:
        i = todo.pop()
        node = graph.nodes[i]
        if (i in dead or i in kept or node.op not in _PIECE_OPS or node.control_inputs
                or readers[i] - dead):
            continue
        dead.add(i)
        todo.extend(r.node for r in node.inputs)
    old_nodes = graph.nodes
    graph.nodes, graph._by_name = [], {}
    new_index, new_ref = {}, {}
    for i, node in enumerate(old_nodes):
        if i in dead:
            continue
        for k in new.before.get(i, ()):
            new_ref[(-(k + 1), 0)] = Ref(graph.add(new.nodes[k]), 0)
        new_index[i] = graph.add(node)
    renumber(graph, new_index, new_ref)
