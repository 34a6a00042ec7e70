"""The trace stage, shared by gt.function and gt.lower: bind a call's arguments to the
Python function's signature, turn its tensors into tf.TensorSpecs and trace the function
on them (tf.function) into a ConcreteFunction at the GLOBAL shapes."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import Layout
from gspmd_tf.layout_map import LayoutRules
from gspmd_tf.mesh import Mesh
from gspmd_tf.runtime.arguments import Arguments, is_static, signature_of
from gspmd_tf.runtime.options import check_entries
from gspmd_tf.runtime.plain_variables import take_over_captured
from gspmd_tf.runtime.sharded_tensor import ShardedTensor


@dataclass(frozen=True)
class Call:
    """One call's tensor inputs as the program takes them, in program input order.

    flat       the tensor leaves (values, ShardedTensors or tf.TensorSpecs)
    specs      their tf.TensorSpecs (what is traced)
    entries    their in_shardings entries (None: inferred)
    committed  a ShardedTensor's own layout (used where its entry is None), its
               gt.Sharding when it lives on another mesh of the same devices, else None
    key        what decides the trace and the lowering: calls with equal keys share both
    """

    arguments: Arguments
    flat: tuple
    specs: tuple
    entries: tuple
    committed: tuple[Optional[Layout], ...]
    key: tuple


def _committed(leaf, mesh):
    """What a ShardedTensor argument commits its input to: its layout on `mesh`; on
    another mesh of the same devices, its sharding (device ids mean the same devices)."""
    if not isinstance(leaf, ShardedTensor):
        return None
    return leaf.layout if leaf.mesh == mesh else leaf.sharding


class Tracer:
    """Traces one Python function (or tf.function) per input signature, for gt.function
    and gt.lower. `in_shardings` has one entry per argument, matched to the function's
    parameters in signature order."""

    def __init__(self, fn: Callable, mesh: Mesh, in_shardings: Optional[Sequence], name: str,
                 layout_map=None):
        check_entries("in_shardings", in_shardings, "argument")
        # plain tf.Variables a trace captures are taken over by this (None: refused)
        self.variable_rules = None if layout_map is None else LayoutRules(layout_map)
        self.fn = fn
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.name = name
        self._signature = signature_of(fn)
        self._traced = tf.function(fn, autograph=False)
        self._keyword_functions = {}  # see _keyword_traced
        self._signatures = []  # traced arguments in words, for errors

    def call(self, args: tuple, kwargs: dict) -> Call:
        """The Call of these arguments (checked against the signature and in_shardings)."""
        arguments = self._arguments(args, kwargs)
        tensors = arguments.tensor_leaves()
        flat = tuple(leaf for _, leaf in tensors)
        specs = tuple(self._spec_of(arguments, i, leaf) for i, leaf in tensors)
        entries = tuple(self._entry(i) for i, _ in tensors)
        committed = tuple(_committed(leaf, self.mesh) for leaf in flat)
        # an argument's own layout matters only where in_shardings leaves it open
        key = (arguments.structure_key(),) + tuple(
            (tuple(s.shape), s.dtype, str(e) if e is not None else c)
            for s, e, c in zip(specs, entries, committed))
        return Call(arguments, flat, specs, entries, committed, key)

    def trace(self, call: Call) -> tf.types.experimental.ConcreteFunction:
        """The ConcreteFunction of `call`, its tensors replaced by their specs."""
        arguments = call.arguments
        spec_of = dict(zip((id(leaf) for leaf in call.flat), call.specs))
        positional, keywords = arguments.call_structure(lambda leaf: spec_of[id(leaf)])
        shown = "(" + ", ".join(f"{n}: {_describe_spec(v)}" for n, v in zip(
            arguments.names, positional + list(keywords.values()))) + ")"
        try:
            concrete = self._concrete(arguments, positional, keywords)
            if self.variable_rules is not None and take_over_captured(
                    concrete, self.mesh, self.variable_rules):
                # the trace captured the handles the variables had before: trace again
                self._traced = tf.function(self.fn, autograph=False)
                self._keyword_functions = {}
                concrete = self._concrete(arguments, positional, keywords)
        except (TypeError, ValueError) as e:
            e.add_note(f"while tracing gt.function {self.name!r} for {shown}" + (
                f"; earlier calls traced {', '.join(self._signatures)}: pass the same "
                "dtypes (e.g. np.asarray(x, np.float32)) to reuse their trace"
                if self._signatures else ""))
            raise
        self._signatures.append(shown)
        return concrete

    def _concrete(self, arguments, positional, keywords):
        if keywords:
            return self._keyword_traced(arguments).get_concrete_function(
                *positional, *keywords.values())
        return self._traced.get_concrete_function(*positional)

    def _arguments(self, args, kwargs):
        arguments = Arguments(f"gt.function {self.name!r}", self._signature, args, kwargs)
        if self.in_shardings is not None and len(self.in_shardings) != len(arguments.values):
            raise ShardingError(
                f"{self.name} got {len(arguments.values)} arguments "
                f"({', '.join(arguments.names)}) but in_shardings has "
                f"{len(self.in_shardings)} entries: pass one entry per argument (None for "
                "Python values and arguments to infer)")
        for index, leaf in arguments.leaves:
            if is_static(leaf) and self._entry(index) is not None:
                raise ShardingError(
                    f"{self.name}: {arguments.describe(index)} is the Python value "
                    f"{leaf!r}, which is static (baked into the trace, as in tf.function), "
                    f"so in_shardings entry {self._entry(index)!r} cannot split it; pass a "
                    "tensor or array, or give None")
        return arguments

    def _entry(self, index):
        return None if self.in_shardings is None else self.in_shardings[index]

    def _spec_of(self, arguments, index, leaf):
        if isinstance(leaf, ShardedTensor):
            if not self.mesh.same_devices(leaf.mesh):
                raise ShardingError(f"argument {leaf!r} lives on another mesh, of other "
                                    f"devices; move it to {self.mesh!r} first")
            return tf.TensorSpec(leaf.shape, leaf.dtype)
        if isinstance(leaf, tf.TensorSpec):
            if leaf.shape.rank is None:
                raise ShardingError(
                    f"{self.name}: {arguments.describe(index)} is {leaf}, of unknown rank; "
                    "gspmd-tf needs static shapes: give the spec its full shape, e.g. "
                    f"tf.TensorSpec((8, 4), tf.{leaf.dtype.name})")
            return leaf
        try:
            value = leaf if isinstance(leaf, tf.Tensor) else tf.convert_to_tensor(leaf)
        except (TypeError, ValueError) as e:
            raise ShardingError(
                f"{self.name}: {arguments.describe(index)} ({type(leaf).__name__}) is "
                f"neither a tensor nor a Python value: {e}") from None
        return tf.TensorSpec(value.shape, value.dtype)

    def _keyword_traced(self, arguments):
        """A tf.function taking every argument by position, which calls fn with the
        keyword-only ones by name: the traced inputs then follow the order of
        `arguments` (tf.function would order keyword arguments its own way)."""
        key = (tuple(arguments.names), arguments.keywords)
        if key not in self._keyword_functions:
            fn, count = self.fn, arguments.keywords
            keyword_names = arguments.names[-count:]

            def by_position(*values):
                return fn(*values[:-count], **dict(zip(keyword_names, values[-count:])))
            by_position.__name__ = getattr(fn, "__name__", "fn")
            by_position.__signature__ = inspect.Signature(
                [inspect.Parameter(re.sub(r"\W", "_", name), inspect.Parameter.POSITIONAL_ONLY)
                 for name in arguments.names])
            self._keyword_functions[key] = tf.function(by_position, autograph=False)
        return self._keyword_functions[key]


def _describe_spec(value):
    """A traced argument in words: dtype and shape of a spec, or the Python value."""
    if isinstance(value, tf.TensorSpec):
        return f"{value.dtype.name}{list(value.shape)}"
    return repr(value)
