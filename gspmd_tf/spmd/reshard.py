"""Emitting collectives: reshard() = emit(plan(...)), and the halo exchange of windowed ops.

This is the one module that calls ProgramBuilder.collective. The planner (planner.py)
decides the steps and prices them; `emit` turns each step into the collective and the local
pads and slices around it; `exchange_halo` emits the collective-permutes that bring a
split dim's neighbouring elements to a windowed op (handlers/conv.py); `rotate` the
cyclic one of a rolled split dim (handlers/roll.py); `send_to_first` the one that takes
a picked element to its group's first device (handlers/slicing.py); `reblock` those that
move a split dim's block boundaries (an unevenly split dim merged or split:
handlers/reshape.py).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import ceil_div, permute_pairs
from gspmd_tf.spmd import planner
from gspmd_tf.spmd.local_ops import (concat_dim, dynamic_slice_dim, pad_dim, per_shard,
                                     replace_dim, reshape, select, shard_offset,
                                     static_slice_dim)
from gspmd_tf.spmd.program import Local

_COLLECTIVE_DTYPE = {tf.bool: tf.int32}


def reshard(b, x, target):
    """Move Local `x` to Layout `target` (no partial axes) along the cheapest plan."""
    if x.layout == target:
        return x
    return emit(planner.plan(x.layout, target, x.shape, x.dtype, b.mesh, b.cost_model), b, x)


def emit(steps, b, x):
    """The Local `x` after the planned `steps` (see planner.py), emitted into builder b."""
    for step in steps:
        layout = step.apply(x.layout)
        ref = _EMITTERS[type(step)](b, x, step, layout)
        x = Local(ref, layout, x.shape, x.dtype)
        assert b.shape_of(ref) == layout.local_shape(b.mesh, x.shape), (step, b.shape_of(ref))
    return x


def _collective(b, kind, ref, shape, **params):
    """Emit a collective, casting dtypes TF collectives lack (bool) around it."""
    dtype = b.graph.dtype(ref)
    wire = _COLLECTIVE_DTYPE.get(dtype)
    if wire is not None:
        ref = b.op("Cast", [ref], b.shape_of(ref), wire, SrcT=dtype, DstT=wire, Truncate=False)
    out = b.collective(kind, ref, shape, wire or dtype, **params)
    if wire is not None:
        out = b.op("Cast", [out], shape, dtype, SrcT=wire, DstT=dtype, Truncate=False)
    return out


def _pad_to(b, ref, dim, size):
    """`ref` zero-padded at the end of `dim` up to `size` elements."""
    have = b.shape_of(ref)[dim]
    return pad_dim(b, ref, dim, size - have) if have < size else ref


def _unpad(b, ref, dim, n):
    """The first `n` elements of `dim` (a whole dim gathered from uneven shards)."""
    return static_slice_dim(b, ref, dim, 0, n) if b.shape_of(ref)[dim] != n else ref


def _shard_size(b, x, dim, axes):
    return ceil_div(x.shape[dim], b.mesh.axes_size(axes))


def _local_slice(b, x, step, layout):
    d = step.dim
    size = _shard_size(b, x, d, layout.dims[d])
    ref = _pad_to(b, x.ref, d, size * b.mesh.axes_size(step.axes))
    return dynamic_slice_dim(b, ref, d, shard_offset(b, step.axes, size), size)


def _all_gather(b, x, step, layout):
    d = step.dim
    local = b.shape_of(x.ref)
    gathered = local[d] * b.mesh.axes_size(step.axes)
    ref = _collective(b, "gt.AllGather", x.ref, replace_dim(local, d, gathered),
                      axes=step.axes, dim=d)
    return _unpad(b, ref, d, x.shape[d]) if not layout.dims[d] else ref


def _broadcast(b, x, step, layout):
    """The first shard of a one-element dim, zeros on the others (a select: padding may
    be NaN), summed over the step's axes."""
    first = b.op("Equal", [b.shard_index(step.axes), b.const(np.int32(0))], (), tf.bool,
                 T=tf.int32, incompatible_shape_error=True)
    ref = select(b, first, x.ref, b.const(np.zeros((), x.dtype.as_numpy_dtype), x.dtype),
                 x.dtype)
    return _collective(b, "gt.AllReduce", ref, b.shape_of(ref), axes=step.axes,
                       reduce_op="sum")


def _all_to_all(b, x, step, layout):
    if step.also:
        return _joined_all_to_all(b, x, step, layout)
    d1, d2 = step.concat_dim, step.split_dim
    k = b.mesh.axes_size(step.axes)
    chunk = _shard_size(b, x, d2, layout.dims[d2])
    ref = _pad_to(b, x.ref, d2, chunk * k)
    local = b.shape_of(ref)
    shape = replace_dim(replace_dim(local, d2, chunk), d1, local[d1] * k)
    ref = _collective(b, "gt.AllToAll", ref, shape, axes=step.axes, split_dim=d2,
                      concat_dim=d1)
    return _unpad(b, ref, d1, x.shape[d1]) if not layout.dims[d1] else ref


def _joined_all_to_all(b, x, step, layout):
    """An all-to-all of several (axes, concat_dim, split_dim) moves at once: each split
    dim cut into [k, chunk] and its k moved to the front, the k's flattened into one dim
    in group order (a member's shard index over all the moves' axes), one all-to-all
    on it, then each received k merged in front of its concat dim (major: the sender's
    index along the move's axes is the minor part of the concat dim's split)."""
    moves = step.moves
    ks = [b.mesh.axes_size(axes) for axes, _, _ in moves]
    ref = x.ref
    for (_, _, d2), k in zip(moves, ks):
        ref = _pad_to(b, ref, d2, _shard_size(b, x, d2, layout.dims[d2]) * k)
    local = b.shape_of(ref)
    cut, front = [], {}  # the shape with split dims cut; each split dim's k position
    split_k = {d2: k for (_, _, d2), k in zip(moves, ks)}
    for d, size in enumerate(local):
        if d in split_k:
            front[d] = len(cut)
            cut += [split_k[d], size // split_k[d]]
        else:
            cut.append(size)
    ks_first = [front[d2] for _, _, d2 in moves]
    order = ks_first + [i for i in range(len(cut)) if i not in ks_first]
    rest = [cut[i] for i in order[len(moves):]]  # the local dims, split dims as chunks
    blocks = _transpose(b, reshape(b, ref, cut), order)
    blocks = reshape(b, blocks, [int(np.prod(ks))] + rest)
    blocks = _collective(b, "gt.AllToAll", blocks, b.shape_of(blocks),
                         axes=step.group_axes, split_dim=0, concat_dim=0)
    concat_k = {d1: i for i, (_, d1, _) in enumerate(moves)}
    order = []
    for d in range(len(rest)):
        order += ([concat_k[d]] if d in concat_k else []) + [len(moves) + d]
    merged = _transpose(b, reshape(b, blocks, ks + rest), order)
    out = [size * (ks[concat_k[d]] if d in concat_k else 1) for d, size in enumerate(rest)]
    ref = reshape(b, merged, out)
    for _, d1, _ in moves:
        if not layout.dims[d1]:
            ref = _unpad(b, ref, d1, x.shape[d1])
    return ref


def _transpose(b, ref, order):
    """`ref` with its dims in `order`."""
    shape, dtype = b.shape_of(ref), b.graph.dtype(ref)
    return b.op("Transpose", [ref, b.const(np.asarray(order, np.int32))],
                tuple(shape[i] for i in order), dtype, T=dtype, Tperm=tf.int32)


def _permute(b, x, step, layout):
    pairs = permute_pairs(b.mesh, x.layout, layout)
    return _collective(b, "gt.Permute", x.ref, b.shape_of(x.ref), pairs=pairs)


def place(b, ref, mesh, layout, src_mesh, dst_mesh):
    """`ref`, a tensor in `layout` placed as on `src_mesh`, placed as on `dst_mesh` (each
    `mesh` or its devices in another order: Sharding.placement): one collective-permute
    of the shards that move, none when none does."""
    pairs = permute_pairs(mesh, layout, layout, src_mesh, dst_mesh)
    if all(s == t for s, t in pairs):
        return ref
    return _collective(b, "gt.Permute", ref, b.shape_of(ref), pairs=pairs)


def _reduce_scatter(b, x, step, layout):
    d = step.dim
    size = _shard_size(b, x, d, layout.dims[d])
    ref = _pad_to(b, x.ref, d, size * b.mesh.axes_size(step.axes))
    shape = replace_dim(b.shape_of(ref), d, size)
    return _collective(b, "gt.ReduceScatter", ref, shape, axes=step.axes, dim=d,
                       reduce_op=x.layout.reduce_op)


def _all_reduce(b, x, step, layout):
    return _collective(b, "gt.AllReduce", x.ref, b.shape_of(x.ref), axes=step.axes,
                       reduce_op=x.layout.reduce_op)


_EMITTERS = {
    planner.LocalSlice: _local_slice,
    planner.AllGather: _all_gather,
    planner.Broadcast: _broadcast,
    planner.AllToAll: _all_to_all,
    planner.CollectivePermute: _permute,
    planner.ReduceScatter: _reduce_scatter,
    planner.AllReduce: _all_reduce,
}


# ------------------------------------------------------------------------ halo exchange

def _shift_pairs(mesh, axes, step):
    """(source, target) pairs: every device of a group sends to the device `step` shard
    indices further along `axes` (devices with no source receive zeros)."""
    groups = mesh.groups(axes)
    k = groups.shape[1]
    if step > 0:
        src, dst = groups[:, :k - step], groups[:, step:]
    else:
        src, dst = groups[:, -step:], groups[:, :k + step]
    return tuple((int(s), int(t)) for s, t in zip(src.ravel(), dst.ravel()))


def rotate(b, ref, axes, step):
    """Every device's `ref` sent to the device `step` shard indices further along `axes`,
    cyclically (the last ones to the first): one collective-permute, none when `step` is
    a multiple of the group size."""
    groups = b.mesh.groups(axes)
    if step % groups.shape[1] == 0:
        return ref
    targets = np.roll(groups, -step, axis=1)
    pairs = tuple((int(s), int(t)) for s, t in zip(groups.ravel(), targets.ravel()))
    return _collective(b, "gt.Permute", ref, b.shape_of(ref), pairs=pairs)


def send_to_first(b, ref, axes, source):
    """Every group's (over `axes`) shard index `source` of `ref` sent to the group's
    first device, the others given zeros: one collective-permute, none when `source`
    is 0 (then `ref` as it is)."""
    if source == 0:
        return ref
    groups = b.mesh.groups(axes)
    pairs = tuple((int(g[source]), int(g[0])) for g in groups)
    return _collective(b, "gt.Permute", ref, b.shape_of(ref), pairs=pairs)


def exchange_halo(b, ref, dim, axes, halo_lo, halo_hi):
    """[last halo_lo elements of the shards before | own block | first halo_hi elements
    of the shards after] along `dim` split over `axes`: one collective-permute per
    neighbour block each way (one each way unless a halo is longer than a block); the
    first/last shards receive zeros."""
    own = b.shape_of(ref)[dim]
    left, right = [], []
    for hop in range(1, ceil_div(halo_lo, own) + 1):
        size = min(own, halo_lo - (hop - 1) * own)
        send = static_slice_dim(b, ref, dim, own - size, size)
        left.insert(0, _collective(b, "gt.Permute", send, b.shape_of(send),
                                   pairs=_shift_pairs(b.mesh, axes, hop)))
    for hop in range(1, ceil_div(halo_hi, own) + 1):
        size = min(own, halo_hi - (hop - 1) * own)
        send = static_slice_dim(b, ref, dim, 0, size)
        right.append(_collective(b, "gt.Permute", send, b.shape_of(send),
                                 pairs=_shift_pairs(b.mesh, axes, -hop)))
    return concat_dim(b, left + [ref] + right, dim)


# ------------------------------------------------------------------------ re-blocking

def reblock_windows(n, k, block_in, block_out, first=0, last=None):
    """How a dim of n elements split k ways in blocks of `block_in` (shard s holds
    [s * block_in, (s + 1) * block_in), padding past n) becomes blocks of `block_out`
    of its range [first, last) (shard i holds [first + i * block_out, ...), padding past
    last; last defaults to n): {distance: ((s, i, lo, hi), ...)}, where target shard i
    takes the window [lo, hi) of source shard s = i - distance's block, for every pair
    that needs any. Empty blocks (a dim of no elements) move nothing."""
    last = n if last is None else last
    if not block_in:
        return {}
    windows = {}
    for i in range(k):
        start, stop = first + i * block_out, min(last, first + (i + 1) * block_out)
        for s in range(start // block_in, k):
            lo, hi = max(start, s * block_in), min(stop, (s + 1) * block_in)
            if lo >= hi:
                break
            windows.setdefault(i - s, []).append((s, i, lo - s * block_in,
                                                  hi - s * block_in))
    return {distance: tuple(pairs) for distance, pairs in windows.items()}


def reblock(b, ref, dim, axes, n, block_out, first=0, last=None):
    """`ref`, a dim of n elements split over `axes` in blocks of its local size (shard s
    holding [s * size, (s + 1) * size), padding past n), returned in blocks of
    `block_out` of its range [first, last) (shard i holding [first + i * block_out,
    ...); last defaults to n): per distance between source and target shards, one
    collective-permute of the window each source's target needs (as long as the longest
    of them, each source's start from a per-shard table; none for a device's own block),
    each window then placed at its offset in the new block and the places selected.
    XLA's reshape of a merged unevenly split dim, and its slice of a split dim whose
    blocks come from a few other devices, do the same exchange."""
    block_in = b.shape_of(ref)[dim]
    groups = b.mesh.groups(axes)
    k = groups.shape[1]
    out_shape = replace_dim(b.shape_of(ref), dim, block_out)
    dtype = b.graph.dtype(ref)
    out = b.const(np.zeros(out_shape, dtype.as_numpy_dtype), dtype)
    for distance, moves in sorted(reblock_windows(n, k, block_in, block_out, first,
                                                  last).items()):
        length = max(hi - lo for _, _, lo, hi in moves)
        send, shift, end = (np.zeros(k, np.int64) for _ in range(3))
        send[:] = moves[0][2]  # shards sending nothing agree with the first
        for s, i, lo, hi in moves:
            send[s] = lo
            shift[i] = s * block_in + lo - first - i * block_out
            end[i] = shift[i] + hi - lo
        source = _pad_to(b, ref, dim, int(send.max()) + length)
        start = per_shard(b, axes, send)
        piece = (static_slice_dim(b, source, dim, start, length) if isinstance(start, int)
                 else dynamic_slice_dim(b, source, dim, start, length))
        if distance:
            piece = _collective(b, "gt.Permute", piece, b.shape_of(piece),
                                pairs=tuple((int(g[s]), int(g[i])) for g in groups
                                            for s, i, _, _ in moves))
        out = _place(b, out, piece, dim, per_shard(b, axes, shift),
                     per_shard(b, axes, end))
    return out


def _place(b, out, piece, dim, shift, end):
    """`out` with `piece` written at offset `shift` along `dim`, its places [shift, end)
    selected (int32 scalars or python ints; parts outside `out` dropped): the piece
    padded by out's size on both sides, the window of out's size sliced at the
    (clamped) offset, then selected where it lands."""
    size, length = b.shape_of(out)[dim], b.shape_of(piece)[dim]
    shift, end = (b.const(v, tf.int32) if isinstance(v, int) else v for v in (shift, end))
    padded = pad_dim(b, pad_dim(b, piece, dim, size, at_start=True), dim, size)
    start = b.op("Sub", [b.const(size, tf.int32), shift], (), tf.int32, T=tf.int32)
    start = b.op("ClipByValue", [start, b.const(0, tf.int32), b.const(size + length, tf.int32)],
                 (), tf.int32, T=tf.int32)
    aligned = dynamic_slice_dim(b, padded, dim, start, size)
    rank = len(b.shape_of(out))
    bshape = [1] * rank
    bshape[dim] = size
    iota = b.const(np.arange(size, dtype=np.int32).reshape(bshape))
    after = b.op("GreaterEqual", [iota, shift], tuple(bshape), tf.bool, T=tf.int32)
    before = b.op("Less", [iota, end], tuple(bshape), tf.bool, T=tf.int32)
    inside = b.op("LogicalAnd", [after, before], tuple(bshape), tf.bool)
    return b.op("SelectV2", [inside, aligned, out], b.shape_of(out), b.graph.dtype(out),
                T=b.graph.dtype(out))
