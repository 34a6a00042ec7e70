"""Lowered.memory() counts what a loop keeps alive: the activations TF's gradient of a
tf.while_loop stores for its backward pass (TensorList accumulators, one element per
iteration) and the intermediates of one iteration of the body."""

import numpy as np
import tensorflow as tf

import gspmd_tf as gt

P = gt.P
_MESH = gt.Mesh.create((4,), ("data",))
ROWS, COLS = 16, 32  # per device [4, 32] float32: 512 bytes


def _gradient_of_loop(iterations):
    def f(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = tf.while_loop(lambda i, x: i < iterations,
                              lambda i, x: (i + 1, tf.tanh(x @ w)), (0, x),
                              maximum_iterations=iterations)[1]
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, w)
    return f


def _peak(fn, *args, specs):
    return gt.lower(fn, _MESH, specs, args=args).memory().peak


def test_loop_gradient_activations_grow_with_iterations():
    x = np.ones((ROWS, COLS), np.float32)
    w = np.eye(COLS, dtype=np.float32)
    short, long = (_peak(_gradient_of_loop(n), x, w, specs=(P("data"), P()))
                   for n in (4, 12))
    # the forward loop keeps each iteration's x (and tanh) for the backward: at least
    # one device-local [4, 32] row block per extra iteration
    assert long - short >= 8 * (ROWS // 4) * COLS * 4, (short, long)


def test_loop_body_intermediates_count_while_it_runs():
    def f(x):
        def body(i, x):
            wide = tf.tile(x[:, :, None], [1, 1, 64])  # 64x an iteration's value
            return i + 1, tf.reduce_mean(wide, -1) + 1.0
        return tf.while_loop(lambda i, x: i < 3, body, (0, x))[1]
    x = np.ones((ROWS, COLS), np.float32)
    assert _peak(f, x, specs=(P("data"),)) >= 64 * (ROWS // 4) * COLS * 4


def test_loop_results_are_its_last_iteration_values_not_counted_twice():
    # While the loop runs, its carried value lives once as the operand (or the previous
    # iteration's result) and once as the value the iteration makes; the loop's results
    # are that last value, not a third buffer beside them.
    def f(x):
        carried = tf.tile(x, [1, 8])  # per device [4, 256] float32: 4,096 bytes
        result = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0),
                               (0, carried))[1]
        return tf.reduce_sum(result, axis=1)
    x = np.ones((ROWS, COLS), np.float32)
    memory = gt.lower(f, _MESH, (P("data"),), args=(x,)).memory()
    carried = (ROWS // 4) * COLS * 8 * 4
    assert 2 * carried <= memory.peak - memory.arguments - memory.outputs < 3 * carried, \
        memory


def test_a_loop_state_the_program_returns_is_counted_once_with_the_outputs():
    # A gradient accumulator's shape: a first value handed to a loop that returns the
    # sum as the program's output. That value is the output buffer's first state
    # (counted with the outputs throughout), not a further buffer while the loop runs.
    def f(x):
        return tf.while_loop(lambda i, total: i < 3,
                             lambda i, total: (i + 1, total + x * 2.0),
                             (0, x * 0.0))[1]
    x = np.ones((ROWS, COLS), np.float32)
    memory = gt.lower(f, _MESH, (P("data"),), args=(x,)).memory()
    block = (ROWS // 4) * COLS * 4
    assert memory.outputs == block, memory
    # while the loop runs: x * 2 and the new total (and scalars), not the first value
    assert 2 * block <= memory.peak - memory.arguments - memory.outputs < 3 * block, memory


def test_a_value_a_loop_passes_through_lives_while_the_loop_result_is_read():
    # TF hands a loop's unchanged value on as its result (the same buffer): read after
    # the loop, it is alive beside what the program makes there.
    def f(x):
        made = tf.tile(x, [1, 8])  # per device [4, 256] float32: 4,096 bytes
        _, passed = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v), (0, made))
        wide = tf.reduce_sum(tf.tile(x, [1, 16]), axis=1)  # 8,192 bytes made after it
        return wide + tf.reduce_sum(passed, axis=1)
    x = np.ones((ROWS, COLS), np.float32)
    memory = gt.lower(f, _MESH, (P("data"),), args=(x,)).memory()
    made = (ROWS // 4) * COLS * 8 * 4
    assert memory.peak - memory.arguments - memory.outputs >= made + 2 * made, memory


def test_a_value_a_loop_passes_through_to_the_output_is_counted_once():
    def f(x):
        made = tf.tile(x, [1, 8])  # per device [4, 256] float32: 4,096 bytes
        return tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v), (0, made))[1]
    x = np.ones((ROWS, COLS), np.float32)
    memory = gt.lower(f, _MESH, (P("data"),), args=(x,)).memory()
    made = (ROWS // 4) * COLS * 8 * 4
    assert memory.outputs == made and memory.peak - memory.arguments < 2 * made, memory
