"""Rules of ops that hand dims through between several operands or results (Split,
Pack, Unpack, FusedBatchNorm, TensorList ops): a dim they cut, stack or index stays
whole, every other dim passes. (An IdentityN is split into Identity ops when imported:
graph/identity_n.py.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gspmd_tf.propagation.oprule import (OpRule, RuleContext, passing_dims, spread_operands,
                                        whole_dims)


def split(ctx: RuleContext, value_input, axis_input) -> Optional[OpRule]:
    """Split/SplitV: the split axis whole (in the operand and every piece); other dims
    pass."""
    axis = ctx.const(axis_input)
    if axis is None:
        return None
    x = ctx.in_shapes[value_input]
    axis = int(axis) % len(x)
    rule = OpRule()
    dims = list(passing_dims(rule, x[:axis] + (1,) + x[axis + 1:]))
    dims[axis] = whole_dims(rule, x[axis])
    rule.operands = spread_operands([tuple(dims)], (value_input,), len(ctx.in_shapes))
    for shape in ctx.out_shapes:
        dims[axis] = whole_dims(rule, shape[axis])
        rule.results.append(tuple(dims))
    return rule


def pack(ctx: RuleContext) -> Optional[OpRule]:
    """Pack (tf.stack): the new dim whole (each device holds every operand); the others
    pass, shared by all operands."""
    out = ctx.out_shapes[0]
    axis = ctx.node.attr("axis") % len(out)
    rule = OpRule()
    dims = passing_dims(rule, out[:axis] + out[axis + 1:])
    rule.operands = [dims] * len(ctx.in_shapes)
    rule.results = [dims[:axis] + (whole_dims(rule, out[axis]),) + dims[axis:]]
    return rule


def unpack(ctx: RuleContext) -> Optional[OpRule]:
    """Unpack (tf.unstack): the removed dim whole; the others pass, shared by all
    results."""
    x = ctx.in_shapes[0]
    axis = ctx.node.attr("axis") % len(x)
    rule = OpRule()
    dims = passing_dims(rule, x[:axis] + x[axis + 1:])
    rule.operands = [dims[:axis] + (whole_dims(rule, x[axis]),) + dims[axis:]]
    rule.results = [dims] * len(ctx.out_shapes)
    return rule


@dataclass(frozen=True)
class BatchNormParams:
    """OpRule.params of FusedBatchNormV3 and its gradient: the channel dim of x."""

    channel: int


def fused_batch_norm(ctx: RuleContext, x_input, channel_inputs) -> Optional[OpRule]:
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
    dims = passing_dims(rule, x)

    def of_channel(shape):
        return (dims[channel],) if shape == (x[channel],) else tuple(() for _ in shape)
    rule.operands = [dims if shape == x else of_channel(shape) if i in channel_inputs
                     else tuple(() for _ in shape) for i, shape in enumerate(ctx.in_shapes)]
    rule.results = [dims] + [of_channel(shape) for shape in ctx.out_shapes[1:]]
    return rule


@dataclass(frozen=True)
class TensorListParams:
    """What a TensorList op's emitter needs: the input holding the element_shape (None
    when the op has none), and the global element shape with its dims' factors."""

    shape_input: object
    element_shape: tuple
    element_dims: tuple


def tensor_list(ctx: RuleContext, elements_in, stacked_in, elements_out, stacked_out,
                shape_input) -> Optional[OpRule]:
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
    dims = passing_dims(rule, element)
    rule.params = TensorListParams(shape_input, element, dims)

    def tensor_dims(i, shape, as_elements, as_stacked):
        if i in as_elements:
            return dims
        if i in as_stacked:
            return (whole_dims(rule, shape[0]),) + dims
        return None
    rule.operands = [tensor_dims(i, s, elements_in, stacked_in)
                     for i, s in enumerate(ctx.in_shapes)]
    rule.results = [tensor_dims(k, s, elements_out, stacked_out) or tuple(() for _ in s)
                    for k, s in enumerate(ctx.out_shapes)]
    return rule
