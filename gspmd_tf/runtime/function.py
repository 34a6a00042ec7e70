"""The entry points: gt.function (trace, lower and run a TF function, per input
signature) and gt.lower (the same stages, nothing run).

    trace (runtime/trace.py) -> import, propagate, partition (runtime/lowering.py)
      -> Lowered (runtime/lowered.py) -> compile (a backend) -> run (Function.__call__)
"""

from __future__ import annotations

import functools
import os
import types
from typing import Callable, Optional, Sequence, Union

import tensorflow as tf
from tensorflow.python.eager import record

from gspmd_tf.backends.replicas import copy_owners
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.runtime import sharded_tensor
from gspmd_tf.runtime.lowered import Lowered
from gspmd_tf.runtime.lowering import lower_traced
from gspmd_tf.runtime.options import LowerOptions, check_entries, check_memory_limit
from gspmd_tf.runtime.sharded_tensor import ShardedTensor, place_value
from gspmd_tf.runtime.trace import Call, Tracer
from gspmd_tf.runtime.variables import variable_of_handle
from gspmd_tf.sharding import Sharding
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
             collective_timeout=None, windowed_einsum=False, memory_limit=None,
             strict=False, layout_map=None):
    """Partition `fn` over `mesh`; usable as `@gt.function(mesh=...)` or `gt.function(f, ...)`.

    in_shardings: one entry per argument, matched to fn's parameters in signature order
    whether passed by position or keyword (a PartitionSpec, a gt.Sharding, None to
    infer, or gt.AUTO for the auto-sharding search to choose; None for Python values,
    which are static); out_shardings: one per flat output, likewise. memory_limit:
    the per-device bytes the search must fit its plan of the AUTO entries in (None: no
    limit; see gspmd_tf/autoshard; lowered.auto_report() shows the plan). Calls return
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
    collective-permutes that overlap (spmd/windowed_einsum.py). strict: lowering
    raises gt.ShardingError where the partitioner would move data on its own (an
    all-gather, all-to-all or collective-permute, or a replicated fallback), naming
    the op, its source line and the annotation that would ask for it explicitly;
    movement at the user's own shardings and the sums of contractions are allowed
    (runtime/strict.py). layout_map: variable-path
    regexes -> PartitionSpecs (as gt.keras.shard_model reads them; a tf.Variable's path
    is its name without ":0"): the plain tf.Variables `fn` captures (Keras 2 / tf_keras
    layers, tf.Module models) are taken over in place as gt.Variables split as it says,
    replicated where no key matches (runtime/plain_variables.py); without it a captured
    plain tf.Variable is a ShardingError.
    """
    threshold = threshold_of(windowed_einsum)  # a bad value fails here, not at the first call
    if fn is None:
        return functools.partial(function, mesh=mesh, in_shardings=in_shardings,
                                 out_shardings=out_shardings, backend=backend,
                                 collective_timeout=collective_timeout,
                                 windowed_einsum=windowed_einsum, memory_limit=memory_limit,
                                 strict=strict, layout_map=layout_map)
    factory = backend_factory(backend, collective_timeout)
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"gt.function needs mesh=gt.Mesh(...), got {mesh!r}: build "
                            "one with gt.Mesh.create(shape, axis_names)")
    check_entries("in_shardings", in_shardings, "argument")
    check_entries("out_shardings", out_shardings, "flat output")
    options = LowerOptions(mesh, factory, _name_of(fn), out_shardings=out_shardings,
                           windowed_einsum=threshold,
                           memory_limit=check_memory_limit(memory_limit), strict=strict)
    return Function(fn, in_shardings, options, layout_map)


def lower(fn, mesh: Mesh, in_shardings: Optional[Sequence] = None,
          out_shardings: Optional[Sequence] = None, *, args: Optional[Sequence] = None,
          backend: Union[str, Callable, None] = None,
          collective_timeout: Optional[float] = None,
          windowed_einsum: Union[bool, int] = False,
          memory_limit: Optional[int] = None, strict: bool = False) -> Lowered:
    """Lower `fn` over `mesh` without running it: a gt.Lowered (shardings, collectives,
    report(), compile()).

    `fn` is one of
      - a tf ConcreteFunction (`tf.function(f).get_concrete_function(*specs)`): its flat
        tensor arguments are the program's inputs;
      - a Graph of gspmd_tf.graph (already imported): its `inputs` before its captures;
      - a Python function or tf.function, traced on `args` (values or tf.TensorSpec, in
        the order of its parameters), exactly as `gt.function(fn, ...).lower(*args)`.
    in_shardings: one entry per input (a PartitionSpec, a gt.Sharding, or None to infer);
    out_shardings: one per flat output, likewise (gt.AUTO: the search chooses). `backend`
    / `collective_timeout` as in gt.function (used by compile()), `windowed_einsum`,
    `memory_limit` and `strict`. The returned object's
    `stage_seconds` gives the wall time of import, propagate and partition.
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"gt.lower needs a gt.Mesh, got {mesh!r}: build one with "
                            "gt.Mesh.create(shape, axis_names) or gt.Mesh.abstract(...)")
    factory = backend_factory(backend, collective_timeout)
    threshold = threshold_of(windowed_einsum)
    memory_limit = check_memory_limit(memory_limit)
    if not isinstance(fn, (Graph, tf.types.experimental.ConcreteFunction)):
        if args is None:
            raise ShardingError(f"gt.lower({fn!r}): give args=(...) (values or "
                                "tf.TensorSpec) to trace the function on, or pass a "
                                "ConcreteFunction")
        check_entries("out_shardings", out_shardings, "flat output")
        name = _name_of(fn)
        tracer = Tracer(fn, mesh, in_shardings, name)
        call = tracer.call(tuple(args), {})
        options = LowerOptions(mesh, factory, name, out_shardings=out_shardings,
                               windowed_einsum=threshold, memory_limit=memory_limit,
                               strict=strict)
        return lower_traced(tracer.trace(call), options, call.entries, call.committed)
    if args is not None:
        raise ShardingError("gt.lower: args are for a Python function; a ConcreteFunction "
                            "or Graph is already traced")
    check_entries("in_shardings", in_shardings, "argument")
    name = getattr(fn, "name", None) or "program"
    name = name.decode() if isinstance(name, bytes) else name
    options = LowerOptions(mesh, factory, name, caller="gt.lower",
                           out_shardings=out_shardings, windowed_einsum=threshold,
                           memory_limit=memory_limit, strict=strict)
    return lower_traced(fn, options, in_shardings)


def _name_of(fn):
    """The name errors and logs give a Python function."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


class Function:
    """A partitioned function: lowered once per input signature, then run.

    Called like the Python function: positional or keyword arguments; Python values
    (None, bool, int, float, str) are static, as in tf.function (a new value traces
    again); every other leaf is a tensor input. On a method (`@gt.function` in a class
    body) it binds `self` like tf.function does.

    Each device runs its part of the program; a tf.py_function or tf.numpy_function
    inside runs once per call (per loop iteration) on its whole inputs, as on one device,
    and every device gets its result.
    Made by gt.function: `options` are its LowerOptions.
    """

    def __init__(self, fn: Callable, in_shardings: Optional[Sequence], options: LowerOptions,
                 layout_map=None):
        self.fn = fn
        self.layout_map = layout_map
        self.name = options.name
        self.mesh = options.mesh
        self.in_shardings = in_shardings
        self.out_shardings = options.out_shardings
        self.options = options
        self._tracer = Tracer(fn, options.mesh, in_shardings, options.name, layout_map)
        self._cache = {}  # Call.key -> Lowered
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
            method = Function(types.MethodType(self.fn, instance), self.in_shardings,
                              self.options, self.layout_map)
            if state is not None:
                state[key] = method
        return method

    def lower(self, *args, **kwargs) -> Lowered:
        """Lower for these arguments (values or tf.TensorSpec); nothing runs."""
        return self._lower(self._tracer.call(args, kwargs))

    def _lower(self, call: Call) -> Lowered:
        """The Lowered of `call`'s input signature (traced and lowered on first use)."""
        lowered = self._cache.get(call.key)
        if lowered is None:
            lowered = self._cache[call.key] = lower_traced(
                self._tracer.trace(call), self.options, call.entries, call.committed)
        return lowered

    # ----------------------------------------------------------------- running
    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly():
            raise ShardingError(
                f"gt.function {self.name!r} was called while TensorFlow traces a graph "
                "(inside tf.function, a Keras model's call or a tf.data map); it runs "
                "eagerly: call it outside tf.function, or move the surrounding code into "
                "the gt.function")
        call = self._tracer.call(args, kwargs)
        lowered = self._lower(call)
        self._check_not_taped(call.arguments, lowered)
        run = lowered.compile()
        program = lowered.program
        graph = lowered.graph
        copies = []  # read-only copies of variables of other meshes, alive for the run
        shared = run.shares_variable_copies
        inputs = [self._shards(value, layout, graph.dtype(ref), copies,
                               program.input_placements.get(i, self.mesh), shared)
                  for i, (value, layout, ref) in enumerate(zip(
                      list(call.flat) + list(graph.captures), program.input_layouts,
                      graph.inputs))]
        try:
            outs = run(inputs)
        except BaseException:
            if not shared:
                for value in list(call.flat) + list(graph.captures):
                    variable = variable_of_handle(value)
                    if variable is not None and variable.mesh == self.mesh:
                        variable.private_copies_differ()
            raise
        del copies
        # an output whose out_shardings entry orders the devices otherwise is on a mesh
        # of that order (Sharding.placement)
        results = [ShardedTensor(program.output_placements.get(j, self.mesh), layout,
                                 graph.shape(ref), graph.dtype(ref), shards)
                   for j, (ref, layout, shards) in enumerate(zip(
                       graph.outputs, program.output_layouts, outs))]
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

    def _shards(self, value, layout, dtype, copies, placed, shared):
        """Per-device shards of one program input of `dtype` in `layout` placed as on
        mesh `placed` (this mesh, or its devices in the order an in_shardings entry
        names), split on the devices (sharded_tensor.place_value); variables: the
        handles of their shard variables (Variable.handles: `shared` is the program's
        Compiled.shares_variable_copies); a variable of another mesh: of copies of its
        value resharded onto this mesh (one per class of copy owners if `shared`),
        appended to `copies`."""
        variable = variable_of_handle(value)
        if variable is not None and variable.mesh == self.mesh:
            return variable.handles(shared)
        if variable is not None:
            handles = [None] * self.mesh.size
            owners = copy_owners(self.mesh, layout) if shared else range(self.mesh.size)
            local = set(self.mesh.addressable_ids)
            for devices, piece in variable.sharded().pieces_on(self.mesh, layout):
                for device in (d for d in devices if d in local):
                    if owners[device] != device:  # its owner came first
                        handles[device] = handles[owners[device]]
                        continue
                    with tf.device(self.mesh.devices[device]):
                        copies.append(tf.Variable(piece, trainable=False))
                    handles[device] = copies[-1].handle
            return handles
        if isinstance(value, ShardedTensor):
            same = value.layout == layout and (value.mesh is placed or value.mesh == placed)
            if same or value.sharding == Sharding.from_layout(placed, layout):
                return value.shards
            value = value.numpy()
        elif getattr(value, "dtype", None) == tf.resource:
            raise ShardingError(
                f"gt.function {self.name!r} was traced reading a gt.Variable that no "
                "longer exists (deleted, e.g. created again under the same Python name by "
                "re-running a notebook cell); its cached program cannot read the new one: "
                "create the gt.function again after the variables it reads, or keep the "
                "old variable alive")
        return place_value(value, placed, layout, dtype)


_REPLICATE = {}  # mesh -> the gt.function copying a tensor of that mesh to every device


def _replicated(tensor: ShardedTensor) -> ShardedTensor:
    """`tensor` replicated on every device of its mesh, by a gt.function whose outputs
    are replicated (its all-gathers run over TF's collectives between the workers)."""
    mesh = tensor.mesh
    if mesh not in _REPLICATE:
        _REPLICATE[mesh] = function(tf.identity, mesh=mesh, out_shardings=(PartitionSpec(),))
    return _REPLICATE[mesh](tensor)


# ShardedTensor reads a value some workers do not hold with this program; it is set
# here because the program runner sits above the value type.
sharded_tensor.set_replicator(_replicated)
