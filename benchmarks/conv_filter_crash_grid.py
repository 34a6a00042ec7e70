"""Which shapes of TF's CPU (oneDNN) convolution kernels corrupt the heap, run by run.

    .venv/bin/python benchmarks/conv_filter_crash_grid.py --runs=3 --calls=200

Fuzzer seed 31 #814 (benchmarks/RESULTS.md §6): single-device eager TF's oneDNN
Conv2DBackpropFilter dies (SIGABRT "free(): invalid size", SIGSEGV) within a few hundred
calls for some strided shapes whose input has rows past the last window. Every case of
the grid below runs --calls eager calls of one raw op in a FRESH subprocess (a crash
kills the process), --runs times; the table gives the runs killed by a signal per case
(a Python error, TF rejecting the case, is shown apart) and whether the input extends
past the last window ((out-1)*S + (K-1)*D + 1 - low pad < input extent). The local
backend (gspmd_tf/backends/tf_kernels.py, input_ending_at_last_window) slices such inputs
for the filter gradients that crash; this script does not import gspmd-tf, it measures
TF alone.
`--onednn=0` runs the same grid with TF_ENABLE_ONEDNN_OPTS=0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

RUNS = flags.DEFINE_integer("runs", 3, "fresh processes per case")
CALLS = flags.DEFINE_integer("calls", 200, "eager calls of the op per process")
ONEDNN = flags.DEFINE_integer("onednn", 1, "TF_ENABLE_ONEDNN_OPTS of the subprocesses")
ONLY = flags.DEFINE_string("only", "", "run only the cases whose label contains this")
CASE = flags.DEFINE_string("case", "", "internal: the JSON case one subprocess runs")

# (op, spatial input extent, filter extent, stride, dilation, padding); 2-D ops vary the
# first spatial dim (the second is 5 wide with a window of 1) unless `square`.
GRID = [
    (op, h, k, s, dil, pad, square)
    for op in ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter",
               "Conv3DBackpropFilterV2")
    for h, k, s, dil, pad, square in (
        (8, 1, 2, 1, "VALID", False), (16, 1, 2, 1, "VALID", False),
        (8, 1, 2, 1, "SAME", False), (10, 1, 2, 1, "VALID", True),
        (10, 2, 3, 1, "VALID", False), (9, 2, 2, 2, "VALID", False),
        (7, 1, 2, 1, "VALID", False), (9, 1, 2, 1, "VALID", False),
        (8, 2, 2, 1, "VALID", False), (9, 1, 2, 1, "VALID", True))
] + [(op, h, 1, 2, 1, "VALID", sq) for op in ("Conv2D", "Conv2DBackpropInput")
     for h, sq in ((8, False), (10, True))]


def _out(h, k, s, dil, pad):
    """Output extent and the input extent the windows reach (pads excluded)."""
    span = (k - 1) * dil + 1
    if pad == "VALID":
        out = (h - span) // s + 1
        return out, (out - 1) * s + span
    out = -(-h // s)
    total = max((out - 1) * s + span - h, 0)
    return out, (out - 1) * s + span - total // 2


def _run_case(case):
    """One subprocess: `calls` eager calls of the case's op; prints OK when none crashed."""
    import numpy as np
    import tensorflow as tf
    op, h, k, s, dil, pad, square, calls = case
    rng = np.random.default_rng(0)
    rank = 3 if op.startswith("Conv3D") else 2
    w = h if square else 5
    spatial = [h, w] + [4] * (rank - 2)
    window = [k, k if square else 1] + [1] * (rank - 2)
    steps = [s, s if square else 1] + [1] * (rank - 2)
    dils = [dil, dil if square else 1] + [1] * (rank - 2)
    outs = [_out(*a, pad)[0] for a in zip(spatial, window, steps, dils)]
    c, o = 2, 2
    depthwise = op.startswith("Depthwise")
    x = tf.constant(rng.random([3] + spatial + [c], np.float32))
    dy = tf.constant(rng.random([3] + outs + [c * o if depthwise else o], np.float32))
    filt = window + [c, o]
    attrs = dict(strides=[1] + steps + [1], padding=pad, dilations=[1] + dils + [1])
    call = {
        "Conv2DBackpropFilter": lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=filt, out_backprop=dy, **attrs),
        "DepthwiseConv2dNativeBackpropFilter":
            lambda: tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                input=x, filter_sizes=filt, out_backprop=dy, **attrs),
        "Conv3DBackpropFilterV2": lambda: tf.raw_ops.Conv3DBackpropFilterV2(
            input=x, filter_sizes=filt, out_backprop=dy, **attrs),
        "Conv2D": lambda: tf.raw_ops.Conv2D(
            input=x, filter=tf.ones(filt), **attrs),
        "Conv2DBackpropInput": lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=x.shape, filter=tf.ones(filt), out_backprop=dy, **attrs),
    }[op]
    for _ in range(calls):
        call()
    print("OK", flush=True)


def main(argv):
    del argv
    if CASE.value:
        _run_case(json.loads(CASE.value))
        return
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=str(ONEDNN.value))
    print(f"{'op':38s} {'H':>3s} {'K':>2s} {'S':>2s} {'D':>2s} {'pad':5s} {'2-D':3s} "
          f"{'past last window':16s} crashed/runs")
    for op, h, k, s, dil, pad, square in GRID:
        label = f"{op} H={h} K={k} S={s} D={dil} {pad}{' square' if square else ''}"
        if ONLY.value and ONLY.value not in label:
            continue
        reach = _out(h, k, s, dil, pad)[1]
        case = json.dumps([op, h, k, s, dil, pad, square, CALLS.value])
        crashed, signals, errors = 0, set(), []
        for _ in range(RUNS.value):
            run = subprocess.run([sys.executable, os.path.abspath(__file__), f"--case={case}"],
                                 env=env, capture_output=True, text=True, timeout=300)
            if run.returncode < 0:  # killed by a signal: the crash looked for
                crashed += 1
                signals.add(run.returncode)
            elif run.returncode != 0 or "OK" not in run.stdout:  # TF rejected the case
                errors.append(run.stderr.strip().splitlines()[-1][:100])
        past = f"yes ({h - reach} rows)" if reach < h else "no"
        print(f"{op:38s} {h:3d} {k:2d} {s:2d} {dil:2d} {pad:5s} {'yes' if square else 'no':3s} "
              f"{past:16s} {crashed}/{RUNS.value}"
              + (f"  exit codes {sorted(signals)}" if signals else "")
              + (f"  ERROR (not a crash): {errors[0]}" if errors else ""), flush=True)


if __name__ == "__main__":
    app.run(main)
