"""Plain tf.Variables taken over as gt.Variables, in place.

Code written for one device keeps its state in tf.Variables: Keras 2 (tf_keras) layers,
tf.Module models. gt.function(..., layout_map=...) takes the ones a trace captures over
as gt.Variables split as the layout map says (replicated where no key matches): the
same Python object is re-initialised as a gt.Variable holding the current value, so
every attribute, list, optimizer or checkpoint that holds it now holds the gt.Variable,
and the user's model needs no rewrite. The function is then traced again (the trace
captured the old handles).
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.autoshard.spec import is_auto
from gspmd_tf.errors import ShardingError
from gspmd_tf.layout_map import LayoutRules, variable_path
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.runtime.variables import Variable, variable_of_handle


def take_over_variable(variable: tf.Variable, mesh: Mesh, spec: PartitionSpec) -> Variable:
    """Re-initialise plain tf.Variable `variable` in place as a gt.Variable of `spec` on
    `mesh` holding its current value (its old device buffer is released)."""
    value = variable.numpy()
    name, trainable = variable_path(variable), variable.trainable
    # the old state (handle, its deleter, cached reads) must not outlive the change of
    # class: Variable.__init__ builds its own
    variable.__dict__.clear()
    variable.__class__ = Variable
    Variable.__init__(variable, value, mesh, spec, name=name, trainable=trainable)
    return variable


def take_over_captured(concrete, mesh: Mesh, rules: LayoutRules) -> int:
    """Take the plain tf.Variables `concrete` (a ConcreteFunction) captures over, each
    split as `rules` say (replicated without a key); returns how many there were."""
    plain = [v for v in concrete.variables if variable_of_handle(v.handle) is None]
    specs = [rules.lookup(v)[1] or PartitionSpec() for v in plain]
    for variable, spec in zip(plain, specs):
        what = f"variable {variable_path(variable)!r} of shape {tuple(variable.shape)}"
        if is_auto(spec):
            raise ShardingError(
                f"layout_map gives {what} gt.AUTO: gt.function chooses layouts only for "
                "arguments; pass the variable's value as an argument with gt.AUTO in "
                "in_shardings, or use gt.keras.shard_model, whose layout maps take gt.AUTO")
        try:
            Variable.layout_for(mesh, spec, tuple(variable.shape), what)
        except ShardingError as e:
            raise ShardingError(f"layout_map gives {what} spec {spec!r}: {e}") from None
    for variable, spec in zip(plain, specs):  # every spec was found before any changes
        take_over_variable(variable, mesh, spec)
    return len(plain)
