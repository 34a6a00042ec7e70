"""Shared test helpers: compare a partitioned function with the single-device one."""

import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import settings, strategies as st

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


def examples(share=1):
    """max_examples for a randomized test: 1/share of the hypothesis profile's (at least
    2), 8x as many under GSPMD_TF_LONG=1 (`make test-long`)."""
    runs = max(2, settings().max_examples // share)
    return runs * (8 if os.environ.get("GSPMD_TF_LONG") == "1" else 1)


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


@st.composite
def specs(draw, mesh_axes, rank):
    """A random PartitionSpec: each dim unsplit, one axis, or two axes; axes used once."""
    free = list(mesh_axes)
    entries = []
    for _ in range(rank):
        choice = draw(st.integers(0, 3))
        if choice == 0 or not free:
            entries.append(None)
            continue
        k = 2 if choice == 3 and len(free) >= 2 else 1
        picked = tuple(draw(st.permutations(free))[:k])
        for a in picked:
            free.remove(a)
        entries.append(picked[0] if k == 1 else picked)
    return gt.P(*entries)


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

    def __init__(self, commands, envs=None, **popen_kwargs):
        """`envs`: an environment per command, where they differ."""
        envs = envs or [popen_kwargs.pop("env", None)] * len(commands)
        self.runs = [subprocess.Popen(command, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env,
                                      **popen_kwargs)
                     for command, env in zip(commands, envs)]
        _LIVE.add(self)

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
        _LIVE.discard(self)


def run_together(commands, timeout, **popen_kwargs):
    """subprocess.run of each command, all started at once (Started) and then waited
    for; their CompletedProcess, in order."""
    return Started(commands, **popen_kwargs).wait(timeout)


# Started processes not yet waited for or killed: the session ends them (stop_background)
_LIVE = set()


class Background:
    """Subprocess work a test module declares at import, `NAME = Background(fn)`: `fn()`
    runs processes (Started, run_together, fuzz workers), reads their output, and returns
    what the module's tests read. It runs no TensorFlow in this process: it may run in a
    thread beside the tests.

    When collection ends, conftest starts the jobs of the modules whose tests are selected,
    in collection order, one at a time in a thread (start_background): their processes,
    which mostly import TF and run a program, take the machine's other core while this
    process runs the tests before them. `result()` returns fn's value or raises its
    exception; a job the thread has not reached runs at once in the caller, so a test
    waits only for its own job, and every job ends before its module's tests do. Jobs
    give their processes session_environ(); the fuzz driver's workers take os.environ,
    so a monkeypatched variable of a test before test_fuzz can reach them (today: the
    all-reduce combine threshold, the collective timeout (which workers set), the
    backend choice unset)."""

    _declared = []

    def __init__(self, fn):
        self.fn = fn
        self.module = fn.__module__
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._value = self._error = None
        Background._declared.append(self)

    def _claim_and_run(self):
        """Runs fn unless another thread has claimed it."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            self._value = self.fn()
        except BaseException as error:  # re-raised in every test that reads the job
            self._error = error
        finally:
            self._done.set()

    def result(self):
        """fn's value (its exception raised); runs fn here if no thread has started it."""
        self._claim_and_run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


_stopping = threading.Event()
_environ = {}
_directories = []


def job_directory(prefix):
    """A new directory for a background job's files (pytest's tmp_path is a test's), removed
    when the session ends."""
    path = tempfile.mkdtemp(prefix=f"gspmd_tf_{prefix}_")
    _directories.append(path)
    return path


def session_environ():
    """os.environ as it was when the background jobs started (what their processes get:
    a test that sets a variable meanwhile must not reach them), os.environ before."""
    return dict(_environ or os.environ)


def start_background(modules):
    """Runs the declared jobs of `modules` (module names), one at a time, in a daemon
    thread."""
    _environ.update(os.environ)
    jobs = [job for job in Background._declared if job.module in modules]

    def serve():
        for job in jobs:
            if _stopping.is_set():
                return
            job._claim_and_run()
    threading.Thread(target=serve, name="background test jobs", daemon=True).start()


def stop_background():
    """Starts no more jobs and kills the processes of those running (the session
    ended, perhaps at a failure with -x)."""
    _stopping.set()
    for started in list(_LIVE):
        for run in started.runs:
            if run.poll() is None:
                run.kill()
    for path in _directories:
        shutil.rmtree(path, ignore_errors=True)
