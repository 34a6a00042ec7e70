"""The fuzzer's worker process: runs programs partitioned and on one device, compares.

    python benchmarks/fuzz_worker.py      (started by benchmarks/fuzz.py, not by hand)

Reads one JSON request a line on stdin ({"id": ..., "program": {...}}, optionally
"part": "reference" or "partitioned" to run only that side, "reference_values" to answer
single-device TF's values (encoded, in "detail"), or "reference": such values to compare
with instead of this process's own reference; see run_program), answers one
JSON line per request on its stdout: {"id", "status", "detail", "seconds"} with status

  pass      every output (and every device's shard of it) equals single-device TF
  mismatch  a value, shape, dtype, shard or output sharding differs
  error     the partitioned run raised (the program is valid: the reference ran)
  invalid   single-device TF itself rejected the program (a generator bug, not gspmd-tf's),
            or returned a shape its own shape inference contradicts (a TF kernel bug),
            or fails as a tf.function with the error gspmd-tf's run raised

TensorFlow is imported once per worker; C-level writes to stdout go to stderr, so the
answer channel carries only answers. Crashes and hangs are seen by the parent.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GSPMD_TF_COLLECTIVE_TIMEOUT", "20")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from fuzz_programs import loosest, output_precisions, source, watched  # noqa: E402

# The traced single-device programs a partitioned result may equal instead of the eager
# one: (jit_compile, in words). The XLA backend compiles the program's compute with TF's
# XLA bridge (as the default, auto, does for most programs) and so has XLA's semantics
# where they differ from TF's kernels, as
# tf.function(jit_compile=True) has on one device (e.g. XLA's minimum and maximum return
# a number where TF's return NaN; fuzz seed 46 #553, #28 under --backend=xla).
TRACED_REFERENCES = ((None, "in graph mode"),) + (
    ((True, "under XLA (jit_compile)"),)
    if os.environ.get("GSPMD_TF_BACKEND") in ("xla", "auto") else ())

# Relative error bound (norm of the error over norm of the value, finite entries) per
# dtype: float32 as the test suite; half types only as loose as their precision forces.
TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "float16": 5e-3, "bfloat16": 4e-2}


class Mismatch(Exception):
    """A partitioned value that differs from single-device TF."""


def check_values(got, want, what, precision, scale=None, exact=None, terms=None):
    """Raise Mismatch unless `got` equals `want` (NaN/Inf positions exactly, finite
    floats within the relative error of `precision`, the least precise float type the
    value was computed in, or else no further from `exact` than `want` is, up to the
    tolerance relative to `terms`, see as_accurate; everything else exactly)."""
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape} != {want.shape}")
    name = str(want.dtype)
    if name not in TOLERANCE or precision is None:
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)
            raise Mismatch(f"{what}: {len(bad)} of {want.size} values differ, first at "
                           f"{tuple(bad[0])}: {got[tuple(bad[0])]} != {want[tuple(bad[0])]}")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    kind_g, kind_w = value_kinds(g), value_kinds(w)
    # Where TF's value is of another kind than the float64 program's non-finite one (TF
    # overflowed to NaN, say, where the float64 program gives -Inf: seed 21 #8884), ours
    # may be of the float64 program's kind; where both are non-finite of different
    # kinds, the kind is an accident of summation order (seed 20 #4063: TF's float32
    # einsum gives -Inf, the same sum in reverse order +Inf, the float64 program +Inf,
    # the float32 values summed in float64 7.5e37) and any non-finite value of ours is.
    # Where the magnitudes of the terms a value sums overflow the float64 program too
    # (`terms` non-finite), no float64 order decides the kind either: a float64 matmul
    # of unsorted_segment_min's fill value (the float64 maximum) gives TF +Inf and a
    # split contraction +Inf + -Inf = NaN (seed 35 #7919); where TF's value is
    # non-finite there, any non-finite value of ours is as good.
    closer = False
    if exact is not None:
        kind_e = value_kinds(exact)
        disputed = (kind_w != kind_e) & (kind_e != 0)
        closer = disputed & ((kind_g == kind_e) | ((kind_w != 0) & (kind_g != 0)))
    if terms is not None:
        overflowing = ~np.isfinite(np.asarray(terms, np.float64))
        closer = closer | (overflowing & (kind_w != 0) & (kind_g != 0))
    if not np.all((kind_g == kind_w) | closer):
        where = tuple(np.argwhere((kind_g != kind_w) & ~closer)[0])
        label = KIND_NAMES[max(kind_g[where], kind_w[where])]
        raise Mismatch(f"{what}: {label} positions differ, e.g. at {where}: "
                       f"{g[where]} vs {w[where]}")
    finite = (kind_g == 0) & (kind_w == 0)
    if scale is None:
        scale = np.linalg.norm(w[finite])
    err = np.linalg.norm(g[finite] - w[finite]) / max(scale, 1e-30)
    if err > TOLERANCE[precision] and not as_accurate(g, w, exact, finite, precision,
                                                      terms):
        where = np.unravel_index(np.argmax(np.where(finite, np.abs(g - w), -1)), w.shape)
        raise Mismatch(f"{what}: relative error {err:.2e} > {TOLERANCE[precision]} "
                       f"(e.g. at {tuple(int(i) for i in where)}: {g[where]} vs {w[where]})")


KIND_NAMES = ("finite", "NaN", "+Inf", "-Inf")


def value_kinds(values):
    """Per element: 0 finite, 1 NaN, 2 +Inf, 3 -Inf (the indices of KIND_NAMES)."""
    values = np.asarray(values, np.float64)
    return np.select([np.isnan(values), np.isposinf(values), np.isneginf(values)],
                     [1, 2, 3], 0)


def as_accurate(got, want, exact, finite, precision, terms=None):
    """Whether `got` is no further from `exact` (the same program with every float32,
    float16 and bfloat16 made float64) than single-device TF's `want` is, up to the
    tolerance relative to `terms` (the magnitude of the terms each exact value sums, see
    summed_magnitude; |exact| when not given): then the difference from TF is rounding
    error (a float32 sum of terms that cancel is off by up to n*eps*sum|x| in any order,
    which can be far more than eps*|sum x|: seed 24 #1489, the gradient of a shift
    before a softmax, 0 in real arithmetic, sum|x| 0.335, TF 5.2e-8, gspmd-tf 9.3e-8;
    TF sums float16 sequentially in float16, seed 21 #5883: 0.4011, the float64 program
    0.4080, gspmd-tf's partial sums 0.4062)."""
    if exact is None:
        return False
    e = exact.astype(np.float64)
    # where ours and TF's are finite the float64 program must be; it may be finite where
    # both overflowed float32 alike (seed 29 #8498: exp of values past 88)
    if not np.all(np.isfinite(e)[finite]):
        return False
    scale = np.abs(e) if terms is None else np.asarray(terms, np.float64)
    return (np.linalg.norm(got[finite] - e[finite])
            <= np.linalg.norm(want[finite] - e[finite])
            + TOLERANCE[precision] * np.linalg.norm(scale[finite]))


# Ops each of whose results is one value of their first input, moved, selected or
# re-typed: the same op on that input's term magnitudes gives the result's.
_MOVING = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims", "Cast", "Slice",
                     "StridedSlice", "GatherV2", "Transpose", "Roll", "Tile", "ReverseV2",
                     "BroadcastTo", "XlaSharding"})
# Ops that scale their operand by a constant: the magnitude scales alike.
_SCALING = frozenset({"Mul", "RealDiv"})
# Ops each of whose results is a sum of products of input values with constant
# non-negative coefficients: the same op on the inputs' magnitudes gives the magnitude
# of the terms it sums. A difference is a sum of the magnitudes.
_SUMMING = frozenset({
    "Sum", "Mean", "AddN", "AddV2", "BiasAdd", "BiasAddGrad", "MatMul", "BatchMatMulV2",
    "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D", "Conv2DBackpropFilter",
    "Conv2DBackpropInput", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput", "UnsortedSegmentSum", "SegmentSum", "Cumsum"})


_CROSS_ENTROPY = frozenset({"SoftmaxCrossEntropyWithLogits",
                            "SparseSoftmaxCrossEntropyWithLogits"})


def cross_entropy_magnitude(tf, op):
    """A bound of the terms a cross-entropy loss sums, per example: sum_j labels_j *
    (logsumexp(logits) - logits_j) cancels terms up to sum_j |labels_j| * (|logsumexp| +
    max_j |logits_j|) (a sparse label weighs one class); a partitioned class dim sums
    them in another order (seed 37 #3936: soft labels, float32, 1.7e-5 relative off TF
    by a cancellation)."""
    logits, labels = op.inputs[0], op.inputs[1]
    lse = tf.abs(tf.reduce_logsumexp(logits, axis=-1))
    bound = lse + tf.reduce_max(tf.abs(logits), axis=-1)
    if op.type == "SparseSoftmaxCrossEntropyWithLogits":
        return bound
    return tf.reduce_sum(tf.abs(labels), axis=-1) * bound


def summed_magnitude(tf, tensor):
    """The magnitude of the terms that graph tensor `tensor` (traced in a tf.function, in
    float64) sums at its last summing op, carried through the ops after it that move,
    select or re-type values (_MOVING) or scale them by a constant (_SCALING, seed 36
    #4500: a slice of a loop's half of a cross-entropy): that op re-created on the
    absolute values of its floating inputs (a Sub as an AddV2); |tensor| where that op
    sums nothing (see _SUMMING). A float32 sum of those terms in any order is off by up
    to n*eps times this, however small the sum itself is.
    An Exp's result is |exp(x)| * max(1, |x|): a relative rounding error r of x (a sum's
    partial sums in another order) changes exp(x) by a relative x*r (seed 29 #8498,
    exp of about 79: TF 1.24e-5 and gspmd-tf 2.76e-5 off the float64 program, 1.3 and 3
    units of float32 rounding of the argument)."""
    if not tensor.dtype.is_floating:
        return tensor
    op = tensor.op
    if op.type in _MOVING and op.inputs[0].dtype.is_floating:
        inner = summed_magnitude(tf, op.inputs[0])
        if op.type == "Cast":
            return tf.cast(inner, tensor.dtype)
        attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith("_")}
        return op.graph.create_op(op.type, [inner] + list(op.inputs[1:]),
                                  [tensor.dtype], attrs=attrs).outputs[0]
    constant = [k for k, t in enumerate(op.inputs) if t.op.type == "Const"]
    if op.type in _SCALING and len(op.inputs) == 2 and constant and (
            op.type == "Mul" or constant == [1]):
        other = summed_magnitude(tf, op.inputs[1 - constant[0]])
        scale = tf.abs(op.inputs[constant[0]])
        return tf.broadcast_to(other * scale if op.type == "Mul" else other / scale,
                               tf.shape(tensor))
    if op.type == "Exp":
        scale = tf.maximum(tf.abs(op.inputs[0]), tf.ones_like(op.inputs[0]))
        return tf.abs(tensor) * scale
    if op.type in _CROSS_ENTROPY and tensor.value_index == 0:
        return tf.cast(cross_entropy_magnitude(tf, op), tensor.dtype)
    if (op.type in _SUMMING or op.type == "Sub") and len(op.outputs) == 1:
        inputs = [tf.abs(t) if t.dtype.is_floating else t for t in op.inputs]
        attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith("_")}
        return op.graph.create_op("AddV2" if op.type == "Sub" else op.type, inputs,
                                  [tensor.dtype], attrs=attrs).outputs[0]
    return tf.abs(tensor)


def unrolling_while_loops(tf):
    """A stand-in for the tf module whose while_loop runs the body as straight-line code
    when its counter starts from a constant and the condition depends on the counter
    alone (the fuzzer's loops: `i_ < trips`), so that summed_magnitude sees through the
    loop; any other loop stays a tf.while_loop."""
    def while_loop(cond, body, loop_vars, **kwargs):
        start = tf.get_static_value(loop_vars[0])
        values = (int(start),) + tuple(loop_vars[1:]) if start is not None else None
        while values is not None:
            go = cond(*values)
            if not isinstance(go, (bool, np.bool_)):
                break
            if not go:
                return values
            values = tuple(body(*values))
        return tf.while_loop(cond, body, loop_vars, **kwargs)

    class Module:  # pylint: disable=too-few-public-methods
        def __getattr__(self, name):
            return while_loop if name == "while_loop" else getattr(tf, name)
    return Module()


def check_output(got, want, spec, mesh, what, precision, exact=None, terms=None):
    """Compare one ShardedTensor with the single-device value: the assembled value,
    every device's shard (replicas must agree) and the requested out_sharding."""
    from gspmd_tf.layout import Layout
    from gspmd_tf.mesh import PartitionSpec
    from gspmd_tf.runtime.sharded_tensor import shard_bounds

    want = np.asarray(want)
    if tuple(got.shape) != want.shape or got.dtype.as_numpy_dtype != want.dtype:
        raise Mismatch(f"{what}: {got.shape} {got.dtype.name} != {want.shape} "
                       f"{want.dtype}")
    check_values(got.numpy(), want, what, precision, exact=exact, terms=terms)
    finite = want[np.isfinite(want)] if want.dtype.kind == "f" or str(want.dtype) in \
        TOLERANCE else None
    scale = None if finite is None else np.linalg.norm(finite.astype(np.float64))
    local = got.layout.local_shape(mesh, want.shape)
    for device, shard in enumerate(got.shards):
        value = np.asarray(shard.numpy())
        if value.shape != local:
            raise Mismatch(f"{what}: device {device} holds shape {value.shape}, "
                           f"expected {local}")
        bounds = shard_bounds(mesh, got.layout, want.shape, device)
        valid = value[tuple(slice(0, b - a) for a, b in bounds)]
        box = tuple(slice(a, b) for a, b in bounds)
        check_values(valid, want[box], f"{what} on device {device}", precision, scale,
                     None if exact is None else np.asarray(exact)[box],
                     None if terms is None else np.asarray(terms)[box])
    if spec is not None:
        expected = Layout.from_spec(mesh, PartitionSpec(*spec), want.ndim)
        if got.layout.dims != expected.dims:
            raise Mismatch(f"{what}: sharding {got.layout} but out_shardings asked "
                           f"for {expected}")


def first_line(exc):
    """`Type: the line of the message that says what went wrong`, short (for TF's
    "Graph execution error:" the line before the failing node's name)."""
    lines = [l.strip() for l in str(exc).strip().splitlines() if l.strip()]
    if lines and lines[0].startswith("Graph execution error"):
        lines = [l for l in lines if not l.startswith(("[[", "File ", "Detected at",
                                                         "Graph execution"))][-1:]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def declared_shapes(program):
    """The shapes TF's shape inference gives f's outputs (the generator mirrors it):
    the outputs', then the gradients' (their inputs' shapes)."""
    shapes = {op["out"]: op["shape"] for op in program["ops"]}
    shapes.update({i["name"]: i["shape"] for i in program["inputs"]})
    result = [tuple(shapes[o]) for o in program["outputs"]]
    if program["grad"]:
        result += [tuple(shapes[name]) for name in watched(program)]
    return result


def program_scope(program_text, partitioned, tf, gt):
    """The names of the program `program_text` (source(program)) once executed: f, args,
    mesh, in/out_shardings, its variables (gt.Variables if `partitioned`, else
    tf.Variables)."""
    scope = {"np": np, "tf": tf, "gt": gt, "P": gt.P}

    def make_variable(value, spec, name):
        if partitioned:
            return gt.Variable(value, scope["mesh"], spec, name=name)
        return tf.Variable(value, name=name)
    scope["make_variable"] = make_variable
    exec(program_text, scope)  # noqa: S102 - the program is our own generated text
    return scope


def as_float64(program_text):
    """The program with every float32, float16 and bfloat16 made float64."""
    return re.sub(r"\b(bfloat16|float16|float32)\b", "float64", program_text)


def encode_values(values):
    """(outputs per call, variables) of numpy arrays as JSON-able data."""
    def one(array):
        return {"dtype": str(array.dtype), "shape": list(array.shape),
                "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}
    return [[[one(a) for a in call] for call in values[0]], [one(a) for a in values[1]]]


def decode_values(data, tf):
    """encode_values' inverse (tf resolves dtype names numpy lacks, e.g. bfloat16)."""
    def one(item):
        dtype = tf.as_dtype(item["dtype"]).as_numpy_dtype
        return np.frombuffer(base64.b64decode(item["data"]), dtype).reshape(item["shape"])
    return [[one(a) for a in call] for call in data[0]], [one(a) for a in data[1]]


def run_program(program, tf, gt, part=None, given_reference=None):
    """Run one program; returns (status, detail). A program with variables runs twice
    (the second call sees the first one's updates) and its variables are compared
    after both calls. part "reference" or "partitioned" runs only that side, compares
    nothing and returns ("pass", "") (the driver uses it to tell whose crash a crash
    is); part "reference_values" returns ("pass", encode_values(reference)). With
    `given_reference` (decode_values' result: single-device TF's values from another
    process, e.g. one with TF's other CPU kernels) the partitioned result is compared
    with it alone.

    The reference is single-device TF run eagerly. Where TF contradicts itself the
    program says nothing about gspmd-tf: a result whose shape is not the one TF's own
    shape inference gives is a TF kernel bug (status invalid); and a partitioned result
    that differs from the eager one but equals what single-device TF computes in graph
    mode (a tf.function, as gspmd-tf runs; under the XLA backend also with
    jit_compile, see TRACED_REFERENCES) passes: it is what TF does. A mismatch
    against an eager result that running the program again does not reproduce is TF's
    too (status invalid): a kernel reading uninitialised memory (the filter gradient of
    a float16/float64 depthwise conv over an empty batch, seed 21 #9520) or corrupting
    the heap (oneDNN's batch matmul broadcasting (5, 1, 8, 2) @ (2, 2), seed 24 #3785)."""
    variables = [v["name"] for v in program.get("variables", ())]
    calls = 2 if variables else 1
    text = source(program)

    def fresh_scope(partitioned, program_text=text):
        return program_scope(program_text, partitioned, tf, gt)

    def reference(graph_mode, program_text=text, jit_compile=None):
        """Single-device TF's outputs of every call, and its final variables; traced as a
        tf.function (with `jit_compile`) when `graph_mode`."""
        with tf.device("/device:CPU:0"):  # eagerly: no tracing cost
            scope = fresh_scope(partitioned=False, program_text=program_text)
            f = tf.function(scope["f"], autograph=False, jit_compile=jit_compile) \
                if graph_mode else scope["f"]
            outs = [f(*[tf.convert_to_tensor(a) for a in scope["args"]])
                    for _ in range(calls)]
        # .numpy(), not np.asarray(tensor): a 0-d bfloat16 tensor's __array__ gives a scalar
        return ([[np.asarray(w.numpy()) for w in call] for call in outs],
                [scope[name].numpy() for name in variables])

    def summed_magnitudes(program_text, exact):
        """summed_magnitude of every output of every call of the program (traced, as a
        tf.function), or None for an output whose traced value is not `exact`'s (the
        eager outputs of the same program: grappler rewrites the traced one); None for
        all when TF cannot run the traced program (then the rule is relative to
        |exact|)."""
        try:
            with tf.device("/device:CPU:0"):
                scope = program_scope(program_text, False, unrolling_while_loops(tf), gt)

                def with_magnitudes(*args):
                    outs = [tf.convert_to_tensor(t) for t in scope["f"](*args)]
                    return outs + [summed_magnitude(tf, t) for t in outs]
                f = tf.function(with_magnitudes, autograph=False)
                calls = [f(*[tf.convert_to_tensor(a) for a in scope["args"]])
                         for _ in range(len(exact))]
        except Exception:  # noqa: BLE001 - e.g. a kernel graph mode lacks
            return None
        result = []
        for call, values in zip(calls, exact):
            n = len(values)
            result.append([
                terms.numpy() if same_value(out.numpy(), value, terms.numpy()) else None
                for out, terms, value in zip(call[:n], call[n:], values)])
        return result

    def partitioned():
        """gspmd-tf's outputs of every call and final variables, and the program's names."""
        scope = fresh_scope(partitioned=True)
        fn = gt.function(scope["f"], mesh=scope["mesh"], in_shardings=scope["in_shardings"],
                         out_shardings=scope["out_shardings"])
        return ([fn(*scope["args"]) for _ in range(calls)],
                [scope[name].sharded() for name in variables]), scope

    if part == "reference_values":
        try:
            return "pass", encode_values(reference(graph_mode=False))
        except Exception as exc:  # noqa: BLE001 - the driver then keeps its verdict
            return "error", first_line(exc)
    if given_reference is not None:
        try:
            got, scope = partitioned()
            compare(program, got, given_reference, scope)
            return "pass", ""
        except Exception as exc:  # noqa: BLE001 - a mismatch or error: the verdict stands
            return "mismatch", first_line(exc)
    if part is not None:
        try:
            partitioned() if part == "partitioned" else reference(graph_mode=False)
        except Exception as exc:  # noqa: BLE001 - the driver asks only whether it dies
            return "error", first_line(exc)
        return "pass", ""
    try:
        want = reference(graph_mode=False)
    except Exception as exc:  # noqa: BLE001 - any failure here is the generator's
        return "invalid", first_line(exc)
    for i, (w, shape) in enumerate(zip(want[0][0], declared_shapes(program))):
        if w.shape != shape:
            return "invalid", (f"output {i}: single-device TF returned shape {w.shape}, its "
                               f"shape inference says {shape}")
    try:
        got, scope = partitioned()
    except Exception as exc:  # noqa: BLE001 - every exception of a valid program counts
        graph_error = fails_in_graph_mode_too(exc, lambda: reference(graph_mode=True), tf)
        if graph_error:
            return "invalid", ("single-device TF in graph mode (a tf.function, as gspmd-tf "
                               "runs) fails the same way: " + graph_error)
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                      if "gspmd_tf" in f.filename), "")
        return "error", first_line(exc) + (f" [{where}]" if where else "")
    try:
        compare(program, got, want, scope)
    except Mismatch as exc:
        if not same_values(want, reference(graph_mode=False)):
            return "invalid", ("single-device TF gave other values running the program "
                               "again (a kernel reading uninitialised memory or "
                               "corrupting the heap)")
        for jit_compile, what in TRACED_REFERENCES:
            try:
                compare(program, got, reference(True, jit_compile=jit_compile), scope)
                return "pass", f"equals single-device TF {what} (eager TF differs)"
            except Exception:  # noqa: BLE001 - then the next one, then the accuracy rule
                pass
        try:
            text64 = as_float64(text)
            exact = reference(False, text64)
            compare(program, got, want, scope, exact, summed_magnitudes(text64, exact[0]))
            return "pass", "as close to the float64 result as single-device TF"
        except Exception:  # noqa: BLE001 - the difference stands
            return "mismatch", str(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. reading a shard failed
        return "error", "reading the result: " + first_line(exc)
    return "pass", ""


def kernel_message(exc):
    """The line of a TF error's message that says what went wrong (first_line's), without
    the "{{function_node ...}}" prefix naming the function it ran in (which differs
    between two programs)."""
    line = first_line(exc).split(": ", 1)[-1]
    return re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line).strip()


def fails_in_graph_mode_too(exc, run_graph_mode, tf):
    """For gspmd-tf's error `exc` (a TF op error): the message of the error single-device
    TF raises running the program as a tf.function, when it is of the same type and its
    kernel message occurs in `exc`'s (grappler rewrites the traced graph, as it rewrites
    gspmd-tf's: seed 31 #9463, the remapper fuses add(x (1, 8), matmul(...)) into a
    MatMul whose "bias" must be 1-D); else None."""
    if not isinstance(exc, tf.errors.OpError):
        return None
    try:
        run_graph_mode()
    except tf.errors.OpError as graph_exc:
        message = kernel_message(graph_exc)
        if type(graph_exc) is type(exc) and message and message in str(exc):
            return first_line(graph_exc)
    return None


def same_value(traced, eager, terms):
    """Whether a float64 output `traced` equals `eager` (non-finite kinds exactly, finite
    values within the float64 tolerance relative to `terms`), other dtypes exactly."""
    if traced.dtype.kind != "f":
        return np.array_equal(traced, eager)
    finite = np.isfinite(eager)
    return bool(np.array_equal(value_kinds(traced), value_kinds(eager)) and np.all(
        np.abs(traced - eager)[finite] <= TOLERANCE["float64"] * np.abs(terms)[finite]))


def same_values(first, second):
    """Whether two references (outputs per call, variables) are equal bit for bit."""
    a = [w for call in first[0] for w in call] + list(first[1])
    b = [w for call in second[0] for w in call] + list(second[1])
    return all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def compare(program, got, want, scope, exact=None, terms=None):
    """Raise Mismatch unless the partitioned (outputs per call, variables) `got` equal
    single-device TF's `want` (or are as accurate, measured against `exact`, the float64
    program's, with `terms` the magnitudes of its outputs' summed terms, see
    as_accurate)."""
    precisions = output_precisions(program)
    calls = len(want[0])
    for call, (g_outs, w_outs) in enumerate(zip(got[0], want[0])):
        specs = scope["out_shardings"] or [None] * len(w_outs)
        if len(g_outs) != len(w_outs):
            raise Mismatch(f"{len(g_outs)} outputs, expected {len(w_outs)}")
        for i, (g, w, spec, precision) in enumerate(zip(g_outs, w_outs, specs, precisions)):
            what = f"output {i}" + (f" of call {call + 1}" if calls > 1 else "")
            check_output(g, w, spec, scope["mesh"], what, precision,
                         None if exact is None else exact[0][call][i],
                         None if terms is None else terms[call][i])
    variables = program.get("variables", ())
    every = loosest(list(precisions) + [v["dtype"] for v in variables])
    for k, (v, g, w) in enumerate(zip(variables, got[1], want[1])):
        check_output(g, w, None, scope["mesh"], f"variable {v['name']}", every,
                     None if exact is None else exact[1][k])


def main():
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray writes to stdout must not corrupt the answer channel
    sys.stdout = sys.stderr
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    import logging
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        start, cpu = time.perf_counter(), time.process_time()
        given = request.get("reference")
        status, detail = run_program(request["program"], tf, gt, request.get("part"),
                                     None if given is None else decode_values(given, tf))
        answers.write(json.dumps({"id": request["id"], "status": status, "detail": detail,
                                  "seconds": time.perf_counter() - start,
                                  "cpu": time.process_time() - cpu}) + "\n")


if __name__ == "__main__":
    main()
