"""gt.keras: train, evaluate and predict with a Keras 3 model (TensorFlow backend) on a mesh.

    model.compile(optimizer="adam", loss=..., metrics=[...])
    gt.keras.shard_model(model, mesh, {".*dense.*kernel": P(None, "model")})
    model.fit(x, y)        # every step is a gt.function over the mesh

`shard_model` backs every variable of the model, of its optimizer and of its metrics by a
gt.Variable (each device holds only its shard) and replaces the model's train/test/predict
functions by ones that pull a batch from Keras' iterator on the host and run
`model.train_step` / `test_step` / `predict_step` as a gt.function with the batch split
by `batch_spec`. Keras itself (fit/evaluate/predict loops, callbacks, save_weights,
load_weights, get_weights, set_weights) is unchanged, but a load_weights that fails
leaves every variable as it was (and raises a ShardingError).

How it hooks into Keras 3 with the TensorFlow backend:
- a keras.Variable keeps its backend tf.Variable in `_value`; reads, gradients and
  assigns of the keras.Variable go through it. `_value` is replaced by a gt.Variable
  created from the current value, so traced code reads/assigns the global variable and
  gt.function feeds each device its shard variable.
- the model instance gets its own `make_train_function`, `make_test_function` and
  `make_predict_function` (Keras calls them from fit/evaluate/predict and
  *_on_batch; compile() resets the functions, so they are rebuilt after a re-compile).

This module imports Keras only inside shard_model, never at import time.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import tensorflow as tf

from gspmd_tf.autoshard.spec import AUTO, is_auto
from gspmd_tf.errors import ShardingError
from gspmd_tf.keras_auto import auto_report, decide
from gspmd_tf.keras_optimizer import build_optimizer, optimizer_chain, slot_references
from gspmd_tf.keras_weights import load_weights as _load_weights
from gspmd_tf.layout import Layout
from gspmd_tf.layout_map import LayoutRules
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.runtime.function import function as _gt_function
from gspmd_tf.runtime.lowering import AUTO_ATTEMPTS
from gspmd_tf.runtime.options import check_memory_limit
from gspmd_tf.runtime.sharded_tensor import ShardedTensor
from gspmd_tf.runtime.variables import Variable

__all__ = ["shard_model", "layout_of", "lowered", "take_over", "auto_report"]


# --------------------------------------------------------------------------- meshes

def _as_mesh(mesh, layout_map):
    """A gt.Mesh from a gt.Mesh, a keras DeviceMesh, or the LayoutMap's device_mesh."""
    if mesh is None:
        mesh = getattr(layout_map, "device_mesh", None)
        if mesh is None:
            raise ShardingError("shard_model needs a mesh: pass mesh=gt.Mesh.create(...)")
    if isinstance(mesh, Mesh):
        return mesh
    if hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):  # keras DeviceMesh
        from gspmd_tf.mesh import local_device_names
        local = {n.lower().split("device:")[-1]: n for n in local_device_names()}
        names = np.empty(np.size(mesh.devices), dtype=object)
        for i, d in enumerate(np.asarray(mesh.devices).reshape(-1)):
            key = str(d).lower().split("device:")[-1]
            if key not in local:
                raise ShardingError(f"keras DeviceMesh device {d!r} is not a local device "
                                    f"of this process ({sorted(local.values())})")
            names[i] = local[key]
        return Mesh(names.reshape(tuple(mesh.shape)), mesh.axis_names)
    raise ShardingError(f"mesh must be a gt.Mesh or keras.distribution.DeviceMesh, got "
                        f"{type(mesh).__name__}")


# --------------------------------------------------------------------------- variables

def _is_sharded(kvar, mesh, layout):
    value = kvar._value
    return (isinstance(value, Variable) and value.mesh == mesh and value.layout == layout)


def _shard_variable(kvar, mesh, spec, what):
    """Back keras.Variable `kvar` by a gt.Variable of `spec` holding its current value."""
    old = getattr(kvar, "_value", None)
    if old is None:  # not created yet (deferred); sharded when it exists
        return False
    # compared as the variable stores it (a size-1 dim unsplit), so a variable already
    # taken over is kept: steps traced earlier read it
    layout = Variable.layout_for(mesh, spec, tuple(kvar.shape), what)
    if _is_sharded(kvar, mesh, layout):
        return False
    value = old.numpy()
    kvar._value = Variable(initial_value=value, mesh=mesh, spec=spec,
                                       dtype=old.dtype, name=kvar.path,
                                       trainable=bool(old.trainable))
    return True


def _undivided_dims(mesh, layout, variable, is_model_variable):
    """What happens to each dim of a model variable that its split does not divide: a
    dim of size 1 stays whole (as gt.Variable stores it), a larger one is split
    unevenly (the last shards padded)."""
    if not is_model_variable:  # optimizer slots repeat their model variable's split
        return []
    found = []
    for d, (n, axes) in enumerate(zip(variable.shape, layout.dims)):
        parts = mesh.axes_size(axes)
        if axes and n % parts:
            found.append(f"{variable.path!r} dim {d} of size {n} over {axes} ({parts} "
                         + ("devices): kept whole" if n <= 1 else "devices): split unevenly"))
    return found


def layout_of(variable):
    """The PartitionSpec a (keras or gt) variable is sharded with, or None if not sharded."""
    value = getattr(variable, "_value", variable)
    return value.spec if isinstance(value, Variable) else None


# --------------------------------------------------------------------------- the state

class _MeshModel:
    """What shard_model attaches to a model (as `model._gt_keras`)."""

    def __init__(self, model, mesh, rules, batch_spec, memory_limit=None):
        self.model = model
        self.mesh = mesh
        self.rules = rules
        self.batch_spec = batch_spec  # AUTO until the search decides it (keras_auto.py)
        self.batch_auto = is_auto(batch_spec)
        self.memory_limit = memory_limit
        self.auto_specs = {}  # id(model variable) -> the spec the search chose for AUTO
        self.auto_lowered = None  # the search's probe (keras_auto.py), once it ran
        self.auto_arguments = []  # what each of the probe's arguments is
        self.functions = {}  # (kind, structure) -> gt.Function
        self.last_batch = {}  # kind -> (gt.Function, TensorSpecs) of its last step
        self.warned = False
        self.reported = set()  # undivided splits already warned about

    # ---------------------------------------------------------------- variables
    def shard_variables(self):
        """Back every existing model, optimizer and metric variable by a gt.Variable.

        Every spec is checked before any variable moves, so a bad layout_map leaves the
        model as it was."""
        model, mesh = self.model, self.mesh
        optimizer = getattr(model, "optimizer", None)
        trainable = list(model.trainable_variables)
        if optimizer is not None and not optimizer.built and model.built and trainable:
            build_optimizer(optimizer, trainable)

        plan = []  # (keras variable, spec, description)
        model_vars = list(model.variables)
        replicated, matched, specs = [], set(), {}
        for v in model_vars:
            key, spec = self.rules.lookup(v)
            if key is None:
                spec = PartitionSpec()
                replicated.append(v.path)
            else:
                matched.add(key)
            if is_auto(spec):  # decided before the first step (_prepare); until then as is
                spec = specs[id(v)] = self.auto_specs.get(id(v))
                if spec is None:
                    continue
            specs[id(v)] = spec
            plan.append((v, spec, f"variable {v.path!r} of shape {tuple(v.shape)}"
                         + (f" (layout_map key {key!r})" if key is not None else "")))

        if optimizer is not None and optimizer.built:
            refs = slot_references(optimizer, trainable)
            for v in optimizer.variables:
                ref = refs.get(id(v))
                spec = PartitionSpec()
                if ref is not None and tuple(ref.shape) == tuple(v.shape):
                    spec = specs.get(id(ref), PartitionSpec())
                    if spec is None:  # its weight's AUTO spec is not decided yet
                        continue
                plan.append((v, spec, f"optimizer variable {v.path!r} of shape "
                             f"{tuple(v.shape)}"))

        seen = {id(v) for v, _, _ in plan}
        for v in getattr(model, "metrics_variables", []):
            if id(v) not in seen:
                seen.add(id(v))
                plan.append((v, PartitionSpec(), f"metric variable {v.path!r}"))

        undivided = []
        for v, spec, what in plan:  # check everything first
            layout = Layout.from_spec(mesh, spec, len(v.shape), what)
            undivided += _undivided_dims(mesh, layout, v, id(v) in specs)
        self._report_undivided(undivided)
        for v, spec, what in plan:
            _shard_variable(v, mesh, spec, what)
        for built in optimizer_chain(optimizer):
            if built.built:
                # Keras (TF backend) keys an optimizer's variable indices by the backing
                # tf.Variable, which was just replaced.
                built._trainable_variables_indices = {
                    built._var_key(v): i for i, v in enumerate(built._trainable_variables)}

        unmatched = [key for key, _ in self.rules.items if key not in matched]
        if model_vars and unmatched and not self.warned:
            self.warned = True
            warnings.warn(
                f"gt.keras.shard_model: layout_map key(s) {unmatched} match no variable of "
                f"model {model.name!r}; these variables stay replicated: {replicated} "
                f"(all variable paths: {[v.path for v in model_vars]})", UserWarning,
                stacklevel=3)

    def _report_undivided(self, undivided):
        """Warn once per variable about splits its dims do not divide."""
        new = [text for text in undivided if text not in self.reported]
        if new:
            self.reported.update(new)
            warnings.warn(
                f"gt.keras: model {self.model.name!r}: layout splits that do not divide the "
                "dim: " + "; ".join(new) + ". The model still computes exactly; give these "
                "dims a split that divides them to spread their memory evenly",
                UserWarning, stacklevel=4)

    def _prepare(self, kind, data):
        """Before the first step on a new batch structure: let Keras build whatever is
        still unbuilt (model, compiled metrics and loss, optimizer), then shard it.
        Variables must exist before tracing: a traced step may not create any."""
        model = self.model
        if kind == "predict":
            if not model.built:  # Keras builds it on the first call; do that eagerly
                import keras
                x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
                model(x, training=False)
        elif getattr(model, "compiled", False):
            unbuilt = (not model.built
                       or (model._compile_metrics is not None
                           and not model._compile_metrics.built)
                       or (model._compile_loss is not None and not model._compile_loss.built)
                       or (model.optimizer is not None and not model.optimizer.built))
            if unbuilt:
                if model.optimizer is not None and not model.optimizer.built and model.built:
                    build_optimizer(model.optimizer, list(model.trainable_variables))
                if not _build_from_symbolic_outputs(model, data):
                    model._symbolic_build(data_batch=data)
        self._decide_auto(kind, data)
        self.shard_variables()

    def _within_limit(self, kind, data, leaves, make):
        """The train step `make()` gives, its AUTO variables decided again with a
        tighter budget while the step's lowered peak exceeds memory_limit: the search
        fits the probe (keras_auto.py), whose peak is an estimate of the step's (as
        lowering._lower_auto tightens its budget, AUTO_ATTEMPTS times)."""
        fn = make()
        if self.memory_limit is None or kind != "train" or not (
                self.auto_specs or self.batch_auto):
            return fn
        limit = budget = self.memory_limit
        for _ in range(AUTO_ATTEMPTS):
            peak = fn.lower(*leaves).memory().peak
            if peak <= limit:
                return fn
            budget = min(budget - (peak - limit),
                         limit - (peak - self.auto_lowered.memory().peak))
            if budget <= 0:
                break
            self.auto_specs.clear()
            if self.batch_auto:
                self.batch_spec = AUTO
            self._decide_auto(kind, data, budget)
            self.shard_variables()
            fn = make()
        raise ShardingError(
            f"gt.keras: model {self.model.name!r}: the train step with the layout map's "
            f"gt.AUTO variables decided needs {peak} bytes per device "
            f"(gt.keras.lowered(model).memory().peak), over memory_limit={limit}, and "
            "tightening the search's budget did not bring it under: raise memory_limit, "
            "use a mesh with more devices, or give the large variables specs")

    def _decide_auto(self, kind, data, budget=None):
        """Choose the specs of the model variables the layout map gives gt.AUTO and
        that have none yet, by the search on the step's probe (keras_auto.py) within
        `budget` bytes per device (default memory_limit)."""
        model = self.model
        specs = {}
        for v in model.variables:
            spec = self.rules.lookup(v)[1]
            specs[id(v)] = self.auto_specs.get(id(v), spec)
        if not (is_auto(self.batch_spec) or any(is_auto(spec) for spec in specs.values())):
            return
        optimizer = getattr(model, "optimizer", None)
        train = kind == "train" and optimizer is not None and optimizer.built
        slots = {}
        if train:
            trainable = list(model.trainable_variables)
            refs = slot_references(optimizer, trainable)
            for var in optimizer.variables:
                ref = refs.get(id(var))
                if ref is not None and tuple(ref.shape) == tuple(var.shape):
                    slots.setdefault(id(ref), []).append(var)
        leaves = [leaf for leaf in tf.nest.flatten(data) if leaf is not None]
        chosen, batch_spec, self.auto_lowered, self.auto_arguments = decide(
            model, self.mesh, specs, slots, tuple(self._spec_for(leaf) for leaf in leaves),
            data, train, self.memory_limit if budget is None else budget)
        self.auto_specs.update(chosen)
        if batch_spec is not None:
            self.batch_spec = batch_spec

    # ---------------------------------------------------------------- steps
    def _spec_for(self, leaf):
        """batch_spec cut to the leaf's rank: labels of rank 1 split their batch dim
        (AUTO while the search has not decided it)."""
        if is_auto(self.batch_spec):
            return AUTO
        rank = len(getattr(leaf, "shape", np.shape(leaf)))
        return PartitionSpec(*self.batch_spec[:rank])

    def step(self, kind, data):
        """(gt.Function of the `kind` step for this batch structure, the batch leaves)."""
        flat = tf.nest.flatten(data)
        present = [i for i, leaf in enumerate(flat) if leaf is not None]
        leaves = [flat[i] for i in present]
        structure = tf.nest.map_structure(lambda leaf: leaf is None, data)
        key = (kind, repr(structure))
        fn = self.functions.get(key)
        if fn is None:
            self._prepare(kind, data)
            # the specs are read at each make: a search again may choose another batch_spec
            fn = self._within_limit(kind, data, leaves, lambda: self._make(
                kind, data, len(flat), present, tuple(self._spec_for(leaf) for leaf in leaves)))
            self.functions[key] = fn
        return fn, leaves

    def run(self, kind, data):
        """One train/test/predict step on a host batch; returns host values."""
        fn, leaves = self.step(kind, data)
        # what the step was called with, for gt.keras.lowered
        self.last_batch[kind] = (fn, [tf.TensorSpec(_shape_of(leaf), _dtype_of(leaf))
                                      for leaf in leaves])
        return _to_host(fn(*leaves))

    def _make(self, kind, template, size, present, in_shardings):
        model = self.model
        step = {"train": "train_step", "test": "test_step", "predict": "predict_step"}[kind]

        def one_step(*leaves):
            flat = [None] * size
            for i, leaf in zip(present, leaves):
                flat[i] = leaf
            data = tf.nest.pack_sequence_as(template, flat)
            return getattr(model, step)(data)

        one_step.__name__ = f"{model.name}_{step}"
        return _gt_function(one_step, mesh=self.mesh, in_shardings=in_shardings)

    def forget(self, kind):
        """Drop the partitioned steps of `kind`: Keras asks for new step functions after
        compile(), which may bring a new optimizer, loss or metrics."""
        self.functions = {k: f for k, f in self.functions.items() if k[0] != kind}

    def train_or_test_function(self, kind):
        self.forget(kind)

        def run_steps(iterator):
            logs = None
            for _ in range(max(1, int(self.model.steps_per_execution))):
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    if logs is None:
                        raise StopIteration from None
                    break
                logs = self.run(kind, data)
            return logs
        return run_steps

    def make_predict_function(self):
        self.forget("predict")
        return self.predict_function

    def predict_function(self, data):
        outputs = [self.run("predict", step_data) for step_data in data]
        if len(outputs) == 1:
            return outputs[0]
        return tf.nest.map_structure(lambda *xs: tf.concat(xs, axis=0), *outputs)


def _build_from_symbolic_outputs(model, data):
    """Build the compiled loss and metrics of a built functional model (the optimizer is
    built already) from the model's own symbolic outputs, as Keras' _symbolic_build does
    from outputs it gets by tracing the whole model once more (a second trace of the
    forward pass, a tenth of GPT-2's first fit). Returns False, doing nothing, for any
    other model: one whose call is not Functional's (its outputs may differ from the
    graph's) or that is not built."""
    import keras
    from keras.src import backend
    from keras.src.models.functional import Functional
    if not (isinstance(model, Functional) and type(model).call is Functional.call
            and all(layer.built for layer in model._flatten_layers())):
        return False

    def symbolic(leaf):
        return None if leaf is None else keras.KerasTensor(
            leaf.shape, backend.standardize_dtype(leaf.dtype))
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
        tf.nest.map_structure(symbolic, data))
    y_pred = model._outputs_struct
    if model._compile_metrics is not None and not model._compile_metrics.built:
        backend.compute_output_spec(model.compute_metrics, x, y, y_pred,
                                          sample_weight=sample_weight)
    if model._compile_loss is not None and not model._compile_loss.built:
        backend.compute_output_spec(model._compute_loss, x, y, y_pred,
                                          sample_weight=sample_weight, training=False)
    return True


def _shape_of(leaf):
    return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)


def _dtype_of(leaf):
    dtype = getattr(leaf, "dtype", None)
    return tf.as_dtype(dtype if dtype is not None else np.asarray(leaf).dtype)


def lowered(model, kind="train", data=None):
    """The gt.Lowered of a shard_model model's `kind` step ("train", "test" or
    "predict"): its report(), collectives(), memory(), input/output shardings.

    data: a batch as fit/evaluate/predict would pass it (e.g. `(x, y)` for "train"),
    lowered without running it (the model, optimizer and metrics are built first);
    without it, the step of the last batch that ran.
    """
    state = getattr(model, "_gt_keras", None)
    if state is None and hasattr(model, "make_train_function"):
        # a model a keras.distribution applies to is taken over when Keras makes its
        # step functions (gspmd_tf.keras_distribution); any other is left as it was
        keras_own = model.train_function
        model.make_train_function()
        state = getattr(model, "_gt_keras", None)
        if state is None:
            model.train_function = keras_own
    if state is None:
        raise ShardingError(f"model {getattr(model, 'name', model)!r} is not sharded: call "
                            "gt.keras.shard_model(model, mesh, layout_map) first, or build "
                            "it under a keras.distribution")
    if kind not in ("train", "test", "predict"):
        raise ShardingError(f"kind {kind!r}: use 'train', 'test' or 'predict'")
    if data is not None:
        fn, leaves = state.step(kind, data)
        return fn.lower(*leaves)
    if kind not in state.last_batch:
        raise ShardingError(f"model {model.name!r} has run no {kind} step yet: pass a "
                            f"batch, gt.keras.lowered(model, {kind!r}, data=(x, y))")
    fn, specs = state.last_batch[kind]
    return fn.lower(*specs)


def _to_host(tree):
    """ShardedTensors -> eager tensors (global values), through dicts/lists/tuples."""
    if isinstance(tree, ShardedTensor):
        return tf.constant(tree.numpy())
    if isinstance(tree, dict):
        return type(tree)((k, _to_host(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_to_host(v) for v in tree)
    if isinstance(tree, tuple):  # namedtuple
        return type(tree)(*(_to_host(v) for v in tree))
    return tree


# --------------------------------------------------------------------------- entry point

def _make_train_function(self, force=False):
    if self.train_function is not None and not force:
        return self.train_function
    self.train_function = self._gt_keras.train_or_test_function("train")
    return self.train_function


def _make_test_function(self, force=False):
    if self.test_function is not None and not force:
        return self.test_function
    self.test_function = self._gt_keras.train_or_test_function("test")
    return self.test_function


def _make_predict_function(self, force=False):
    if self.predict_function is not None and not force:
        return self.predict_function
    self.predict_function = self._gt_keras.make_predict_function()
    return self.predict_function


def shard_model(model, mesh=None, layout_map=None, batch_spec=None, memory_limit=None):
    """Run `model` (Keras 3, TensorFlow backend) partitioned over `mesh`; returns `model`.

    mesh: a gt.Mesh (or a keras.distribution.DeviceMesh of local devices; defaults to
      the device_mesh of a keras LayoutMap).
    layout_map: dict or keras.distribution.LayoutMap from variable-path regexes
      (keras `variable.path`, e.g. "dense_1/kernel", ".*dense.*kernel") to
      PartitionSpecs (or tuples of axis names / keras TensorLayouts). Lookup follows
      keras.distribution.LayoutMap: an exact key first, else re.fullmatch of every key;
      a path matching two keys is a ShardingError. Unmatched variables are replicated;
      a key matching no variable gives a warning listing the replicated variables.
    batch_spec: how every batch leaf (x, y, sample_weight) is split; a leaf of lower
      rank takes the spec's first entries (labels of rank 1 split their batch dim).
      gt.AUTO: the auto-sharding search chooses it with the AUTO variables (from the
      largest batch leaf's split in the step's probe). Default: gt.AUTO when a
      layout_map value is gt.AUTO (the step then starts from the batch split whose
      activations the search fitted in memory_limit), else P("data").
    memory_limit: per-device bytes the auto-sharding search must fit the train step in
      when a layout_map value is gt.AUTO (None: no limit). Before the first step (or
      gt.keras.lowered(model, kind, data)) the search chooses a spec for every AUTO
      variable on a functional copy of the step (gspmd_tf/keras_auto.py; an optimizer
      slot takes its weight's spec); gt.keras.auto_report(model) shows the decisions.

    Afterwards every model variable, optimizer variable (the optimizer is built for the
    trainable variables if it is not yet; a slot variable takes the spec of its model
    variable, others are replicated) and metric variable is backed by a gt.Variable on
    `mesh`, and fit / evaluate / predict / *_on_batch run each step as a gt.function.
    Variables Keras creates later (compiled metrics built on the first batch, a new
    optimizer after re-compiling) are sharded before the first step that uses them.
    Calling shard_model again moves the model to another mesh or layout.
    """
    rules = LayoutRules(layout_map)
    if batch_spec is None:
        batch_spec = AUTO if any(is_auto(spec) for _, spec in rules.items) \
            else PartitionSpec("data")
    return take_over(model, _as_mesh(mesh, layout_map), rules, batch_spec,
                     check_memory_limit(memory_limit))


def take_over(model, mesh: Mesh, rules, batch_spec,
              memory_limit: "int | None" = None) -> "keras.Model":
    """shard_model's work once the layout source is known: `rules.lookup(variable)`
    gives (what decided, PartitionSpec or None for replicated) of a model variable, and
    `rules.items` the (key, spec) pairs to warn about when they match no variable;
    `memory_limit` the AUTO search's per-device bytes."""
    import keras  # the installed Keras 3
    if keras.backend.backend() != "tensorflow":
        raise ShardingError(f"gt.keras needs Keras' TensorFlow backend, but Keras runs on "
                            f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow")
    if not isinstance(model, keras.Model):
        raise ShardingError(
            f"shard_model takes a keras.Model, not {type(model).__name__} {model!r:.80}; "
            "wrap a layer in one (keras.Sequential([layer])), or for a plain function "
            "use gt.function with gt.Variables")
    if not is_auto(batch_spec):
        batch_spec = batch_spec if isinstance(batch_spec, PartitionSpec) \
            else PartitionSpec(*(batch_spec or ()))
        Layout.from_spec(mesh, batch_spec, len(batch_spec), "batch_spec")  # checks axes
    state = _MeshModel(model, mesh, rules, batch_spec, memory_limit)
    state.shard_variables()
    object.__setattr__(model, "_gt_keras", state)
    for name, fn in (("make_train_function", _make_train_function),
                     ("make_test_function", _make_test_function),
                     ("make_predict_function", _make_predict_function),
                     ("load_weights", _load_weights)):
        object.__setattr__(model, name, types.MethodType(fn, model))
    model.train_function = None
    model.test_function = None
    model.predict_function = None
    return model
