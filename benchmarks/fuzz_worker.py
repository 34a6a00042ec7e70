"""The fuzzer's worker process: runs programs partitioned and on one device, compares.

    python benchmarks/fuzz_worker.py      (started by benchmarks/fuzz.py, not by hand)

Reads one JSON request a line on stdin ({"id": ..., "program": {...}}), answers one JSON
line per request on its stdout: {"id", "status", "detail", "seconds"} with status

  pass      every output (and every device's shard of it) equals single-device TF
  mismatch  a value, shape, dtype, shard or output sharding differs
  error     the partitioned run raised (the program is valid: the reference ran)
  invalid   single-device TF itself rejected the program (a generator bug, not gspmd-tf's)

TensorFlow is imported once per worker; C-level writes to stdout go to stderr, so the
answer channel carries only answers. Crashes and hangs are seen by the parent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GSPMD_TF_COLLECTIVE_TIMEOUT", "20")
# TF's own kernels as the reference (oneDNN's softmax of NaN/Inf rows depends on the CPU:
# see tests/conftest.py)
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from fuzz_programs import output_precisions, source  # noqa: E402

# Relative error bound (norm of the error over norm of the value, finite entries) per
# dtype: float32 as the test suite; half types only as loose as their precision forces.
TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "float16": 5e-3, "bfloat16": 4e-2}


class Mismatch(Exception):
    """A partitioned value that differs from single-device TF."""


def check_values(got, want, what, precision, scale=None):
    """Raise Mismatch unless `got` equals `want` (NaN/Inf positions exactly, finite
    floats within the relative error of `precision`, the least precise float type the
    value was computed in; everything else exactly)."""
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
    for label, mask in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        if not np.array_equal(mask(g), mask(w)):
            where = np.argwhere(mask(g) != mask(w))[0]
            raise Mismatch(f"{what}: {label} positions differ, e.g. at {tuple(where)}: "
                           f"{g[tuple(where)]} vs {w[tuple(where)]}")
    finite = np.isfinite(w)
    if scale is None:
        scale = np.linalg.norm(w[finite])
    err = np.linalg.norm(g[finite] - w[finite]) / max(scale, 1e-30)
    if err > TOLERANCE[precision]:
        where = np.unravel_index(np.argmax(np.where(finite, np.abs(g - w), -1)), w.shape)
        raise Mismatch(f"{what}: relative error {err:.2e} > {TOLERANCE[precision]} "
                       f"(e.g. at {tuple(int(i) for i in where)}: {g[where]} vs {w[where]})")


def check_output(got, want, spec, mesh, i, precision):
    """Compare one ShardedTensor with the single-device value: the assembled value,
    every device's shard (replicas must agree) and the requested out_sharding."""
    from gspmd_tf.layout import Layout
    from gspmd_tf.mesh import PartitionSpec
    from gspmd_tf.runtime.sharded_tensor import shard_bounds

    want = np.asarray(want)
    if tuple(got.shape) != want.shape or got.dtype.as_numpy_dtype != want.dtype:
        raise Mismatch(f"output {i}: {got.shape} {got.dtype.name} != {want.shape} "
                       f"{want.dtype}")
    check_values(got.numpy(), want, f"output {i}", precision)
    finite = want[np.isfinite(want)] if want.dtype.kind == "f" or str(want.dtype) in \
        TOLERANCE else None
    scale = None if finite is None else np.linalg.norm(finite.astype(np.float64))
    local = got.layout.local_shape(mesh, want.shape)
    for device, shard in enumerate(got.shards):
        value = np.asarray(shard.numpy())
        if value.shape != local:
            raise Mismatch(f"output {i}: device {device} holds shape {value.shape}, "
                           f"expected {local}")
        bounds = shard_bounds(mesh, got.layout, want.shape, device)
        valid = value[tuple(slice(0, b - a) for a, b in bounds)]
        check_values(valid, want[tuple(slice(a, b) for a, b in bounds)],
                     f"output {i} on device {device}", precision, scale)
    if spec is not None:
        expected = Layout.from_spec(mesh, PartitionSpec(*spec), want.ndim)
        if got.layout.dims != expected.dims:
            raise Mismatch(f"output {i}: sharding {got.layout} but out_shardings asked "
                           f"for {expected}")


def first_line(exc):
    """`Type: the line of the message that says what went wrong`, short (for TF's
    "Graph execution error:" the line before the failing node's name)."""
    lines = [l.strip() for l in str(exc).strip().splitlines() if l.strip()]
    if lines and lines[0].startswith("Graph execution error"):
        lines = [l for l in lines if not l.startswith(("[[", "File ", "Detected at",
                                                         "Graph execution"))][-1:]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def run_program(program, tf, gt):
    """Run one program; returns (status, detail)."""
    scope = {"np": np, "tf": tf, "gt": gt, "P": gt.P}
    try:
        exec(source(program), scope)  # noqa: S102 - the program is our own generated text
        with tf.device("/device:CPU:0"):  # eagerly: no tracing cost for the reference
            want = scope["f"](*[tf.convert_to_tensor(a) for a in scope["args"]])
        # .numpy(), not np.asarray(tensor): a 0-d bfloat16 tensor's __array__ gives a scalar
        want = [np.asarray(w.numpy()) for w in want]
    except Exception as exc:  # noqa: BLE001 - any failure here is the generator's
        return "invalid", first_line(exc)
    try:
        fn = gt.function(scope["f"], mesh=scope["mesh"], in_shardings=scope["in_shardings"],
                         out_shardings=scope["out_shardings"])
        got = fn(*scope["args"])
    except Exception as exc:  # noqa: BLE001 - every exception of a valid program counts
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                      if "gspmd_tf" in f.filename), "")
        return "error", first_line(exc) + (f" [{where}]" if where else "")
    specs = scope["out_shardings"] or [None] * len(want)
    try:
        if len(got) != len(want):
            raise Mismatch(f"{len(got)} outputs, expected {len(want)}")
        for i, (g, w, spec, precision) in enumerate(zip(got, want, specs,
                                                        output_precisions(program))):
            check_output(g, w, spec, scope["mesh"], i, precision)
    except Mismatch as exc:
        return "mismatch", str(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. reading a shard failed
        return "error", "reading the result: " + first_line(exc)
    return "pass", ""


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
        status, detail = run_program(request["program"], tf, gt)
        answers.write(json.dumps({"id": request["id"], "status": status, "detail": detail,
                                  "seconds": time.perf_counter() - start,
                                  "cpu": time.process_time() - cpu}) + "\n")


if __name__ == "__main__":
    main()
