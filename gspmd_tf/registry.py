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

and what the backends, the runtime and graph.fold must know of it (the same entry, so
no stage keeps an op-type list of its own):
  stateful           True / False: whether the op has effects beyond its outputs (it
                     must run, in order); None (the default): as TF's op registry says,
                     and an op TF does not register counts as stateful (is_stateful)
  multiply_adds      cost(node, in_shapes) -> the multiply-adds the op does (dots and
                     convolutions; 0 for ops without one: see multiply_adds)
  bytes_touched      cost(node, in_shapes, in_dtypes) -> the bytes the op reads and
                     writes in memory; None (the default): every operand and result once
                     (see bytes_touched); a VIEW op none, a slice or gather what it
                     copies (read_result_bytes)
  xla_numerics       differs(node, operand_dtype) -> why XLA computes other values than
                     TF's kernel for this instance (NaN ordering, integer division by
                     zero, other random numbers, a kernel XLA:CPU gets wrong), or None:
                     a backend that compiles with XLA runs such an op on TF's kernel
                     (xla_numerics_differ), unless it has an xla_form
  xla_form           form(node, inputs) -> the op's result built of TF ops whose XLA
                     values are TF's kernel's where xla_numerics says XLA's differ (a
                     select where the kernel selects): what a backend compiling with XLA
                     emits in place of such an op, so it needs no op-by-op barrier
  traits             names of what the op is, read where an op kind matters: DOT (its
                     local form on blocks is a dot: windowed einsum), CONVOLUTION,
                     READS_VARIABLE (reads only the variable behind its resource input),
                     ASSIGNS_VARIABLE (sets the variable of its first input to a value
                     computed from its other operands), VALUE_SHAPED (its output shape
                     depends on its input values: the importer defers it to graph.fold),
                     VIEW (its result is its first operand's value, at most reshaped: it
                     moves no data, and a backend need not run it where the shapes agree)
                     PRINTS (writes its inputs where the user reads them, a stream, a log
                     or a file: a backend runs it once for the devices holding its inputs
                     equal, so a whole value prints once per call, as on one device)
What one runtime's kernels need of an op (a layout, a sliced input) is that backend's
legalization table, keyed by op type (gspmd_tf/backends/tf_kernels.py), not the entry.

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
import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from gspmd_tf.errors import ShardingError
from gspmd_tf.propagation.oprule import OpRule, RuleContext, equation_rule

log = logging.getLogger("gspmd_tf")

if TYPE_CHECKING:  # (importing gspmd_tf.graph runs graph.fold, which reads this module)
    from gspmd_tf.graph.ir import Graph, Node

FOLD_SHAPE = "shape"
FOLD_VALUES = "values"

# traits (OpDef.traits)
DOT = "dot"
CONVOLUTION = "convolution"
READS_VARIABLE = "reads_variable"
ASSIGNS_VARIABLE = "assigns_variable"
VALUE_SHAPED = "value_shaped"
VIEW = "view"
PRINTS = "prints"
TRAITS = frozenset({DOT, CONVOLUTION, READS_VARIABLE, ASSIGNS_VARIABLE, VALUE_SHAPED, VIEW,
                    PRINTS})


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
    stateful: Optional[bool] = None
    multiply_adds: Optional[Callable] = None
    bytes_touched: Optional[Callable] = None
    xla_numerics: Optional[Callable] = None
    xla_form: Optional[Callable] = None
    traits: frozenset = frozenset()

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
    for name in ("multiply_adds", "bytes_touched", "xla_numerics", "xla_form"):
        value = getattr(entry, name)
        if value is not None and not callable(value):
            raise ShardingError(f"op type {op!r}: {name} must be a callable (see the "
                                f"registry's docstring), not {value!r}")
    if entry.stateful not in (None, True, False):
        raise ShardingError(f"op type {op!r}: stateful must be True, False or None, not "
                            f"{entry.stateful!r}")
    if not entry.traits <= TRAITS:
        raise ShardingError(f"op type {op!r}: unknown traits {sorted(entry.traits - TRAITS)}; "
                            f"the traits are {sorted(TRAITS)}")
    if entry.fold not in (None, FOLD_SHAPE, FOLD_VALUES):
        raise ShardingError(f"op type {op!r}: fold must be None, {FOLD_SHAPE!r} or "
                            f"{FOLD_VALUES!r}, not {entry.fold!r}")
    return entry


def _put(op_type, override=False, **fields):
    """Merge `fields` into the entry of `op_type` (created when missing). A rule or an
    emitter may be declared once per op type unless `override`; traits add up."""
    if "traits" in fields:
        fields["traits"] = frozenset(fields["traits"])
    old = _TABLE.get(op_type)
    if old is None:
        entry = OpDef(op_type, **fields)
    else:
        if not override and (
                (fields.get("rule") is not None and old.rule is not None)
                or (fields.get("emit") is not None and old.emit is not None)):
            raise ShardingError(f"op type {op_type!r} already has a rule; pass "
                                "override=True to replace it")
        if "traits" in fields:
            fields["traits"] |= old.traits
        entry = dataclasses.replace(old, **fields)
    _TABLE[op_type] = entry


def declare(op_types: Union[str, list, dict], rule: Optional[Callable] = None, *,
            emit: Optional[Callable] = None, replay: bool = False, **flags) -> None:
    """Declare built-in op types: `op_types` is a name, a list of names, or a dict
    {name: rule parameters} (a tuple, or one value) when they differ per op. Flags
    (silent_replicated, safe_padding as a dict, fold, stateful, multiply_adds,
    bytes_touched, xla_numerics, xla_form, traits) without a rule give a flag-only
    entry; flags merge into an entry declared elsewhere. Checked when the module is imported."""
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
                replay: bool = False, override: bool = False,
                stateful: Optional[bool] = None, multiply_adds: Optional[Callable] = None,
                bytes_touched: Optional[Callable] = None,
                xla_numerics: Optional[Callable] = None, traits=()) -> None:
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
    stateful, multiply_adds, bytes_touched, xla_numerics, traits: the rest of the op's
        contract, as the built-in entries declare it (module docstring): whether the op
        has effects beyond its outputs (None: as TF's op registry says), its multiply-add
        count and the bytes it reads and writes for the cost model, why XLA would compute other values (a backend compiling with XLA then runs
        it on TF's kernel), and its traits (DOT, CONVOLUTION, ...).

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
    # only the contract fields given: an override keeps what the entry declared of the rest
    contract = {name: value for name, value in (
        ("stateful", stateful), ("multiply_adds", multiply_adds),
        ("bytes_touched", bytes_touched), ("xla_numerics", xla_numerics), ("traits", traits)) if value not in (None, ())}
    _put(op_type, override=override, rule=rule, rule_args=args, emit=emit, replay=replay,
         custom=True, **contract)
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
    """The OpRule of `node`, or None when it has no rule (it runs replicated). A rule
    that does not fit the node's tensors (a dim count other than the tensor's rank: a
    builder meeting values it was not written for, such as a stack of TensorLists, whose
    IR shape is their element's) is not used: the node runs
    replicated, with a warning naming it, where the propagation core would read past its
    arrays."""
    rule = op_def(node.op).build_rule(graph, node)
    if rule is None:
        return None
    misfit = _misfit(rule, [graph.shape(ref) for ref in node.inputs], node.out_shapes)
    if misfit:
        log.warning("gspmd_tf: op %s (%s): its partitioning rule does not fit it (%s); it "
                    "runs replicated", node.name, node.op, misfit)
        return None
    return rule


def _misfit(rule: OpRule, in_shapes, out_shapes) -> str:
    """Why `rule` does not fit tensors of `in_shapes` and `out_shapes` ('' if it does):
    a dim count other than the tensor's rank (checked per build, so kept to ranks)."""
    for what, all_dims, shapes in (("operand", rule.operands, in_shapes),
                                   ("result", rule.results, out_shapes)):
        if len(all_dims) > len(shapes):
            return f"{len(all_dims)} {what}s in the rule, {len(shapes)} in the op"
        for k, dims in enumerate(all_dims):
            if dims is not None and len(dims) != len(shapes[k]):
                return (f"{what} {k} has {len(shapes[k])} dims, the rule gives it "
                        f"{len(dims)}")
    return ""


def ops_with_rules() -> list[str]:
    """Sorted op types that have a rule builder."""
    return sorted(op for op, entry in _TABLE.items() if entry.rule is not None)


# ------------------------------------------------------------- what backends ask of ops

def is_stateful(op_type: str) -> bool:
    """Whether ops of `op_type` have effects beyond their outputs, so that they must run
    even when nothing reads them, and in program order: the entry's `stateful` when
    declared, else TF's op registry; an op TF does not register counts as stateful
    (the safe answer: it is kept and ordered). gspmd-tf's own gt.* nodes are pure
    functions of their operands (a program input's place is kept by dce itself)."""
    if op_type.startswith("gt."):
        return False
    declared = op_def(op_type).stateful
    if declared is not None:
        return declared
    return _tf_stateful(op_type)


@functools.lru_cache(maxsize=None)
def _tf_stateful(op_type):
    tf_op = op_def_registry.get(op_type)
    return tf_op is None or tf_op.is_stateful


def multiply_adds(node, in_shapes: Sequence) -> int:
    """The multiply-adds `node` does (its entry's cost function on its input shapes),
    0 for an op without one (elementwise, data movement) or with an unknown shape."""
    cost = op_def(node.op).multiply_adds
    if cost is None or any(s is None or None in s for s in in_shapes) or \
            any(s is None or None in s for s in node.out_shapes):
        return 0
    return int(cost(node, in_shapes))


def dense_bytes(shape, dtype) -> int:
    """Bytes of a dense tensor of `shape` and `dtype` (a tf.DType); 0 for an unknown
    shape and for handles and strings (resources, variants), which hold no dense data."""
    if shape is None or None in shape or dtype is None or \
            dtype.base_dtype in (tf.resource, tf.variant, tf.string):
        return 0
    return math.prod(shape) * dtype.size


def bytes_touched(node, in_shapes: Sequence, in_dtypes: Sequence) -> int:
    """The bytes `node` reads and writes in memory: its entry's cost function when it
    declares one, none for a VIEW op, else every operand and result once."""
    entry = op_def(node.op)
    if entry.bytes_touched is not None:
        return int(entry.bytes_touched(node, in_shapes, in_dtypes))
    if VIEW in entry.traits:
        return 0
    return (sum(dense_bytes(s, d) for s, d in zip(in_shapes, in_dtypes))
            + sum(dense_bytes(s, d) for s, d in zip(node.out_shapes, node.out_dtypes)))


def read_result_bytes(node, in_shapes, in_dtypes) -> int:
    """A bytes_touched function: each result read from its operand and written once
    (a slice or gather copies only what it keeps)."""
    return 2 * sum(dense_bytes(s, d) for s, d in zip(node.out_shapes, node.out_dtypes))


# Random ops XLA draws other numbers for than TF's kernels (each declares it: the random
# families of spmd/handlers/basic.py, the others beside them): both backends must give
# the same numbers.
RANDOM_NUMERICS = "a random op (XLA draws other numbers than TF's kernel)"
# XLA's max and min propagate NaN; TF's CPU kernels of these ops do not
# (tests/test_nonfinite.py; fuzzer seed 46, RESULTS §14.11)
NAN_ORDER = "XLA orders NaN against numbers otherwise than TF's kernel"
# TF's elementwise gradient kernels give 0 for a zero upstream gradient whatever the
# forward output (NaN, Inf: 0 * NaN), XLA's the product (NaN); TF's ReluGrad passes a
# NaN upstream gradient, XLA's selects 0 (fuzz seed 60 #36: rsqrt of a negative value
# before a minimum, RESULTS §14.11's EluGrad)
ZERO_GRADIENT = ("XLA's gradient kernel gives other values than TF's where the upstream "
                 "gradient is 0 or NaN")
# XLA gives -1 for an integer divided by zero (an integer Mean of no elements too)
INTEGER_DIVISION = "XLA divides integers by zero otherwise than TF's kernel"


def xla_numerics_differ(node, operand_dtype) -> Optional[str]:
    """Why XLA computes other values than TF's kernel for `node` (its first operand of
    dtype `operand_dtype`, None without operands), or None: the entry's xla_numerics
    (None for an op whose entry declares none)."""
    differs = op_def(node.op).xla_numerics
    return None if differs is None else differs(node, operand_dtype)


def xla_form(node, operand_dtype) -> Optional[Callable]:
    """The entry's xla_form when XLA's values of `node` differ from TF's kernel's
    (xla_numerics_differ) and the entry gives a form that computes TF's in XLA; else
    None (where they do not differ, the op itself compiles)."""
    form = op_def(node.op).xla_form
    return form if form is not None and xla_numerics_differ(node, operand_dtype) else None


def on_floats(reason):
    """An xla_numerics function: `reason` when the op's first operand is floating."""
    def differs(node, operand_dtype):
        return reason if operand_dtype is not None and operand_dtype.is_floating else None
    return differs


def on_integers(reason):
    """An xla_numerics function: `reason` when the op's first operand is an integer."""
    def differs(node, operand_dtype):
        return reason if operand_dtype is not None and operand_dtype.is_integer else None
    return differs


def always(reason):
    """An xla_numerics function: `reason` for every instance."""
    return lambda node, operand_dtype: reason


def has_trait(op_type: str, trait: str) -> bool:
    """Whether the entry of `op_type` declares `trait` (one of TRAITS)."""
    return trait in op_def(op_type).traits
