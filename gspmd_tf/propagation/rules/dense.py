"""Rules of ops that keep their dims: elementwise ops, contractions (MatMul, Einsum),
biases, sources and variable updates.
"""

from __future__ import annotations

import string
from typing import Optional

from gspmd_tf.propagation.oprule import (OpRule, RuleContext, einsum_letters, einsum_rule,
                                        spread_operands)


def elementwise(ctx: RuleContext, data_inputs=None) -> Optional[OpRule]:
    """Broadcasting elementwise op: dims aligned from the right."""
    out = ctx.out_shapes[0]
    rank = len(out)
    idx = range(len(ctx.in_shapes)) if data_inputs is None else data_inputs
    letters = einsum_letters(rank)
    terms = []
    for i in range(len(ctx.in_shapes)):
        if i in idx:
            terms.append(letters[rank - len(ctx.in_shapes[i]):])
    rule = einsum_rule(",".join(terms) + "->" + letters,
                       [ctx.in_shapes[i] for i in idx], out)
    rule.operands = spread_operands(rule.operands, idx, len(ctx.in_shapes))
    for extra in ctx.out_shapes[1:]:  # e.g. same-shaped second outputs
        rule.results.append(rule.results[0] if extra == out else None)
    return rule


def matmul(ctx: RuleContext) -> Optional[OpRule]:
    """MatMul with transpose_a / transpose_b."""
    a = "ki" if ctx.node.attr("transpose_a") else "ik"
    b = "jk" if ctx.node.attr("transpose_b") else "kj"
    return einsum_rule(f"{a},{b}->ij", ctx.in_shapes, ctx.out_shapes[0])


def batch_matmul(ctx: RuleContext) -> Optional[OpRule]:
    """BatchMatMulV2/V3 with adj_x / adj_y and broadcasting batch dims."""
    out = ctx.out_shapes[0]
    batch = einsum_letters(len(out) - 2, 4)
    a = "ki" if ctx.node.attr("adj_x") else "ik"
    b = "jk" if ctx.node.attr("adj_y") else "kj"
    ra, rb = len(ctx.in_shapes[0]), len(ctx.in_shapes[1])
    eq = f"{batch[len(batch) - (ra - 2):]}{a},{batch[len(batch) - (rb - 2):]}{b}->{batch}ij"
    return einsum_rule(eq, ctx.in_shapes, out)


def einsum(ctx: RuleContext) -> Optional[OpRule]:
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
    out_fill = fill[n - (len(out_shape) - len(out.replace("...", ""))):]
    return ",".join(terms) + "->" + out.replace("...", out_fill)


def bias_add(ctx: RuleContext) -> Optional[OpRule]:
    """BiasAdd: the bias runs along the channel dim."""
    rank = len(ctx.in_shapes[0])
    letters = einsum_letters(rank)
    channel = 1 if ctx.node.attr("data_format") == "NCHW" else rank - 1
    return einsum_rule(f"{letters},{letters[channel]}->{letters}", ctx.in_shapes,
                       ctx.out_shapes[0])


def bias_add_grad(ctx: RuleContext) -> Optional[OpRule]:
    """BiasAddGrad: sums every dim but the channel (a REDUCE factor each)."""
    rank = len(ctx.in_shapes[0])
    letters = einsum_letters(rank)
    channel = 1 if ctx.node.attr("data_format") == "NCHW" else rank - 1
    return einsum_rule(f"{letters}->{letters[channel]}", ctx.in_shapes, ctx.out_shapes[0])


def broadcast_to(ctx: RuleContext) -> Optional[OpRule]:
    """BroadcastTo: a broadcasting elementwise op of its one data input."""
    return elementwise(ctx, data_inputs=(0,))


def select_v1(ctx: RuleContext) -> Optional[OpRule]:
    """Select: a vector condition picks rows (the first dim) of higher-rank operands;
    otherwise elementwise like SelectV2."""
    cond, x = ctx.in_shapes[0], ctx.in_shapes[1]
    if len(cond) != 1 or len(x) <= 1:
        return elementwise(ctx)
    letters = einsum_letters(len(x))
    return einsum_rule(f"{letters[0]},{letters},{letters}->{letters}", ctx.in_shapes,
                       ctx.out_shapes[0])


def last_dim_normalizer(ctx: RuleContext) -> Optional[OpRule]:
    """Softmax/LogSoftmax: elementwise, the last dim reduced inside the handler."""
    return elementwise(ctx)


def cross_entropy(ctx: RuleContext, sparse) -> Optional[OpRule]:
    """(Sparse)SoftmaxCrossEntropyWithLogits: loss [B], backprop [B, C]."""
    b, c = ctx.in_shapes[0]
    labels = "b" if sparse else "bc"
    rule = einsum_rule(f"bc,{labels}->bc", ctx.in_shapes, (b, c))
    loss_dims = rule.results[0][:1]
    rule.results = [loss_dims, rule.results[0]]
    return rule


def source(ctx: RuleContext) -> Optional[OpRule]:
    """Const/Fill and other sources: every result dim a free factor."""
    rule = OpRule()
    rule.operands = [None] * len(ctx.in_shapes)
    for shape in ctx.out_shapes[:1]:
        rule.results.append(tuple((rule.add_factor(s),) if s > 1 else () for s in shape))
    return rule


def variable_update(ctx: RuleContext) -> Optional[OpRule]:
    """Reads, assigns and fused optimizer updates of a variable (its handle has the
    variable's shape in the IR): every input of that shape shares its factors;
    scalars (learning rate, betas...) are not data."""
    shape = ctx.in_shapes[0]
    letters = einsum_letters(len(shape))
    data = [i for i, s in enumerate(ctx.in_shapes) if s == shape]
    out = ctx.out_shapes[0] if ctx.out_shapes else shape
    rule = einsum_rule(",".join([letters] * len(data)) + "->" + letters,
                       [shape] * len(data), out)
    rule.operands = spread_operands(rule.operands, data, len(ctx.in_shapes))
    if not ctx.out_shapes:
        rule.results = []
    return rule
