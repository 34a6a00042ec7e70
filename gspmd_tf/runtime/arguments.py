"""The arguments of one gt.function call: bound to the signature, split into leaves.

Like tf.function, a call may pass arguments by keyword, and Python values (None, bool,
int, float, complex, str) are static: they are baked into the trace, and a new value
means a new trace. Every other leaf (tf.Tensor, numpy array or scalar, ShardedTensor,
tf.TensorSpec) is a program input.
"""

from __future__ import annotations

import inspect

import numpy as np
import tensorflow as tf

from gspmd_tf.errors import ShardingError

STATIC_TYPES = (bool, int, float, complex, str, bytes, type(None))
_COMPOSITES = {tf.RaggedTensor: "a tf.RaggedTensor: pad it with .to_tensor() or pass its "
                                "flat_values and row_splits as separate tensors",
               tf.SparseTensor: "a tf.SparseTensor: pass tf.sparse.to_dense(value) or its "
                                "indices, values and dense_shape as separate tensors",
               tf.IndexedSlices: "a tf.IndexedSlices: pass tf.convert_to_tensor(value)"}


def signature_of(fn):
    """inspect.Signature of fn, or None when Python cannot tell (some builtins)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class Arguments:
    """One call's arguments.

    `names[i]`/`values[i]`: the i-th argument in parameter order (keyword arguments moved
    to their parameter, skipped parameters given their defaults); `keywords`: how many
    trailing values are keyword-only parameters. `leaves` holds each value's flat leaves
    as (argument index, leaf); `is_static(leaf)` tells Python values from tensors.
    """

    def __init__(self, function_name, signature, args, kwargs):
        self.function_name = function_name
        self.names, self.values, self.keywords = _bind(function_name, signature, args, kwargs)
        self.leaves = []
        for index, value in enumerate(self.values):
            for leaf in tf.nest.flatten(value):
                self._check_leaf(index, leaf)
                self.leaves.append((index, leaf))

    def describe(self, index):
        """`argument i ('name')` for error messages."""
        return f"argument {index} ({self.names[index]!r})"

    def _check_leaf(self, index, leaf):
        for kind, advice in _COMPOSITES.items():
            if isinstance(leaf, kind):
                raise ShardingError(
                    f"{self.function_name}: {self.describe(index)} is {advice}; gt.function "
                    "takes dense tensors")

    def tensor_leaves(self):
        """(argument index, leaf) of the leaves that are program inputs, in order."""
        return [(i, leaf) for i, leaf in self.leaves if not is_static(leaf)]

    def structure_key(self):
        """What, besides the tensors' specs, makes a different trace: nesting, static
        values and keyword names."""
        static = tuple((i, type(leaf).__name__, leaf) for i, leaf in self.leaves
                       if is_static(leaf))
        nesting = tuple(None if _is_leaf(v) else repr(tf.nest.map_structure(lambda _: 0, v))
                        for v in self.values)
        return tuple(self.names), self.keywords, static, nesting

    def call_structure(self, replace):
        """(positional, keyword) arguments with every program-input leaf passed through
        `replace` (e.g. to a tf.TensorSpec)."""
        values = [tf.nest.map_structure(lambda leaf: leaf if is_static(leaf)
                                        else replace(leaf), v) for v in self.values]
        split = len(values) - self.keywords
        return values[:split], dict(zip(self.names[split:], values[split:]))


def is_static(leaf):
    """True for a Python value baked into the trace (numpy scalars are tensors)."""
    return isinstance(leaf, STATIC_TYPES) and not isinstance(leaf, np.generic)


def _is_leaf(value):
    flat = tf.nest.flatten(value)
    return len(flat) == 1 and flat[0] is value


def _bind(function_name, signature, args, kwargs):
    """(names, values, number of keyword-only values) of a call, in parameter order."""
    if signature is None:
        if kwargs:
            raise TypeError(f"{function_name}: its signature is unknown, so pass arguments "
                            "by position")
        return [f"arg{i}" for i in range(len(args))], list(args), 0
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{function_name}(): {e}") from None
    names, values, keywords = [], [], 0
    last_passed = max((i for i, p in enumerate(signature.parameters)
                       if p in bound.arguments), default=-1)
    for i, (name, param) in enumerate(signature.parameters.items()):
        kind = param.kind
        if kind == param.VAR_KEYWORD:
            if bound.arguments.get(name):
                raise TypeError(
                    f"{function_name}(): gt.function takes no **{name} arguments (got "
                    f"{sorted(bound.arguments[name])}); name them in the signature")
        elif kind == param.VAR_POSITIONAL:
            extra = bound.arguments.get(name, ())
            names += [f"{name}[{k}]" for k in range(len(extra))]
            values += list(extra)
        elif name in bound.arguments or (kind != param.KEYWORD_ONLY and i < last_passed):
            # a skipped parameter before a passed one gets its default, so the values
            # stay positional
            names.append(name)
            values.append(bound.arguments.get(name, param.default))
            keywords += kind == param.KEYWORD_ONLY
    return names, values, keywords
