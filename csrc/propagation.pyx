# cython: boundscheck=False, wraparound=False, cdivision=True, language_level=3
"""Factor-based sharding propagation: the fixpoint loop over flat arrays.

The Python driver (gspmd_tf/propagation/propagate.py) encodes the graph:

  tensors   t: rank[t], dim_start[t] (row of its first dim in `axes`), fixed[t]
  axes      [num_dims, MAX_AXES] mesh axis ids per tensor dim, major to minor; naxes[dim]
  ops       op: slot_start[op]..slot_start[op+1] are its tensors (operands then results),
            factor_start[op] the id of its first factor
  slots     s: slot_tensor[s]; its dims are dim rows sd = slot_dim_start[s] + d
  slot dims sd: factor ids (op-local) dim_factors[dim_factor_start[sd]:dim_factor_start[sd+1]];
            dim_uneven[sd] 1: the dim may take its major factor's uneven split (below)
  factors   factor_size[f], factor_kind[f] (0 pass, 1 reduce, 2 replicate)
  users     tensor_op_start/tensor_ops: the ops that read or write each tensor
  layers    slot_layer[s]: the first priority layer in which slot s takes part
  barriers  no_write[s] 1: the op never extends slot s's tensor (a propagation barrier
            lets shardings through one way only, or neither)
  open dims closed[dim] 1: no op extends that dim (the closed dims of a seed that has
            open ones: such a seed is not fixed, and its own axes have origin slot -1)
  origins   origin_slot[dim, k], origin_layer[dim, k]: the slot whose tensor offered axis k
            of that dim row and the layer it was added in (written when the core appends
            the axis; undefined for seeds' axes and past naxes)

One step on an op: each factor takes the most-split candidate that the op's tensors offer
(a candidate extending another wins; of two incompatible ones the larger split wins, the
first seen on a tie); an axis goes to one factor only among the factors of each tensor
(the larger split first, the earlier slot's on a tie); then every tensor that is not
fixed (annotated) has each dim extended to its factors' axes where its current axes are a
prefix of them and the axes are free in that tensor. In a dim of several factors each is
split evenly, except the major factor of a dim with dim_uneven set (the merged dim of a
Reshape that merges dims behind an unevenly split one: its handler re-blocks the merged
dim; see rules.reshape). Axes only ever get appended, so the loop ends; ops are revisited
while a tensor of theirs changed, alternating forward and backward sweeps.

Priority layers (XLA's aggressiveness levels, Shardy's op priorities): the loop above
runs once per layer L = 0, 1, ..., each to a fixed point before the next; in layer L an op
sees and extends only its slots with slot_layer <= L (the others are as if absent), so
what an earlier layer decided is there before a later layer's slots can compete with it.
Every appended axis records the slot it came from and the layer (the origins).
"""

import numpy as np
cimport numpy as cnp

cdef enum:
    MAX_AXES = 4
    REPLICATE = 2


cdef long long _size(const signed char* ax, int n, const int* axis_size) noexcept nogil:
    cdef long long p = 1
    cdef int k
    for k in range(n):
        p *= axis_size[ax[k]]
    return p


cdef bint _is_prefix(const signed char* a, int na, const signed char* b, int nb) noexcept nogil:
    cdef int k
    if na > nb:
        return False
    for k in range(na):
        if a[k] != b[k]:
            return False
    return True


cdef class _Propagator:
    cdef int[::1] rank, dim_start, slot_start, factor_start, slot_tensor, slot_dim_start
    cdef int[::1] dim_factor_start, dim_factors, tensor_op_start, tensor_ops
    cdef unsigned char[::1] dim_uneven
    cdef long long[::1] factor_size  # dim sizes may pass 2**31
    cdef int[::1] axis_size
    cdef signed char[:, ::1] axes
    cdef signed char[::1] naxes, factor_kind
    cdef unsigned char[::1] fixed, dirty, slot_layer, no_write, closed
    cdef int[:, ::1] origin_slot
    cdef signed char[:, ::1] origin_layer
    cdef int layer  # the layer being run
    # per-op scratch, one row per factor, sized for the op with the most factors (an op
    # may have any number: IdentityN over a whole optimizer step has hundreds): the chosen
    # axes of each factor and the slot that offered them
    cdef signed char[:, ::1] cand
    cdef int[::1] cand_n, cand_src
    cdef long long[::1] cand_size
    # the candidates after _resolve: how many of each factor's axes it keeps
    cdef int[::1] res_n
    # _resolve's input: the factors it must not consider (1), and its progress
    cdef unsigned char[::1] done

    cdef void _offer(self, int f, const signed char* ax, int n, int s) noexcept nogil:
        """Merge candidate `ax` for factor f, offered by slot s (which holds all of `ax`)."""
        cdef long long size
        if n == 0:
            return
        if _is_prefix(&self.cand[f, 0], self.cand_n[f], ax, n):
            pass
        elif _is_prefix(ax, n, &self.cand[f, 0], self.cand_n[f]):
            return
        else:
            size = _size(ax, n, &self.axis_size[0])
            if size <= self.cand_size[f]:
                return
        for k in range(n):
            self.cand[f, k] = ax[k]
        self.cand_n[f] = n
        self.cand_src[f] = s
        self.cand_size[f] = _size(ax, n, &self.axis_size[0])

    cdef void _collect(self, int op) noexcept nogil:
        """Candidates of every factor from the op's tensors' current axes."""
        cdef int s, t, d, sd, j, nf, f, k, start, n, fb = self.factor_start[op]
        cdef long long p, fsize, asz
        cdef signed char* ax
        for f in range(self.factor_start[op + 1] - fb):
            self.cand_n[f] = 0
            self.cand_size[f] = 1
            self.cand_src[f] = 0x7fffffff
        for s in range(self.slot_start[op], self.slot_start[op + 1]):
            if self.slot_layer[s] > self.layer:
                continue
            t = self.slot_tensor[s]
            for d in range(self.rank[t]):
                sd = self.slot_dim_start[s] + d
                nf = self.dim_factor_start[sd + 1] - self.dim_factor_start[sd]
                if nf == 0:
                    continue
                ax = &self.axes[self.dim_start[t] + d, 0]
                n = self.naxes[self.dim_start[t] + d]
                k = 0
                for j in range(nf):
                    f = self.dim_factors[self.dim_factor_start[sd] + j]
                    fsize = self.factor_size[fb + f]
                    start = k
                    p = 1
                    if nf == 1:  # a dim that is one factor may be split unevenly
                        k = n
                        p = fsize
                    else:
                        while k < n:
                            asz = self.axis_size[ax[k]]
                            if fsize % (p * asz) != 0:
                                break
                            p *= asz
                            k += 1
                    if self.factor_kind[fb + f] != REPLICATE:
                        self._offer(f, ax + start, k - start, s)
                    if p != fsize:
                        break

    cdef bint _resolve(self, int op) noexcept nogil:
        """Give each axis to one of the factors with done[f] == 0 only (res_n[f]: how
        many of cand[f] factor f keeps): larger splits first, then the candidate of the
        earlier slot (as XLA prefers the first of equally specific operands). Returns
        whether some factor lost axes."""
        cdef int nfac = self.factor_start[op + 1] - self.factor_start[op]
        cdef long long used = 0
        cdef int f, best, k
        cdef bint cut = False
        while True:
            best = -1
            for f in range(nfac):
                if not self.done[f] and (best < 0 or self.cand_size[f] > self.cand_size[best] or (
                        self.cand_size[f] == self.cand_size[best]
                        and self.cand_src[f] < self.cand_src[best])):
                    best = f
            if best < 0:
                return cut
            self.done[best] = 1
            self.res_n[best] = self.cand_n[best]
            for k in range(self.cand_n[best]):
                if used & (1LL << self.cand[best, k]):
                    self.res_n[best] = k
                    cut = True
                    break
                used |= 1LL << self.cand[best, k]

    cdef bint _project(self, int op, bint cut) noexcept nogil:
        """Extend the op's unfixed tensors to the chosen factor axes. Where the op-wide
        choice cut a factor's axes (`cut`), each tensor's factors are chosen among
        themselves: an axis that went to a factor the tensor lacks stays free for it (as
        XLA infers a dot operand from the result alone)."""
        cdef int s, t, d, sd, j, nf, f, k, n, td, d2, fb = self.factor_start[op]
        cdef signed char new[MAX_AXES]
        cdef int new_src[MAX_AXES]
        cdef long long other, p, asz
        cdef bint changed = False, uneven
        for s in range(self.slot_start[op], self.slot_start[op + 1]):
            t = self.slot_tensor[s]
            if self.fixed[t] or self.slot_layer[s] > self.layer or self.no_write[s]:
                continue
            if cut:  # choose among the factors this tensor holds
                for f in range(self.factor_start[op + 1] - fb):
                    self.done[f] = 1
                for sd in range(self.slot_dim_start[s], self.slot_dim_start[s] + self.rank[t]):
                    for j in range(self.dim_factor_start[sd], self.dim_factor_start[sd + 1]):
                        self.done[self.dim_factors[j]] = 0
                self._resolve(op)
            for d in range(self.rank[t]):
                sd = self.slot_dim_start[s] + d
                nf = self.dim_factor_start[sd + 1] - self.dim_factor_start[sd]
                if nf == 0 or self.closed[self.dim_start[t] + d]:
                    continue
                n = 0
                uneven = self.dim_uneven[sd]
                for j in range(nf):
                    f = self.dim_factors[self.dim_factor_start[sd] + j]
                    p = 1
                    for k in range(self.res_n[f]):
                        asz = self.axis_size[self.cand[f, k]]
                        # in a dim of several factors each is split evenly (but the major
                        # factor of a dim_uneven one)
                        if n == MAX_AXES or (nf > 1 and self.factor_size[fb + f] % (p * asz)
                                             and not (j == 0 and uneven)):
                            break
                        p *= asz
                        new[n] = self.cand[f, k]
                        new_src[n] = self.cand_src[f]
                        n += 1
                    if p != self.factor_size[fb + f]:
                        break
                td = self.dim_start[t] + d
                if n <= self.naxes[td] or not _is_prefix(&self.axes[td, 0], self.naxes[td], new, n):
                    continue
                other = 0
                for d2 in range(self.rank[t]):
                    if d2 != d:
                        for k in range(self.naxes[self.dim_start[t] + d2]):
                            other |= 1LL << self.axes[self.dim_start[t] + d2, k]
                k = self.naxes[td]
                while k < n and not (other & (1LL << new[k])):
                    self.axes[td, k] = new[k]
                    self.origin_slot[td, k] = new_src[k]
                    self.origin_layer[td, k] = self.layer
                    k += 1
                if k > self.naxes[td]:
                    self.naxes[td] = k
                    changed = True
                    self._mark_users(t, op)
        return changed

    cdef void _mark_users(self, int t, int op) noexcept nogil:
        """Mark the ops of tensor t but `op`, which has just made its step."""
        cdef int i
        for i in range(self.tensor_op_start[t], self.tensor_op_start[t + 1]):
            if self.tensor_ops[i] != op:
                self.dirty[self.tensor_ops[i]] = 1

    cdef bint _step(self, int op) noexcept nogil:
        cdef int f
        self._collect(op)
        for f in range(self.factor_start[op + 1] - self.factor_start[op]):
            self.done[f] = 0
        return self._project(op, self._resolve(op))

    cdef void _mark_layer(self, int layer) noexcept nogil:
        """Mark the ops that gain a slot in `layer`; the others are at their fixed point
        until a tensor of theirs changes."""
        cdef int op, s
        for op in range(self.slot_start.shape[0] - 1):
            for s in range(self.slot_start[op], self.slot_start[op + 1]):
                if self.slot_layer[s] == layer:
                    self.dirty[op] = 1
                    break

    def run(self, int num_layers, int max_sweeps):
        """Run each layer to its fixed point (sweeping forward and backward until nothing
        changes); returns the total sweep count."""
        cdef int num_ops = self.slot_start.shape[0] - 1
        cdef int sweep = 0, i, op, start, layer
        cdef bint changed
        with nogil:
            for layer in range(num_layers):
                self.layer = layer
                self._mark_layer(layer)
                changed = True
                start = sweep
                while changed and sweep < max_sweeps:
                    changed = False
                    for i in range(num_ops):
                        op = i if (sweep - start) % 2 == 0 else num_ops - 1 - i
                        if self.dirty[op]:
                            self.dirty[op] = 0
                            if self._step(op):
                                changed = True
                    sweep += 1
        return sweep


def propagate_arrays(rank, dim_start, fixed, axes, naxes, axis_size, slot_start,
                     factor_start, slot_tensor, slot_dim_start, dim_factor_start,
                     dim_factors, dim_uneven, factor_size, factor_kind, tensor_op_start,
                     tensor_ops, slot_layer, int num_layers, origin_slot, origin_layer,
                     int max_sweeps=1000, no_write=None, closed=None):
    """Run propagation in place on `axes`/`naxes` (and the origins); returns the number
    of sweeps over all layers.

    Arrays are int32 except factor_size (int64), axes, naxes, factor_kind, origin_layer
    (int8) and fixed, dim_uneven, slot_layer, no_write, closed (uint8; None: all 0); see the
    module docstring for their meaning. An op may have any number of factors, a dim at
    most 4 axes.
    """
    cdef _Propagator p = _Propagator()
    p.rank, p.dim_start, p.fixed = rank, dim_start, fixed
    p.axes, p.naxes, p.axis_size = axes, naxes, axis_size
    p.slot_start, p.factor_start = slot_start, factor_start
    p.slot_tensor, p.slot_dim_start = slot_tensor, slot_dim_start
    p.dim_factor_start, p.dim_factors, p.dim_uneven = dim_factor_start, dim_factors, dim_uneven
    p.factor_size, p.factor_kind = factor_size, factor_kind
    p.tensor_op_start, p.tensor_ops = tensor_op_start, tensor_ops
    p.slot_layer, p.origin_slot, p.origin_layer = slot_layer, origin_slot, origin_layer
    p.dirty = np.zeros(len(slot_start) - 1, dtype=np.uint8)
    p.no_write = (np.zeros(len(slot_tensor), dtype=np.uint8) if no_write is None
                  else no_write)
    p.closed = np.zeros(len(naxes), dtype=np.uint8) if closed is None else closed
    most = max(int(np.max(np.diff(factor_start))) if len(factor_start) > 1 else 0, 1)
    p.cand = np.empty((most, MAX_AXES), np.int8)
    p.cand_n, p.cand_src, p.res_n = (np.empty(most, np.int32) for _ in range(3))
    p.cand_size = np.empty(most, np.int64)
    p.done = np.empty(most, np.uint8)
    return p.run(num_layers, max_sweeps)


def trace_axis(int t, int axis, const unsigned char[::1] fixed, const int[::1] rank,
               const int[::1] dim_start, const signed char[:, ::1] axes, const signed char[::1] naxes,
               const int[:, ::1] origin_slot, const signed char[:, ::1] origin_layer,
               const int[::1] slot_tensor):
    """Follow mesh axis `axis` of tensor t back to the fixed tensor it came from.

    Returns (tensors, dims, slots, layers) as int arrays, one entry per tensor on the way,
    t first and the seed last: tensor tensors[i] holds the axis on dim dims[i] and took it
    from slot slots[i] (the seed's entries are -1) in layer layers[i]. Each hop goes to a
    tensor that held the axis earlier, so the walk ends at a seed (a fixed tensor, or
    an axis a seed with open dims was given: origin slot -1).
    """
    out_t, out_d, out_s, out_l = [], [], [], []
    cdef int row, k, d, slot
    while True:
        row = -1
        for d in range(rank[t]):
            for k in range(naxes[dim_start[t] + d]):
                if axes[dim_start[t] + d, k] == axis:
                    row = dim_start[t] + d
                    break
            if row >= 0:
                break
        if row < 0:
            raise ValueError(f"tensor {t} does not hold mesh axis {axis}")
        out_t.append(t)
        out_d.append(row - dim_start[t])
        if fixed[t] or origin_slot[row, k] < 0:
            out_s.append(-1)
            out_l.append(-1)
            break
        slot = origin_slot[row, k]
        out_s.append(slot)
        out_l.append(origin_layer[row, k])
        t = slot_tensor[slot]
    return (np.asarray(out_t, np.int64), np.asarray(out_d, np.int64),
            np.asarray(out_s, np.int64), np.asarray(out_l, np.int64))
