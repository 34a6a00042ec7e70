"""Small local computations the partitioner emits: slices, pads, offsets, masks."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def replace_dim(shape, dim, size):
    """`shape` with dim `dim` set to `size`."""
    shape = list(shape)
    shape[dim] = size
    return tuple(shape)


def shard_offset(b, axes, shard_size):
    """int32 scalar: global start of this device's shard along `axes`."""
    index = b.shard_index(axes)
    return b.op("Mul", [index, b.const(shard_size, tf.int32)], (), tf.int32, T=tf.int32)


def per_shard(b, axes, table, useful=None):
    """table[shard index along axes]: an int32 scalar for a 1-D table, an int32 vector
    for a table of rows. A constant (python int for a scalar) when nothing is split or
    the first `useful` entries agree: the other shards compute only padding."""
    table = np.asarray(table, np.int64)
    if not axes or np.all(table[:useful] == table[0]):
        return int(table[0]) if table.ndim == 1 else b.const(table[0].astype(np.int32))
    index = b.shard_index(axes)
    return b.op("GatherV2", [b.const(table.astype(np.int32)), index, b.const(np.int32(0))],
                table.shape[1:], tf.int32, Tparams=tf.int32, Tindices=tf.int32,
                Taxis=tf.int32, batch_dims=0)


# TF's CPU Slice and Pad kernels take at most 8 dims; a reshape's factor decomposition
# can have more (tests/test_reshape.py), so ops along one dim of such a tensor run on a
# view of three dims: the dims before `dim`, `dim`, the dims after.
MAX_KERNEL_RANK = 8


def along_dim(op):
    """Decorator of `op(b, ref, dim, *args) -> Ref` that changes only dim `dim` of `ref`:
    on a tensor of more than MAX_KERNEL_RANK dims it runs on the three-dim view."""
    def wrapped(b, ref, dim, *args, **kwargs):
        shape = b.shape_of(ref)
        if len(shape) <= MAX_KERNEL_RANK:
            return op(b, ref, dim, *args, **kwargs)
        view = (int(np.prod(shape[:dim])), shape[dim], int(np.prod(shape[dim + 1:])))
        out = op(b, reshape(b, ref, view), 1, *args, **kwargs)
        return reshape(b, out, replace_dim(shape, dim, b.shape_of(out)[1]))
    wrapped.__name__, wrapped.__doc__ = op.__name__, op.__doc__
    return wrapped


def reshape(b, ref, shape):
    """`ref` reshaped to the static `shape`."""
    dtype = b.graph.dtype(ref)
    return b.op("Reshape", [ref, b.const(np.asarray(shape, np.int32))], tuple(shape), dtype,
                T=dtype, Tshape=tf.int32)


@along_dim
def dynamic_slice_dim(b, ref, dim, start, size):
    """ref[..., start:start+size, ...] along `dim`; `start` an int32 scalar Ref."""
    shape = b.shape_of(ref)
    rank = len(shape)
    unit = np.zeros(rank, np.int32)
    unit[dim] = 1
    begin = b.op("Mul", [b.const(unit), start], (rank,), tf.int32, T=tf.int32)
    sizes = b.const(np.asarray(replace_dim(shape, dim, size), np.int32))
    return b.op("Slice", [ref, begin, sizes], replace_dim(shape, dim, size),
                b.graph.dtype(ref), T=b.graph.dtype(ref), Index=tf.int32)


@along_dim
def static_slice_dim(b, ref, dim, start, size):
    """ref[..., start:start+size, ...] along `dim` with python ints."""
    shape = b.shape_of(ref)
    begin = np.zeros(len(shape), np.int32)
    begin[dim] = start
    return b.op("Slice", [ref, b.const(begin), b.const(np.asarray(replace_dim(shape, dim, size), np.int32))],
                replace_dim(shape, dim, size), b.graph.dtype(ref), T=b.graph.dtype(ref),
                Index=tf.int32)


@along_dim
def pad_dim(b, ref, dim, extra, at_start=False):
    """Zero-pad `extra` elements at the end of `dim` (at its start with `at_start`)."""
    shape = b.shape_of(ref)
    paddings = np.zeros((len(shape), 2), np.int32)
    paddings[dim, 0 if at_start else 1] = extra
    return b.op("Pad", [ref, b.const(paddings)], replace_dim(shape, dim, shape[dim] + extra),
                b.graph.dtype(ref), T=b.graph.dtype(ref), Tpaddings=tf.int32)


def concat_dim(b, refs, dim):
    """The local tensors `refs` (None entries skipped) concatenated along `dim`."""
    refs = [r for r in refs if r is not None]
    if len(refs) == 1:
        return refs[0]
    shapes = [b.shape_of(r) for r in refs]
    dtype = b.graph.dtype(refs[0])
    shape = replace_dim(shapes[0], dim, sum(s[dim] for s in shapes))
    return b.op("ConcatV2", refs + [b.const(np.int32(dim))], shape, dtype, N=len(refs),
                T=dtype, Tidx=tf.int32)


def global_index(b, ref, dim, axes):
    """int32 tensor broadcastable to `ref`: the global index of each element along `dim`.

    `axes` split `dim`; the local block of this device starts at shard_index * local size.
    """
    shape = b.shape_of(ref)
    local = shape[dim]
    bshape = [1] * len(shape)
    bshape[dim] = local
    iota = b.const(np.arange(local, dtype=np.int32).reshape(bshape))
    if not axes:
        return iota
    offset = shard_offset(b, axes, local)
    return b.op("AddV2", [iota, offset], tuple(bshape), tf.int32, T=tf.int32)


def mask_padding(b, local, dims, fill):
    """Set the padding of uneven split `dims` of Local `local` to `fill`; returns a Ref."""
    ref = local.ref
    for dim in dims:
        axes = local.layout.dims[dim]
        n = local.shape[dim]
        if axes and n % b.mesh.axes_size(axes):
            ref = _fill_past(b, ref, dim, axes, n, fill, local.dtype)
    return ref


@along_dim  # SelectV2 broadcasts at most 8 dims (seed 28 #1986: a Tile's rank-10 gradient)
def _fill_past(b, ref, dim, axes, n, fill, dtype):
    """`ref` (split over `axes` along `dim`) with its elements of global index >= n along
    `dim` set to `fill`."""
    index = global_index(b, ref, dim, axes)
    valid = b.op("Less", [index, b.const(n, tf.int32)], b.shape_of(index), tf.bool,
                 T=tf.int32)
    fill_ref = b.const(np.asarray(fill, dtype.as_numpy_dtype))
    return b.op("SelectV2", [valid, ref, fill_ref], b.shape_of(ref), dtype, T=dtype)


def identity_of(reduce_op, dtype):
    """The value that does not change a reduction: 0 for sum, -inf/min for max..."""
    np_dtype = dtype.as_numpy_dtype
    if dtype == tf.bool:
        return {"sum": False, "max": False, "min": True, "prod": True}[reduce_op]
    if reduce_op == "sum":
        return np_dtype(0)
    if reduce_op == "prod":
        return np_dtype(1)
    if dtype.is_floating:
        return np_dtype(-np.inf if reduce_op == "max" else np.inf)
    info = np.iinfo(np_dtype)
    return np_dtype(info.min if reduce_op == "max" else info.max)


def unary(b, op, x, dtype):
    """Elementwise op on one local tensor."""
    return b.op(op, [x], b.shape_of(x), dtype, T=dtype)


def binary(b, op, x, y, dtype, out_dtype=None):
    """Broadcasting elementwise op on two local tensors."""
    shape = np.broadcast_shapes(b.shape_of(x), b.shape_of(y))
    return b.op(op, [x, y], tuple(shape), out_dtype or dtype, T=dtype)


def reduce_last(b, op, x, dtype, keep_dims=True):
    """Sum/Max/Min of the last dim."""
    shape = b.shape_of(x)
    out = shape[:-1] + ((1,) if keep_dims else ())
    return b.op(op, [x, b.const(np.int32(len(shape) - 1))], out, dtype, T=dtype,
                Tidx=tf.int32, keep_dims=keep_dims)


def select(b, cond, x, y, dtype):
    """SelectV2 with broadcasting."""
    shape = np.broadcast_shapes(b.shape_of(cond), b.shape_of(x), b.shape_of(y))
    return b.op("SelectV2", [cond, x, y], tuple(shape), dtype, T=dtype)


def cast(b, x, src, dst):
    """Cast a local tensor."""
    return b.op("Cast", [x], b.shape_of(x), dst, SrcT=src, DstT=dst, Truncate=False)
