"""The fuzzer's worker process: runs programs partitioned and on one device, compares.

    python -m gspmd_tf.testing.differential   (started by gspmd_tf.testing.workers.Worker)

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

TensorFlow is imported once per worker (with this module: TF's import writes nothing to
stdout); main() then sends C-level writes to stdout to stderr, so the answer channel
carries only answers. Crashes and hangs are seen by the parent.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import sys
import time
import traceback

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.testing.accuracy import (TOLERANCE, Mismatch, check_output, summed_magnitude,
                                       unrolling_while_loops, value_kinds)
from gspmd_tf.testing.program_space import loosest
from gspmd_tf.testing.program_text import output_precisions, source, watched

# Single-device TF's values a partitioned result may equal instead of the eager ones:
# the program traced (a tf.function, as gspmd-tf runs; grappler rewrites it) and, on the
# backends compiling segments (GSPMD_TF_BACKEND xla or auto: the compute between
# collectives compiled with TF's XLA bridge), single-device TF of those segments under
# jit_compile (one_device_segments). Where XLA's values differ from TF's kernels (its
# minimum and maximum return a number where TF's return NaN: fuzz seed 46 #553), a
# segment's value is XLA's on one device as on eight: that is XLA's difference, not a
# partitioning bug; a program is a mismatch only if it differs from every reference.
SEGMENT_BACKENDS = ("xla", "auto")


def compiles_segments():
    """Whether the partitioned programs run on a backend compiling segments with XLA
    (GSPMD_TF_BACKEND, which benchmarks/fuzz.py --backend sets for its workers)."""
    return os.environ.get("GSPMD_TF_BACKEND") in SEGMENT_BACKENDS


def one_device(program):
    """`program` on a mesh of the same axes, each of size 1: every PartitionSpec, hint
    and out_sharding stays valid and splits nothing, so gspmd-tf's partitioner leaves the
    program whole (no collective, no shard) on device 0."""
    mesh = program["mesh"]
    return dict(program, mesh={"shape": [1] * len(mesh["shape"]), "axes": mesh["axes"]})


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
    mode (a tf.function, as gspmd-tf runs) or, under a backend compiling segments, what
    single-device TF computes running the segments XLA compiles under jit_compile
    (one_device_segments) passes: it is what TF does. A mismatch
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

    def partitioned(program_text=text, backend=None):
        """gspmd-tf's outputs of every call and final variables, and the program's names."""
        scope = fresh_scope(partitioned=True, program_text=program_text)
        fn = gt.function(scope["f"], mesh=scope["mesh"], in_shardings=scope["in_shardings"],
                         out_shardings=scope["out_shardings"], backend=backend)
        return ([fn(*scope["args"]) for _ in range(calls)],
                [scope[name].sharded() for name in variables]), scope

    def one_device_segments():
        """Single-device TF of the XLA backend's segments: the program on one device
        (one_device: nothing partitioned, no collective) run by the XLA backend, which
        cuts it as it cuts the partitioned program (at control flow, stateful ops and
        the ops whose contract says XLA's values differ, which run on TF's kernels)
        and runs each segment as a tf.function(jit_compile=True); as numpy values."""
        (outs, values), _ = partitioned(source(one_device(program)), backend="xla")
        return ([[np.asarray(t.numpy()) for t in call] for call in outs],
                [np.asarray(v.numpy()) for v in values])

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
        traced = [(lambda: reference(graph_mode=True), "in graph mode")]
        if compiles_segments():
            traced.append((one_device_segments, "running XLA's segments (jit_compile)"))
        for values, what in traced:
            try:
                compare(program, got, values(), scope)
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
    """Serve requests on stdin until EOF (the worker process's entry point)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray writes to stdout must not corrupt the answer channel
    sys.stdout = sys.stderr
    gt.configure_cpu_devices(8)
    tf.get_logger().setLevel("ERROR")
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
