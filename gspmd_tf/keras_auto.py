"""gt.AUTO in gt.keras layout maps: the auto-sharding search chooses those variables' specs.

    gt.keras.shard_model(model, mesh, {".*kernel": gt.AUTO}, memory_limit=2**30)
    model.fit(x, y)   # the first step decides the AUTO specs, then runs with them

A Keras variable lives in a tf.Variable the traced step captures, and the search
(gspmd_tf/autoshard) chooses layouts of arguments, so the decision is made on a
functional copy of the train step, the "probe": every model, metric and optimizer-slot
variable is an argument (the AUTO ones gt.AUTO, the rest their layout map spec), the
model runs by `stateless_call` and `stateless_compute_loss` (Keras' own functional
forms) under a GradientTape, and each weight is updated element-wise with its slots
(`s' = 0.9 s + 0.1 g`, `w' = w - lr g / (sqrt|s'| + eps)`). That update stands in for
the optimizer's (Keras' TF optimizer has no stateless form): it has the optimizer's
slots, their bytes and their element-wise meeting with the weight and gradient, so the
search's ties (autoshard/ties.py) give each slot its weight's decision and the memory
limit counts them. The probe is only lowered (never run); its plan's specs are given to
the AUTO variables, and the real step (Keras' train_step) is partitioned with them like
any layout map's.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from gspmd_tf.autoshard import AUTO, is_auto
from gspmd_tf.errors import ShardingError
from gspmd_tf.layout_map import variable_path
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.runtime.function import function as _gt_function

# The probe's update: a slot's decay and the weight's step (any values: never run).
_DECAY, _STEP, _EPSILON = 0.9, 1e-3, 1e-7


def decide(model, mesh: Mesh, specs: dict, slots: dict, batch_specs: tuple, data,
           train: bool, memory_limit: Optional[int]):
    """(the chosen PartitionSpec by id() of every AUTO variable, the batch spec chosen
    (None unless the batch leaves are AUTO), the probe's gt.Lowered, what each probe
    argument is: "batch leaf 0" or a variable path).
    `specs` maps id(variable) of each model variable to its layout map
    spec (AUTO or a PartitionSpec); `slots` id(model variable) -> its optimizer slot
    variables; `batch_specs` the batch leaves' specs (PartitionSpecs, or AUTO each);
    `data` a batch (its present leaves in tf.nest order); `train`: a train step
    (forward, gradients, update) else forward only."""
    import keras
    trainable = list(model.trainable_variables)
    frozen = list(model.non_trainable_variables)
    metrics = list(getattr(model, "metrics_variables", [])) if train else []
    slot_lists = [list(slots.get(id(v), ())) if train else [] for v in trainable]
    flat = tf.nest.flatten(data)
    present = [i for i, leaf in enumerate(flat) if leaf is not None]
    counts = [len(present), len(trainable), len(frozen), len(metrics)]

    def probe(*args):
        parts, start = [], 0
        for n in counts:
            parts.append(list(args[start:start + n]))
            start += n
        leaves, weights, frozen_values, metric_values = parts
        slot_values = list(args[start:])
        full = [None] * len(flat)
        for i, leaf in zip(present, leaves):
            full[i] = leaf
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
            tf.nest.pack_sequence_as(data, full))
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y_pred, frozen_values = model.stateless_call(weights, frozen_values, x,
                                                         training=train)
            if not train:
                return y_pred
            loss, (_, frozen_values, metric_values) = model.stateless_compute_loss(
                weights, frozen_values, metric_values, x, y, y_pred, sample_weight)
        grads = tape.gradient(loss, weights)
        new_weights, new_slots = [], []
        for w, g, own in zip(weights, grads, slot_lists):
            values = [slot_values.pop(0) for _ in own]
            if g is None:
                new_weights.append(w)
                new_slots += values
                continue
            values = [_DECAY * s + (1 - _DECAY) * g for s in values]
            scale = tf.sqrt(tf.abs(values[-1])) + _EPSILON if values else 1.0
            new_weights.append(w - _STEP * g / scale)
            new_slots += values
        return new_weights, frozen_values, metric_values, new_slots

    probe.__name__ = probe.__qualname__ = f"{model.name}_auto_sharding_probe"
    slot_variables = [s for own in slot_lists for s in own]
    weight_entries = [_entry(specs, v) for v in trainable]
    slot_entries = [e for v, e in zip(trainable, weight_entries) for _ in slots.get(id(v), ())
                    ] if train else []
    in_shardings = (tuple(batch_specs) + tuple(weight_entries)
                    + tuple(_entry(specs, v) for v in frozen)
                    + (PartitionSpec(),) * len(metrics) + tuple(slot_entries))
    arg_specs = [tf.TensorSpec(_shape(flat[i]), _dtype(flat[i])) for i in present] + [
        tf.TensorSpec(tuple(v.shape), tf.as_dtype(v.dtype))
        for v in trainable + frozen + metrics + slot_variables]
    lowered = _gt_function(probe, mesh=mesh, in_shardings=in_shardings,
                           memory_limit=memory_limit).lower(*arg_specs)
    chosen = {}
    layouts = lowered.program.input_layouts
    for k, v in enumerate(trainable + frozen, start=len(present)):
        if is_auto(in_shardings[k]):
            chosen[id(v)] = layouts[k].to_spec()
    arguments = [f"batch leaf {i}" for i in present] + [
        v.path for v in trainable + frozen + metrics + slot_variables]
    return chosen, _batch_spec(lowered, arg_specs[:len(present)], batch_specs), lowered, \
        arguments


def _batch_spec(lowered, leaf_specs, batch_specs) -> Optional[PartitionSpec]:
    """The one batch_spec the model's steps take from the search's choice for the AUTO
    batch leaves: the spec of the leaf of most elements (the first of equals), which
    the search split for the activations it feeds. gt.keras gives every leaf one spec
    cut to its rank, so the steps of other kinds (test, predict) and batch structures
    use it too; the step the probe stands for then starts from the split whose memory
    the search counted (its intermediates are not carried over: the real step's
    propagation derives them from the batch and the variables)."""
    auto = [k for k, spec in enumerate(batch_specs) if is_auto(spec)]
    if not auto:
        return None
    k = max(auto, key=lambda k: (leaf_specs[k].shape.num_elements() or 0, -k))
    return lowered.program.input_layouts[k].to_spec()


def auto_report(model) -> str:
    """The auto-sharding search's report for a shard_model model whose layout map has
    gt.AUTO values: the spec chosen for each AUTO variable (and the batch_spec, where
    AUTO), the shard_model call that pins them, then the search's own report on the
    step's probe (gspmd_tf/keras_auto.py: each decision's cost and alternatives) with
    what each of the probe's arguments is."""
    state = getattr(model, "_gt_keras", None)
    if state is None or state.auto_lowered is None:
        raise ShardingError(f"model {getattr(model, 'name', model)!r} has no auto-sharding "
                            "decisions: give gt.AUTO as a layout_map value to "
                            "gt.keras.shard_model and run (or gt.keras.lowered) a step")
    by_id = {id(v): v for v in model.variables}
    lines = ["gt.keras auto-sharding: the specs chosen for the layout map's gt.AUTO "
             "variables (optimizer slots take their variable's)"]
    lines += [f"  {by_id[k].path}: {spec}" for k, spec in state.auto_specs.items()
              if k in by_id]
    if state.batch_auto:
        lines.append(f"  batch_spec (every batch leaf, cut to its rank): {state.batch_spec}")
    # the steps are partitioned from the variables' and the batch's specs alone, so
    # these reproduce them (slots take their variable's spec)
    pinned = {}
    for v in model.variables:
        spec = state.auto_specs.get(id(v)) or state.rules.lookup(v)[1]
        if spec and not is_auto(spec):
            pinned[variable_path(v)] = spec
    lines += ["", f"pin the plan with gt.keras.shard_model(model, mesh, layout_map="
              f"{pinned!r}, batch_spec={state.batch_spec!r})"]
    lines += ["", "the probe's arguments: " + ", ".join(
        f"{k} {what}" for k, what in enumerate(state.auto_arguments)), "",
        state.auto_lowered.auto_report()]
    return "\n".join(lines)


def _entry(specs, variable):
    """The probe's in_shardings entry of a model variable."""
    spec = specs.get(id(variable), PartitionSpec())
    return AUTO if is_auto(spec) else spec


def _shape(leaf):
    return tuple(leaf.shape) if hasattr(leaf, "shape") else tuple(tf.convert_to_tensor(
        leaf).shape)


def _dtype(leaf):
    dtype = getattr(leaf, "dtype", None)
    return tf.as_dtype(dtype) if dtype is not None else tf.convert_to_tensor(leaf).dtype
