"""Batch matmuls whose batch dims broadcast run without reaching TF's faulty oneDNN kernel
(the crash of the fuzzer's fourth 10,000-program run, seed 24 #3785; benchmarks/RESULTS.md
§6, "The crash of the fourth run").

TF's oneDNN BatchMatMul corrupts the heap broadcasting (5, 1, 8, 2) @ (2, 2) in the kernel
(single-device eager TF: SIGSEGV or SIGABRT within a few calls). The fuzzer's reference
ran that matmul inside a tf.cond branch; gspmd-tf's program, which makes such broadcasts
explicit (spmd/handlers/basic.py batch_matmul), ran it 300 times without a fault. The
partitioned programs run here in a SUBPROCESS, so a crash fails the test instead of
killing pytest, and are called repeatedly, since the corruption shows only after a few
calls. Their values are compared with single-device TF computing the same products with
the broadcast written out (tf.broadcast_to), which does not reach the faulty kernel path.
"""

import json
import os
import re
import sys
import textwrap

from gspmd_tf.testing.generator import generate
from util import Background, run_together, session_environ

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CALLS = 30  # calls of each partitioned program (the reference faults within ~8)

# (name, operand shape, matrix shape, inside a tf.cond, mesh, operand spec); the first has
# seed 24 #3785's shapes, cond and mesh (its operand split on dim 0 here), then the same on
# one device and other in-kernel broadcasts that fault in single-device TF
CASES = [
    ("seed24_3785_cond", (5, 1, 8, 2), (2, 2), True, (8, 1), ("x",)),
    ("cond_one_device", (5, 1, 8, 2), (2, 2), True, (1, 1), ()),
    ("rank3_matrix", (5, 1, 8, 2), (1, 2, 2), False, (2, 4), ("x", None, "y")),
    ("rank4_matrix", (5, 1, 8, 2), (1, 1, 2, 2), False, (1, 1), ()),
    ("seed21_7078", (3, 1, 6, 3), (3, 1), False, (2, 4), (None, None, "y")),
]

PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    import tensorflow as tf

    cases, calls = json.loads(sys.argv[1]), int(sys.argv[2])
    report = {}
    for name, a_shape, b_shape, in_cond, mesh_shape, spec, dtype in cases:
        dtype = getattr(tf, dtype)
        rng = np.random.default_rng(len(report))
        a = tf.constant(rng.standard_normal(a_shape), dtype)
        b = tf.constant(rng.standard_normal(b_shape), dtype)

        def f(a, b, explicit=False):
            if explicit:  # the same products, no broadcast in the kernel
                batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
                a = tf.broadcast_to(a, tuple(batch) + tuple(a.shape[-2:]))
                b = tf.broadcast_to(b, tuple(batch) + tuple(b.shape[-2:]))
            if not in_cond:
                return [tf.matmul(a, b)]
            return [tf.cond(tf.reduce_sum(tf.cast(a, tf.float32)) > 0,
                            lambda: tf.matmul(a, b) * 0.25, lambda: tf.matmul(a, b) * 0.5)]

        with tf.device("/device:CPU:0"):
            want = np.asarray(f(a, b, explicit=True)[0].numpy(), np.float64)
        mesh = gt.Mesh.create(tuple(mesh_shape), ("x", "y"))
        fn = gt.function(f, mesh=mesh, in_shardings=(gt.P(*spec), gt.P()))
        errors = []
        for _ in range(calls):
            got = np.asarray(fn(a.numpy(), b.numpy())[0].numpy(), np.float64)
            errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        report[name + "_" + dtype.name] = max(errors)
    print(json.dumps(report))
""")

TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-2}  # the fuzzer's (gspmd_tf/testing/accuracy.py)
CASES_BY_DTYPE = [list(case) + [dtype] for case in CASES for dtype in TOLERANCE]


@Background
def probe_run():
    """The PROBE subprocess's finished run (started when collection ends)."""
    env = dict(session_environ(), TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done, = run_together([[sys.executable, "-c", PROBE, json.dumps(CASES_BY_DTYPE),
                           str(CALLS)]], timeout=600, env=env, cwd=REPO)
    return done


def test_broadcast_batch_matmul_runs_repeatedly_without_a_fault():
    """Every case, float32 and bfloat16, called CALLS times in one subprocess: the process
    exits normally and every call equals single-device TF."""
    done = probe_run.result()
    assert done.returncode == 0, (f"the subprocess died (return code {done.returncode}):\n"
                                  + done.stderr[-3000:])
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == len(CASES_BY_DTYPE)
    for name, error in errors.items():
        assert error <= TOLERANCE[name.rsplit("_", 1)[1]], (name, error)


def test_generated_body_matmuls_broadcast_over_at_most_one_batch_dim():
    """The fuzzer's while bodies and cond branches multiply by a captured matrix: a 2-D
    one only for operands with at most one batch dim, else one with the operand's batch
    dims (the reference is the faulty kernel). 400 control-flow programs of seed 24 (all
    families, so that other ops make rank-4 operands) and #3785 itself."""
    programs = [generate(24, i, control_flow_prob=1.0) for i in range(400)]
    checked, batched = 0, 0
    for program in programs + [generate(24, 3785)]:
        shapes = {i["name"]: i["shape"] for i in program["inputs"]}
        shapes.update({op["out"]: op["shape"] for op in program["ops"]})
        for op in program["ops"]:
            if op["family"] not in ("cond", "while"):
                continue
            operand = shapes[op["args"][0]]
            for k in re.findall(r", \{(\d+)\}\) \* 0\.25", op["expr"]):  # the matmul step
                matrix = shapes[op["args"][int(k)]]
                expected = (operand[:-2] if len(operand) > 3 else []) + [operand[-1]] * 2
                assert matrix == expected, (op["expr"], operand, matrix)
                checked += 1
                batched += len(operand) > 3
    assert checked > 100 and batched > 5
