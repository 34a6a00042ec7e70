"""Partitioned control flow: shardings propagate through While / If / Case bodies, each
body is one SPMD sub-program with its own collectives (run on every iteration, on every
device), and loop operands are never gathered. Values equal single-device TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.graph.ir import walk
from util import assert_close, randn, single_device
from util import run_and_compare, tensor_lists

P = gt.P


@pytest.fixture
def xw():
    rng = np.random.default_rng(11)
    return randn(rng, 8, 16), randn(rng, 16, 16) / 4


def region_op(low, op_types):
    """The program's (first) control-flow node of one of `op_types`."""
    return next(n for n in walk(low.program.graph) if n.op in op_types)


def body_collectives(node):
    """Kinds of the collectives inside a control-flow node's regions."""
    return sorted(n.op for region in node.regions for n in walk(region)
                  if n.op.startswith("gt.") and n.op not in ("gt.Input", "gt.ShardIndex"))


def matmul_loop(x, w):
    def body(i, h):
        return i + 1, tf.tanh(h @ w)
    return tf.while_loop(lambda i, h: i < 4, body, (0, x))[1]


def test_while_matmul_all_reduce_in_body(mesh, xw, caplog):
    """Model-split weights: the body's matmul contracts a split dim, so the body holds an
    all-reduce (run on each of the 4 iterations on all 8 devices); the loop value stays
    split and nothing is gathered."""
    low, warnings = run_and_compare(matmul_loop, xw, mesh, (P("data", "model"), P("model", None)),
                                    caplog=caplog)
    assert not low.program.replicated_ops and not warnings
    loop = region_op(low, ("While", "StatelessWhile"))
    # the partial product is reduce-scattered back to the loop value's column split
    assert body_collectives(loop) == ["gt.ReduceScatter"]
    assert {c.kind for c in low.collectives()} == {"reduce-scatter"}
    # the loop's operand, body parameter, body result and result share one sharding
    body = loop.regions[1]
    x_local = low.program.graph.shape(loop.inputs[3])
    assert body.shape(body.inputs[3]) == x_local == body.shape(body.outputs[3])
    assert x_local[0] == 4  # rows split over "data"


def test_while_row_parallel_matmul_all_reduces_every_iteration(mesh, xw):
    """The loop value replicated over "model" (annotated in the body), the weights'
    rows split over it: each iteration slices the value locally, multiplies, and
    all-reduces the partial product (Megatron's row-parallel layer) on all 8 devices."""
    def fn(x, w):
        def body(i, h):
            return i + 1, gt.mesh_split(tf.tanh(h @ w), mesh, P("data", None))
        return tf.while_loop(lambda i, h: i < 5, body, (0, x))[1]
    low, _ = run_and_compare(fn, xw, mesh, (P("data", None), P("model", None)))
    loop = region_op(low, ("While", "StatelessWhile"))
    assert body_collectives(loop) == ["gt.AllReduce"]
    assert [c.kind for c in low.collectives()] == ["all-reduce"]


def test_loop_carried_split_tensor_needs_no_collective(mesh, xw):
    def fn(x, w):
        return tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 0.5 + w * h),
                             (0, x))[1]
    x, w = xw
    low, _ = run_and_compare(fn, (x, w[:8]), mesh, (P("data", "model"), P("data", "model")))
    assert low.collectives() == []
    assert low.output_shardings[0] == gt.Sharding.from_spec(mesh, P("data", "model"), 2)


def test_permute_inside_the_body(mesh, xw):
    """Rows 0..8 of a row-split operand, sliced inside the body, move between devices
    on every iteration (a gt.Permute inside the body)."""
    def fn(x, w):
        return tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 0.5 + w[:8]),
                             (0, x))[1]
    low, _ = run_and_compare(fn, xw, mesh, (P("data", "model"), P("data", "model")))
    assert [c.kind for c in low.collectives()] == ["collective-permute"]


def test_split_inside_the_body_propagates_out(mesh, xw):
    """An annotation inside the body decides the loop value's sharding (propagation
    runs out of the body back to the operand and the result)."""
    def fn(x, w):
        def body(i, h):
            return i + 1, gt.mesh_split(tf.sin(h) + 1.0, mesh, P(None, "model"))
        return tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]
    low, _ = run_and_compare(fn, xw, mesh, (None, None))
    want = gt.Sharding.from_spec(mesh, P(None, "model"), 2)
    assert low.input_shardings[0] == want and low.output_shardings[0] == want


def test_cond_with_split_operands(mesh, xw, caplog):
    def fn(x, w):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.tanh(x @ w), lambda: tf.sin(x) - 1.0)
    x, w = xw
    for sign in (1, -1):
        xs = np.abs(x) * sign
        low, warnings = run_and_compare(fn, (xs, w), mesh, (P("data", None), P(None, "model")),
                                        caplog=caplog)
    assert not low.program.replicated_ops and not warnings
    node = region_op(low, ("If", "StatelessIf"))
    # operands enter split: x by rows, w by columns
    assert low.program.graph.shape(node.inputs[1])[0] == 4
    assert "all-gather" not in {c.kind for c in low.collectives()}


def test_case_with_split_operands(mesh, xw):
    def fn(x, w):
        k = tf.cast(x[0, 0], tf.int32)
        return tf.switch_case(k, [lambda: x * 2.0, lambda: x @ w, lambda: tf.sin(x)])
    x, w = xw
    for k in (0, 1, 2):
        xk = x.copy()
        xk[0, 0] = k
        low, _ = run_and_compare(fn, (xk, w), mesh, (P("data", "model"), P("model", None)))
        node = region_op(low, ("Case", "StatelessCase"))
        assert low.program.graph.shape(node.inputs[1]) == (4, 4)
        assert "gt.ReduceScatter" in body_collectives(node)  # the x @ w branch


def test_nested_cond_in_while_with_collectives(mesh, xw):
    def fn(x, w):
        def body(i, h):
            h = tf.cond(i % 2 == 0, lambda: tf.tanh(h @ w), lambda: tf.sin(h))
            return i + 1, h
        return tf.while_loop(lambda i, h: i < 5, body, (0, x))[1]
    low, _ = run_and_compare(fn, xw, mesh, (P("data", "model"), P("model", None)))
    assert {c.kind for c in low.collectives()} == {"reduce-scatter"}


def test_gradient_through_the_loop(mesh, xw, caplog):
    """The gradient loop (over TF's TensorList accumulators) is partitioned too."""
    def grad(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = tf.reduce_sum(matmul_loop(x, w) ** 2)
        return tape.gradient(y, w)
    low, warnings = run_and_compare(grad, xw, mesh, (P("data", "model"), P("model", None)),
                                    caplog=caplog)
    assert not warnings
    loops = [n for n in low.program.graph.nodes if n.regions]
    assert len(loops) == 2 and all(body_collectives(n) for n in loops)


def accumulate(x, w):
    def body(i, array, h):
        h = tf.tanh(h @ w)
        return i + 1, array.write(i, h), h
    array = tf.TensorArray(tf.float32, size=3)
    return tf.while_loop(lambda i, a, h: i < 3, body, (0, array, x))[1].stack()


def test_tensor_list_accumulate(mesh, xw, caplog):
    """A TensorArray of split elements stays split: each device's list holds its shards
    (the list's index dim whole), and the stacked result is split like the elements."""
    low, warnings = run_and_compare(accumulate, xw, mesh, (P("data", "model"), P("model", None)),
                                    caplog=caplog)
    assert not warnings
    lists = {n.op: n.out_shapes[0] for n in walk(low.program.graph) if "TensorList" in n.op}
    assert lists == {"TensorListReserve": (4, 4), "TensorListSetItem": (4, 4),
                     "TensorListStack": (3, 4, 4)}
    assert low.output_shardings[0] == gt.Sharding.from_spec(mesh, P(None, "data", "model"), 3)
    assert {c.kind for c in low.collectives()} == {"reduce-scatter"}  # the matmul's only


def test_tensor_list_gradient(mesh, xw, caplog):
    """The gradient of a loop over a TensorArray: TF's accumulators (EmptyTensorList,
    TensorListPushBack, TensorListPopBack in the gradient loop, TensorListFromTensor)
    keep split elements; nothing runs replicated."""
    def grad(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = tf.reduce_sum(accumulate(x, w) ** 2)
        return tape.gradient(y, w)
    low, warnings = run_and_compare(grad, xw, mesh, (P("data", "model"), P("model", None)),
                                    caplog=caplog)
    assert not warnings
    ops = {n.op for n in walk(low.program.graph)}
    assert {"EmptyTensorList", "TensorListPushBack", "TensorListPopBack"} <= ops


def test_roll_on_a_split_dim_inside_the_body(mesh, xw):
    """The pipeline's shift: tf.roll along a split stage dim inside a while body."""
    def fn(x, w):
        def body(i, h):
            return i + 1, tf.roll(h, 1, axis=0) * 0.5 + 1.0
        return tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]
    run_and_compare(fn, xw, mesh, (P("data", None), None))


def test_body_collectives_have_fixed_deterministic_keys(mesh, xw):
    """The collectives inside bodies get instance keys like top-level ones: one per
    collective (used on every iteration), the same for every compile of the program."""
    specs = (P("data", "model"), P("model", None))
    first = gt.function(matmul_loop, mesh=mesh, in_shardings=specs).lower(*xw).compile()
    again = gt.function(matmul_loop, mesh=mesh, in_shardings=specs).lower(*xw).compile()
    keys = first.collective_keys()
    names = [name for name, *_ in keys]
    assert any(name.startswith("while/") for name in names)
    assert len({instance for _, _, instance, _ in keys}) == len(keys)
    assert keys == again.collective_keys()


@pytest.mark.parametrize("layer", ["LSTM", "GRU"])
@pytest.mark.parametrize("layout_map", [{}, {".*rnn.*kernel": P(None, "model")}],
                         ids=["data_parallel", "hidden_split"])
def test_keras_rnn_trains_with_its_loops_partitioned(mesh, caplog, layer, layout_map):
    """A Keras LSTM / GRU (a While forward, a While over TensorLists backward): one epoch
    of fit, batch split over "data" (and the gate kernels' columns over "model"), equals
    one device, and no op runs replicated (no warning): the loops and their TensorList
    ops are partitioned. With the kernels split, the loops read them in place (the
    gradient takes VariableShape of the handle a loop hands through: folded to the
    variable's shape)."""
    import os
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("gt.keras needs Keras' TensorFlow backend")
    rng = np.random.default_rng(5)
    x = randn(rng, 16, 4, 4)
    y = rng.integers(0, 3, (16,)).astype(np.int32)

    def model():
        keras.utils.set_random_seed(2)
        m = keras.Sequential([keras.Input((4, 4)), getattr(keras.layers, layer)(8, name="rnn"),
                              keras.layers.Dense(3)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
    single, sharded = model(), model()
    gt.keras.shard_model(sharded, mesh, layout_map=layout_map)
    want = single.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = sharded.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert_close(got.history["loss"], want.history["loss"], "loss")
    for a, b in zip(sharded.weights, single.weights):
        assert_close(a.numpy(), b.numpy(), a.path)
    replicated = [r.getMessage() for r in caplog.records if "replicated" in r.getMessage()]
    assert not replicated, replicated


def test_every_tensor_list_op_on_split_elements(mesh, caplog):
    """The list ops with rules (util.tensor_lists) on elements split over both axes:
    every device's lists hold its shards, values equal one device, and nothing moves
    between devices."""
    rng = np.random.default_rng(2)
    low, warnings = run_and_compare(tensor_lists, (randn(rng, 3, 4, 6), randn(rng, 4, 6)), mesh,
                                    (P(None, "data", "model"), P("data", "model")), caplog=caplog)
    assert not warnings and low.collectives() == []


def test_cond_returning_a_tensor_list(mesh, xw, caplog):
    """Branches that write split elements into a TensorArray return the list as it is
    (a list is never resharded)."""
    def fn(x, w):
        array = tf.TensorArray(tf.float32, size=2, element_shape=(8, 16))
        array = tf.cond(tf.reduce_sum(x) > 0, lambda: array.write(0, x @ w),
                        lambda: array.write(1, tf.sin(x)))
        return array.read(0) + 2.0 * array.read(1)  # an unwritten element reads zeros
    x, w = xw
    for sign in (1, -1):
        low, warnings = run_and_compare(fn, (np.abs(x) * sign, w), mesh,
                                        (P("data", None), P(None, "model")), caplog=caplog)
        assert not warnings


def _region(build):
    """A region Graph with parameters i: int32[], x: float32[2, 3] (gt.Input nodes);
    build(graph, i, x) adds its nodes and returns its outputs."""
    from gspmd_tf.graph.ir import Graph, Node, Ref
    region = Graph()
    params = [Ref(region.add(Node(name, "gt.Input", out_shapes=[shape], out_dtypes=[dtype],
                                  params={"index": k})), 0)
              for k, (name, shape, dtype) in enumerate([("i", (), tf.int32),
                                                         ("x", (2, 3), tf.float32)])]
    region.inputs = params
    region.outputs = build(region, *params)
    return region


def _op(graph, name, op, inputs, shape, out_dtype, **attrs):
    """A TF op node added to `graph`; its Ref."""
    from gspmd_tf.graph.ir import Node, Ref, attr_value
    return Ref(graph.add(Node(name, op, inputs, {k: attr_value(v) for k, v in attrs.items()},
                              [shape], [out_dtype])), 0)


def test_cyclic_permute_inside_a_loop_body(mesh):
    """The pipeline's shift: a gt.Permute sending each device's block to the next device
    of a cycle, inside a While body run for 4 iterations on all 8 devices (LocalBackend:
    point-to-point collectives, one instance key for every iteration)."""
    from gspmd_tf.backends import LocalBackend
    from gspmd_tf.graph.ir import Graph, Node, Ref, attr_value
    from tensorflow.core.framework import attr_value_pb2
    n = mesh.size
    cycle = [(d, (d + 1) % n) for d in range(n)]

    def cond(g, i, x):
        four = _op(g, "four", "Const", [], (), tf.int32, dtype=tf.int32, value=np.asarray(4, np.int32))
        return [_op(g, "less", "Less", [i, four], (), tf.bool, T=tf.int32)]

    def body(g, i, x):
        one = _op(g, "one", "Const", [], (), tf.int32, dtype=tf.int32, value=np.asarray(1, np.int32))
        half = _op(g, "half", "Const", [], (), tf.float32, dtype=tf.float32,
                   value=np.asarray(0.5, np.float32))
        shifted = Ref(g.add(Node("shift", "gt.Permute", [x], out_shapes=[(2, 3)],
                                 out_dtypes=[tf.float32], params={"pairs": cycle})), 0)
        return [_op(g, "next", "AddV2", [i, one], (), tf.int32, T=tf.int32),
                _op(g, "scaled", "Mul", [shifted, half], (2, 3), tf.float32, T=tf.float32)]

    program = Graph()
    x = Ref(program.add(Node("x", "gt.Input", out_shapes=[(2, 3)], out_dtypes=[tf.float32],
                             params={"index": 0})), 0)
    zero = _op(program, "zero", "Const", [], (), tf.int32, dtype=tf.int32, value=np.asarray(0, np.int32))
    missing = attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name="no_such_fn"))
    loop = program.add(Node(
        "loop", "StatelessWhile", [zero, x],
        attrs={"T": attr_value([tf.int32, tf.float32]), "cond": missing, "body": missing,
               "parallel_iterations": attr_value(10),
               "output_shapes": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                   shape=[tf.TensorShape(s).as_proto() for s in [(), (2, 3)]]))},
        out_shapes=[(), (2, 3)], out_dtypes=[tf.int32, tf.float32],
        regions=[_region(cond), _region(body)]))
    program.inputs, program.outputs = [x], [Ref(loop, 1)]
    shards = [np.full((2, 3), d, np.float32) for d in range(n)]
    outs = LocalBackend(mesh).compile(program, "cyclic shift loop")([shards])
    for d, out in enumerate(outs[0]):
        assert_close(out.numpy(), shards[(d - 4) % n] / 16, f"device {d}")
