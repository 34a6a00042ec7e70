"""The default backend, by platform (the XLA backend on accelerators, the local one on
CPUs and several workers), and backend="auto" (opt-in): the XLA backend where it
applies, else the local one, per program (gspmd_tf/backends/auto.py); the values either
way equal single-device TF.
"""

import logging
import types

import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import auto
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.cost_model import CostModel
from gspmd_tf.runtime.function import DEFAULT_BACKEND, backend_factory
from util import assert_close, explicitly_padded_input_gradient, randn, single_device

P = gt.P


def run_auto(fn, mesh, args, in_shardings, caplog):
    """`fn` on backend="auto": (outputs as numpy, single-device outputs, the backend
    class the default chose, from its log line)."""
    f = gt.function(fn, mesh=mesh, in_shardings=in_shardings, backend="auto")
    with caplog.at_level(logging.INFO, logger="gspmd_tf"):
        got = [t.numpy() for t in tf.nest.flatten(f(*args))]
    chosen = [r.getMessage() for r in caplog.records if " runs on the " in r.getMessage()]
    assert len(chosen) == 1, chosen
    return got, single_device(fn, args), chosen[0]


def _stand_in_mesh(devices, fully_addressable=True):
    """A mesh of `devices` (names) to choose for (no GPU or cluster here to run on)."""
    return types.SimpleNamespace(devices=devices, is_fully_addressable=fully_addressable,
                                 is_abstract=False)


def test_default_is_chosen_by_platform():
    """CPU meshes: the local backend (TF's kernels, TF's values); accelerator meshes of
    this process: the XLA backend; meshes of several workers: the local backend."""
    assert DEFAULT_BACKEND == "default"
    cpus = gt.Mesh.create((2, 4), ("data", "model"))
    assert type(backend_factory(None, None)(cpus)) is LocalBackend
    assert type(auto.for_platform(cpus)) is LocalBackend
    gpus = _stand_in_mesh([f"/job:localhost/replica:0/task:0/device:GPU:{k}"
                           for k in range(4)])
    assert type(auto.for_platform(gpus)) is XlaBackend
    workers = _stand_in_mesh([f"/job:worker/replica:0/task:{t}/device:GPU:0"
                              for t in range(2)], fully_addressable=False)
    assert type(auto.for_platform(workers)) is LocalBackend


def test_the_default_runs_an_explicitly_padded_conv_input_gradient_right(rng, monkeypatch):
    """The default (no backend given, no GSPMD_TF_BACKEND) on CPUs equals single-device
    TF where XLA:CPU is wrong (issue 25 item 3)."""
    monkeypatch.delenv("GSPMD_TF_BACKEND", raising=False)
    mesh = gt.Mesh.create((2,), ("x",))

    input_gradient, args = explicitly_padded_input_gradient(rng)
    got = gt.function(input_gradient, mesh=mesh, in_shardings=(None, P("x")))(*args)
    assert_close(got.numpy(), single_device(input_gradient, args)[0])


def test_small_program_on_cpus_is_compiled_by_xla(rng, caplog):
    """A two-layer Megatron block of small matmuls: the XLA backend, equal values."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))

    def mlp(x, w1, w2):
        return tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) ** 2)

    args = [randn(rng, 16, 32), randn(rng, 32, 64), randn(rng, 64, 32)]
    got, want, chosen = run_auto(mlp, mesh, args,
                                 (P("data", None), P(None, "model"), P("model", None)), caplog)
    assert "XlaBackend" in chosen, chosen
    for g, w in zip(got, want):
        assert_close(g, w)


def test_matmul_heavy_program_on_cpus_stays_on_tf_kernels(rng, caplog):
    """Dots whose XLA:CPU slowdown outweighs the kernel launches compiling saves (the
    cost model's estimate): the local backend."""
    mesh = gt.Mesh.create((2,), ("x",))
    # per device: (256 / 2) x 512 x 256 = 2^24 multiply-adds over a handful of ops
    args = [randn(rng, 256, 512), randn(rng, 512, 256)]
    got, want, chosen = run_auto(tf.matmul, mesh, args, (P("x", None), None), caplog)
    assert "LocalBackend" in chosen and "faster than compiling" in chosen, chosen
    assert_close(got[0], want[0])


def _conv_then_elementwise(layers):
    """A SAME 2-D convolution followed by `layers` of cheap elementwise ops."""
    def conv_then_elementwise(image, kernel):
        y = tf.nn.conv2d(image, kernel, strides=1, padding="SAME")
        for _ in range(layers):
            y = tf.nn.relu(y) * 0.5 + 0.25
        return y
    return conv_then_elementwise


# per device: 16 x 16 x 32 outputs over 3 x 3 x 16 inputs: 1,179,648 multiply-adds
CONV_SHAPES = ((2, 16, 16, 16), (3, 3, 16, 32))


def test_large_convolution_among_few_ops_stays_on_tf_kernels(rng, caplog):
    """A convolution whose XLA:CPU slowdown outweighs the launches of the few ops around
    it: the local backend."""
    mesh = gt.Mesh.create((2,), ("x",))
    args = [randn(rng, *shape) for shape in CONV_SHAPES]
    got, want, chosen = run_auto(_conv_then_elementwise(2), mesh, args, (P("x"), None),
                                 caplog)
    assert "LocalBackend" in chosen, chosen
    assert_close(got[0], want[0])


def test_the_choice_moves_with_the_backends_cost_models():
    """The same program (a large convolution among many cheap ops) compiles on the
    default models and stays on TF's kernels where XLA's convolutions are priced 10x
    slower or TF's kernel launches free."""
    mesh = gt.Mesh.create((2,), ("x",))
    specs = [tf.TensorSpec(shape) for shape in CONV_SHAPES]
    program = gt.function(_conv_then_elementwise(12), mesh=mesh,
                          in_shardings=(P("x"), None)).lower(*specs).compile().program
    models = {cls: cls(mesh).cost_model for cls in (LocalBackend, XlaBackend)}
    assert auto.choose(mesh, program, models)[0] is XlaBackend
    xla = models[XlaBackend]
    slow_convolutions = CostModel.for_mesh(
        mesh, multiply_adds_per_second=xla.multiply_adds_per_second,
        convolution_multiply_adds_per_second=xla.convolution_multiply_adds_per_second / 10,
        kernel_seconds=xla.kernel_seconds)
    assert auto.choose(mesh, program, {**models, XlaBackend: slow_convolutions})[0] \
        is LocalBackend
    free_launches = CostModel.for_mesh(mesh, kernel_seconds=0.0)
    assert auto.choose(mesh, program, {**models, LocalBackend: free_launches})[0] \
        is LocalBackend


def test_small_convolution_is_compiled(rng, caplog):
    mesh = gt.Mesh.create((2,), ("x",))

    def conv(image, kernel):
        return tf.nn.relu(tf.nn.conv2d(image, kernel, strides=1, padding="SAME")) + 1.0

    args = [randn(rng, 2, 6, 6, 2), randn(rng, 3, 3, 2, 3)]
    got, want, chosen = run_auto(conv, mesh, args, (P("x"), None), caplog)
    assert "XlaBackend" in chosen, chosen
    assert_close(got[0], want[0])


def test_what_runs_op_by_op_is_no_warning_under_the_default(rng, caplog):
    """A while loop runs op by op under the XLA backend: a warning when the user chose
    backend="xla", an INFO line when the default chose it."""
    mesh = gt.Mesh.create((2,), ("x",))

    def loop(x):
        return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                             (tf.constant(0), x))[1]

    x = randn(rng, 4, 3)
    with caplog.at_level(logging.INFO, logger="gspmd_tf"):
        for backend in ("auto", "xla"):
            assert_close(gt.function(loop, mesh=mesh, in_shardings=(P("x"),),
                                     backend=backend)(x).numpy(), single_device(loop, [x])[0])
    levels = {r.levelname for r in caplog.records if "op by op" in r.getMessage()}
    assert levels == {"INFO", "WARNING"}, levels
    assert sum(r.levelname == "WARNING" for r in caplog.records) == 1


def test_the_partitioner_combines_copy_all_reduces_by_default():
    """Both backends it picks make a CPU mesh's all-reduces copies, combined as any."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    assert auto.AutoBackend(mesh).all_reduce_combine_bytes(in_region=False) is None
    assert auto.AutoBackend(mesh).all_reduce_combine_bytes(in_region=True) is None


@pytest.mark.parametrize("device,expected", [("/job:localhost/replica:0/task:0/device:GPU:{}",
                                              XlaBackend)])
def test_accelerator_meshes_take_xla(device, expected):
    """The choice reads the mesh's device kinds (no GPU here to run on: a stand-in mesh)."""
    mesh = _stand_in_mesh([device.format(k) for k in range(4)])
    cls, reason = auto.choose(mesh, program=None)
    assert cls is expected and "GPU" in reason


def test_meshes_of_several_workers_stay_local():
    mesh = _stand_in_mesh([f"/job:worker/replica:0/task:{t}/device:CPU:0"
                           for t in range(2)], fully_addressable=False)
    cls, reason = auto.choose(mesh, program=None)
    assert cls is LocalBackend and "several workers" in reason


def test_auto_counts_the_dots_inside_loop_bodies(rng):
    """A matmul of 2^24 multiply-adds per device inside a while loop: counted from the
    body (the top level alone holds no dot), so "auto" keeps it on TF's kernels."""
    mesh = gt.Mesh.create((2,), ("x",))

    def loop(x, w):
        return tf.while_loop(lambda i, y: i < 2, lambda i, y: (i + 1, tf.matmul(y, w)),
                             (tf.constant(0), x))[1]

    args = [randn(rng, 256, 512), randn(rng, 512, 512)]
    program = gt.lower(loop, mesh, (P("x", None), None), args=args).program.graph
    assert not any(node.op == "MatMul" for node in program.nodes)
    cls, reason = auto.choose(mesh, program)
    assert cls is LocalBackend and "faster than compiling" in reason, reason
