# cython: boundscheck=False, wraparound=False, cdivision=True, language_level=3
"""Halo sizes of windowed ops (convolutions, pooling) split along one spatial dim.

One dim of an operand of global size `n` is split `shards` ways: shard i owns
[i * L, (i + 1) * L) with L = ceil(n / shards) (the last shards may hold padding). The
result dim is split the same way: shard i computes the result elements
[i * W, (i + 1) * W), W = ceil(result size / shards). Each shard needs a contiguous
range [need_lo(i), need_hi(i)) of the operand, which sticks out of its own block by

    left(i)  = i * L - need_lo(i)          elements from the shards before it
    right(i) = need_hi(i) - (i + 1) * L    elements from the shards after it

(negative: it has elements to spare). Every device builds the same "extended" local
tensor [ext_lo elements | own block | ext_hi elements], ext_* the largest halo over the
shards that compute at least one real result element (the others compute padding and
may read anything), then slices the `span` elements it needs at offset[i] = ext_lo -
left(i). The halos are filled by shifting blocks one shard along (a collective-permute
each way), so a plan is `feasible` when no shard needs more than one neighbour's block
(the outermost shards' outer halos lie beyond the global edge: zeros, no neighbour);
otherwise hops_lo / hops_hi say how many shards each way the halos span.

`whole=True` plans for an operand dim that is not split (every shard owns [0, n)),
e.g. after a fallback gather: the extension is plain padding.

Two index maps exist:
  window_plan:     forward windowed op (conv, pooling): result element j reads operand
                   elements j*stride - pad_lo + t*dilation, t < window.
  transposed_plan: its transpose (Conv2DBackpropInput): result element p (an input
                   position of the forward op) gathers every operand element j (a
                   forward output) whose window covers p.
range_plan takes arbitrary per-shard reads (the forward input a MaxPoolGrad shard's
windows cover). same_padding is TF's SAME padding of one dim.
"""

import numpy as np
cimport numpy as cnp

ctypedef long long i64


cdef inline i64 _floordiv(i64 a, i64 b) noexcept nogil:
    cdef i64 q = a / b
    if (a % b != 0) and ((a < 0) != (b < 0)):
        q -= 1
    return q


cdef inline i64 _ceildiv(i64 a, i64 b) noexcept nogil:
    return -_floordiv(-a, b)


cdef dict _finish(i64[::1] start, i64 span, i64 shards, i64 own, bint whole,
                  i64 useful, dict plan):
    """Halo sizes, extension and slice offsets from each shard's needed start."""
    cdef i64[::1] left = np.empty(shards, dtype=np.int64)
    cdef i64[::1] right = np.empty(shards, dtype=np.int64)
    cdef i64[::1] offset = np.empty(shards, dtype=np.int64)
    cdef i64 i, own_start, ext_lo = 0, ext_hi = 0, inner_lo = 0, inner_hi = 0
    cdef i64 extended, top
    cdef bint uniform = True
    with nogil:
        for i in range(shards):
            own_start = 0 if whole else i * own
            left[i] = own_start - start[i]
            right[i] = start[i] + span - own_start - own
            if i < useful:
                ext_lo = max(ext_lo, left[i])
                ext_hi = max(ext_hi, right[i])
                # halos a neighbour must supply (outer halos of the edge shards are
                # beyond the global edge)
                if i > 0:
                    inner_lo = max(inner_lo, left[i])
                if i < shards - 1:
                    inner_hi = max(inner_hi, right[i])
        extended = ext_lo + own + ext_hi
        top = extended - span
        for i in range(shards):
            offset[i] = min(max(ext_lo - left[i], 0), top)
            if i < useful and offset[i] != offset[0]:
                uniform = False
    plan.update(
        span=int(span), own=int(own), shards=int(shards), whole=bool(whole),
        useful=int(useful), left=np.asarray(left), right=np.asarray(right),
        ext_lo=int(ext_lo), ext_hi=int(ext_hi), extended=int(extended),
        # elements received from the shards before/after (the rest of ext_* is zero
        # padding), and from how many shards each way
        halo_lo=0 if whole else int(max(inner_lo, 0)),
        halo_hi=0 if whole else int(max(inner_hi, 0)),
        hops_lo=0 if whole else int(_ceildiv(max(inner_lo, 0), own)),
        hops_hi=0 if whole else int(_ceildiv(max(inner_hi, 0), own)),
        feasible=bool(whole or (inner_lo <= own and inner_hi <= own)),
        offset=np.asarray(offset), uniform=bool(uniform))
    return plan


def window_plan(i64 n, i64 window, i64 stride=1, i64 dilation=1, i64 pad_lo=0,
                i64 pad_hi=0, i64 shards=1, bint whole=False):
    """Plan for a forward windowed op along one dim (see the module docstring).

    Returns a dict: out_size (number of windows), out_shard (W), own (L, or n when
    whole), span (operand elements one shard's W windows read), start[i] (global
    operand index of the first of them, may be negative: padding), left[i], right[i],
    ext_lo, ext_hi, extended (= ext_lo + own + ext_hi), halo_lo, halo_hi (elements
    received from each neighbour), offset[i] (where shard i's span starts in the
    extended tensor), uniform (same offset on every useful shard), useful (shards
    with at least one real window), feasible.
    """
    if n < 1 or window < 1 or stride < 1 or dilation < 1 or shards < 1:
        raise ValueError(f"bad window: n={n} window={window} stride={stride} "
                         f"dilation={dilation} shards={shards}")
    cdef i64 dilated = (window - 1) * dilation + 1
    cdef i64 full = n + pad_lo + pad_hi
    cdef i64 out_size = 0 if full < dilated else (full - dilated) // stride + 1
    if out_size < 1:
        raise ValueError(f"window of {dilated} elements does not fit {n} + padding "
                         f"({pad_lo}, {pad_hi})")
    cdef i64 out_shard = _ceildiv(out_size, shards)
    cdef i64 own = n if whole else _ceildiv(n, shards)
    cdef i64 span = (out_shard - 1) * stride + dilated
    cdef i64 useful = _ceildiv(out_size, out_shard)
    cdef i64[::1] start = np.empty(shards, dtype=np.int64)
    cdef i64 i
    with nogil:
        for i in range(shards):
            start[i] = i * out_shard * stride - pad_lo
    plan = dict(out_size=int(out_size), out_shard=int(out_shard), start=np.asarray(start))
    return _finish(start, span, shards, own, whole, useful, plan)


def transposed_plan(i64 n_result, i64 n_operand, i64 window, i64 stride=1,
                    i64 dilation=1, i64 pad_lo=0, i64 shards=1, bint whole=False):
    """Plan for the transpose of a forward windowed op (gradient w.r.t. its input).

    The forward op maps an input of `n_result` elements to `n_operand` windows; here the
    operand (the forward output's gradient) is split in blocks of ceil(n_operand /
    shards) and the result in blocks of R = ceil(n_result / shards). Shard i takes the
    operand elements [start[i], start[i] + span) (every window reaching its result
    block), computes the transposed op with VALID padding over them, which yields
    `local_size` result elements beginning at global index first[i]. Padded with `lead`
    zeros before and zeros after to `local_padded` elements (positions no window of the
    span reaches get no gradient), the shard's block begins at post[i]. Also returns
    the window_plan fields for the operand.
    """
    if (n_result < 1 or n_operand < 1 or window < 1 or stride < 1 or dilation < 1
            or shards < 1):
        raise ValueError("bad transposed window")
    cdef i64 dilated = (window - 1) * dilation + 1
    cdef i64 res = _ceildiv(n_result, shards)
    cdef i64 own = n_operand if whole else _ceildiv(n_operand, shards)
    cdef i64 useful = _ceildiv(n_result, res)
    cdef i64[::1] start = np.empty(shards, dtype=np.int64)
    cdef i64[::1] last = np.empty(shards, dtype=np.int64)
    cdef i64[::1] first = np.empty(shards, dtype=np.int64)
    cdef i64[::1] post = np.empty(shards, dtype=np.int64)
    cdef i64 i, span = 1, local_size, local_padded, lead = 0
    with nogil:
        for i in range(shards):
            # first window whose last element reaches position i*R; last window
            # starting at or before the block's last position
            start[i] = _ceildiv(i * res + pad_lo - (dilated - 1), stride)
            last[i] = _floordiv((i + 1) * res - 1 + pad_lo, stride)
            if i < useful:
                span = max(span, last[i] - start[i] + 1)
        local_size = (span - 1) * stride + dilated
        for i in range(shards):
            first[i] = start[i] * stride - pad_lo
            if i < useful:
                lead = max(lead, first[i] - i * res)
        local_padded = lead + local_size
        for i in range(shards):
            post[i] = i * res - first[i] + lead
            if i < useful:
                local_padded = max(local_padded, post[i] + res)
        for i in range(shards):
            post[i] = min(max(post[i], 0), local_padded - res)
    plan = dict(out_size=int(n_result), out_shard=int(res), start=np.asarray(start),
                first=np.asarray(first), post=np.asarray(post), lead=int(lead),
                local_size=int(local_size), local_padded=int(local_padded))
    return _finish(start, span, shards, own, whole, useful, plan)


def same_padding(i64 n, i64 window, i64 stride=1, i64 dilation=1):
    """TF's SAME padding (low, high) of one dim."""
    cdef i64 dilated = (window - 1) * dilation + 1
    cdef i64 out = _ceildiv(n, stride)
    cdef i64 total = max((out - 1) * stride + dilated - n, 0)
    return int(total // 2), int(total - total // 2)


def range_plan(starts, i64 span, i64 n, i64 shards, bint whole=False, i64 useful=-1):
    """Plan for arbitrary per-shard reads [starts[i], starts[i] + span) of a dim of `n`
    elements split `shards` ways (or whole): e.g. the forward input that a gradient
    shard's windows read (MaxPoolGrad). `useful`: shards whose reads matter (all when
    negative)."""
    cdef i64[::1] start = np.ascontiguousarray(starts, dtype=np.int64)
    if start.shape[0] != shards or span < 1 or n < 1:
        raise ValueError("range_plan: one start per shard and a positive span")
    if useful < 0:
        useful = shards
    cdef i64 own = n if whole else _ceildiv(n, shards)
    return _finish(start, span, shards, own, whole, useful, dict(start=np.asarray(start)))
