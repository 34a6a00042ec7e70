"""gt.function: trace, import, propagate, partition, lower and run a TF function."""

from __future__ import annotations

import functools
import inspect
import os
import re
import types

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh
from gspmd_tf.runtime.arguments import Arguments, is_static, signature_of
from gspmd_tf.runtime.lowering import check_entries, lower_traced
from gspmd_tf.runtime.sharded_tensor import ShardedTensor, split_value
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.spmd.windowed_einsum import threshold_of
from gspmd_tf.timeouts import check_timeout


# The built-in backends by name. "default" picks one by the mesh's platform (the XLA
# backend on accelerators, else the local one: backends/auto.for_platform); "auto" per
# program by multiply-adds (backends/auto.py), for users who opt in.
BACKENDS = ("default", "auto", "local", "xla")
DEFAULT_BACKEND = "default"


def backend_factory(backend, collective_timeout):
    """The factory (mesh -> gspmd_tf.backends.Backend) gt.function and gt.lower use.

    `backend`: a factory, used as it is; or "default" (XlaBackend on a mesh of
    accelerators, else LocalBackend: backends/auto.for_platform), "auto" (AutoBackend:
    XlaBackend or LocalBackend, chosen per program), "xla" (XlaBackend: compute between
    collectives compiled by XLA), "local" (LocalBackend: every op emitted op by op) or
    None for the GSPMD_TF_BACKEND environment variable, else DEFAULT_BACKEND.
    `collective_timeout` applies to the built-in backends only.
    """
    if callable(backend):
        if collective_timeout is not None:
            raise ValueError("collective_timeout applies to the built-in backends: give it "
                             "to your backend instead")
        return backend
    name = backend or os.environ.get("GSPMD_TF_BACKEND") or DEFAULT_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} (or GSPMD_TF_BACKEND): use one of {BACKENDS} or "
                         "a factory mesh -> gspmd_tf.backends.Backend")
    from gspmd_tf.backends.auto import AutoBackend, for_platform
    from gspmd_tf.backends.local import LocalBackend
    from gspmd_tf.backends.xla import XlaBackend
    if collective_timeout is not None:
        check_timeout(collective_timeout)
    cls = {"default": for_platform, "auto": AutoBackend, "local": LocalBackend,
           "xla": XlaBackend}[name]
    return functools.partial(cls, collective_timeout=collective_timeout)


def function(fn=None, *, mesh, in_shardings=None, out_shardings=None, backend=None,
             collective_timeout=None, windowed_einsum=False):
    """Partition `fn` over `mesh`; usable as `@gt.function(mesh=...)` or `gt.function(f, ...)`.

    in_shardings: one entry per argument, matched to fn's parameters in signature order
    whether passed by position or keyword (a PartitionSpec, a gt.Sharding, or None to
    infer; None for Python values, which are static); out_shardings: one per flat
    output, likewise. Calls return
    ShardedTensors in the structure `fn` returns. collective_timeout: seconds a call may
    take before it is cancelled with DeadlineExceededError (default: the
    GSPMD_TF_COLLECTIVE_TIMEOUT environment variable, else 300; 0 for no limit); for
    the built-in backends only. `backend`: "default" (by platform: the XLA backend on
    accelerators, the local one on CPUs and several workers), "auto" (opt-in: the XLA
    backend where a multiply-add heuristic says it is faster, per program:
    backends/auto.py), "local" (op by op), "xla" (compute between collectives compiled
    by XLA), None (GSPMD_TF_BACKEND, else DEFAULT_BACKEND, "default"), or a factory
    mesh -> gspmd_tf.backends.Backend; see backend_factory. windowed_einsum: True, False (the default) or a size in bytes: a
    dot whose operand would be all-gathered (or whose result reduce-scattered) along a
    mesh axis, at least that big on one device, runs as a loop of local dots and
    collective-permutes that overlap (spmd/windowed_einsum.py).
    """
    threshold_of(windowed_einsum)  # a bad value fails here, not at the first call
    if fn is None:
        return functools.partial(function, mesh=mesh, in_shardings=in_shardings,
                                 out_shardings=out_shardings, backend=backend,
                                 collective_timeout=collective_timeout,
                                 windowed_einsum=windowed_einsum)
    return Function(fn, mesh, in_shardings, out_shardings,
                    backend_factory(backend, collective_timeout), windowed_einsum)


class Function:
    """A partitioned function: lowered once per input signature, then run.

    Called like the Python function: positional or keyword arguments; Python values
    (None, bool, int, float, str) are static, as in tf.function (a new value traces
    again); every other leaf is a tensor input. On a method (`@gt.function` in a class
    body) it binds `self` like tf.function does.

    Each device runs its part of the program: a tf.py_function or tf.numpy_function
    inside runs once per device per call (on that device's shard, or on the whole value
    where gspmd-tf runs the op replicated), so keep such functions free of side effects.
    """

    def __init__(self, fn, mesh, in_shardings, out_shardings, backend_factory,
                 windowed_einsum=False):
        if not isinstance(mesh, Mesh):
            raise ShardingError(f"gt.function needs mesh=gt.Mesh(...), got {mesh!r}: build "
                                "one with gt.Mesh.create(shape, axis_names)")
        check_entries("in_shardings", in_shardings, "argument")
        check_entries("out_shardings", out_shardings, "flat output")
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self._backend_factory = backend_factory
        self._windowed_einsum = windowed_einsum
        self._signature = signature_of(fn)
        self._traced = tf.function(fn, autograph=False)
        self._keyword_functions = {}  # see _keyword_traced
        self._cache = {}
        self._signatures = []  # traced arguments in words, for errors
        functools.update_wrapper(self, fn)

    def __get__(self, instance, owner=None):
        """`@gt.function` on a method: the Function of this instance, built once.

        It is kept in the instance's __dict__ (so it lives as long as the instance and
        keeps its traces); an instance without one gets a new Function, and traces, on
        every access.
        """
        if instance is None:
            return self
        state = getattr(instance, "__dict__", None)
        key = f"_gt_function_{id(self)}"
        method = None if state is None else state.get(key)
        if method is None:
            method = Function(types.MethodType(self.fn, instance), self.mesh, self.in_shardings,
                              self.out_shardings, self._backend_factory,
                              self._windowed_einsum)
            if state is not None:
                state[key] = method
        return method

    # ----------------------------------------------------------------- signature
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
            if leaf.mesh != self.mesh:
                raise ShardingError(f"argument {leaf!r} lives on another mesh; move it to "
                                    f"{self.mesh!r} first")
            return tf.TensorSpec(leaf.shape, leaf.dtype)
        if isinstance(leaf, tf.TensorSpec):
            return leaf
        try:
            value = leaf if isinstance(leaf, tf.Tensor) else tf.convert_to_tensor(leaf)
        except (TypeError, ValueError) as e:
            raise ShardingError(
                f"{self.name}: {arguments.describe(index)} ({type(leaf).__name__}) is "
                f"neither a tensor nor a Python value: {e}") from None
        return tf.TensorSpec(value.shape, value.dtype)

    def lower(self, *args, **kwargs):
        """Lower for these arguments (values or tf.TensorSpec); nothing runs."""
        return self._lower(self._arguments(args, kwargs))[0]

    def _lower(self, arguments):
        tensors = arguments.tensor_leaves()
        flat = [leaf for _, leaf in tensors]
        specs = [self._spec_of(arguments, i, leaf) for i, leaf in tensors]
        entries = [self._entry(i) for i, _ in tensors]
        committed = [leaf.layout if isinstance(leaf, ShardedTensor) else None for leaf in flat]
        # an argument's own layout matters only where in_shardings leaves it open
        key = (arguments.structure_key(),) + tuple(
            (tuple(s.shape), s.dtype, str(e) if e is not None else c)
            for s, e, c in zip(specs, entries, committed))
        if key not in self._cache:
            self._cache[key] = self._build(arguments, specs, entries, committed)
        return self._cache[key], flat

    def _trace(self, arguments, specs):
        """The ConcreteFunction for these arguments, tensors replaced by `specs`."""
        spec_of = dict(zip((id(leaf) for _, leaf in arguments.tensor_leaves()), specs))
        positional, keywords = arguments.call_structure(lambda leaf: spec_of[id(leaf)])
        shown = "(" + ", ".join(f"{n}: {_describe_spec(v)}" for n, v in zip(
            arguments.names, positional + list(keywords.values()))) + ")"
        try:
            if keywords:
                concrete = self._keyword_traced(arguments).get_concrete_function(
                    *positional, *keywords.values())
            else:
                concrete = self._traced.get_concrete_function(*positional)
        except (TypeError, ValueError) as e:
            e.add_note(f"while tracing gt.function {self.name!r} for {shown}" + (
                f"; earlier calls traced {', '.join(self._signatures)}: pass the same "
                "dtypes (e.g. np.asarray(x, np.float32)) to reuse their trace"
                if self._signatures else ""))
            raise
        self._signatures.append(shown)
        return concrete

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

    def _build(self, arguments, specs, entries, committed):
        return lower_traced(self._trace(arguments, specs), self.mesh, entries, committed,
                            self.out_shardings, self._backend_factory, self.name,
                            windowed_einsum=threshold_of(self._windowed_einsum))

    # ----------------------------------------------------------------- running
    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly():
            raise ShardingError(
                f"gt.function {self.name!r} was called while TensorFlow traces a graph "
                "(inside tf.function, a Keras model's call or a tf.data map); it runs "
                "eagerly: call it outside tf.function, or move the surrounding code into "
                "the gt.function")
        arguments = self._arguments(args, kwargs)
        lowered, flat = self._lower(arguments)
        self._check_not_taped(arguments, lowered)
        run = lowered.compile()
        program = lowered.program
        graph = lowered.graph
        copies = []  # read-only copies of variables of other meshes, alive for the run
        inputs = [self._shards(value, layout, copies) for value, layout in
                  zip(list(flat) + list(graph.captures), program.input_layouts)]
        outs = run(inputs)
        del copies
        results = [ShardedTensor(self.mesh, layout, lowered.graph.shape(ref),
                                 lowered.graph.dtype(ref), shards)
                   for ref, layout, shards in zip(lowered.graph.outputs,
                                                  program.output_layouts, outs)]
        return tf.nest.pack_sequence_as(lowered.structured_outputs, results,
                                        expand_composites=True)

    def _check_not_taped(self, arguments, lowered):
        """A GradientTape cannot see into the partitioned program: refuse a call whose
        gradient it would silently miss."""
        if not record.could_possibly_record():
            return
        for index, leaf in arguments.tensor_leaves():
            if isinstance(leaf, tf.Tensor) and record.should_record_backprop([leaf]):
                watched = arguments.describe(index)
                break
        else:
            trainable = [variable_of_handle(v) for v in lowered.graph.captures]
            watched = next((f"variable {v.name!r}" for v in trainable
                            if v is not None and v.trainable), None)
            if watched is None:
                return
        raise ShardingError(
            f"gt.function {self.name!r} was called under a tf.GradientTape that may "
            f"differentiate {watched}; the tape cannot see inside the partitioned program, "
            "so that gradient would be None. Take the gradient inside the gt.function "
            "(open the tape in it and return or apply the gradients, as a training step "
            "does), or call it outside the tape")

    def _shards(self, value, layout, copies):
        """Per-device shards of one program input in `layout` (variables: the handles
        of their shard variables; a variable of another mesh: of copies of its value
        resharded onto this mesh, appended to `copies`)."""
        variable = variable_of_handle(value)
        if variable is not None and variable.mesh == self.mesh:
            return [None if v is None else v.handle for v in variable.shard_variables]
        if variable is not None:
            handles = [None] * self.mesh.size
            local = set(self.mesh.addressable_ids)
            for devices, piece in variable.sharded().pieces_on(self.mesh, layout):
                for device in (d for d in devices if d in local):
                    with tf.device(self.mesh.devices[device]):
                        copies.append(tf.Variable(piece, trainable=False))
                    handles[device] = copies[-1].handle
            return handles
        if isinstance(value, ShardedTensor):
            if value.layout == layout:
                return value.shards
            value = value.numpy()
        elif hasattr(value, "numpy"):
            value = value.numpy()
        return split_value(np.asarray(value), self.mesh, layout)


def _describe_spec(value):
    """A traced argument in words: dtype and shape of a spec, or the Python value."""
    if isinstance(value, tf.TensorSpec):
        return f"{value.dtype.name}{list(value.shape)}"
    return repr(value)
