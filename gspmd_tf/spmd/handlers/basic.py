"""Handlers for ops that need no more than adjusted shape arguments."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.propagation import rules
from gspmd_tf.propagation.rules import REDUCE
from gspmd_tf.registry import (DOT, INTEGER_DIVISION, RANDOM_NUMERICS, always, declare,
                               on_integers, op_def, op_family)
from gspmd_tf.spmd.local_ops import cast, identity_of, mask_padding
from gspmd_tf.spmd.program import Local


def local_shapes(ctx, layouts):
    """Local shapes of the node's results under `layouts`."""
    return [ctx.local_shape(layout, k) for k, layout in enumerate(layouts)]


def any_padded(ctx, operands):
    """Whether a data operand of the op (Locals `operands`) has padded shards."""
    padded = ctx.p.padded
    return any(dims is not None and padded(x)
               for x, dims in zip(operands, ctx.rule.operands))


def masked_refs(ctx, operands):
    """Operand refs with the padding of split, uneven REDUCE dims set to the identity of
    the reduction, so padding never reaches a result; and the padding of inputs the op
    checks (the op registry's safe_padding) set to a harmless value."""
    rule = ctx.rule
    if not any_padded(ctx, operands):
        return [x.ref for x in operands]  # the common case: no shard has padding
    reduce_op = {"arg": "max"}.get(rule.reduce_op, rule.reduce_op)
    safe = dict(op_def(ctx.node.op).safe_padding)
    refs = []
    for i, (x, dims) in enumerate(zip(operands, rule.operands)):
        if dims is None:
            refs.append(x.ref)
            continue
        masked = [d for d, fs in enumerate(dims)
                  if any(rule.factor_kinds[f] == REDUCE and ctx.factor_axes[f] for f in fs)]
        ref = (mask_padding(ctx.b, x, masked, identity_of(reduce_op, x.dtype))
               if masked else x.ref)
        if i in safe:
            checked = [d for d, axes in enumerate(x.layout.dims) if axes and d not in masked]
            ref = mask_padding(ctx.b, x._replace(ref=ref), checked, safe[i])
        refs.append(ref)
    return refs


def replay(ctx, operands, layouts, attrs=None, refs=None):
    """Re-create the op on the local operands."""
    refs = masked_refs(ctx, operands) if refs is None else refs
    return ctx.b.replay(ctx.node, refs, local_shapes(ctx, layouts), ctx.node.out_dtypes,
                        attrs)


@op_family(["XlaSharding", "EnsureShape"], rules.elementwise)
def as_identity(ctx, operands, layouts):
    """XlaSharding (only an annotation) and EnsureShape (the global shape is known and
    checked when the graph is imported): locally an Identity (so is a Squeeze of no
    dims of size 1)."""
    dtype = ctx.node.out_dtypes[0]
    return [ctx.b.op("Identity", [operands[0].ref], local_shapes(ctx, layouts)[0], dtype,
                     name=ctx.node.name, T=dtype)]


def with_local_shape_input(position):
    """Ops whose input `position` is the output shape (Reshape, Fill): give the local one."""
    def emit(ctx, operands, layouts):
        refs = masked_refs(ctx, operands)
        shape = local_shapes(ctx, layouts)[0]
        dtype = ctx.node.attrs.get("Tshape") or ctx.node.attrs.get("index_type")
        np_dtype = np.int64 if dtype is not None and dtype.type == tf.int64.as_datatype_enum \
            else np.int32
        refs[position] = ctx.b.const(np.asarray(shape, np_dtype))
        return replay(ctx, operands, layouts, refs=refs)
    return emit


@op_family("Squeeze", rules.squeeze_or_expand)
def squeeze(ctx, operands, layouts):
    """Squeeze the dims of size 1 in the global shape, named explicitly: a split dim
    can be size 1 in a shard only (6 split over 8)."""
    shape = ctx.inputs[0].shape
    dims = ctx.node.attr("squeeze_dims") or [d for d, n in enumerate(shape) if n == 1]
    if not dims:  # TF's Squeeze of no named dims squeezes every dim of size 1 in a shard
        return as_identity(ctx, operands, layouts)
    return replay(ctx, operands, layouts,
                  attrs={"squeeze_dims": sorted(int(d) % len(shape) for d in dims)})


# stateless random ops of a shape and a seed (key, counter, algorithm; bounds or
# distribution parameters; StatelessMultinomial: logits, StatelessShuffle: the value):
# the same inputs give the same numbers, so every device draws the whole tensor from its
# replicated inputs and keeps its slice
STATELESS_RANDOM = """StatelessRandomUniform StatelessRandomNormal StatelessTruncatedNormal
StatelessRandomUniformInt StatelessRandomUniformFullInt StatelessRandomUniformV2
StatelessRandomNormalV2 StatelessTruncatedNormalV2 StatelessRandomUniformIntV2
StatelessRandomUniformFullIntV2 StatelessRandomBinomial StatelessRandomGammaV2
StatelessRandomGammaV3 StatelessRandomPoisson StatelessParameterizedTruncatedNormal
StatelessMultinomial StatelessShuffle""".split()


# stateful random ops (tf.random.uniform / normal / truncated_normal, tf.nn.dropout): an
# op seed makes a kernel's stream deterministic, one draw after another, so every
# device's kernel, seeded the same and drawing the whole tensor each step, draws what
# the single-device kernel draws
STATEFUL_RANDOM = ["RandomUniform", "RandomStandardNormal", "TruncatedNormal",
                   "RandomUniformInt"]


# the other random ops (no rule: they run replicated, drawing what one device draws) and
# a random op's seed machinery (key, counter and algorithm: XLA's default algorithm is
# not TF's kernel's)
OTHER_RANDOM = """Multinomial ParameterizedTruncatedNormal RandomCrop RandomGamma
RandomGammaGrad RandomIndexShuffle RandomPoisson RandomPoissonV2 RandomShuffle
StatefulRandomBinomial StatefulTruncatedNormal StatelessRandomGetAlg
StatelessRandomGetKeyCounter StatelessRandomGetKeyCounterAlg""".split()
declare(OTHER_RANDOM, xla_numerics=always(RANDOM_NUMERICS))


@op_family("Const", rules.source)
@op_family(STATELESS_RANDOM, rules.source, xla_numerics=always(RANDOM_NUMERICS))
def whole_then_sliced(ctx, operands, layouts, attrs=None):
    """A constant, or a stateless random tensor: the whole value (its other inputs
    replicated), then this device's slice of it (no communication). A random tensor's
    slice is what the single-device program draws there, at the cost of drawing the
    whole tensor on every device. `attrs` override the node's."""
    b = ctx.b
    node = ctx.node
    ref = b.replay(node, [x.ref for x in operands], [node.out_shapes[0]], node.out_dtypes,
                   attrs)[0]
    whole = Local(ref, Layout.replicated(len(node.out_shapes[0])), node.out_shapes[0],
                  node.out_dtypes[0])
    return [ctx.reshard(whole, layouts[0]).ref]


@op_family(STATEFUL_RANDOM, rules.source, xla_numerics=always(RANDOM_NUMERICS))
def seeded_whole_then_sliced(ctx, operands, layouts):
    """A stateful random tensor drawn whole on every device, then sliced, as
    whole_then_sliced. Without a seed (seed and seed2 0) TF seeds each kernel at random,
    so the devices could draw different tensors; they get one random seed pair, drawn
    here, instead: the same stream on every device, a new one per lowering (no
    single-device program draws reproducible values there either)."""
    node = ctx.node
    attrs = None
    if not node.attr("seed", 0) and not node.attr("seed2", 0):
        seeds = np.random.default_rng().integers(1, 2**31, size=2)
        attrs = {"seed": int(seeds[0]), "seed2": int(seeds[1])}
    return whole_then_sliced(ctx, operands, layouts, attrs)


# The type a partitioned mean of these sums and divides in. Integers TF's mean sums
# without wrapping: the mean of four int32 -2**31 and a 7 is -1717986917, where their
# int32 sum wraps to 7 (int64's wraps). Half types: float32, as TF's half reductions
# (the count may not be a half number either: 1001 in bfloat16).
WIDE_MEANS = {**dict.fromkeys((tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.uint32),
                              tf.int64),
              tf.float16: tf.float32, tf.bfloat16: tf.float32}


@op_family({"Mean": "sum"}, rules.reduction, xla_numerics=on_integers(INTEGER_DIVISION))
def mean(ctx, operands, layouts):
    """Mean over a split dim: the local sums are combined, then divided by the global
    count once, as TF's kernel divides its sum. Scaling each partial sum first rounds
    every shard's share: a float16 mean of round(x) whose sum is 0 came out 6e-05
    (fuzzer, seed 21 #1464). A float16/bfloat16 mean is summed, combined and divided
    in float32 and rounded once (a bfloat16 mean near 0 of 224 values, summed in
    bfloat16 per shard, came out 1.2x TF's: seed 37 #9544); an int32 (or narrower) mean
    in int64, as TF sums it without wrapping (seed 35 #9094: the mean over a split dim
    of unsorted_segment_max's int32 fill values). The mean of nothing is NaN for floats
    (0 / 0); TF's integer mean of nothing is 0 (the sum, 0, divided by 1)."""
    if not ctx.split_reduce_axes():
        return replay(ctx, operands, layouts)
    b = ctx.b
    dtype = ctx.node.out_dtypes[0]
    wide = WIDE_MEANS.get(dtype, dtype)
    in_shape = ctx.inputs[0].shape
    count = int(np.prod([in_shape[a] for a in ctx.rule.params.axes]))
    refs = masked_refs(ctx, operands)
    shape = local_shapes(ctx, layouts)[0]
    summed = cast(b, refs[0], dtype, wide) if wide != dtype else refs[0]
    total = b.op("Sum", [summed, refs[1]], shape, wide, T=wide,
                 Tidx=ctx.node.attrs["Tidx"], keep_dims=bool(ctx.node.attr("keep_dims")))
    whole = Layout(layouts[0].dims)
    total = ctx.reshard(Local(total, layouts[0], ctx.node.out_shapes[0], wide), whole)
    divisor = b.const(np.asarray(count if dtype.is_floating else max(count, 1)), wide)
    if wide == dtype:
        ref = b.op("Div", [total.ref, divisor], shape, dtype, name=ctx.node.name, T=dtype)
    else:
        quotient = b.op("Div", [total.ref, divisor], shape, wide, T=wide)
        ref = b.op("Cast", [quotient], shape, dtype, name=ctx.node.name, SrcT=wide,
                   DstT=dtype, Truncate=False)
    return [Local(ref, whole, ctx.node.out_shapes[0], dtype)]


HALF_TYPES = frozenset({tf.float16, tf.bfloat16})  # a set: see program.UNMOVABLE


def reduced_in(ctx, operands, layouts, wide):
    """The op's reduction over split dims computed in the wider float type `wide`: each
    device reduces its shard in `wide`, the partial results are combined in `wide`, and
    the result is rounded to the op's type once (see reduce_sum, reduce_prod)."""
    b = ctx.b
    dtype = ctx.node.out_dtypes[0]
    refs = [cast(b, ref, x.dtype, wide) if x.dtype == dtype else ref
            for ref, x in zip(masked_refs(ctx, operands), operands)]
    shape = local_shapes(ctx, layouts)[0]
    attrs = dict(ctx.node.attrs)
    attrs["T"] = wide
    partial = b.op(ctx.node.op, refs, shape, wide, **attrs)
    out_shape = ctx.node.out_shapes[0]
    whole = Layout(layouts[0].dims)
    total = ctx.reshard(Local(partial, layouts[0], out_shape, wide), whole)
    ref = b.op("Cast", [total.ref], shape, dtype, name=ctx.node.name, SrcT=wide, DstT=dtype,
               Truncate=False)
    return [Local(ref, whole, out_shape, dtype)]


@op_family({"Sum": "sum"}, rules.reduction)
def reduce_sum(ctx, operands, layouts):
    """Sum: replayed (a split reduced dim leaves a partial sum the partitioner combines),
    except a float16/bfloat16 sum over split dims, summed in float32 and rounded once:
    in the half type every shard's sum and every combining add rounds again, and TF
    itself sums float16 sequentially in float16, so a partition of that order is no
    closer to the exact sum (fuzzer, seed 21 #5883: a float16 einsum 'abc->' over a
    split dim further from the float64 program than TF's)."""
    if ctx.node.out_dtypes[0] in HALF_TYPES and ctx.split_reduce_axes():
        return reduced_in(ctx, operands, layouts, tf.float32)
    return replay(ctx, operands, layouts)


@op_family({"Prod": "prod"}, rules.reduction)
def reduce_prod(ctx, operands, layouts):
    """Prod: replayed, except a float32/half product over split dims, multiplied in
    float64 and rounded once. In the narrow type a shard's product of finite values can
    underflow to 0 (or overflow to Inf) where TF's order of the same factors does not,
    and 0 * Inf is NaN: 180 normals with one +Inf and one -Inf gave NaN, TF and the
    float64 program -Inf (fuzzer, seed 21 #7937)."""
    dtype = ctx.node.out_dtypes[0]
    if (dtype in HALF_TYPES or dtype == tf.float32) and ctx.split_reduce_axes():
        return reduced_in(ctx, operands, layouts, tf.float64)
    return replay(ctx, operands, layouts)


def bias_add(ctx, operands, layouts):
    """BiasAdd: an NCHW one (channel not last) becomes an Add of the bias reshaped to
    [C, 1, ...]. TF's graph optimizer fuses Conv2D -> BiasAdd into one oneDNN op that
    adds the bias on the LAST dim whatever the data_format: silently wrong values, or an
    AbortedError when the sizes differ (fuzzer, seed 12 #871); eager TF is right."""
    x = operands[0]
    if ctx.node.attr("data_format") != "NCHW" or len(x.shape) < 3:
        return replay(ctx, operands, layouts)
    b = ctx.b
    dtype = ctx.node.out_dtypes[0]
    refs = masked_refs(ctx, operands)
    channels = operands[1].layout.local_shape(ctx.mesh, operands[1].shape)[0]
    column = [channels] + [1] * (len(x.shape) - 2)
    bias = b.op("Reshape", [refs[1], b.const(np.asarray(column, np.int32))], tuple(column),
                dtype, T=dtype, Tshape=tf.int32)
    return [b.op("AddV2", [refs[0], bias], local_shapes(ctx, layouts)[0], dtype,
                 name=ctx.node.name, T=dtype)]


def no_products(ctx, layouts):
    """The result of an op whose sums have no terms (an empty contracted dim, windows over
    an empty dim): zeros of the local result shape, emitted as a Fill."""
    b = ctx.b
    dtype = ctx.node.out_dtypes[0]
    shape = local_shapes(ctx, layouts)[0]
    return [b.op("Fill", [b.const(np.asarray(shape, np.int32)), b.const(0, dtype)], shape,
                 dtype, name=ctx.node.name, T=dtype, index_type=tf.int32)]


def matmul_multiply_adds(node, in_shapes):
    """MatMul's multiply-adds: its output's elements times the contracted length."""
    return math.prod(node.out_shapes[0]) * in_shapes[0][0 if node.attr("transpose_a") else 1]


def batch_matmul_multiply_adds(node, in_shapes):
    """BatchMatMul's multiply-adds: its output's elements times the contracted length."""
    return math.prod(node.out_shapes[0]) * in_shapes[0][-2 if node.attr("adj_x") else -1]


@op_family("MatMul", rules.matmul, multiply_adds=matmul_multiply_adds, traits=[DOT])
def matmul(ctx, operands, layouts):
    """MatMul: over an empty contracted dim the product is zeros (no_products). TF's
    graph optimizer fuses MatMul -> BiasAdd / Add into one oneDNN op that aborts the
    whole process on an empty contraction (fuzzer, seed 20 #5261); eager TF gives zeros."""
    contracted = ctx.inputs[0].shape[0 if ctx.node.attr("transpose_a") else 1]
    if contracted:
        return replay(ctx, operands, layouts)
    return no_products(ctx, layouts)


@op_family(["BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"], rules.batch_matmul,
           multiply_adds=batch_matmul_multiply_adds, traits=[DOT])
def batch_matmul(ctx, operands, layouts):
    """Batch matmul: replayed, except that batch dims the kernel would broadcast are made
    explicit. TF's oneDNN BatchMatMul corrupts the heap (wrong values, then SIGSEGV or
    SIGABRT; single-device eager TF too, fine with TF_ENABLE_ONEDNN_OPTS=0) for some
    in-kernel broadcasts: (3, 1, 6, 3) @ (3, 1) (fuzzer, seed 21 #7078). So an operand
    whose batch dims are all 1 loses them (rank 2), the other's batch dims (broadcast to
    the common batch shape if both have some) become one dim, and the result is
    reshaped back: the same dot products without any broadcast in the kernel."""
    refs = masked_refs(ctx, operands)
    local = [x.layout.local_shape(ctx.mesh, x.shape) for x in operands]
    rank = max(len(shape) for shape in local)
    batches = [(1,) * (rank - len(shape)) + tuple(shape[:-2]) for shape in local]
    if batches[0] == batches[1]:
        return replay(ctx, operands, layouts, refs=refs)
    b = ctx.b
    batch = tuple(np.broadcast_shapes(*batches))
    rows = int(np.prod(batch))
    for k, (x, shape) in enumerate(zip(operands, local)):
        matrix = tuple(shape[-2:])
        if all(n == 1 for n in batches[k]):
            flat = matrix
        else:
            if batches[k] != batch:
                whole = batch + matrix
                refs[k] = b.op("BroadcastTo", [refs[k], b.const(np.asarray(whole, np.int32))],
                               whole, x.dtype, T=x.dtype, Tidx=tf.int32)
            flat = (rows,) + matrix
        refs[k] = b.op("Reshape", [refs[k], b.const(np.asarray(flat, np.int32))], flat,
                       x.dtype, T=x.dtype, Tshape=tf.int32)
    shape = local_shapes(ctx, layouts)[0]
    dtype = ctx.node.out_dtypes[0]
    # batches differ, so one operand has batch dims > 1 and is now rank 3
    product = b.op(ctx.node.op, refs, (rows,) + tuple(shape[-2:]), dtype,
                   **dict(ctx.node.attrs))
    return [b.op("Reshape", [product, b.const(np.asarray(shape, np.int32))], shape, dtype,
                 name=ctx.node.name, T=dtype, Tshape=tf.int32)]


declare("Fill", rules.source, emit=with_local_shape_input(0))
declare(["BiasAdd", "BiasAddV1"], rules.bias_add, emit=bias_add)
