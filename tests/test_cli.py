"""`python -m gspmd_tf inspect`: a SavedModel saved by a subprocess, lowered by the CLI in
subprocesses (in the background of the session: util.Background) and in this process."""

import os
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.cli import lower_saved_model, parse_shape_flags, parse_spec
from util import Background, job_directory, run_together, session_environ

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


class _Dense(tf.Module):
    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(np.ones((16, 8), np.float32), name="dense/kernel")

    @tf.function(input_signature=[tf.TensorSpec([32, 16], tf.float32, name="x")])
    def serve(self, x):
        return {"y": tf.reduce_sum(tf.nn.relu(x @ self.kernel), axis=1)}


def save_dense(path):
    """A _Dense module saved at `path` with its serving signature."""
    module = _Dense()
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})


@Background
def cli_job():
    """({name: finished `python -m gspmd_tf inspect` run}, html path, SavedModel path): a
    report (with --html), --help and a --shard regex matching nothing, run side by side
    once and read by the tests, after a subprocess saved the SavedModel (save_dense; this
    thread runs no TF)."""
    directory = job_directory("cli")
    saved_model = os.path.join(directory, "dense")
    html = pathlib.Path(directory) / "report.html"
    env = dict(session_environ(), TF_CPP_MIN_LOG_LEVEL="2")
    inspect = [sys.executable, "-m", "gspmd_tf", "inspect"]
    save, helped = run_together(
        [[sys.executable, "-c", f"import test_cli; test_cli.save_dense({saved_model!r})"],
         inspect + ["--help"]], timeout=300, cwd=ROOT,
        env=dict(env, PYTHONPATH=os.pathsep.join([ROOT, TESTS])))
    assert save.returncode == 0, save.stderr[-3000:]
    runs = {"report": (saved_model, "--mesh=2x4", "--axes=data,model", "--shard=x=data",
                       "--shard", "dense/kernel=None,model", f"--html={html}"),
            "unmatched": (saved_model, "--mesh=2x4", "--axes=data,model",
                          "--shard=kernel=model")}
    done = run_together([inspect + list(args) for args in runs.values()], timeout=300,
                        cwd=ROOT, env=env)
    return dict(zip(runs, done), help=helped), html, saved_model


@pytest.fixture(scope="module")
def cli_runs():
    """cli_job's ({name: finished run}, html path)."""
    runs, html, _ = cli_job.result()
    return runs, html


@pytest.fixture(scope="module")
def saved_model():
    """The path of the SavedModel cli_job's subprocess saved."""
    return cli_job.result()[2]


def test_spec_syntax():
    assert parse_spec("data,None") == gt.P("data", None)
    assert parse_spec("data+model,-") == gt.P(("data", "model"), None)
    assert parse_spec("") == gt.P()


def test_inspect_prints_report_collectives_and_memory(cli_runs):
    runs, html = cli_runs
    run = runs["report"]
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    kernel = next(l for l in lines if l.strip().startswith("dense/kernel "))
    assert "P(None, 'model')" in kernel
    matmul = next(l for l in lines if " MatMul " in l)
    assert matmul.rstrip().endswith("P('data', 'model')")
    # the row sum over the split 'model' dim needs one all-reduce of a [16] f32 shard
    collective = next(l for l in lines if l.startswith("all-reduce"))
    assert "(16,)" in collective and " 64 " in collective
    assert "1 collectives, 64 bytes per device" in run.stdout
    memory = dict(l.split()[:2] for l in lines[lines.index(next(
        l for l in lines if l.startswith("per-device memory"))) + 1:][:4])
    assert memory["arguments"] == str(16 * 16 * 4) and memory["variables"] == str(16 * 2 * 4)
    assert memory["outputs"] == str(16 * 4)
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_inspect_help_lists_flags_and_the_saved_model_it_reads(cli_runs):
    run = cli_runs[0]["help"]  # (absl's --help exits with status 1)
    for flag in ("--mesh", "--axes", "--shard", "--shape", "--html", "--signature"):
        assert f"  {flag}:" in run.stdout, run.stdout
    assert "SAVED_MODEL is the directory tf.saved_model.save" in run.stdout


def test_inspect_names_what_is_wrong(cli_runs):
    run = cli_runs[0]["unmatched"]
    assert run.returncode == 2
    assert "['kernel'] match no input or variable" in run.stderr
    assert "'dense/kernel'" in run.stderr and "'x'" in run.stderr


def test_lowered_in_process_matches_the_cli(saved_model):
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    lowered = lower_saved_model(saved_model, mesh, {"x": gt.P(None, "model")})
    assert lowered.input_shardings[0] == gt.Sharding.from_spec(mesh, gt.P(None, "model"), 2)
    assert lowered.memory().variables == 16 * 8 * 4  # unmatched variables stay whole
    with pytest.raises(gt.ShardingError, match="no signature 'train'"):
        lower_saved_model(saved_model, mesh, {}, "train")


class _AnyBatch(_Dense):
    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
    def serve(self, x):
        return {"y": tf.nn.relu(x @ self.kernel)}


def test_unknown_batch_dims_take_the_given_shape(tmp_path):
    module = _AnyBatch()
    path = str(tmp_path / "any_batch")
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    rules = {"x": gt.P("data"), "dense/kernel": gt.P(None, "model")}
    with pytest.raises(gt.ShardingError, match=r"shape \(None, 16\): give its size, e.g. "
                                               r"--shape x=32,16"):
        lower_saved_model(path, mesh, rules)
    lowered = lower_saved_model(path, mesh, rules, shapes=parse_shape_flags(["x=64,16"]))
    relu = next(n.name for n in lowered.graph.nodes if n.op == "Relu")
    assert lowered.graph.shape(lowered.graph.ref(relu)) == (64, 8)
    assert lowered.layout_of(relu).to_spec() == gt.P("data", "model")
    assert lowered.memory().variables == 16 * 2 * 4  # the kernel is still found by name
    with pytest.raises(gt.ShardingError, match="signature 'serving_default' takes 'x'"):
        lower_saved_model(path, mesh, rules, shapes={"x": (64, 3)})
    with pytest.raises(gt.ShardingError, match=r"\['z'\] are not inputs"):
        lower_saved_model(path, mesh, rules, shapes={"x": (64, 16), "z": (1,)})
