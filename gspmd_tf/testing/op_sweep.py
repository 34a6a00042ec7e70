"""An op sweep: every TF op type with a registered gradient, and those models emit
without one, run partitioned on generated inputs and compared with single-device TF,
each classified (issue 25 item 6).

The ops come from TF's gradient registry (tensorflow.python.framework.ops: the op types
a differentiated model can hold) and MODEL_OP_TYPES (variable updates, optimizer
kernels, what Keras' train steps hold). The inputs come from the op's OpDef alone, where that
is enough: each tensor input of the first dtype its attr allows among float32, int32,
int64, bool (a list input: two such tensors), shaped by the first of TEMPLATES that
single-device TF accepts (floats [4, 6] with 6 uneven over 4 devices, integers alike
or scalars, images [2, 6, 4, 3] with an integer pair, squares, vectors); attrs at their
defaults, or ATTRS where an attr has none. Ops the OpDef alone gives no valid inputs for
(ranks, shape and index values, complex inputs, sparse tensors, state: variables,
tables, TensorArrays, seeded random ops) take theirs from RECIPES (op_recipes and
stateful_recipes); a variable an op reads or writes is compared after the call too. Each op runs on a mesh drawn from MESH_SHAPES (2x4 or 4x2 of "data", "model"),
each flat input with a random PartitionSpec (replicated, either dim split, both, one dim
over both axes; the first input always split), drawn per op from the seed.

Outcomes (OUTCOMES):
  partitioned     values equal single-device TF, and the op ran on split operands or
                  results
  replicated      values equal, the op ran replicated: for lack of a rule, or because
                  its rule (or propagation from these inputs) keeps every dim whole
  refused         gt raised a ShardingError (its message is the reason)
  wrong           a value differs from single-device TF (accuracy.check_values)
  error           gt raised another exception
  not generated   the op cannot run in this process (stateful_recipes.CANNOT_RUN: a
                  GPU or TPU kernel, a TF1 queue or Session, a file; or not in this TF
                  build), single-device TF refused it (removed from GraphDef, no CPU
                  kernel), or, for the few ops without a recipe yet, the OpDef alone
                  gives no inputs (tests/test_op_sweep.py's WITHOUT_RECIPE)
benchmarks/op_sweep.py writes the table; tests/test_op_sweep.py runs a fixed slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import inspect

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry, ops

import gspmd_tf as gt
from gspmd_tf.graph.ir import Ref
from gspmd_tf.runtime.annotated import explicit_reshards
from gspmd_tf.testing.accuracy import TOLERANCE, Mismatch, check_values
from gspmd_tf.testing import op_recipes, stateful_recipes
from gspmd_tf.testing.op_recipes import Recipe
from gspmd_tf.testing.stateful_recipes import CANNOT_RUN

RECIPES = {**op_recipes.RECIPES, **stateful_recipes.RECIPES}
OUTCOMES = ("partitioned", "replicated", "refused", "wrong", "error", "not generated")
MESH_SHAPES, AXES = ((2, 4), (4, 2)), ("data", "model")
SPECS = (gt.P(), gt.P("data"), gt.P(None, "model"), gt.P("model", "data"),
         gt.P(None, ("data", "model")))
_DTYPES = (tf.float32, tf.int32, tf.int64, tf.bool)  # preference order
# (shape of float and bool inputs, shape of integer inputs, integer values or None for
# random ones in [0, 4)), tried in order
TEMPLATES = (((4, 6), (4, 6), None), ((4, 6), (), 1), ((2, 6, 4, 3), (2,), (3, 5)),
             ((6, 6), (6,), None), ((6,), (6,), None))
# values of attrs that have no default (windows for images of TEMPLATES[2])
ATTRS = {"strides": [1, 1, 1, 1], "ksize": [1, 2, 2, 1], "padding": "SAME",
         "num_split": 2, "block_size": 2, "num": 2}


@dataclass(frozen=True)
class Outcome:
    """What the sweep found for one op type: one of OUTCOMES and why, in words."""

    op_type: str
    kind: str
    reason: str = ""


class NotGenerated(Exception):
    """The OpDef alone gives no inputs for the op (the message says why)."""


def gradient_op_types() -> list:
    """Every op type TF registers a gradient for that this TF build defines, sorted."""
    return sorted(name for name in ops._gradient_registry.list()  # pylint: disable=protected-access
                  if op_def_registry.get(name) is not None)


# op types models emit that TF registers no gradient for: Keras 3's train steps (the
# ops of an Embedding, LayerNormalization, MultiHeadAttention, Dropout, Conv1D,
# BatchNormalization, LSTM and Dense model's train_step under each of Keras' eleven
# optimizers, Placeholder aside: an argument), keras_hub's GPT-2, Gemma, Llama, Qwen and
# BERT train steps under AdamW (All, from Gemma; everything else of theirs is above or has
# a gradient) and the kernels of the optimizers of tf.compat.v1.train and tf-keras' legacy
# optimizers (ResourceApply*)
MODEL_OP_TYPES = ("All", "Any", "AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp",
                  "Bitcast", "EmptyTensorList", "IsNan", "NoOp", "ResourceScatterAdd",
                  "ResourceScatterSub", "StatelessRandomGetKeyCounter", "TensorListReserve",
                  "Where", "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin",
                  "ResourceScatterMax", "ResourceScatterUpdate", "ResourceScatterNdUpdate",
                  "ResourceScatterNdAdd", "ResourceApplyGradientDescent",
                  "ResourceApplyMomentum", "ResourceApplyKerasMomentum",
                  "ResourceApplyAdagrad", "ResourceApplyAdagradV2", "ResourceApplyAdam",
                  "ResourceApplyAdaMax", "ResourceApplyRMSProp",
                  "ResourceApplyCenteredRMSProp", "ResourceApplyAdadelta",
                  "ResourceApplyFtrl", "ResourceSparseApplyAdagrad")


def sweep_op_types() -> list:
    """The op types the sweep covers: gradient_op_types() and MODEL_OP_TYPES, sorted."""
    return sorted(set(gradient_op_types()) | {
        name for name in MODEL_OP_TYPES if op_def_registry.get(name) is not None})


def generated_call(op_type: str, rng: np.random.Generator, template=TEMPLATES[0]) -> tuple:
    """(fn, args): fn(*args) runs `op_type` (tf.raw_ops) on inputs generated by
    `template` (one of TEMPLATES; module docstring). Raises NotGenerated when the OpDef
    alone does not give them."""
    op_def = op_def_registry.get(op_type)
    if op_def is None or not hasattr(tf.raw_ops, op_type):
        raise NotGenerated("not in this TF build's raw ops")
    if op_type in CANNOT_RUN:
        raise NotGenerated(CANNOT_RUN[op_type])
    if op_def.is_stateful and op_type not in RECIPES:
        # a recipe is given only to a stateful op whose values its inputs (and seeds)
        # fix: variables, TensorArrays, hash tables, seeded random ops
        raise NotGenerated("a stateful op")
    if op_type in RECIPES:
        return _recipe_call(op_def, RECIPES[op_type], rng)
    inferred = set()
    chosen = {}
    counts, values, sources = [], [], []
    for arg in op_def.input_arg:
        if arg.type_list_attr or arg.is_ref:
            raise NotGenerated(f"input {arg.name} is a list of types or a ref")
        dtype = _input_dtype(op_def, arg, chosen)
        if dtype is None:
            raise NotGenerated(f"input {arg.name} takes no float32/int32/int64/bool")
        count = 2 if arg.number_attr else 1
        if arg.number_attr:
            inferred.add(arg.number_attr)
        counts.append(count if arg.number_attr else None)
        values += [_value(dtype, rng, template) for _ in range(count)]
        # a template's fixed integers (an axis, a size) are constants of the program,
        # so the shapes they decide are known at trace time
        sources += ["constant" if dtype.is_integer and template[2] is not None
                    else "argument"] * count
    missing = [a.name for a in op_def.attr
               if not a.HasField("default_value") and a.name not in chosen
               and a.name not in inferred]
    unknown = [name for name in missing if name not in ATTRS]
    if unknown:
        raise NotGenerated(f"attrs without a default: {', '.join(unknown)}")
    attrs = {name: ATTRS[name] for name in missing}
    return _call(op_type, counts, values, sources, attrs)


class OpCall:
    """generated_call's fn: `fn(*args)` runs the op. `variables` are the initial values
    of the variables the op reads or writes; `bind` gives it the variables to use (of
    those values: tf.Variables for single-device TF, gt.Variables for gt.function)
    before it is traced."""

    def __init__(self, body: Callable, variables: list):
        self._body, self.variables, self.bound = body, variables, []

    def bind(self, variables: list) -> None:
        """Use `variables` (one per initial value) from the next trace on."""
        self.bound = list(variables)

    def __call__(self, *arguments):
        return self._body(arguments, self.bound)


def _call(op_type, counts, values, sources, attrs, makes=None, finish=None) -> tuple:
    """generated_call's (fn, args) for tf.raw_ops.`op_type` of the flat input `values`,
    each an "argument" of the program, a "constant" of it or a "variable" (its handle
    passed), grouped by `counts` (per OpDef input: the length of a list input, None for
    a tensor; extra values after them go to `finish` only); `makes` (per value, None or
    a function building the op's input from it in the program) and `finish` (the op's
    outputs and inputs -> the program's outputs) as a Recipe gives them."""
    raw = getattr(tf.raw_ops, op_type)
    # raw ops name some inputs otherwise than their OpDef (Sum's reduction_indices is
    # axis): their parameters come in OpDef order
    names = list(inspect.signature(raw).parameters)[:len(counts)]
    makes = makes or [None] * len(values)

    def body(arguments, variables):
        given, bound = iter(arguments), iter(variables)
        flat = [tf.constant(v) if source == "constant" else
                next(bound).handle if source == "variable" else next(given)
                for v, source in zip(values, sources)]
        flat = [make(t) if make else t for t, make in zip(flat, makes)]
        kwargs, at = dict(attrs), 0
        for name, count in zip(names, counts):
            # (a list input may be empty: count 0, not None)
            kwargs[name] = list(flat[at:at + count]) if count is not None else flat[at]
            at += 1 if count is None else count
        result = raw(**kwargs)
        if finish:
            return finish(result, flat)
        # an op without outputs (an assignment, an assertion) runs for its effect
        return [] if isinstance(result, tf.Operation) else result
    variables = [v for v, source in zip(values, sources) if source == "variable"]
    return OpCall(body, variables), [v for v, source in zip(values, sources)
                                     if source == "argument"]


def _recipe_call(op_def, recipe: Recipe, rng) -> tuple:
    """generated_call's (fn, args) for an op with a Recipe (op_recipes.py)."""
    if len(recipe.inputs) != len(op_def.input_arg):
        raise NotGenerated(f"its recipe gives {len(recipe.inputs)} of "
                           f"{len(op_def.input_arg)} inputs")
    counts, values, sources, makes = [], [], [], []
    for given in recipe.inputs + recipe.extra:
        group = given if isinstance(given, list) else [given]
        counts.append(len(group) if isinstance(given, list) else None)
        values += [arg.array(rng) for arg in group]
        sources += [arg.kind if arg.kind in ("constant", "variable") else "argument"
                    for arg in group]
        makes += [arg.make for arg in group]
    attrs = {name: tf.as_dtype(v) if name in _TYPE_ATTRS and isinstance(v, str)
             else v for name, v in recipe.attrs.items()}
    return _call(op_def.name, counts[:len(recipe.inputs)], values, sources, attrs, makes,
                 recipe.finish)


# attrs recipes give as dtype names
_TYPE_ATTRS = ("DstT", "Tout", "dtype", "element_dtype", "shape_type", "type", "out_type")


def _input_dtype(op_def, arg, chosen) -> Optional[tf.DType]:
    """The dtype of input `arg`: its fixed type, or its type attr's (the first of
    _DTYPES the attr allows; one choice per attr, recorded in `chosen`)."""
    if arg.type:
        dtype = tf.as_dtype(arg.type)
        return dtype if dtype in _DTYPES else None
    if arg.type_attr in chosen:
        return chosen[arg.type_attr]
    attr = next(a for a in op_def.attr if a.name == arg.type_attr)
    allowed = [tf.as_dtype(t) for t in attr.allowed_values.list.type] or list(_DTYPES)
    dtype = next((d for d in _DTYPES if d in allowed), None)
    if dtype is not None:
        chosen[arg.type_attr] = dtype
    return dtype


def _value(dtype, rng, template):
    """An array of `dtype` shaped by `template`: normal floats, bools, small
    non-negative integers (or the template's integer values)."""
    shape, int_shape, int_values = template
    if dtype == tf.bool:
        return rng.random(shape) < 0.5
    if dtype.is_integer:
        if int_values is not None:
            return np.broadcast_to(np.asarray(int_values), int_shape).astype(
                dtype.as_numpy_dtype)
        return rng.integers(0, 4, int_shape).astype(dtype.as_numpy_dtype)
    return rng.standard_normal(shape).astype(dtype.as_numpy_dtype)


def sweep_op(op_type: str, meshes, seed: int = 0) -> Outcome:
    """The Outcome of `op_type` on one of `meshes` (sweep_meshes()), the mesh, inputs
    and layouts drawn from `seed` and the op type."""
    # a generator of its own: the inputs and layouts drawn do not depend on the meshes
    mesh = meshes[np.random.default_rng([seed, 1, *op_type.encode()]).integers(len(meshes))]
    rng = np.random.default_rng([seed, *op_type.encode()])
    refusal = None
    for template in TEMPLATES[:1] if op_type in RECIPES else TEMPLATES:
        try:
            fn, args = generated_call(op_type, rng, template)
        except NotGenerated as reason:
            return Outcome(op_type, "not generated", str(reason))
        try:
            with tf.device("/device:CPU:0"):
                fn.bind([tf.Variable(v) for v in fn.variables])
                traced = tf.function(fn, autograph=False)
                want = [np.asarray(t) for t in tf.nest.flatten(traced(*args))]
                inferred = [t.shape for t in tf.nest.flatten(
                    traced.get_concrete_function(*args).structured_outputs)]
                # the variables after the call are outputs too
                want += [v.numpy() for v in fn.bound]
                inferred += [v.shape for v in fn.bound]
            break
        except Exception as exc:  # noqa: BLE001 - TF refusing the generated inputs
            refusal = refusal or exc
    else:
        return Outcome(op_type, "not generated", f"single-device TF: {_first_line(refusal)}")
    # the first input split (so a replicated op had something to split), the rest any;
    # the arguments' specs first, then the variables'
    inputs = list(args) + list(fn.variables)
    drawn = tuple(_fitted(SPECS[i], np.ndim(value)) for i, value in zip(
        [rng.integers(1, len(SPECS))] + list(rng.integers(0, len(SPECS),
                                                          max(len(inputs) - 1, 0))),
        inputs))
    specs = drawn[:len(args)]
    # outputs whose kernel shape contradicts TF's own shape inference (which gspmd-tf
    # follows) say nothing about gspmd-tf, and are not read: oneDNN's FusedBatchNormV3
    # and FusedBatchNormGrad return their unused reserve spaces as scalars where
    # inference says (0,), or (0,) where inference knows no shape, on one device or
    # only on some shards (so an empty output, which holds nothing to compare, is not
    # read either)
    contradicted = [i for i, (w, shape) in enumerate(zip(want, inferred))
                    if w.size == 0 or (shape.is_fully_defined() and tuple(shape) != w.shape)]
    try:
        fn.bind([gt.Variable(v, mesh, spec) for v, spec in zip(fn.variables,
                                                              drawn[len(args):])])
        f = gt.function(fn, mesh=mesh, in_shardings=specs)
        got = [None if i in contradicted else t.numpy()
               for i, t in enumerate(tf.nest.flatten(f(*args)))]
        got += [v.numpy() for v in fn.bound]
        lowered = f.lower(*args)
    except gt.ShardingError as exc:
        return Outcome(op_type, "refused", _first_line(exc))
    except Exception as exc:  # noqa: BLE001 - any other failure is the sweep's finding
        return Outcome(op_type, "error", f"{type(exc).__name__}: {_first_line(exc)}")
    try:
        for i, (g, w) in enumerate(zip(got, want)):
            if i in contradicted:
                continue
            g = np.asarray(g)
            if np.iscomplexobj(w):  # real and imaginary parts, each as floats
                g, w = np.stack([g.real, g.imag]), np.stack([w.real, w.imag])
            name = str(w.dtype)
            check_values(g, w, f"output {i}", name if name in TOLERANCE else None)
    except Mismatch as exc:
        return Outcome(op_type, "wrong", f"{exc} (mesh {mesh.shape}, inputs {drawn})")
    outcome = _classified(op_type, lowered)
    if contradicted:
        note = (f"outputs {contradicted} not compared: TF's kernel contradicts its shape "
                "inference")
        outcome = Outcome(op_type, outcome.kind, "; ".join(filter(None, (outcome.reason,
                                                                       note))))
    return outcome


def _fitted(spec, rank):
    """`spec` cut to `rank` entries."""
    return gt.P(*tuple(spec)[:rank])


def _classified(op_type, lowered) -> Outcome:
    """partitioned or replicated (with the reason) for an op whose values were equal."""
    program = lowered.program
    indices = [i for i, node in enumerate(lowered.graph.nodes) if node.op == op_type]
    names = {lowered.graph.nodes[i].name for i in indices}
    if names & set(program.replicated_ops):
        return Outcome(op_type, "replicated", "no partitioning rule")
    needs, _ = explicit_reshards(lowered)  # one walk of the program for every index
    if any(not layout.is_replicated for i in indices
           for layout in _ran_layouts(lowered, needs, i)):
        return Outcome(op_type, "partitioned")
    return Outcome(op_type, "replicated", "its rule keeps the split dims whole")


def _ran_layouts(lowered, needs, index) -> list:
    """The layouts node `index` of the graph ran with: each operand's (the target of the
    gt.Reshard the op needed, else its propagated layout) and each result's (the source
    of the gt.Reshard that moved it to its propagated layout, else that layout); `needs`
    is annotated.explicit_reshards' first table."""
    graph, node = lowered.graph, lowered.graph.nodes[index]
    operands = [needs.get((node.name, graph.tensor_name(ref)),
                          (None, lowered.propagation.layout(ref)))[1] for ref in node.inputs]
    results = [needs.get((node.name, graph.tensor_name(Ref(index, k))),
                         (lowered.propagation.layout(Ref(index, k)),))[0]
               for k in range(len(node.out_shapes))]
    return operands + results


def _first_line(exc) -> str:
    """The first line of an exception's message, without TF's function-node prefix."""
    text = (getattr(exc, "message", None) or str(exc) or type(exc).__name__).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line[:200]


def sweep(op_types, meshes, seed: int = 0,
          progress: Optional[Callable[[Outcome], None]] = None) -> list:
    """The Outcome of each of `op_types` (sweep_op); `progress` sees each as it comes."""
    outcomes = []
    for op_type in op_types:
        outcome = sweep_op(op_type, meshes, seed)
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    return outcomes


def table(outcomes) -> str:
    """The coverage table as markdown: counts per outcome, then one row per op."""
    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in OUTCOMES}
    lines = ["| outcome | op types |", "|---|---:|"]
    lines += [f"| {kind} | {counts[kind]} |" for kind in OUTCOMES]
    lines += ["", "| op type | outcome | reason |", "|---|---|---|"]
    lines += [f"| {o.op_type} | {o.kind} | {o.reason.replace('|', '/')} |" for o in outcomes]
    return "\n".join(lines)


def sweep_meshes() -> tuple:
    """The sweep's meshes: each of MESH_SHAPES over this process's first 8 devices."""
    return tuple(gt.Mesh.create(shape, AXES) for shape in MESH_SHAPES)
