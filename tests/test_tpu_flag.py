"""gspmd_tf.tpu and the benchmarks' --tpu flag, without a TPU: the resolver error is clear
and names the TPU; the TPU program (the annotated global graph under a strategy) computes
the function when run by a strategy that is not a TPU's."""

import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import tpu
from util import Background, run_together, session_environ

P = gt.P
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def test_unknown_tpu_name_is_a_clear_error():
    # a name is looked up through GCE's metadata server, which this host lacks
    with pytest.raises(tpu.TPUNotFoundError, match="'no-such-tpu-7'.*'local'"):
        tpu.connect("no-such-tpu-7")


def test_step_time_tpu_flag_stops_at_the_resolver():
    """--tpu=local goes through TPUClusterResolver, connect and TPU initialization, which
    fails here for want of TPU cores (in a subprocess: connecting changes TF's context)."""
    run = script_runs.result()["resolver"]
    assert run.returncode == 1
    assert re.search(r"--tpu=local: TPU 'local' could not be reached \(NotFoundError: "
                     r"TPUs not found", run.stderr), run.stderr[-2000:]


def _system():
    """A TPUSystem on TF's default strategy: the TPU program's code path, run on CPU."""
    return tpu.TPUSystem(tf.distribute.get_strategy(), 8)


def test_tpu_program_computes_the_function():
    def f(x, w):
        return tf.nn.relu(x @ w), tf.reduce_sum(x)
    system = _system()
    low = gt.lower(f, system.mesh((2, 4), ("data", "model")), (P("data"), P(None, "model")),
                   args=[tf.TensorSpec((8, 16)), tf.TensorSpec((16, 32))])
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 32)))
    got = system.program(low)(x, w)
    want = f(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-5)


def test_mesh_must_cover_the_cores():
    with pytest.raises(gt.ShardingError, match="TPU has 8 cores"):
        _system().mesh((2, 2), ("data", "model"))


# each runs in its own process: the scripts' absl flags clash with each other and with
# other benchmark modules that tests import (fuzz defines --batch too)
_ON_DEFAULT_STRATEGY = """
import gspmd_tf as gt
import tensorflow as tf
from absl import flags
from gspmd_tf import tpu
import {script}
flags.FLAGS(["{script}"] + {argv!r})
system = tpu.TPUSystem(tf.distribute.get_strategy(), 8)
{call}
"""


def _on_default_strategy(script, argv, call):
    """The command running `call` of benchmarks/`script` with a TPUSystem on TF's
    default strategy (the TPU program's code path, on CPU)."""
    return [sys.executable, "-c",
            _ON_DEFAULT_STRATEGY.format(script=script, argv=argv, call=call)]


@Background
def script_runs():
    """{name: finished run} of the benchmark scripts' --tpu paths, each in a fresh
    process, run side by side once and read by the tests."""
    commands = {
        "resolver": [sys.executable, os.path.join(BENCHMARKS, "step_time.py"),
                     "--tpu=local", "--meshes=2,4", "--repeats=1"],
        # benchmarks/train_step.py's --tpu body
        "train_step": _on_default_strategy(
            "train_step", ["--layers=2", "--batch=4", "--seq=8", "--d_model=16",
                           "--d_ff=32", "--steps=2", "--warmup=1"],
            "train_step.run_on_tpu(gt, system, (2, 4))"),
        # benchmarks/step_time.py's --tpu body
        "step_time": _on_default_strategy(
            "step_time", ["--layers=1", "--d_model=16", "--heads=2", "--d_ff=32",
                          "--vocab=32", "--seq=8", "--batch=4", "--repeats=1",
                          "--warmup=0"],
            "from gspmd_tf import demo\n"
            "cfg = demo.ModelConfig(layers=1, d_model=16, heads=2, d_ff=32, vocab=32, "
            "seq=8, batch=4)\n"
            "step_time.run_on_tpu(gt, tf, system, [(2, 4)], cfg, demo.make_loss_fn(cfg), "
            "[demo.make_batch(cfg)] + demo.init_params(cfg))")}
    done = run_together(list(commands.values()), timeout=300, cwd=BENCHMARKS,
                        env=dict(session_environ(), PYTHONPATH=os.pathsep.join(
                            [os.path.dirname(BENCHMARKS), BENCHMARKS])))
    return dict(zip(commands, done))


def _last_row(run):
    """The last table row a --tpu path printed."""
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_train_step_tpu_path_matches_single_device():
    """benchmarks/train_step.py's --tpu body (functional SGD step lowered for the TPU
    mesh, run as the TPU program): its loss after the steps is single-device TF's."""
    row = _last_row(script_runs.result()["train_step"])
    assert float(row.rstrip(" |").rsplit("|", 1)[1]) <= 1e-5, row


def test_step_time_tpu_path_matches_single_device():
    """benchmarks/step_time.py's --tpu body: the demo LM's loss equals the host's."""
    row = _last_row(script_runs.result()["step_time"])
    assert float(row.rstrip(" |").rsplit("|", 1)[1]) <= 1e-5, row
