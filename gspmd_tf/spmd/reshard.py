"""reshard(): the one way a tensor of the SPMD program changes layout.

Steps, each only where needed, cheapest first:
  1. pending reductions: reduce-scatter when the target splits a dim over exactly the
     partial axes, else all-reduce;
  2. a dim split over the same axes in another order: collective-permute;
  3. an axis leaving one dim for another: all-to-all;
  4. axes leaving a dim: all-gather (uneven dims are gathered whole, then unpadded);
  5. axes joining a dim: a local dynamic slice (padding uneven dims first).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout, ceil_div
from gspmd_tf.spmd.local_ops import (dynamic_slice_dim, pad_dim, replace_dim, shard_offset,
                                     static_slice_dim)
from gspmd_tf.spmd.program import Local

_COLLECTIVE_DTYPE = {tf.bool: tf.int32}


def reshard(b, x, target):
    """Move Local `x` to Layout `target` (no partial axes); returns a Local."""
    if x.layout == target:
        return x
    if x.layout.partial:
        x = _resolve_partial(b, x, target)
    x = _permute_reordered_dims(b, x, target)
    x = _all_to_all_moves(b, x, target)
    x = _gather_removed_axes(b, x, target)
    x = _slice_added_axes(b, x, target)
    assert x.layout == target, (x.layout, target)
    return x


def _with(x, ref, dims, partial=None, reduce_op=None):
    layout = Layout(tuple(dims), x.layout.partial if partial is None else partial,
                    reduce_op or x.layout.reduce_op)
    return Local(ref, layout, x.shape, x.dtype)


def _collective(b, kind, x, shape, **params):
    """Emit a collective, casting dtypes TF collectives lack (bool) around it."""
    ref, dtype = x.ref, x.dtype
    wire = _COLLECTIVE_DTYPE.get(dtype)
    if wire is not None:
        ref = b.op("Cast", [ref], b.shape_of(ref), wire, SrcT=dtype, DstT=wire, Truncate=False)
    out = b.collective(kind, ref, shape, wire or dtype, **params)
    if wire is not None:
        out = b.op("Cast", [out], shape, dtype, SrcT=wire, DstT=dtype, Truncate=False)
    return out


def _resolve_partial(b, x, target):
    mesh = b.mesh
    partial = x.layout.partial
    dims = list(x.layout.dims)
    local = b.shape_of(x.ref)
    k = mesh.axes_size(partial)
    for d, td in enumerate(target.dims):
        cd = dims[d]
        extra = td[len(cd):len(cd) + len(partial)]
        if (td[:len(cd)] == cd and set(extra) == set(partial) and len(extra) == len(partial)
                and x.shape[d] % (mesh.axes_size(cd) * k) == 0):
            shape = replace_dim(local, d, local[d] // k)
            ref = _collective(b, "gt.ReduceScatter", x, shape, axes=extra, dim=d,
                              reduce_op=x.layout.reduce_op)
            dims[d] = cd + extra
            return _with(x, ref, dims, partial=(), reduce_op="sum")
    ref = _collective(b, "gt.AllReduce", x, local, axes=partial, reduce_op=x.layout.reduce_op)
    return _with(x, ref, dims, partial=(), reduce_op="sum")


def _permute_reordered_dims(b, x, target):
    """Dims split over the same axes as the target, in another order: one permute."""
    mesh = b.mesh
    dims = list(x.layout.dims)
    moved = [d for d, (cd, td) in enumerate(zip(dims, target.dims))
             if cd != td and len(cd) > 1 and sorted(cd) == sorted(td)
             and x.shape[d] % mesh.axes_size(cd) == 0]
    if not moved:
        return x
    ids = np.arange(mesh.size)
    want = {d: target.dims[d] for d in moved}
    have = {d: dims[d] for d in moved}
    # the device holding, in the current layout, the shard each device must hold
    coords = np.array([mesh.coords(i) for i in ids]).reshape(mesh.size, -1)
    source_coords = coords.copy()
    for d in moved:
        index = _linear(mesh, coords, want[d])
        source_coords[:, [mesh.axis_index(a) for a in have[d]]] = _unravel(mesh, index, have[d])
    sources = mesh.device_ids[tuple(source_coords.T)]
    pairs = tuple((int(s), int(t)) for s, t in zip(sources, ids))  # fixed points too
    ref = _collective(b, "gt.Permute", x, b.shape_of(x.ref), pairs=pairs)
    for d in moved:
        dims[d] = target.dims[d]
    return _with(x, ref, dims)


def _linear(mesh, coords, axes):
    index = np.zeros(len(coords), np.int64)
    for a in axes:
        i = mesh.axis_index(a)
        index = index * mesh.shape[i] + coords[:, i]
    return index


def _unravel(mesh, index, axes):
    sizes = [mesh.axis_size(a) for a in axes]
    return np.stack(np.unravel_index(index, sizes), axis=1)


def _even(mesh, n, axes):
    return n % mesh.axes_size(axes) == 0


def _all_to_all_moves(b, x, target):
    """An axis that leaves dim d1 as its minor axis and is the next axis dim d2 wants."""
    mesh = b.mesh
    moved = True
    while moved:
        moved = False
        dims = list(x.layout.dims)
        for d1, cd in enumerate(dims):
            if not cd or target.dims[d1][:len(cd)] == cd:
                continue
            axis = cd[-1]
            for d2, c2 in enumerate(dims):
                td2 = target.dims[d2]
                if (d2 == d1 or td2[:len(c2)] != c2 or len(td2) <= len(c2)
                        or td2[len(c2)] != axis or not _even(mesh, x.shape[d1], cd)
                        or not _even(mesh, x.shape[d2], c2 + (axis,))):
                    continue
                local = b.shape_of(x.ref)
                k = mesh.axis_size(axis)
                shape = replace_dim(replace_dim(local, d2, local[d2] // k), d1, local[d1] * k)
                ref = _collective(b, "gt.AllToAll", x, shape, axes=(axis,), split_dim=d2,
                                  concat_dim=d1)
                dims[d1], dims[d2] = cd[:-1], c2 + (axis,)
                x = _with(x, ref, dims)
                moved = True
                break
            if moved:
                break
    return x


def _gather_removed_axes(b, x, target):
    for d, cd in enumerate(x.layout.dims):
        keep = 0
        td = target.dims[d]
        while keep < min(len(cd), len(td)) and cd[keep] == td[keep]:
            keep += 1
        if keep < len(cd):
            x = _gather(b, x, d, keep)
    return x


def _gather(b, x, d, keep):
    """All-gather the axes of dim d after the first `keep` (all of them if d is uneven,
    so that the shard size of what is kept stays exact)."""
    mesh = b.mesh
    dims = list(x.layout.dims)
    cd = dims[d]
    if not _even(mesh, x.shape[d], cd):
        keep = 0
    removed = cd[keep:]
    local = b.shape_of(x.ref)
    gathered = local[d] * mesh.axes_size(removed)
    ref = _collective(b, "gt.AllGather", x, replace_dim(local, d, gathered), axes=removed,
                      dim=d)
    if keep == 0 and gathered != x.shape[d]:
        ref = static_slice_dim(b, ref, d, 0, x.shape[d])
    dims[d] = cd[:keep]
    return _with(x, ref, dims)


def _slice_added_axes(b, x, target):
    mesh = b.mesh
    for d, td in enumerate(target.dims):
        cd = x.layout.dims[d]
        if cd == td:
            continue
        assert td[:len(cd)] == cd, (cd, td)
        if cd and not _even(mesh, x.shape[d], td):  # uneven: slice from the whole dim
            x = _gather(b, x, d, 0)
            cd = ()
        dims = list(x.layout.dims)
        added = td[len(cd):]
        k_added = mesh.axes_size(added)
        size = ceil_div(x.shape[d], mesh.axes_size(td))
        ref = x.ref
        local = b.shape_of(ref)[d]
        if local < size * k_added:  # uneven dims pad to even shards
            ref = pad_dim(b, ref, d, size * k_added - local)
        ref = dynamic_slice_dim(b, ref, d, shard_offset(b, added, size), size)
        dims[d] = td
        x = _with(x, ref, dims)
    return x
