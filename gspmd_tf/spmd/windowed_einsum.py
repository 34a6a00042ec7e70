"""Windowed einsum (collective matmul): a dot's all-gather or reduce-scatter as a loop.

GSPMD paper section 3.5; XLA's dot handler does the same under
xla_gspmd_threshold_for_windowed_einsum_mib. When the partitioner would all-gather one
operand of a dot along mesh axis `a` (n devices) and then run the local dot, the dot is
instead run in n steps on the block each device holds, the block passed on to the
neighbour (one collective-permute) while the next step computes: the permute of step t
and the dot of step t have no data between them, so they overlap. Symmetrically, when
the dot's partial result (summed over a contracted factor split on `a`) would be
reduce-scattered along a result dim onto `a`, each step computes the partial result of
one block and adds it to an accumulator that travels round the ring; after n steps each
device holds the sum of its own block. Every block passes through the all-gather loop,
so it also yields the gathered operand, which later ops needing it gathered reuse.

Both replace exactly one collective of the plain path by n - 1 permutes of a block
1/n the size, so the bytes moved per device are the same (an all-gather moves (n-1)/n of
the gathered tensor too) and the local dot does the same work in n pieces. The plain
path stays where the loop would not be exact or not simple: padded (uneven) shards, whose
blocks would need the masks the plain path applies; ops whose local form is not the
replayed op on blocks (an Einsum that sums a letter out of one operand, a broadcasting
BatchMatMul: see handlers/einsum.py and basic.batch_matmul); half-precision dots (the
plain path's collectives sum their partial results in float32); and split dims made of
several factors.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.propagation.rules import REDUCE
from gspmd_tf.registry import DOT, has_trait
from gspmd_tf.spmd.local_ops import concat_dim, dynamic_slice_dim, replace_dim, shard_offset
from gspmd_tf.spmd.program import Local
from gspmd_tf.spmd.reshard import rotate

# dtypes whose partial sums the loop may add in their own precision: the plain path's
# collectives sum half-precision values in float32 (collective_dtypes.CARRIERS)
_SUMMED_AS_IS = (tf.float32, tf.float64)


def threshold_of(option):
    """The per-device byte threshold of gt.function's `windowed_einsum` option: None
    (off) for False/None, 0 for True, else the number of bytes (an int >= 0)."""
    if option is None or option is False:
        return None
    if option is True:
        return 0
    if isinstance(option, (int, np.integer)) and option >= 0:
        return int(option)
    raise ValueError(f"windowed_einsum={option!r}: give True, False, or a size in bytes "
                     "(dots whose gathered operand or scattered result is at least that "
                     "big on one device are windowed)")


def windowed_dot(ctx, threshold):
    """The results (Locals) of the dot of OpContext `ctx` emitted as a windowed loop, or
    None when the plain path applies (not a dot, no all-gather or reduce-scatter around
    it, a case the loop does not cover, or smaller than `threshold` bytes)."""
    if not _loopable(ctx):
        return None
    layouts = ctx.result_layouts()
    for i in (0, 1):
        found = _gathered_dim(ctx, i)
        if found is None:
            continue
        want = ctx.operand_layouts()[i]
        if ctx.p.resharded(ctx.inputs[i], want) is not None:
            continue  # gathered already for another op: the plain dot moves nothing more
        if _bytes(ctx, want, i) >= threshold:
            return _all_gather_loop(ctx, i, *found, layouts[0])
    found = _scattered_dim(ctx, layouts[0])
    if found is not None and _local_bytes(ctx, layouts[0]) >= threshold:
        return _reduce_scatter_loop(ctx, *found, layouts[0])
    return None


def _loopable(ctx):
    """Whether the op is a dot whose local form is its replay on blocks (see the module
    docstring), with operands and result free of padding."""
    node, rule = ctx.node, ctx.rule
    if not has_trait(node.op, DOT) or len(node.inputs) != 2 or len(rule.results) != 1 or \
            rule.reduce_op != "sum":
        return False
    if node.out_dtypes[0] not in _SUMMED_AS_IS:
        return False
    if any(0 in shape for shape in [node.out_shapes[0]] + [x.shape for x in ctx.inputs]):
        return False  # nothing to multiply (basic.no_products)
    for i in (0, 1):
        others = {f for fs in rule.operands[1 - i] for f in fs}
        if any(rule.factor_kinds[f] == REDUCE and f not in others
               for fs in rule.operands[i] for f in fs):
            return False  # an Einsum letter summed out of one operand
    if node.op.startswith("BatchMatMul"):
        ranks = [len(x.shape) for x in ctx.inputs]
        if ranks[0] != ranks[1] or ctx.inputs[0].shape[:-2] != ctx.inputs[1].shape[:-2]:
            return False  # broadcast batch dims: basic.batch_matmul reshapes them
    for x, layout in zip(ctx.inputs, ctx.operand_layouts()):
        if ctx.p.padded(x) or ctx.p.padded(x._replace(layout=layout)):
            return False
    result = ctx.result_layouts()[0]
    target = ctx.targets[0]
    shape = node.out_shapes[0]
    return not (ctx.p.padded(Local(None, result, shape, None)) or
                ctx.p.padded(Local(None, Layout(target.dims), shape, None)))


def _gathered_dim(ctx, i):
    """(dim of operand i, result dim, mesh axis) when the plan all-gathers operand i
    along one axis (the minor one of one dim) and nothing else, that dim being a factor
    of operand i and the result only; else None."""
    rule, x = ctx.rule, ctx.inputs[i]
    want = ctx.operand_layouts()[i]
    changed = [d for d, (have, need) in enumerate(zip(x.layout.dims, want.dims))
               if have != need]
    if x.layout.partial or len(changed) != 1:
        return None
    d = changed[0]
    have, need = x.layout.dims[d], want.dims[d]
    factors = rule.operands[i][d]
    if not have or have[:-1] != need or len(factors) != 1:
        return None
    f = factors[0]
    if rule.factor_kinds[f] == REDUCE or any(f in fs for fs in rule.operands[1 - i]):
        return None
    result_dims = [e for e, fs in enumerate(rule.results[0]) if tuple(fs) == (f,)]
    return (d, result_dims[0], have[-1]) if len(result_dims) == 1 else None


def _scattered_dim(ctx, result):
    """(operand j, its dim, result dim, mesh axis) when the dot's `result` layout is
    partial over an axis that its target splits a result dim over, as the minor axis
    (a reduce-scatter), that dim being a factor of operand j and the result only; else
    None."""
    rule, target = ctx.rule, ctx.targets[0]
    for axis in result.partial:
        for e, (have, want) in enumerate(zip(result.dims, target.dims)):
            if want != have + (axis,) or len(rule.results[0][e]) != 1:
                continue
            g = rule.results[0][e][0]
            owners = [(j, dim) for j in (0, 1) for dim, fs in enumerate(rule.operands[j])
                      if g in fs]
            if len(owners) == 1 and rule.operands[owners[0][0]][owners[0][1]] == (g,):
                return owners[0] + (e, axis)
    return None


def _all_gather_loop(ctx, i, dim, result_dim, axis, layout):
    """The dot with operand i's dim `dim` gathered along `axis` in n steps: each step
    multiplies the block at hand and passes it to the previous device along `axis`, so
    at step t device s holds block (s + t) mod n; the result blocks, concatenated in
    step order, are rolled by s blocks into place. The gathered operand is recorded
    for later reshards."""
    b, node = ctx.b, ctx.node
    n = ctx.mesh.axis_size(axis)
    dtype = node.out_dtypes[0]
    other = ctx.reshard(ctx.inputs[1 - i], ctx.operand_layouts()[1 - i])
    shape = ctx.local_shape(layout)
    step_shape = replace_dim(shape, result_dim, shape[result_dim] // n)
    x = ctx.inputs[i]
    blocks, pieces = [x.ref], []
    for t in range(n):
        if t < n - 1:
            blocks.append(rotate(b, blocks[-1], (axis,), -1))
        refs = [other.ref, other.ref]
        refs[i] = blocks[t]
        pieces.append(b.replay(node, refs, [step_shape], node.out_dtypes)[0])
    ref = _in_place(b, pieces, result_dim, axis)
    # every block passed through: the gathered operand, for other ops that gather it
    # (the gradient's dot, say) without another all-gather; dropped if none does
    want = ctx.operand_layouts()[i]
    ctx.p.remember_reshard(x, want, Local(_in_place(b, blocks, dim, axis), want, x.shape,
                                          x.dtype))
    return [Local(ref, layout, node.out_shapes[0], dtype)]


def _in_place(b, blocks, dim, axis):
    """The blocks a device met in step order (block t is shard (s + t) mod n along
    `axis`, s its own) concatenated along `dim` and rolled by s blocks into shard order."""
    in_step_order = concat_dim(b, blocks, dim)
    shape = b.shape_of(in_step_order)
    dtype = b.graph.dtype(in_step_order)
    shift = shard_offset(b, (axis,), b.shape_of(blocks[0])[dim])
    return b.op("Roll", [in_step_order, shift, b.const(np.int32(dim))], shape, dtype,
                T=dtype, Tshift=tf.int32, Taxis=tf.int32)


def _reduce_scatter_loop(ctx, j, dim, result_dim, axis, layout):
    """The dot's partial result reduce-scattered along `axis` in n steps: at step t
    device s multiplies block (s + t + 1) mod n of operand j's `dim`, adds it to the
    accumulator it received, and passes that to the previous device; after the last
    step it holds the whole sum of its own block s."""
    b, node = ctx.b, ctx.node
    n = ctx.mesh.axis_size(axis)
    dtype = node.out_dtypes[0]
    operands = ctx.operands()
    shape = ctx.local_shape(layout)
    size = shape[result_dim] // n
    step_shape = replace_dim(shape, result_dim, size)
    index = b.shard_index((axis,))
    accumulated = None
    for t in range(n):
        block = b.op("FloorMod", [b.op("AddV2", [index, b.const(t + 1, tf.int32)], (),
                                       tf.int32, T=tf.int32), b.const(n, tf.int32)],
                     (), tf.int32, T=tf.int32)
        start = b.op("Mul", [block, b.const(size, tf.int32)], (), tf.int32, T=tf.int32)
        refs = [x.ref for x in operands]
        refs[j] = dynamic_slice_dim(b, refs[j], dim, start, size)
        part = b.replay(node, refs, [step_shape], node.out_dtypes)[0]
        accumulated = part if accumulated is None else b.op(
            "AddV2", [accumulated, part], step_shape, dtype, T=dtype)
        if t < n - 1:
            accumulated = rotate(b, accumulated, (axis,), -1)
    dims = tuple(axes + (axis,) if d == result_dim else axes
                 for d, axes in enumerate(layout.dims))
    scattered = Layout(dims, tuple(a for a in layout.partial if a != axis), layout.reduce_op)
    return [Local(accumulated, scattered, node.out_shapes[0], dtype)]


def _bytes(ctx, layout, i):
    """Bytes of operand i's shard under `layout`."""
    x = ctx.inputs[i]
    return int(np.prod(ctx.p.local_shape(layout, x.shape), dtype=np.int64)) * x.dtype.size


def _local_bytes(ctx, layout):
    """Bytes of the dot's local result under `layout`."""
    return int(np.prod(ctx.local_shape(layout), dtype=np.int64)) * ctx.node.out_dtypes[0].size
