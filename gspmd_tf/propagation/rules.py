"""Sharding rules: for each op type, how operand and result dims map to factors.

A rule is data (an OpRule): the op's factors (sizes and kinds) and, for every operand and
result, the factors each of its dims is made of, major to minor, plus typed parameters
its emitter needs (`params`). Propagation and the generic partitioner read only OpRules.
This module holds the rule builders; which builder serves each op type, with which
parameters, is the op registry's (gspmd_tf/registry.py). Windowed ops' builders are in
windowed.py.

Factor kinds:
  PASS         the same index in every tensor that has it (may be split anywhere)
  REDUCE       only in operands: summed/maxed away; split -> partial result
  REPLICATE    must not be split (the partitioner gathers it)
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np

PASS, REDUCE, REPLICATE = 0, 1, 2


@dataclass
class OpRule:
    """Factors of one op and how each operand/result dim is made of them.

    operands[i] is None for an input that is not a data tensor (a shape, an axis list);
    otherwise a tuple with, per dim, a tuple of factor ids (empty for a size-1 dim that
    broadcasts). `reduce_op` says how REDUCE factors combine (sum, max, min, prod).
    `params` is a typed record of what the op's emitter needs that the rule already
    worked out (a windowed op's geometry, a gather's axis...), or None; it is not part
    of the printed form, nor is `uneven_major` (where propagation may pass an uneven
    split into a merged dim).
    """

    factor_sizes: list = field(default_factory=list)
    factor_kinds: list = field(default_factory=list)
    operands: list = field(default_factory=list)
    results: list = field(default_factory=list)
    reduce_op: str = "sum"
    params: object = None
    # ((result, dim), ...): result dims of several factors that take their major
    # factor's split even when it is uneven (a Reshape merging dims behind an unevenly
    # split one; see rules.reshape)
    uneven_major: tuple = ()

    def key(self):
        """A hashable value, equal for rules with the same factors, dims and reduce op
        (`params` left out): for memoising what depends only on those, such as the
        partitioner's choice of factor axes."""
        def tensors(all_dims):
            return tuple(None if dims is None else tuple(tuple(fs) for fs in dims)
                         for dims in all_dims)
        return (tuple(self.factor_sizes), tuple(self.factor_kinds), tensors(self.operands),
                tensors(self.results), self.reduce_op)

    def add_factor(self, size, kind=PASS):
        """A new factor; returns its id."""
        self.factor_sizes.append(int(size))
        self.factor_kinds.append(kind)
        return len(self.factor_sizes) - 1

    def __str__(self):
        """Shardy's form, e.g. `([i, k], [k, j])->([i, j]) {i=8, j=16, k=8} reduction={k}`.

        Factors are named i, j, k... by id; a dim made of several factors joins their
        names major first (`[ij, k]`), a dim without one (size 1, broadcast) is `1`, a
        non-data operand `_`. REPLICATE factors are listed as `need_replication`, and the
        reduce op follows when it is not a sum."""
        names = [_factor_name(f) for f in range(len(self.factor_sizes))]

        def tensors(all_dims):
            return ", ".join("_" if dims is None else
                             "[" + ", ".join("".join(names[f] for f in fs) or "1"
                                             for fs in dims) + "]" for dims in all_dims)

        sizes = ", ".join(f"{name}={size}" for name, size in zip(names, self.factor_sizes))
        text = f"({tensors(self.operands)})->({tensors(self.results)}) {{{sizes}}}"
        for kind, label in ((REDUCE, "reduction"), (REPLICATE, "need_replication")):
            of_kind = [name for name, k in zip(names, self.factor_kinds) if k == kind]
            if of_kind:
                text += f" {label}={{{', '.join(of_kind)}}}"
        return text if self.reduce_op == "sum" else f"{text} reduce={self.reduce_op}"


def _factor_name(f):
    """i, j, ..., z, then z_1, z_2... (as Shardy names factors)."""
    return chr(ord("i") + f) if f < 18 else f"z_{f - 17}"


class RuleContext:
    """What a rule builder may look at: the node, its input/output shapes, constants."""

    def __init__(self, graph, node):
        self.graph = graph
        self.node = node
        self.in_shapes = [graph.shape(r) for r in node.inputs]
        self.out_shapes = node.out_shapes

    def const(self, i):
        """Value of constant input i (None when the input is not a constant)."""
        return self.graph.const_value(self.node.inputs[i])


def _dims_of(letters, shape, factor_of):
    """Per-dim factor tuples for `shape` indexed by einsum `letters`."""
    return tuple(() if size == 1 or factor_of[letter][0] is None else (factor_of[letter][0],)
                 for letter, size in zip(letters, shape))


def einsum_rule(equation, in_shapes, out_shape, reduce_op="sum"):
    """Rule from an einsum equation; letters missing from the output are REDUCE.

    A size-1 operand dim whose letter is larger elsewhere broadcasts (no factor). A letter
    that names two dims of one tensor (a diagonal, e.g. 'aab') is REPLICATE: one mesh axis
    cannot split two dims of a tensor.
    """
    lhs, out = equation.replace(" ", "").split("->")
    inputs = lhs.split(",")
    sizes = {}
    for letters, shape in zip(inputs + [out], list(in_shapes) + [out_shape]):
        for letter, size in zip(letters, shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    rule = OpRule(reduce_op=reduce_op)
    factor_of = {}
    for letter in sorted(sizes, key=(inputs[0] + "".join(inputs[1:]) + out).index):
        if sizes[letter] == 1:
            factor_of[letter] = (None, 1)
            continue
        if any(term.count(letter) > 1 for term in inputs + [out]):
            kind = REPLICATE
        else:
            kind = PASS if letter in out else REDUCE
        factor_of[letter] = (rule.add_factor(sizes[letter], kind), sizes[letter])
    for letters, shape in zip(inputs, in_shapes):
        rule.operands.append(_dims_of(letters, shape, factor_of))
    rule.results.append(_dims_of(out, out_shape, factor_of))
    return rule


def _letters(n, offset=0):
    return string.ascii_letters[offset:offset + n]


# ----------------------------------------------------------------------------- builders
# Each builder takes a RuleContext (and its parameters from the op registry) and returns
# an OpRule or None (None: no rule for this instance; the op then runs replicated).


def elementwise(ctx, data_inputs=None):
    """Broadcasting elementwise op: dims aligned from the right."""
    out = ctx.out_shapes[0]
    rank = len(out)
    idx = range(len(ctx.in_shapes)) if data_inputs is None else data_inputs
    letters = _letters(rank)
    terms = []
    for i in range(len(ctx.in_shapes)):
        if i in idx:
            terms.append(letters[rank - len(ctx.in_shapes[i]):])
    rule = einsum_rule(",".join(terms) + "->" + letters,
                       [ctx.in_shapes[i] for i in idx], out)
    rule.operands = _spread(rule.operands, idx, len(ctx.in_shapes))
    for extra in ctx.out_shapes[1:]:  # e.g. same-shaped second outputs
        rule.results.append(rule.results[0] if extra == out else None)
    return rule


def _spread(operand_dims, positions, count):
    """Place per-operand dims at `positions` among `count` inputs (others None)."""
    full = [None] * count
    for pos, dims in zip(positions, operand_dims):
        full[pos] = dims
    return full


def matmul(ctx):
    """MatMul with transpose_a / transpose_b."""
    a = "ki" if ctx.node.attr("transpose_a") else "ik"
    b = "jk" if ctx.node.attr("transpose_b") else "kj"
    return einsum_rule(f"{a},{b}->ij", ctx.in_shapes, ctx.out_shapes[0])


def batch_matmul(ctx):
    """BatchMatMulV2/V3 with adj_x / adj_y and broadcasting batch dims."""
    out = ctx.out_shapes[0]
    batch = _letters(len(out) - 2, 4)
    a = "ki" if ctx.node.attr("adj_x") else "ik"
    b = "jk" if ctx.node.attr("adj_y") else "kj"
    ra, rb = len(ctx.in_shapes[0]), len(ctx.in_shapes[1])
    eq = f"{batch[len(batch) - (ra - 2):]}{a},{batch[len(batch) - (rb - 2):]}{b}->{batch}ij"
    return einsum_rule(eq, ctx.in_shapes, out)


def einsum(ctx):
    """Einsum from its `equation` attr (ellipsis expanded)."""
    equation = ctx.node.attr("equation")
    if "..." in equation:
        equation = _expand_ellipsis(equation, ctx.in_shapes, ctx.out_shapes[0])
    return einsum_rule(equation, ctx.in_shapes, ctx.out_shapes[0])


def _expand_ellipsis(equation, in_shapes, out_shape):
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    used = set(equation)
    spare = [c for c in string.ascii_letters if c not in used]
    n = max(len(s) - len(t.replace("...", "")) for t, s in zip(terms, in_shapes))
    fill = "".join(spare[:n])
    terms = [t.replace("...", fill[n - (len(s) - len(t.replace("...", ""))):])
             for t, s in zip(terms, in_shapes)]
    return ",".join(terms) + "->" + out.replace("...", fill[n - (len(out_shape) - len(out.replace("...", ""))):])


def bias_add(ctx):
    """BiasAdd: the bias runs along the channel dim."""
    rank = len(ctx.in_shapes[0])
    letters = _letters(rank)
    channel = 1 if ctx.node.attr("data_format") == "NCHW" else rank - 1
    return einsum_rule(f"{letters},{letters[channel]}->{letters}", ctx.in_shapes,
                       ctx.out_shapes[0])


@dataclass(frozen=True)
class ReductionParams:
    """OpRule.params of a reduction (Sum, Mean, ArgMax...): its reduced dims, sorted."""

    axes: tuple


def _axes(ctx, i, rank):
    value = ctx.const(i)
    if value is None:
        return None
    return sorted({int(a) % rank for a in np.atleast_1d(value)})


def reduction(ctx, reduce_op):
    """Sum/Mean/Max/...: reduced dims are REDUCE factors."""
    shape = ctx.in_shapes[0]
    axes = _axes(ctx, 1, len(shape))
    if axes is None:
        return None
    letters = _letters(len(shape))
    keep = ctx.node.attr("keep_dims")
    out = "".join(l for d, l in enumerate(letters) if d not in axes or keep)
    rule = einsum_rule(f"{letters}->{out}", [shape], ctx.out_shapes[0], reduce_op)
    if keep:  # kept reduced dims have size 1 in the result: no factor there
        rule.results[0] = tuple(() if d in axes else f for d, f in enumerate(rule.results[0]))
        for d in axes:
            if shape[d] > 1:
                rule.factor_kinds[rule.operands[0][d][0]] = REDUCE
    rule.operands.append(None)
    rule.params = ReductionParams(tuple(axes))
    return rule


def arg_reduction(ctx):
    """ArgMax/ArgMin: the reduced dim may be split (the handler combines (value, index))."""
    shape = ctx.in_shapes[0]
    axes = _axes(ctx, 1, len(shape))
    if axes is None:
        return None
    letters = _letters(len(shape))
    out = "".join(l for d, l in enumerate(letters) if d not in axes)
    rule = einsum_rule(f"{letters}->{out}", [shape], ctx.out_shapes[0], "arg")
    rule.operands.append(None)
    rule.params = ReductionParams(tuple(axes))
    return rule


def last_dim_normalizer(ctx):
    """Softmax/LogSoftmax: elementwise, the last dim reduced inside the handler."""
    return elementwise(ctx)


def cross_entropy(ctx, sparse):
    """(Sparse)SoftmaxCrossEntropyWithLogits: loss [B], backprop [B, C]."""
    b, c = ctx.in_shapes[0]
    labels = "b" if sparse else "bc"
    rule = einsum_rule(f"bc,{labels}->bc", ctx.in_shapes, (b, c))
    loss_dims = rule.results[0][:1]
    rule.results = [loss_dims, rule.results[0]]
    return rule


def transpose(ctx):
    """Transpose by a constant permutation."""
    perm = ctx.const(1)
    if perm is None:
        return None
    letters = _letters(len(ctx.in_shapes[0]))
    rule = einsum_rule(f"{letters}->{''.join(letters[p] for p in perm)}",
                       ctx.in_shapes[:1], ctx.out_shapes[0])
    rule.operands.append(None)
    return rule


def reshape(ctx, data_inputs=(0,)):
    """Reshape (also ExpandDims, Squeeze): dims split into common sub-factors.

    Where the Reshape merges a dim with the dims after it, an uneven split of the major
    dim cannot be a sub-factor of the merged dim, but the Reshape's handler re-blocks the
    merged dim exactly (spmd/handlers/reshape.py); `uneven_major` lets propagation carry
    such a split forward, from the operand to the result, so the merged dim keeps it.
    Not backward (a free operand's producer is often sliced from a replicated tensor for
    nothing, where the re-block would add a collective-permute), and not into the
    reverse reshape's unevenly split major dim (its padded blocks cost more to gather
    later than the even operand; docs/DESIGN_LOG.md, "Merging reshapes with free
    results")."""
    rule = OpRule()
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    in_dims, out_dims = reshape_factors(rule, in_shape, out_shape)
    rule.operands = _spread([in_dims], data_inputs, len(ctx.in_shapes))
    rule.results = [out_dims]
    rule.uneven_major = tuple((0, d) for d in merge_dims(in_shape, out_shape)
                              if len(out_dims[d]) > 1 and in_shape[d] > 1)
    return rule


def merge_dims(wide_shape, narrow_shape):
    """The dims d at which `narrow_shape` is `wide_shape` with dims [d, d + m) merged
    into one, m = len(wide_shape) - len(narrow_shape) + 1 >= 2, every other dim equal
    (several when size-1 dims make the place ambiguous; none when not such a merge)."""
    wide, narrow = tuple(wide_shape), tuple(narrow_shape)
    merged = len(wide) - len(narrow) + 1
    if merged < 2:
        return []
    return [d for d in range(len(narrow))
            if wide[:d] == narrow[:d] and wide[d + merged:] == narrow[d + 1:]]


def reshape_factors(rule, in_shape, out_shape):
    """Sub-factors shared by the dims of two shapes of equal size.

    Both shapes index the same flat array. A factor is shared only where it is the same
    digit of the flat index in both: the same size and the same product of everything
    major to it. Walking both shapes major to minor, the gcd of what is left of the
    current dims is such a digit while the walk is aligned. Where the dims share nothing
    (gcd 1), the shapes regroup the flat index differently: what is left of each dim up
    to the next point where the products of whole dims meet again is REPLICATE. A tensor
    without elements has no data to split: its dims are all REPLICATE.
    """
    in_dims = [[] for _ in in_shape]
    out_dims = [[] for _ in out_shape]
    if 0 in in_shape or 0 in out_shape:
        for dims, shape in ((in_dims, in_shape), (out_dims, out_shape)):
            for dim, size in zip(dims, shape):
                if size > 1:
                    dim.append(rule.add_factor(size, REPLICATE))
        return tuple(map(tuple, in_dims)), tuple(map(tuple, out_dims))
    walk_in, walk_out = _DimWalk(in_shape, in_dims), _DimWalk(out_shape, out_dims)
    aligned = True
    while walk_in.more() and walk_out.more():
        if aligned:
            g = int(np.gcd(walk_in.left, walk_out.left))
            if g > 1:
                f = rule.add_factor(g)
                walk_in.take(f, g)
                walk_out.take(f, g)
                continue
            aligned = False
        # misaligned: replicate the rest of the dim that ends first (both on a tie)
        end_in, end_out = walk_in.dim_end(), walk_out.dim_end()
        if end_in <= end_out:
            walk_in.take(rule.add_factor(walk_in.left, REPLICATE), walk_in.left)
        if end_out <= end_in:
            walk_out.take(rule.add_factor(walk_out.left, REPLICATE), walk_out.left)
        aligned = end_in == end_out
    return tuple(map(tuple, in_dims)), tuple(map(tuple, out_dims))


class _DimWalk:
    """A walk over a shape's dims major to minor, taking sub-factors of the current dim
    (size-1 dims skipped); `left` is what is left of the current dim."""

    def __init__(self, shape, dims):
        self.shape, self.dims = shape, dims
        self.dim, self.done = -1, 1  # `done`: product of everything taken
        self.left = 1
        self._skip_finished()

    def _skip_finished(self):
        while self.left == 1 and self.dim + 1 < len(self.shape):
            self.dim += 1
            self.left = self.shape[self.dim]

    def more(self):
        """True while something is left to take."""
        return self.left > 1

    def dim_end(self):
        """Product of everything up to the end of the current dim."""
        return self.done * self.left

    def take(self, factor, size):
        """Give the current dim its next sub-factor, of `size`."""
        self.dims[self.dim].append(factor)
        self.left //= size
        self.done *= size
        self._skip_finished()


def per_dim(ctx, replicate_dims, data_inputs=(0,), result_rank_source=0):
    """Same-rank op whose `replicate_dims` must be whole (concat axis, padded dims...)."""
    out = ctx.out_shapes[0]
    rule = OpRule()
    dims_out = []
    dims_in = [[] for _ in data_inputs]
    for d, size in enumerate(out):
        if d in replicate_dims:
            for k, i in enumerate(data_inputs):
                dims_in[k].append((rule.add_factor(ctx.in_shapes[i][d], REPLICATE),)
                                  if ctx.in_shapes[i][d] > 1 else ())
            dims_out.append((rule.add_factor(size, REPLICATE),) if size > 1 else ())
            continue
        f = rule.add_factor(size) if size > 1 else None
        dims_out.append((f,) if f is not None else ())
        for k, i in enumerate(data_inputs):
            dims_in[k].append((f,) if f is not None and ctx.in_shapes[i][d] == size else ())
    rule.operands = _spread([tuple(d) for d in dims_in], data_inputs, len(ctx.in_shapes))
    rule.results = [tuple(dims_out)]
    return rule


def concat(ctx):
    """ConcatV2: the concat axis is whole; other dims pass."""
    n = len(ctx.in_shapes) - 1
    axis = ctx.const(n)
    if axis is None:
        return None
    axis = int(axis) % len(ctx.out_shapes[0])
    return per_dim(ctx, {axis}, data_inputs=tuple(range(n)))


def changed_dims(ctx):
    """Dims where output and input sizes differ (Slice, StridedSlice, Pad, Tile)."""
    return {d for d, (a, b) in enumerate(zip(ctx.in_shapes[0], ctx.out_shapes[0])) if a != b}


def same_rank_slicing(ctx):
    """Tile/MirrorPad (and Slice/Pad with non-constant bounds) of the same rank:
    changed dims whole."""
    if len(ctx.in_shapes[0]) != len(ctx.out_shapes[0]):
        return None
    return per_dim(ctx, changed_dims(ctx))


def pad_or_slice(ctx, kind):
    """Slice ("slice"), Pad or PadV2 ("pad") x -> y by constant bounds: each dim a
    stride-1 window of 1 element (see _sliced_factors), `pad_lo` = -begin for a slice.
    Without constant bounds (or a PadV2's value) the changed dims stay whole."""
    x, y = ctx.in_shapes[0], ctx.out_shapes[0]
    bounds = ctx.const(1)
    dims = tuple(range(len(x)))
    value_unknown = len(ctx.in_shapes) > 2 and ctx.const(2) is None  # a PadV2's value
    if len(x) != len(y) or bounds is None or value_unknown:
        rule = same_rank_slicing(ctx)
        if rule is not None:
            rule.params = SliceParams(dims, dims)
        return rule
    bounds = np.asarray(bounds, np.int64).reshape(len(x), -1)
    lows = -bounds[:, 0] if kind == "slice" else bounds[:, 0]
    rule = OpRule()
    dims_x, dims_y, windows = _sliced_factors(rule, x, y, dims, dims, [1] * len(x), lows)
    rule.params = SliceParams(dims, dims, windows)
    rule.operands = _spread([dims_x], (0,), len(ctx.in_shapes))
    rule.results = [dims_y]
    return rule


@dataclass(frozen=True)
class SliceParams:
    """OpRule.params of StridedSlice(Grad), its masks normalized: `kept` has, per dim of
    the slice, the dim of the sliced tensor it is (None for a new axis); `spec` has, per
    dim of the sliced tensor, its entry in begin/end/strides (None for a dim taken whole:
    inside the ellipsis or past the spec)."""

    kept: tuple
    spec: tuple
    windows: tuple = ()  # windowed.SpatialDim of each dim that may stay split (halos)


def strided_slice_params(node, rank, spec_len):
    """StridedSlice(Grad)'s ellipsis, new-axis and shrink masks as SliceParams for a
    sliced tensor of rank `rank` and a begin/end/strides spec of `spec_len` entries.

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
    return SliceParams(tuple(kept), tuple(spec))


def _sliced_factors(rule, x, y, kept, spec, strides, lows=None):
    """Dims of a tensor x and of its slice (or padding) y: y dim j is x dim kept[j], or a
    new axis where that is None; x dim d has entry spec[d] (None: taken whole) in
    `strides` and `lows` (its first element read, negated: the low padding; None when
    unknown: changed dims stay whole).

    A kept dim of unchanged size and stride 1 passes. A kept dim whose size changes,
    with a positive stride and both sizes above 1, is a window of one element (stride,
    padding from lows): one factor shared by x and y, PASS-like as a convolution's
    spatial dims are (split x -> split y; the handler exchanges the halos each result
    block needs with its neighbours); its SpatialDim is returned in `windows`. Other
    dims (shrunk, negative strides, size 1) stay whole.
    Returns (dims of x, dims of y, windows)."""
    from gspmd_tf.propagation.windowed import SpatialDim  # windowed imports this module
    at = {d: j for j, d in enumerate(kept) if d is not None}
    dims_x, dims_y, windows = [], [()] * len(y), []
    for d, n in enumerate(x):
        j = at.get(d)
        stride = 1 if spec[d] is None else int(strides[spec[d]])
        if j is not None and n == y[j] and stride == 1 and n > 1:
            dims_x.append((rule.add_factor(n),))
            dims_y[j] = dims_x[d]
        elif j is not None and lows is not None and stride > 0 and n > 1 and y[j] > 1:
            lo = int(lows[spec[d]]) if spec[d] is not None else 0
            hi = (y[j] - 1) * stride + 1 - n - lo
            dims_x.append((rule.add_factor(max(n, y[j])),))
            dims_y[j] = dims_x[d]
            windows.append(SpatialDim(d, j, int(n), int(y[j]), 1, stride, 1, lo, hi))
        else:
            dims_x.append((rule.add_factor(n, REPLICATE),) if n > 1 else ())
    for j, n in enumerate(y):
        if n > 1 and not dims_y[j]:
            dims_y[j] = (rule.add_factor(n, REPLICATE),)
    return tuple(dims_x), tuple(dims_y), tuple(windows)


def strided_slice(ctx):
    """StridedSlice x -> y (see _sliced_factors); the first element read on each dim is
    worked out as TF does (masks, negative and out-of-range bounds)."""
    x = ctx.in_shapes[0]
    params = strided_slice_params(ctx.node, len(x), ctx.in_shapes[1][0])
    strides = ctx.const(3)
    if strides is None:
        return None
    strides = np.atleast_1d(strides)
    begin = ctx.const(1)
    lows = None if begin is None else -_first_read(ctx.node, x, params, begin, strides)
    rule = OpRule()
    dims_x, dims_y, windows = _sliced_factors(rule, x, ctx.out_shapes[0], params.kept,
                                              params.spec, strides, lows)
    rule.params = SliceParams(params.kept, params.spec, windows)
    rule.operands = [dims_x, None, None, None]
    rule.results = [dims_y]
    return rule


def _first_read(node, x, params, begin, strides):
    """Per spec entry, the index of x a StridedSlice reads first on that dim (as TF
    clamps begin: begin_mask, negative and out-of-range begins)."""
    begin_mask = node.attr("begin_mask") or 0
    first = np.zeros(len(strides), np.int64)
    for d, s in enumerate(params.spec):
        if s is None or strides[s] <= 0:
            continue
        b = 0 if begin_mask >> s & 1 else int(np.atleast_1d(begin)[s])
        first[s] = min(max(b + x[d] if b < 0 else b, 0), x[d])
    return first


@dataclass(frozen=True)
class GatherParams:
    """OpRule.params of GatherV2/ResourceGather: the gathered table dim, and how many
    leading dims table and indices share (batch_dims)."""

    axis: int
    batch_dims: int


def gather(ctx):
    """GatherV2/ResourceGather: indices dims and the table's other dims pass; the gathered
    table dim is REDUCE (masked local lookup, then all-reduce of the partial result).
    The first batch_dims dims of table and indices are one PASS factor each, shared with
    the result: a parallel gather, each device looking up its own batch, as XLA does."""
    table, indices = ctx.in_shapes[0], ctx.in_shapes[1]
    batch_dims = ctx.node.attr("batch_dims") or 0
    if batch_dims < 0:
        batch_dims += len(indices)
    if ctx.node.op == "ResourceGather":  # gathers the first dim after the batch
        axis = batch_dims
    else:
        axis = ctx.const(2)
        if axis is None:
            return None
        axis = int(axis) % len(table)
    if not 0 <= batch_dims <= min(axis, len(indices)):
        return None
    t = _letters(len(table))
    ind = t[:batch_dims] + _letters(len(indices) - batch_dims, len(table))
    out = t[:axis] + ind[batch_dims:] + t[axis + 1:]
    rule = einsum_rule(f"{t},{ind}->{out}", [table, indices], ctx.out_shapes[0])
    rule.operands += [None] * (len(ctx.in_shapes) - 2)
    rule.params = GatherParams(axis, batch_dims)
    return rule


def one_hot(ctx):
    """OneHot: indices dims pass; the new depth dim is a fresh factor."""
    out = ctx.out_shapes[0]
    axis = ctx.node.attr("axis")
    axis = len(out) - 1 if axis == -1 else axis
    ind = _letters(len(ctx.in_shapes[0]))
    out_letters = ind[:axis] + "Z" + ind[axis:]
    rule = einsum_rule(f"{ind}->{out_letters}", ctx.in_shapes[:1], out)
    rule.operands += [None, None, None]
    return rule


def source(ctx):
    """Const/Fill and other sources: every result dim a free factor."""
    rule = OpRule()
    rule.operands = [None] * len(ctx.in_shapes)
    for shape in ctx.out_shapes[:1]:
        rule.results.append(tuple((rule.add_factor(s),) if s > 1 else () for s in shape))
    return rule


def variable_update(ctx):
    """Reads, assigns and fused optimizer updates of a variable (its handle has the
    variable's shape in the IR): every input of that shape shares its factors;
    scalars (learning rate, betas...) are not data."""
    shape = ctx.in_shapes[0]
    letters = _letters(len(shape))
    data = [i for i, s in enumerate(ctx.in_shapes) if s == shape]
    out = ctx.out_shapes[0] if ctx.out_shapes else shape
    rule = einsum_rule(",".join([letters] * len(data)) + "->" + letters,
                       [shape] * len(data), out)
    rule.operands = _spread(rule.operands, data, len(ctx.in_shapes))
    if not ctx.out_shapes:
        rule.results = []
    return rule


def bitcast(ctx):
    """Bitcast: the dims both sides have pass; the minor dim a bitcast to a narrower type
    adds (or to a wider one removes) is in one tensor only and stays whole."""
    x, y = ctx.in_shapes[0], ctx.out_shapes[0]
    rule = OpRule()
    shared = tuple((rule.add_factor(n),) if n > 1 else () for n in x[:min(len(x), len(y))])

    def whole(shape):
        return tuple((rule.add_factor(n, REPLICATE),) if n > 1 else ()
                     for n in shape[len(shared):])
    rule.operands = [shared + whole(x)]
    rule.results = [shared + whole(y)]
    return rule


def squeeze_or_expand(ctx):
    """ExpandDims/Squeeze are reshapes of size-1 dims."""
    return reshape(ctx)


# ------------------------------------------------------------------ gradient-side ops
# Ops TF's gradient code emits (besides elementwise *Grad ops, served by elementwise).


def bias_add_grad(ctx):
    """BiasAddGrad: sums every dim but the channel (a REDUCE factor each)."""
    rank = len(ctx.in_shapes[0])
    letters = _letters(rank)
    channel = 1 if ctx.node.attr("data_format") == "NCHW" else rank - 1
    return einsum_rule(f"{letters}->{letters[channel]}", ctx.in_shapes, ctx.out_shapes[0])


def broadcast_to(ctx):
    """BroadcastTo: a broadcasting elementwise op of its one data input."""
    return elementwise(ctx, data_inputs=(0,))


def tile(ctx):
    """Tile by constant multiples: a dim tiled from size 1 broadcasts (a result-only
    factor, split freely: each device tiles its block); an untiled dim passes; a dim
    tiled from a larger size stays whole."""
    multiples = ctx.const(1)
    if multiples is None:
        return same_rank_slicing(ctx)
    rule = OpRule()
    dims_in, dims_out = [], []
    for n, m in zip(ctx.in_shapes[0], ctx.out_shapes[0]):
        if n == m or n == 1:
            f = rule.add_factor(m) if m > 1 else None
            dims_out.append((f,) if f is not None else ())
            dims_in.append((f,) if f is not None and n == m else ())
        else:
            dims_in.append((rule.add_factor(n, REPLICATE),))
            dims_out.append((rule.add_factor(m, REPLICATE),))
    rule.operands = [tuple(dims_in), None]
    rule.results = [tuple(dims_out)]
    return rule


def strided_slice_grad(ctx):
    """StridedSliceGrad: dy (the slice's shape) scattered into zeros of x's shape; the
    factors of the forward slice (see _sliced_factors). A dim sliced with stride 1 is a
    pad of dy (low padding: the first element the slice read) and may stay split, its
    window read from dy; dims with other strides stay whole."""
    from gspmd_tf.propagation.windowed import SpatialDim  # windowed imports this module
    x = ctx.out_shapes[0]
    params = strided_slice_params(ctx.node, len(x), ctx.in_shapes[1][0])
    strides, begin = ctx.const(3), ctx.const(1)
    if strides is None or begin is None or ctx.const(2) is None:
        return None
    strides = np.atleast_1d(strides)
    unit = np.where(strides == 1, 1, 0)  # other strides: whole (not windows of dy)
    lows = -_first_read(ctx.node, x, params, begin, unit)
    rule = OpRule()
    dims_x, dims_dy, windows = _sliced_factors(rule, x, ctx.in_shapes[4], params.kept,
                                               params.spec, unit, lows)
    windows = tuple(SpatialDim(w.y_dim, w.x_dim, w.out, w.n, 1, 1, 1, -w.pad_lo, -w.pad_hi)
                    for w in windows)
    rule.params = SliceParams(params.kept, params.spec, windows)
    rule.operands = [None, None, None, None, dims_dy]
    rule.results = [dims_x]
    return rule


def unsorted_segment(ctx, reduce_op):
    """UnsortedSegmentSum/Max/Min/Prod: data [N..., D...], segment_ids [N...] ->
    [num_segments, D...]. The segment dims N are REDUCE (partial result); D pass; the
    segment dim of the result is a factor of its own (each device keeps the segments of
    its block)."""
    data, ids = ctx.in_shapes[0], ctx.in_shapes[1]
    letters = _letters(len(data) + 1)
    seg = letters[-1]
    out = seg + letters[len(ids):len(data)]
    rule = einsum_rule(f"{letters[:len(data)]},{letters[:len(ids)]}->{out}",
                       [data, ids], ctx.out_shapes[0], reduce_op)
    rule.operands.append(None)
    return rule


def select_v1(ctx):
    """Select: a vector condition picks rows (the first dim) of higher-rank operands;
    otherwise elementwise like SelectV2."""
    cond, x = ctx.in_shapes[0], ctx.in_shapes[1]
    if len(cond) != 1 or len(x) <= 1:
        return elementwise(ctx)
    letters = _letters(len(x))
    return einsum_rule(f"{letters[0]},{letters},{letters}->{letters}", ctx.in_shapes,
                       ctx.out_shapes[0])


# ------------------------------------------------------- structure: several tensors
# Ops that hand dims through between several operands or results (IdentityN, Split,
# Pack...): a dim they cut, stack or index stays whole, every other dim passes.


def _passing(rule, shape):
    """A fresh PASS factor per dim of `shape` (none for size-1 dims)."""
    return tuple((rule.add_factor(n),) if n > 1 else () for n in shape)


def _whole(rule, n):
    """The dims of a dim of size `n` that stays whole (a REPLICATE factor)."""
    return (rule.add_factor(n, REPLICATE),) if n > 1 else ()


def identity_n(ctx):
    """IdentityN: each result is its operand."""
    rule = OpRule()
    for shape in ctx.in_shapes:
        dims = _passing(rule, shape)
        rule.operands.append(dims)
        rule.results.append(dims)
    return rule


def split(ctx, value_input, axis_input):
    """Split/SplitV: the split axis whole (in the operand and every piece); other dims
    pass."""
    axis = ctx.const(axis_input)
    if axis is None:
        return None
    x = ctx.in_shapes[value_input]
    axis = int(axis) % len(x)
    rule = OpRule()
    dims = list(_passing(rule, x[:axis] + (1,) + x[axis + 1:]))
    dims[axis] = _whole(rule, x[axis])
    rule.operands = _spread([tuple(dims)], (value_input,), len(ctx.in_shapes))
    for shape in ctx.out_shapes:
        dims[axis] = _whole(rule, shape[axis])
        rule.results.append(tuple(dims))
    return rule


def pack(ctx):
    """Pack (tf.stack): the new dim whole (each device holds every operand); the others
    pass, shared by all operands."""
    out = ctx.out_shapes[0]
    axis = ctx.node.attr("axis") % len(out)
    rule = OpRule()
    dims = _passing(rule, out[:axis] + out[axis + 1:])
    rule.operands = [dims] * len(ctx.in_shapes)
    rule.results = [dims[:axis] + (_whole(rule, out[axis]),) + dims[axis:]]
    return rule


def unpack(ctx):
    """Unpack (tf.unstack): the removed dim whole; the others pass, shared by all
    results."""
    x = ctx.in_shapes[0]
    axis = ctx.node.attr("axis") % len(x)
    rule = OpRule()
    dims = _passing(rule, x[:axis] + x[axis + 1:])
    rule.operands = [dims[:axis] + (_whole(rule, x[axis]),) + dims[axis:]]
    rule.results = [dims] * len(ctx.out_shapes)
    return rule


def last_dims_whole(ctx, count):
    """Ops that mix the last `count` dims (MatrixBandPart: 2, TopKV2: 1): those whole,
    batch dims pass; every result (TopKV2's values and indices) shares the rule's."""
    rank = len(ctx.in_shapes[0])
    rule = per_dim(ctx, set(range(rank - count, rank)))
    rule.results *= len(ctx.out_shapes)
    return rule


def cumulative(ctx):
    """Cumsum/Cumprod along a constant axis: that axis whole, the others pass."""
    axis = ctx.const(1)
    if axis is None:
        return None
    return per_dim(ctx, {int(axis) % len(ctx.in_shapes[0])})


@dataclass(frozen=True)
class RollParams:
    """OpRule.params of Roll: per rolled dim, its net shift in [1, n) as (dim, shift)
    pairs (TF adds the shifts of an axis named twice; a shift of a multiple of n is no
    roll and left out)."""

    shifts: tuple


def roll(ctx):
    """Roll with constant shift and axis: every dim passes, a rolled one too (a cyclic
    shift of a split dim is a collective-permute of blocks: handlers/roll.py). Without
    a constant axis the op has no rule; without a constant shift the axes stay whole."""
    x = ctx.in_shapes[0]
    axis, shift = ctx.const(2), ctx.const(1)
    if axis is None:
        return None
    axes = [int(a) % len(x) for a in np.atleast_1d(axis)]
    if shift is None:
        return per_dim(ctx, set(axes))
    net = {}
    for a, s in zip(axes, np.broadcast_to(np.atleast_1d(shift), (len(axes),))):
        # an empty dim has nothing to roll (TF accepts any shift of it)
        net[a] = (net.get(a, 0) + int(s)) % x[a] if x[a] else 0
    rule = per_dim(ctx, set())
    rule.params = RollParams(tuple(sorted((a, s) for a, s in net.items() if s)))
    return rule


def _nd_indexed(rule, indices, table, batch_kind, indexed_kind=REPLICATE):
    """Dims of a GatherNd/ScatterNd's indices [B..., K] and of its indexed tensor: the
    index batch dims B are factors of `batch_kind`, K whole, the K indexed dims of the
    tensor of `indexed_kind`, its trailing dims pass (shared with the slices). Returns
    (index dims, tensor dims, batch dims, trailing dims)."""
    k = indices[-1]
    batch = tuple((rule.add_factor(n, batch_kind),) if n > 1 else () for n in indices[:-1])
    index_dims = batch + (_whole(rule, k),)
    indexed = tuple((rule.add_factor(n, indexed_kind),) if n > 1 else () for n in table[:k])
    trailing = _passing(rule, table[k:])
    return index_dims, indexed + trailing, batch, trailing


def gather_nd(ctx):
    """GatherNd params [P...], indices [B..., K] -> [B..., P[K:]]: index batch dims pass,
    the trailing params dims pass; the K indexed params dims are REDUCE (split: a masked
    local lookup, partial results summed, as GatherV2's gathered dim)."""
    rule = OpRule()
    index_dims, params_dims, batch, trailing = _nd_indexed(
        rule, ctx.in_shapes[1], ctx.in_shapes[0], PASS, REDUCE)
    rule.operands = [params_dims, index_dims]
    rule.results = [batch + trailing]
    return rule


def scatter_nd(ctx, indices_input, batch_kind):
    """ScatterNd (indices, updates, shape) and TensorScatter* (tensor, indices, updates):
    updates [B..., S[K:]] go to the K indexed dims of a result of shape S. The index batch
    dims B are `batch_kind`: REDUCE where scattered sums add up (split: partial results),
    REPLICATE where a later update overwrites an earlier one. The K indexed dims stay whole,
    the trailing dims pass."""
    rule = OpRule()
    out = ctx.out_shapes[0]
    index_dims, out_dims, batch, trailing = _nd_indexed(
        rule, ctx.in_shapes[indices_input], out, batch_kind)
    operands = [None] * len(ctx.in_shapes)
    operands[indices_input] = index_dims
    operands[indices_input + 1] = batch + trailing  # updates
    if indices_input == 1:  # TensorScatter*: the tensor written into
        operands[0] = out_dims
    rule.operands = operands
    rule.results = [out_dims]
    return rule


@dataclass(frozen=True)
class BatchNormParams:
    """OpRule.params of FusedBatchNormV3 and its gradient: the channel dim of x."""

    channel: int


def fused_batch_norm(ctx, x_input, channel_inputs):
    """FusedBatchNormV3 (x, scale, offset, mean, variance) and FusedBatchNormGradV3 (dy,
    x, scale, reserve_space_1/2/3): every dim of x passes (and of dy, y, dx); the per-
    channel inputs (at `channel_inputs`; x at `x_input`) and results share the channel
    factor. The handler combines the moments and
    the gradient sums over split batch or spatial dims itself; empty per-channel inputs
    (an unused mean) and the scratch reserve spaces have no factor."""
    x = ctx.in_shapes[x_input]
    fmt = ctx.node.attr("data_format") or "NHWC"
    channel = 1 if fmt.startswith("NC") else len(x) - 1
    rule = OpRule(params=BatchNormParams(channel))
    dims = _passing(rule, x)

    def of_channel(shape):
        return (dims[channel],) if shape == (x[channel],) else tuple(() for _ in shape)
    rule.operands = [dims if shape == x else of_channel(shape) if i in channel_inputs
                     else tuple(() for _ in shape) for i, shape in enumerate(ctx.in_shapes)]
    rule.results = [dims] + [of_channel(shape) for shape in ctx.out_shapes[1:]]
    return rule


def equation_rule(ctx, equation):
    """A fixed einsum equation over the op's first inputs (as many as it has terms); the
    other inputs are not data (a user's rule given as a string, gt.register_op)."""
    n = equation.split("->")[0].count(",") + 1
    rule = einsum_rule(equation, ctx.in_shapes[:n], ctx.out_shapes[0])
    rule.operands += [None] * (len(ctx.in_shapes) - n)
    return rule


@dataclass(frozen=True)
class TensorListParams:
    """What a TensorList op's emitter needs: the input holding the element_shape (None
    when the op has none), and the global element shape with its dims' factors."""

    shape_input: object
    element_shape: tuple
    element_dims: tuple


def tensor_list(ctx, elements_in, stacked_in, elements_out, stacked_out, shape_input):
    """TensorList ops. In the IR a list has the shape of its elements
    (graph/tensor_lists.py): the lists and elements listed in `elements_in` /
    `elements_out` share a PASS factor per element dim; the tensors in `stacked_in` /
    `stacked_out` are [list length] + element shape, the length dim whole (a list is
    never split along its index). Other inputs are not data, other outputs have no
    factor. None when the shapes disagree (a list whose element shape is unknown)."""
    shapes = ([ctx.in_shapes[i] for i in elements_in]
              + [ctx.out_shapes[k] for k in elements_out])
    stacked = [ctx.in_shapes[i] for i in stacked_in] + [ctx.out_shapes[k] for k in stacked_out]
    element = tuple(shapes[0]) if shapes else tuple(stacked[0][1:])
    if any(tuple(s) != element for s in shapes) or \
            any(len(s) != len(element) + 1 or tuple(s[1:]) != element for s in stacked):
        return None
    rule = OpRule()
    dims = _passing(rule, element)
    rule.params = TensorListParams(shape_input, element, dims)

    def tensor_dims(i, shape, as_elements, as_stacked):
        if i in as_elements:
            return dims
        if i in as_stacked:
            return (_whole(rule, shape[0]),) + dims
        return None
    rule.operands = [tensor_dims(i, s, elements_in, stacked_in)
                     for i, s in enumerate(ctx.in_shapes)]
    rule.results = [tensor_dims(k, s, elements_out, stacked_out) or tuple(() for _ in s)
                    for k, s in enumerate(ctx.out_shapes)]
    return rule
