"""Shared test helpers: compare a partitioned function with the single-device one."""

import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.sharded_tensor import distinct_boxes

RTOL = 1e-5  # float32 relative error, measured on the whole tensor


def _jax_python_problem(path):
    """Why `path` cannot serve as JAX's interpreter, or None if it can."""
    if not path:
        return ("GSPMD_TF_JAX_PYTHON is unset: set it to the python of an environment with "
                "JAX (jax[cpu]) to run XLA's own SPMD partitioner on these cases")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"GSPMD_TF_JAX_PYTHON={path} is not an executable file"
    return None


# The interpreter of a Python environment with JAX, for the tests that check gspmd-tf's
# programs against XLA's own SPMD partitioner (benchmarks/xla_spmd_check.py): named by
# GSPMD_TF_JAX_PYTHON, no machine-local default; those tests skip, saying why, without it.
JAX_PYTHON = os.environ.get("GSPMD_TF_JAX_PYTHON", "")
requires_jax_python = pytest.mark.skipif(_jax_python_problem(JAX_PYTHON) is not None,
                                         reason=_jax_python_problem(JAX_PYTHON) or "")


def single_device(fn, args):
    """`fn` run by plain TF on one device, as numpy leaves."""
    with tf.device("/device:CPU:0"):
        out = tf.function(fn, autograph=False)(*args)
    return [np.asarray(t.numpy()) for t in tf.nest.flatten(out)]


def assert_close(got, want, what=""):
    """Floats: NaN and infinities in the same places, the rest within RTOL relative
    error (norm); everything else exact."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if np.issubdtype(want.dtype, np.floating):
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.where(finite, 0, got), np.where(finite, 0, want),
                                      err_msg=f"{what}: NaN/Inf differ")
        got, want = np.where(finite, got, 0), np.where(finite, want, 0)
        scale = max(np.linalg.norm(want.astype(np.float64)), 1e-30)
        err = np.linalg.norm((got.astype(np.float64) - want)) / scale
        assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def check_partitioned(fn, args, mesh, in_shardings, out_shardings=None, reference=None):
    """Run `fn` partitioned and on one device; assert equal values. Returns Lowered.

    `reference` (default `fn`) is what runs on one device: a function computing the same
    values, for ops single-device TF cannot run as written (NCHW convs on CPU)."""
    f = gt.function(fn, mesh=mesh, in_shardings=in_shardings, out_shardings=out_shardings)
    got = tf.nest.flatten(f(*args))
    want = single_device(reference or fn, args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, gt.ShardedTensor)
        assert_close(g.numpy(), w, f"output {i}")
    return f.lower(*args)


def assert_like_tf_variable(make, variable, initial, got, args):
    """The outputs `got` (numpy) of a gt.function of make(variable) and the gt.Variable
    `variable` after it equal the outputs of tf.function(make(v)) on `args` and a
    tf.Variable v made from `initial` on one device after it."""
    with tf.device("/device:CPU:0"):
        plain = tf.Variable(initial)
        want = [t.numpy() for t in tf.function(make(plain), autograph=False)(*args)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"output {i}")
    assert_close(variable.numpy(), plain.numpy(), "variable")


def randn(rng, *shape):
    """float32 normal values."""
    return rng.standard_normal(shape).astype(np.float32)


def assert_replicas_equal(variable):
    """Every device holding the same elements of `variable` holds the same values."""
    for box, devices in distinct_boxes(variable.mesh, variable.layout, variable.shape):
        inside = tuple(slice(0, b - a) for a, b in box)
        first = variable.shard_variables[devices[0]].numpy()[inside]
        for device in devices[1:]:
            np.testing.assert_array_equal(variable.shard_variables[device].numpy()[inside],
                                          first, err_msg=f"{variable.name} device {device}")


def tensor_lists(x, item):
    """Every TensorList op with a rule, on lists of [4, 6] elements (a list has its
    element's shape in the IR)."""
    from tensorflow.python.ops import list_ops
    lst = list_ops.tensor_list_from_tensor(x, element_shape=[4, 6])
    lst = list_ops.tensor_list_set_item(lst, 1, item)
    lst = list_ops.tensor_list_push_back(lst, item)
    got = list_ops.tensor_list_get_item(lst, 0, tf.float32, element_shape=[4, 6])
    lst, popped = list_ops.tensor_list_pop_back(lst, tf.float32)
    lst = tf.raw_ops.TensorListResize(input_handle=lst, size=3)
    stacked = list_ops.tensor_list_stack(lst, tf.float32, element_shape=[4, 6],
                                         num_elements=3)
    empty = list_ops.tensor_list_push_back(
        list_ops.empty_tensor_list([4, 6], tf.float32), item)
    reserved = tf.raw_ops.TensorListReserve(element_shape=[4, 6], num_elements=3,
                                            element_dtype=tf.float32)
    return (stacked, got, popped, list_ops.tensor_list_length(lst),
            list_ops.tensor_list_stack(empty, tf.float32, num_elements=1),
            list_ops.tensor_list_stack(list_ops.tensor_list_set_item(reserved, 0, item),
                                       tf.float32, num_elements=3))


def run_and_compare(fn, args, mesh, specs, out_specs=None, caplog=None):
    """fn partitioned on `mesh` and on one device: equal values (assert_close per
    output); returns (Lowered, the gspmd_tf warnings logged, when `caplog` is given)."""
    f = gt.function(fn, mesh=mesh, in_shardings=specs, out_shardings=out_specs)
    if caplog is not None:
        caplog.set_level("WARNING", logger="gspmd_tf")
    got = tf.nest.flatten(f(*args))
    want = single_device(fn, args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g.numpy(), w, f"output {i}")
    warnings = [r.getMessage() for r in caplog.records] if caplog is not None else []
    return f.lower(*args), warnings


def explicitly_padded_input_gradient(rng):
    """(fn, args): a Conv2DBackpropInput with EXPLICIT padding that XLA:CPU computes
    wrong (1e23 or NaN, changing from call to call: a 2x2 filter over rows padded by 3
    in front; issue 25 item 3), and its arguments (filter, output gradient)."""
    from tensorflow.python.ops import gen_nn_ops

    def input_gradient(kernel, dy):
        return gen_nn_ops.conv2d_backprop_input(
            [2, 5, 5, 2], kernel, dy, strides=[1, 1, 1, 1], padding="EXPLICIT",
            explicit_paddings=[0, 0, 3, 0, 3, 0, 0, 0])
    return input_gradient, [randn(rng, 2, 2, 2, 3), randn(rng, 2, 7, 7, 3)]


class Started:
    """Subprocesses started at once (captured text output), running beside whatever the
    caller does next: processes that spend most of their time importing TF do it side by
    side with each other and with the tests."""

    def __init__(self, commands, **popen_kwargs):
        self.runs = [subprocess.Popen(command, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, **popen_kwargs)
                     for command in commands]

    def wait(self, timeout):
        """Their CompletedProcess, in order; kills the rest if one times out."""
        done = []
        try:
            for run in self.runs:
                out, err = run.communicate(timeout=timeout)
                done.append(subprocess.CompletedProcess(run.args, run.returncode, out, err))
        finally:
            self.kill()
        return done

    def kill(self):
        """End those still running (a module's tests ended without waiting for them)."""
        for run in self.runs:
            if run.poll() is None:
                run.kill()
                run.communicate()


def run_together(commands, timeout, **popen_kwargs):
    """subprocess.run of each command, all started at once (Started) and then waited
    for; their CompletedProcess, in order."""
    return Started(commands, **popen_kwargs).wait(timeout)
