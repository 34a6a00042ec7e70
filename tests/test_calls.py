"""Calling a gt.function as a TF user calls a tf.function: methods, keywords, Python
values, and the slips that must fail with a clear error instead of a confusing one."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close, check_partitioned

P = gt.P


def x8x4(dtype=np.float32):
    return np.arange(32).reshape(8, 4).astype(dtype)


def test_method_binds_self(mesh):
    class Scaler:
        def __init__(self, k):
            self.k = k
            self.traces = 0

        @gt.function(mesh=mesh, in_shardings=(P("data"),))
        def scale(self, x):
            self.traces += 1
            return x * self.k

    two, three = Scaler(2.0), Scaler(3.0)
    assert_close(two.scale(x8x4()).numpy(), 2 * x8x4())
    assert_close(three.scale(x8x4()).numpy(), 3 * x8x4())
    assert_close(two.scale(x8x4()).numpy(), 2 * x8x4())
    assert two.traces == 1 and three.traces == 1  # one trace per instance, kept
    assert two.scale is two.scale and Scaler.scale.name.endswith("Scaler.scale")
    assert Scaler(4.0).scale(x8x4()).sharding == two.scale(x8x4()).sharding


def test_keyword_arguments_match_in_shardings_by_signature(mesh):
    def affine(x, w, bias=None, *, scale=1.0):
        y = x @ w
        return (y if bias is None else y + bias) * scale

    f = gt.function(affine, mesh=mesh, in_shardings=(P("data"), P(None, "model"), None, None))
    x, w, b = x8x4(), np.ones((4, 8), np.float32), np.arange(8, dtype=np.float32)
    want = (x @ w + b) * 2.0
    assert_close(f(x, w, b, scale=2.0).numpy(), want)
    assert_close(f(w=w, x=x, scale=2.0, bias=b).numpy(), want)
    assert f(w=w, x=x, bias=b, scale=2.0).sharding == f(x, w, b, scale=2.0).sharding
    assert f.lower(x=x, w=w, bias=b, scale=2.0).input_shardings[0] == \
        gt.Sharding.from_spec(mesh, P("data"), 2)
    with pytest.raises(TypeError, match="missing a required argument: 'w'"):
        f(x)
    g = gt.function(affine, mesh=mesh, in_shardings=(P("data"), None))
    with pytest.raises(gt.ShardingError,
                       match=r"got 3 arguments \(x, w, bias\) but in_shardings has 2"):
        g(x, w, bias=b)  # bias is the third parameter: it needs a third entry


def test_keyword_only_tensors_in_any_order(mesh):
    def f(x, *, z, b):
        return x @ z + b

    g = gt.function(f, mesh=mesh, in_shardings=(P("data"), P(None, "model"), P("model")))
    x, z, b = x8x4(), np.ones((4, 8), np.float32), np.arange(8, dtype=np.float32)
    assert_close(g(x, b=b, z=z).numpy(), x @ z + b)
    assert g.lower(x, z=z, b=b).input_shardings[2] == gt.Sharding.from_spec(mesh, P("model"), 1)


def test_keyword_arguments_skipping_a_default(mesh):
    f = gt.function(lambda x, y=None, z=1.0: x * z if y is None else (x + y) * z, mesh=mesh)
    assert_close(f(x8x4(), z=3.0).numpy(), 3 * x8x4())


def test_python_values_are_static_as_in_tf_function(mesh):
    traces = []

    def scaled(x, k, training=False):
        traces.append((k, training))
        return x * k + (1.0 if training else 0.0)

    f = gt.function(scaled, mesh=mesh, in_shardings=(P("data"), None, None))
    assert_close(f(x8x4(), 2.0, True).numpy(), 2 * x8x4() + 1)
    assert_close(f(x8x4(), 2, False).numpy(), 2 * x8x4())   # an int where a float was
    assert_close(f(x8x4(), 2.0, True).numpy(), 2 * x8x4() + 1)
    assert traces == [(2.0, True), (2, False)]
    # a Python number as the only argument: a constant program, as in tf.function
    g = gt.function(lambda v: v * 2.0, mesh=mesh)
    assert_close(g(3).numpy(), np.float32(6.0))
    h = gt.function(lambda v: v * 2.0, mesh=mesh, in_shardings=(P("data"),))
    with pytest.raises(gt.ShardingError, match=r"argument 0 \('v'\) is the Python value 3, "
                                               r"which is static.*P\('data'\)"):
        h(3)


def test_numpy_scalars_stay_tensors(mesh):
    f = gt.function(lambda x, k: x * k, mesh=mesh, in_shardings=(P("data"), None))
    assert_close(f(x8x4(), np.float32(2)).numpy(), 2 * x8x4())
    assert_close(f(x8x4(), np.float32(5)).numpy(), 5 * x8x4())
    assert len(f._cache) == 1


def test_other_dtype_than_traced_names_both(mesh):
    f = gt.function(lambda x: x * 2.0, mesh=mesh, in_shardings=(P("data"),))
    f(x8x4())
    with pytest.raises(TypeError) as info:
        f(x8x4(np.int32))
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "<lambda>' for (x: int32[8, 4])" in note
    assert "earlier calls traced (x: float32[8, 4])" in note


@pytest.mark.parametrize("value, message", [
    (None, r"argument 0 \('x'\) is the Python value None"),
    (tf.ragged.constant([[1.0], [2.0, 3.0]]), r"argument 0 \('x'\) is a tf.RaggedTensor"),
    (tf.sparse.from_dense(np.eye(8, 4, dtype=np.float32)),
     r"argument 0 \('x'\) is a tf.SparseTensor"),
    (object(), r"argument 0 \('x'\) \(object\) is neither a tensor nor a Python value"),
])
def test_arguments_that_are_not_dense_tensors(mesh, value, message):
    f = gt.function(lambda x: x * 2.0, mesh=mesh, in_shardings=(P("data"),))
    with pytest.raises(gt.ShardingError, match=message):
        f(value)


def test_strings_on_split_dims(mesh):
    words = np.array([b"a", b"bc", b"", b"def", b"g", b"hi", b"j", b"kl", b"m", b"n"])
    # an elementwise string op stays local; StringJoin has no rule, so it runs
    # replicated and its inputs are all-gathered (by copies: TF's collectives take no
    # strings); 10 words over 4 devices is uneven
    for value in (words, tf.constant(words)):  # a tf string tensor reads as objects
        check_partitioned(lambda s: tf.strings.join([s, s], separator="-"), [value], mesh,
                          (P("model"),))
    check_partitioned(lambda s: tf.strings.length(s), [words.reshape(2, 5)], mesh,
                      (P("data", "model"),))


def test_complex_values_across_split_dims(mesh):
    rng = np.random.default_rng(0)
    z = (rng.integers(-4, 5, (8, 4)) + 1j * rng.integers(-4, 5, (8, 4))).astype(np.complex64)
    check_partitioned(lambda v: tf.reduce_sum(v * v, axis=0), [z], mesh, (P("data", "model"),))
    check_partitioned(lambda v: tf.transpose(v) * 2, [z], mesh, (P("data"),),
                      out_shardings=(P("model"),))
    check_partitioned(lambda v: tf.reduce_prod(v, axis=1), [z[:, :2] / 2], mesh,
                      (P(None, "data"),))


def test_called_inside_tf_function_says_what_to_do(mesh):
    f = gt.function(lambda x: x * 2.0, mesh=mesh, in_shardings=(P("data"),))
    with pytest.raises(gt.ShardingError, match="called while TensorFlow traces a graph"):
        tf.function(lambda v: f(v).shards[0], autograph=False)(x8x4())
    with pytest.raises(gt.ShardingError, match="called while TensorFlow traces a graph"):
        tf.function(lambda: f(x8x4()).shards[0], autograph=False)()


def test_called_under_gradient_tape_says_what_to_do(mesh):
    f = gt.function(lambda x: x * 2.0, mesh=mesh, in_shardings=(P("data"),))
    x = tf.constant(x8x4())
    with tf.GradientTape() as tape:
        tape.watch(x)
        with pytest.raises(gt.ShardingError, match=r"GradientTape.*argument 0 \('x'\).*"
                                                   r"inside the gt.function"):
            f(x)
    with tf.GradientTape():
        assert_close(f(x8x4()).numpy(), 2 * x8x4())  # nothing watched: fine
    v = gt.Variable(x8x4(), mesh=mesh, spec=P("data"))
    g = gt.function(lambda x: x * v, mesh=mesh, in_shardings=(P("data"),))
    with tf.GradientTape():
        with pytest.raises(gt.ShardingError, match="GradientTape.*variable"):
            g(x8x4())
    assert_close(g(x8x4()).numpy(), x8x4() ** 2)


def test_variable_recreated_with_the_same_name(mesh):
    # as tf.Variable: names need not be unique; each variable is its own
    first = gt.Variable(x8x4(), mesh=mesh, spec=P("data"), name="w")
    second = gt.Variable(2 * x8x4(), mesh=mesh, spec=P("data"), name="w")
    assert tf.Variable(1.0, name="w").name == tf.Variable(2.0, name="w").name
    read = gt.function(lambda: second * 1.0, mesh=mesh)
    assert_close(read().numpy(), 2 * x8x4())
    assert_close(gt.function(lambda: first * 1.0, mesh=mesh)().numpy(), x8x4())


def test_py_function_runs_once_per_call(mesh, caplog):
    """Its input gathered whole: the function runs once per call, on the whole value,
    and every device gets its result (documented in gt.function)."""
    calls = []

    def double(v):
        calls.append(tuple(v.shape))
        return v * 2

    def doubled(x):
        y = tf.py_function(double, [x], tf.float32)
        y.set_shape(x.shape)  # gspmd-tf needs static shapes
        return y

    f = gt.function(doubled, mesh=mesh, in_shardings=(P("data"),))
    for step in range(1, 3):
        assert_close(f(x8x4()).numpy(), 2 * x8x4())
        assert calls == [(8, 4)] * step
    assert "no partitioning rule" not in caplog.text
    assert "once per call" in gt.Function.__doc__


def test_numpy_function_runs_once_per_call(mesh):
    """tf.numpy_function twice in a program, the second on the first's result: each
    runs once per call, on its whole input."""
    calls = []

    def count(v):
        calls.append(v.shape)
        return v + 1.0

    def fn(x):
        once = tf.numpy_function(count, [x], tf.float32)
        once.set_shape(x.shape)
        twice = tf.numpy_function(count, [once * 2.0], tf.float32)
        twice.set_shape(x.shape)
        return twice

    x = x8x4()
    f = gt.function(fn, mesh=mesh, in_shardings=(P("data", "model"),))
    assert_close(f(x).numpy(), (x + 1) * 2 + 1)
    assert calls == [(8, 4)] * 2


@pytest.mark.parametrize("backend", ["local", "xla"])
def test_tf_print_prints_once_per_call_iteration_and_taken_branch(mesh, tmp_path, capfd,
                                                                  backend):
    """tf.print of a split tensor writes what single-device TF writes: the whole value,
    once per call at top level (PRINTS: the devices holding its input equal run it
    once), once per iteration in a tf.while_loop body and once in a tf.cond's taken
    branch (v1 Print there), not once per device or per device's body."""
    def printed(x, stream):
        tf.print("sum", tf.reduce_sum(x), x[:, 0], output_stream=stream, summarize=-1)

        def body(i, v):
            tf.print("step", i, tf.reduce_sum(v), output_stream=stream)
            return i + 1, v * 2.0

        _, y = tf.while_loop(lambda i, v: i < 3, body, (tf.constant(0), x))
        return tf.cond(tf.reduce_sum(y) > 0.0,
                       lambda: tf.identity(tf.compat.v1.Print(y, [y[0, 0]], "taken ")),
                       lambda: y - 1.0)

    x = x8x4()
    got, want = tmp_path / "got.txt", tmp_path / "want.txt"
    f = gt.function(lambda v: printed(v, f"file://{got}"), mesh=mesh,
                    in_shardings=(P("data", "model"),), backend=backend)
    for _ in range(2):
        assert_close(f(x).numpy(), 8 * x)
    assert capfd.readouterr().err.count("taken [0]") == 2  # v1 Print writes to stderr
    with tf.device("/device:CPU:0"):
        tf.function(lambda v: printed(v, f"file://{want}"))(x)
    lines, expected = got.read_text().splitlines(), want.read_text().splitlines()
    assert [line.split()[0] for line in expected] == ["sum", "step", "step", "step"]
    assert len(lines) == 2 * len(expected)
    for line, other in zip(lines, expected + expected):
        # the same words and values (a split sum's last digits may differ)
        for word, other_word in zip(line.split(), other.split(), strict=True):
            if word.replace(".", "").isdigit():
                assert_close(np.float32(word), np.float32(other_word))
            else:
                assert word == other_word


def test_runtime_errors_name_the_function(mesh):
    def checked(x):
        return tf.debugging.check_numerics(x * 2.0, "x has a NaN")

    f = gt.function(checked, mesh=mesh, in_shardings=(P("data"),))
    with pytest.raises(tf.errors.InvalidArgumentError, match="x has a NaN") as info:
        f(np.full((8, 4), np.nan, np.float32))
    assert "while running gt.function 'test_runtime_errors_name_the_function.<locals>." \
           "checked'" in info.value.__notes__
    assert "__inference_gt_function_test_runtime_errors_name_the_function_locals_checked" \
        in str(info.value)
