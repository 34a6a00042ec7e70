"""The op registry: everything gspmd-tf knows about a TF op type, in one entry (OpDef).

An OpDef holds
  rule, rule_args    the rule builder and its parameters: rule(ctx, *rule_args) -> an
                     OpRule, or None when this instance has no rule (it then runs
                     replicated); ctx is a gspmd_tf.propagation.oprule.RuleContext
  emit               the handler that emits the op on local shards (gspmd_tf/spmd/handlers:
                     emit(ctx, operands, layouts) -> [Ref or Local]), or
  replay             True: re-creating the TF op on local shapes is exact. It is declared
                     per op, never assumed: an op with a rule needs one of the two.
  silent_replicated  no warning when it runs replicated (scalars, shapes)
  safe_padding       (input, value) pairs: inputs the op checks (an integer divisor, an
                     index, a label...) whose padding (the tail of an uneven split dim)
                     is set to `value` first, so it cannot fail where the global op
                     does not
  fold               FOLD_SHAPE: graph.fold turns it into a constant from its input shapes
                     (Shape, Size...); FOLD_VALUES: a pure op graph.fold evaluates when all
                     its inputs are constants
  custom             registered by a user (register_op), like Shardy's is_custom_rule

Built-in op families are declared where their emitter is: `@op_family(...)` on a handler
in gspmd_tf/spmd/handlers/*.py, or `declare(..., replay=True)` in
gspmd_tf/spmd/handlers/replayed.py for ops whose TF op replayed on local shapes is exact
(that module also holds the flag-only entries of ops without a rule). Users add rules for
their own ops with register_op (gt.register_op).

This module is a leaf of the stages: propagation (rules), graph.fold (flags) and the
partitioner (emitters) read it; the declarations import it, never the reverse. The package
(gspmd_tf/__init__.py) imports the built-in declarations before anything else, so the
table is complete whatever module a user or test imports first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from gspmd_tf.errors import ShardingError
from gspmd_tf.propagation.oprule import OpRule, RuleContext, equation_rule

if TYPE_CHECKING:  # (importing gspmd_tf.graph runs graph.fold, which reads this module)
    from gspmd_tf.graph.ir import Graph, Node

FOLD_SHAPE = "shape"
FOLD_VALUES = "values"


@dataclass(frozen=True)
class OpDef:
    """One op type's entry (see the module docstring)."""

    op_type: str
    rule: Optional[Callable] = None
    rule_args: tuple = ()
    emit: Optional[Callable] = None
    replay: bool = False
    silent_replicated: bool = False
    safe_padding: tuple = ()
    fold: Optional[str] = None
    custom: bool = False

    def build_rule(self, graph: Graph, node: Node) -> Optional[OpRule]:
        """The OpRule of `node` (an op of this type), or None (no rule: replicated)."""
        if self.rule is None:
            return None
        return self.rule(RuleContext(graph, node), *self.rule_args)


_TABLE = {}  # op type -> OpDef


def _check(entry):
    """The entry if it is complete and consistent; else a ShardingError saying why."""
    op = entry.op_type
    if entry.rule is not None and not callable(entry.rule):
        raise ShardingError(f"op type {op!r}: rule must be a callable or an einsum "
                            f"equation string, not {entry.rule!r}")
    if entry.emit is not None and entry.replay:
        raise ShardingError(f"op type {op!r}: give either emit=<handler> or replay=True, "
                            "not both")
    if entry.rule is None and (entry.emit is not None or entry.replay):
        raise ShardingError(f"op type {op!r}: an emitter (or replay) needs a rule; without "
                            "a rule the op runs replicated")
    if entry.rule is not None and entry.emit is None and not entry.replay:
        raise ShardingError(
            f"op type {op!r} has a rule but no emitter: pass emit=<handler> or, when "
            "running the TF op on each device's local shards gives exactly the local "
            "part of its result, replay=True")
    if entry.fold not in (None, FOLD_SHAPE, FOLD_VALUES):
        raise ShardingError(f"op type {op!r}: fold must be None, {FOLD_SHAPE!r} or "
                            f"{FOLD_VALUES!r}, not {entry.fold!r}")
    return entry


def _put(op_type, override=False, **fields):
    """Merge `fields` into the entry of `op_type` (created when missing). A rule or an
    emitter may be declared once per op type unless `override`."""
    old = _TABLE.get(op_type)
    if old is None:
        entry = OpDef(op_type, **fields)
    else:
        if not override and (
                (fields.get("rule") is not None and old.rule is not None)
                or (fields.get("emit") is not None and old.emit is not None)):
            raise ShardingError(f"op type {op_type!r} already has a rule; pass "
                                "override=True to replace it")
        entry = dataclasses.replace(old, **fields)
    _TABLE[op_type] = entry


def declare(op_types: Union[str, list, dict], rule: Optional[Callable] = None, *,
            emit: Optional[Callable] = None, replay: bool = False, **flags) -> None:
    """Declare built-in op types: `op_types` is a name, a list of names, or a dict
    {name: rule parameters} (a tuple, or one value) when they differ per op. Flags
    (silent_replicated, safe_padding as a dict, fold) without a rule give a flag-only
    entry; flags merge into an entry declared elsewhere. Checked when the module is
    imported."""
    if "safe_padding" in flags:
        flags["safe_padding"] = tuple(sorted(flags["safe_padding"].items()))
    if isinstance(op_types, str):
        op_types = [op_types]
    per_op = op_types if isinstance(op_types, dict) else dict.fromkeys(op_types, ())
    for op_type, args in per_op.items():
        fields = dict(flags)
        if rule is not None or emit is not None or replay:  # (checked below)
            fields.update(rule=rule, rule_args=args if isinstance(args, tuple) else (args,),
                          emit=emit, replay=replay)
        _put(op_type, **fields)
    for op_type in per_op:
        _check(_TABLE[op_type])


def op_family(op_types: Union[str, list, dict], rule: Callable, **flags) -> Callable:
    """Decorator of a handler: declare `op_types` (see declare) with rule `rule` and the
    decorated function as their emitter."""
    def register(emit):
        declare(op_types, rule, emit=emit, **flags)
        return emit
    return register


def register_op(op_type: str, rule: Union[str, Callable], *, emit: Optional[Callable] = None,
                replay: bool = False, override: bool = False) -> None:
    """Give a TF op type (a custom op, or one gspmd-tf has no rule for) a sharding rule.

    rule: an einsum equation over the op's first inputs, e.g. "bij,j->bij" (letters
        missing from the output are summed: the emitter must then produce partial sums),
        or a callable rule(ctx) -> gspmd_tf.propagation.oprule.OpRule or None. `ctx`
        (a RuleContext) has in_shapes, out_shapes, node.attr(name) and const(i); the
        builders of gspmd_tf.propagation.rules (einsum_rule, elementwise, per_dim...)
        build the common forms. A factor may be PASS (split anywhere), REDUCE (operands
        only, summed away) or REPLICATE (never split).
    replay: True when running the TF op as it is on every device's local shards gives
        exactly that device's part of the result, for every split the rule allows: the
        usual case for ops that are elementwise or independent along their PASS dims.
    emit: otherwise, the handler emit(ctx, operands, layouts) -> list of program refs
        (see gspmd_tf/spmd/handlers/__init__.py), as the built-in handlers are.
    override: replace the rule of an op type that has one (built-in or registered).

    Register before the first call of a gt.function that uses the op: programs already
    lowered keep the rules they were built with. Raises ShardingError when the entry is
    incomplete (a rule without emit or replay) or the op type already has a rule.
    """
    if not isinstance(op_type, str) or not op_type:
        raise ShardingError(f"register_op: op_type must be a TF op type name, not {op_type!r}")
    args = ()
    if isinstance(rule, str):
        rule, args = equation_rule, (rule,)
    previous = _TABLE.get(op_type)
    _put(op_type, override=override, rule=rule, rule_args=args, emit=emit, replay=replay,
         custom=True)
    try:
        _check(_TABLE[op_type])
    except ShardingError:
        if previous is None:
            del _TABLE[op_type]
        else:
            _TABLE[op_type] = previous
        raise


_NOTHING = OpDef("")


def op_def(op_type: str) -> OpDef:
    """The entry of `op_type` (an empty OpDef when the registry knows nothing of it)."""
    return _TABLE.get(op_type, _NOTHING)


def has_rule(op_type: str) -> bool:
    """Whether `op_type` has a rule builder."""
    return op_def(op_type).rule is not None


def rule_for(graph: Graph, node: Node) -> Optional[OpRule]:
    """The OpRule of `node`, or None when it has no rule (it runs replicated)."""
    return op_def(node.op).build_rule(graph, node)


def ops_with_rules() -> list[str]:
    """Sorted op types that have a rule builder."""
    return sorted(op for op, entry in _TABLE.items() if entry.rule is not None)
