"""A sharded Keras model's load_weights, all or nothing (gt.keras installs it on the
models it takes over): Keras writes the variables one by one as it reads the file, so a
file that does not fit would leave some written and some not; every variable is written
back instead."""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.runtime.variables import Variable


def load_weights(self, filepath, *args, **kwargs):
    """keras.Model.load_weights, all or nothing: a load that fails (a file that does not
    fit the model, a corrupt or missing one) writes every variable back as it was and
    raises a ShardingError naming the file, Keras' error its cause."""
    written_back = _values_now(all_variables(self))
    try:
        return type(self).load_weights(self, filepath, *args, **kwargs)
    except (ValueError, OSError, KeyError, tf.errors.OpError) as error:
        for target, value in written_back:
            target.assign(value, read_value=False)
        raise ShardingError(
            f"model {self.name!r}: load_weights({str(filepath)!r}) failed, every variable "
            f"left as it was ({' '.join(str(error).split()):.400}): load a file saved from a "
            "model of the same architecture and variable shapes") from error


def all_variables(model):
    """Every variable of `model`, its optimizer and its metrics, once each."""
    optimizer = getattr(model, "optimizer", None)
    found = {}
    for v in (list(model.variables) + list(getattr(optimizer, "variables", ()) or ())
              + list(getattr(model, "metrics_variables", ()))):
        found.setdefault(id(v), v)
    return list(found.values())


def _values_now(variables):
    """(tf.Variable, its value now) of every shard variable of the gt.Variables backing
    `variables` (keras Variables) and of every other backing tf.Variable. A value read
    keeps its buffer: a later assign writes a new one (TF copies a buffer that is
    referenced elsewhere), so this holds no second copy until a variable changes."""
    pairs = []
    for kvar in variables:
        backing = getattr(kvar, "_value", kvar)
        targets = backing.copies() if isinstance(backing, Variable) else [backing]
        for target in targets:
            with tf.device(target.device):
                pairs.append((target, target.read_value()))
    return pairs
