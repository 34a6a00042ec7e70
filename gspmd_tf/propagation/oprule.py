"""The rule record every stage reads (OpRule), what a rule builder sees (RuleContext) and
the core builders the others are made of (einsum_rule, per_dim).

A rule is data: the op's factors (sizes and kinds) and, for every operand and result, the
factors each of its dims is made of, major to minor, plus typed parameters its emitter
needs (`params`). Propagation and the generic partitioner read only OpRules. The op
registry (gspmd_tf/registry.py) maps op types to rule builders; the builders of the op
families are in rules/ and windowed.py, all made of the pieces here.

Factor kinds:
  PASS         the same index in every tensor that has it (may be split anywhere)
  REDUCE       only in operands: summed/maxed away; split -> partial result
  REPLICATE    must not be split (the partitioner gathers it)
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from gspmd_tf.disjoint_sets import DisjointSets

if TYPE_CHECKING:  # (importing gspmd_tf.graph runs the importer, which reads the registry)
    from gspmd_tf.graph.ir import Graph, Node

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

    factor_sizes: list[int] = field(default_factory=list)
    factor_kinds: list[int] = field(default_factory=list)
    operands: list[Optional[tuple]] = field(default_factory=list)
    results: list[Optional[tuple]] = field(default_factory=list)
    reduce_op: str = "sum"
    params: object = None
    # ((result, dim), ...): result dims of several factors that take their major
    # factor's split even when it is uneven (a Reshape merging dims behind an unevenly
    # split one; see rules.reshape)
    uneven_major: tuple = ()

    def key(self) -> tuple:
        """A hashable value, equal for rules with the same factors, dims and reduce op
        (`params` left out): for memoising what depends only on those, such as the
        partitioner's choice of factor axes."""
        def tensors(all_dims):
            return tuple(None if dims is None else tuple(tuple(fs) for fs in dims)
                         for dims in all_dims)
        return (tuple(self.factor_sizes), tuple(self.factor_kinds), tensors(self.operands),
                tensors(self.results), self.reduce_op)

    def independent_groups(self) -> Optional[list]:
        """Group id per factor where the op is several computations that share no tensor
        (IdentityN: each result is its operand), else None. Factors of different groups
        never meet in one tensor, so they may use the same mesh axis; an op with REDUCE
        factors is one group (its results are all partial over them)."""
        if REDUCE in self.factor_kinds or not self.factor_sizes:
            return None
        sets = DisjointSets()
        for dims in list(self.operands) + list(self.results):
            held = [f for fs in dims or () for f in fs]
            for f in held[1:]:
                sets.union(held[0], f)
        roots = [sets.find(f) for f in range(len(self.factor_sizes))]
        return roots if len(set(roots)) > 1 else None

    def add_factor(self, size: int, kind: int = PASS) -> int:
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

    def __init__(self, graph: Graph, node: Node):
        self.graph = graph
        self.node = node
        self.in_shapes = [graph.shape(r) for r in node.inputs]
        self.out_shapes = node.out_shapes

    def const(self, i: int):
        """Value of constant input i (None when the input is not a constant)."""
        return self.graph.const_value(self.node.inputs[i])


@dataclass(frozen=True)
class SpatialDim:
    """One windowed dim: x size, y size (number of windows) and the window."""

    x_dim: int
    y_dim: int
    n: int
    out: int
    window: int
    stride: int
    dilation: int
    pad_lo: int
    pad_hi: int


def _dims_of(letters, shape, factor_of):
    """Per-dim factor tuples for `shape` indexed by einsum `letters`."""
    return tuple(() if size == 1 or factor_of[letter][0] is None else (factor_of[letter][0],)
                 for letter, size in zip(letters, shape))


def einsum_rule(equation: str, in_shapes: Sequence[tuple], out_shape: tuple,
                reduce_op: str = "sum") -> OpRule:
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


def equation_rule(ctx: RuleContext, equation: str) -> OpRule:
    """A fixed einsum equation over the op's first inputs (as many as it has terms); the
    other inputs are not data (a user's rule given as a string, gt.register_op)."""
    n = equation.split("->")[0].count(",") + 1
    rule = einsum_rule(equation, ctx.in_shapes[:n], ctx.out_shapes[0])
    rule.operands += [None] * (len(ctx.in_shapes) - n)
    return rule


def einsum_letters(n: int, offset: int = 0) -> str:
    return string.ascii_letters[offset:offset + n]


def spread_operands(operand_dims: Sequence, positions: Sequence[int], count: int) -> list:
    """Place per-operand dims at `positions` among `count` inputs (others None)."""
    full = [None] * count
    for pos, dims in zip(positions, operand_dims):
        full[pos] = dims
    return full


def passing_dims(rule: OpRule, shape: Sequence[int]) -> tuple:
    """A fresh PASS factor per dim of `shape` (none for size-1 dims)."""
    return tuple((rule.add_factor(n),) if n > 1 else () for n in shape)


def whole_dims(rule: OpRule, n: int) -> tuple:
    """The dims of a dim of size `n` that stays whole (a REPLICATE factor)."""
    return (rule.add_factor(n, REPLICATE),) if n > 1 else ()


def per_dim(ctx: RuleContext, replicate_dims: set, data_inputs: tuple = (0,),
            result_rank_source: int = 0) -> OpRule:
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
    rule.operands = spread_operands([tuple(d) for d in dims_in], data_inputs, len(ctx.in_shapes))
    rule.results = [tuple(dims_out)]
    return rule
