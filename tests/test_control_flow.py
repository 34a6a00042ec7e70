"""Control flow (While / If / Case) in a gt.function: the bodies are regions of the IR,
partitioned into SPMD sub-programs (no warning, nothing replicated for it), and values
equal single-device TF. tests/test_control_flow_partitioned.py checks the shardings and
collectives of partitioned bodies."""

import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

import gspmd_tf as gt
from gspmd_tf.backends import LocalBackend
from gspmd_tf.graph.importer import import_graph
from gspmd_tf.graph.ir import Graph, Node, Ref, attr_value
from util import assert_close, randn, single_device

P = gt.P
SPECS = (P("data", "model"), P(None, "model"))


@pytest.fixture
def xw():
    rng = np.random.default_rng(7)
    return randn(rng, 8, 16), randn(rng, 16, 16) / 4


def check_calls(fn, calls, mesh, caplog, specs=SPECS, out_specs=None):
    """One gt.function of `fn` called on each argument tuple of `calls`: values equal
    single-device TF. Returns (Lowered of the first call, the warnings logged)."""
    f = gt.function(fn, mesh=mesh, in_shardings=specs, out_shardings=out_specs)
    with caplog.at_level("WARNING", logger="gspmd_tf"):
        for args in calls:
            got = tf.nest.flatten(f(*args))
            want = single_device(fn, args)
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want)):
                assert_close(g.numpy(), w, f"output {i}")
    return f.lower(*calls[0]), [r.getMessage() for r in caplog.records]


def region_ops(graph):
    """Every node with regions in `graph` and, recursively, in its regions."""
    found = []
    for node in graph.nodes:
        if node.regions:
            found.append(node)
            for region in node.regions:
                found += region_ops(region)
    return found


def assert_partitioned(low, warnings, names):
    """The control-flow ops `names` are partitioned: none runs replicated or is named
    by a warning (their bodies are SPMD sub-programs)."""
    assert names and not set(names) & set(low.program.replicated_ops)
    for name in names:
        assert not any(re.search(rf"[ ,]{re.escape(name)}(?:[ ,]|$)", w) for w in warnings), (
            name, warnings)


def while_matmul(x, w):
    def body(i, h):
        return i + 1, tf.tanh(h @ w)
    return tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]


def test_while_with_matmul_body(mesh, xw, caplog):
    low, warnings = check_calls(while_matmul, [xw], mesh, caplog, out_specs=(P("data"),))
    assert_partitioned(low, warnings, ["while"])
    # the body is partitioned: its matmul's model-split result is gathered back to the
    # loop value's layout inside it, on every iteration
    assert {c.kind for c in low.collectives()} == {"all-gather"}
    assert low.output_shardings[0] == gt.Sharding.from_spec(mesh, P("data"), 2)


def test_while_regions_in_the_ir(xw):
    graph = import_graph(tf.function(while_matmul, autograph=False)
                         .get_concrete_function(*xw))
    loop = graph.nodes[graph.node_index("while")]
    assert loop.op == "StatelessWhile" and len(loop.regions) == 2
    cond, body = loop.regions
    operands = loop.region_operands()
    assert operands == loop.inputs  # a loop passes all its operands to cond and body
    for region in (cond, body):
        # region parameters are the graph's inputs, one per operand, of its shape
        assert [region.shape(r) for r in region.inputs] == [graph.shape(r) for r in operands]
        assert all(region.nodes[r.node].op == "Placeholder" for r in region.inputs)
    assert [cond.dtype(r) for r in cond.outputs] == [tf.bool]
    # body results are the loop-carried values: same shapes and dtypes as the loop's
    assert [body.shape(r) for r in body.outputs] == loop.out_shapes
    assert [body.dtype(r) for r in body.outputs] == loop.out_dtypes
    assert any(n.op == "MatMul" and n.name.startswith("while/body/") for n in body.nodes)
    assert not any(n.op == "MatMul" for n in graph.nodes)  # not inlined


def cond_fn(x, w):
    return tf.cond(tf.reduce_sum(x) > 0, lambda: x @ w, lambda: tf.sin(x) - 1.0)


def test_cond_takes_both_branches(mesh, xw, caplog):
    x, w = xw
    x = np.abs(x)
    low, warnings = check_calls(cond_fn, [(x, w), (-x, w)], mesh, caplog)
    assert_partitioned(low, warnings, ["cond"])
    node = low.graph.nodes[low.graph.node_index("cond")]
    assert node.op in ("If", "StatelessIf") and len(node.regions) == 2
    assert node.region_operands() == node.inputs[1:]


def switch_fn(x, w):
    k = tf.cast(x[0, 0], tf.int32)
    return tf.switch_case(k, [lambda: x * 2.0, lambda: x @ w, lambda: tf.sin(x)])


def test_switch_case_takes_every_branch(mesh, xw, caplog):
    x, w = xw
    calls = []
    for k in (0, 1, 2, 5):  # 5: out of range, the last branch (TF's default)
        xk = x.copy()
        xk[0, 0] = k
        calls.append((xk, w))
    low, warnings = check_calls(switch_fn, calls, mesh, caplog)
    case = region_ops(low.program.graph)
    assert [n.op for n in case] == ["StatelessCase"] and len(case[0].regions) == 3
    assert_partitioned(low, warnings, [case[0].name])


def nested_fn(x, w):
    def body(i, h):
        h = tf.cond(i % 2 == 0, lambda: h @ w, lambda: tf.sin(h))
        return i + 1, h
    return tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]


def test_cond_nested_in_while(mesh, xw, caplog):
    low, warnings = check_calls(nested_fn, [xw], mesh, caplog)
    assert_partitioned(low, warnings, ["while"])
    loop = low.program.graph.nodes[low.program.graph.node_index("while")]
    inner = [n for n in loop.regions[1].nodes if n.regions]
    assert [n.op for n in inner] == ["StatelessIf"] and len(inner[0].regions) == 2


def _map_fn(x, w):
    return tf.map_fn(lambda row: tf.tanh(tf.linalg.matvec(w, row)), x)


def _tensor_array(x, w):
    def body(i, array, h):
        h = tf.tanh(h @ w)
        return i + 1, array.write(i, h), h
    array = tf.TensorArray(tf.float32, size=4)
    return tf.while_loop(lambda i, a, h: i < 4, body, (0, array, x),
                         maximum_iterations=4)[1].stack()


def _scan_gradient(x, w):
    with tf.GradientTape() as tape:
        tape.watch(w)
        steps = tf.reshape(x, (2, 4, 16))
        y = tf.reduce_sum(tf.scan(lambda a, r: tf.tanh(a @ w) + r, steps))
    return tape.gradient(y, w)


@pytest.mark.parametrize("fn", [_map_fn, _tensor_array, _scan_gradient],
                         ids=lambda fn: fn.__name__)
def test_loops_over_tensor_arrays(mesh, xw, caplog, fn):
    """tf.map_fn, tf.TensorArray in a while_loop and tf.scan's gradient: loops whose
    bodies read and write TensorLists."""
    low, warnings = check_calls(fn, [xw], mesh, caplog)
    assert_partitioned(low, warnings, [n.name for n in low.graph.nodes if n.regions])


def test_mesh_split_inside_a_body_is_kept_as_an_identity(mesh, xw, caplog):
    def fn(x, w):
        def body(i, h):
            return i + 1, gt.mesh_split(h @ w, mesh, P("data"))
        return tf.while_loop(lambda i, h: i < 2, body, (0, x))[1]
    check_calls(fn, [xw], mesh, caplog)


def test_gradient_through_cond(mesh, xw, caplog):
    def grad(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.reduce_sum(tf.tanh(x @ w)),
                        lambda: tf.reduce_sum(x * x))
        return tape.gradient(y, [x, w])
    x, w = xw
    x = np.abs(x)
    low, warnings = check_calls(grad, [(x, w), (-x, w)], mesh, caplog)
    ifs = [n for n in low.graph.nodes if n.regions]
    assert len(ifs) == 2  # the forward If and its gradient If
    assert_partitioned(low, warnings, [n.name for n in ifs])


def test_gradient_through_while(mesh, xw, caplog):
    """TF's while gradient keeps intermediates in TensorLists; the loops and the list ops
    are partitioned (no warning), values match single device."""
    def grad(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h @ w)),
                              (0, x))[1]
            y = tf.reduce_sum(h * h)
        return tape.gradient(y, w)
    low, warnings = check_calls(grad, [xw], mesh, caplog)
    loops = [n.name for n in low.graph.nodes if n.regions]
    assert len(loops) == 2  # forward and gradient loops
    assert_partitioned(low, warnings, loops)
    assert not any("replicated" in w for w in warnings), warnings


def test_loop_shape_changing_between_iterations_is_refused(mesh, xw):
    def grow(x, w):
        return tf.while_loop(
            lambda i, h: i < 3, lambda i, h: (i + 1, tf.concat([h, h], 0)), (0, x),
            shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, 16])))[1]
    f = gt.function(grow, mesh=mesh, in_shardings=SPECS)
    with pytest.raises(gt.ShardingError, match=r"loop 'while' \(StatelessWhile\).*"
                                               r"shape_invariants"):
        f(*xw)


def test_branches_of_different_shapes_are_refused(mesh, xw):
    def ragged(x, w):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: x, lambda: x[:4])
    f = gt.function(ragged, mesh=mesh, in_shardings=SPECS)
    with pytest.raises(gt.ShardingError, match=r"op 'cond' .*branches return different"):
        f(*xw)


def test_variables_in_bodies(mesh, xw):
    x, w = xw
    sharded = gt.Variable(w, mesh, P(None, "model"), name="sharded_w")

    # a sharded variable read in a body: each device reads its shard there
    def loop(x):
        return tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h @ sharded), (0, x))[1]
    f = gt.function(loop, mesh=mesh, in_shardings=(P("data"),))
    assert_close(f(x).numpy(), x @ w @ w)
    g = gt.function(lambda x: tf.cond(x[0, 0] > 0, lambda: x @ sharded, lambda: x),
                    mesh=mesh, in_shardings=(P("data"),))
    for sign in (1, -1):
        xs = x.copy()
        xs[0, 0] = sign
        assert_close(g(xs).numpy(), xs @ w if sign > 0 else xs)

    # written in a body: each device updates its shard on every iteration
    def update(x):
        def body(i, h):
            sharded.assign_add(tf.ones_like(sharded))
            return i + 1, h + 1.0
        return tf.while_loop(lambda i, h: i < 2, body, (0, x))[1]
    h = gt.function(update, mesh=mesh, in_shardings=(P("data"),))
    assert_close(h(x).numpy(), x + 2)
    assert_close(sharded.numpy(), w + 2)

    # a replicated variable is read and updated inside the body on every device
    counter = gt.Variable(np.zeros((4,), np.float32), mesh, P(), name="counter")

    def step(x):
        def body(i, h):
            counter.assign_add(tf.ones((4,)))
            return i + 1, h * 2.0 + counter[0]
        return tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]
    k = gt.function(step, mesh=mesh, in_shardings=(P("data"),))
    assert_close(k(x).numpy(), ((x * 2 + 1) * 2 + 2) * 2 + 3)
    assert_close(counter.numpy(), np.full((4,), 3.0, np.float32))


def test_variable_of_another_mesh_in_bodies(mesh, xw):
    """A body may read a variable of another mesh (its value is resharded in); writing
    it in a body is refused like any update of such a variable."""
    x, w = xw
    v = gt.Variable(w, gt.Mesh.create((4, 2), ("data", "model")), P(None, "model"),
                    name="foreign_loop")

    def read(x):
        return tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h @ v), (0, x))[1]
    f = gt.function(read, mesh=mesh, in_shardings=(P("data"),))
    assert_close(f(x).numpy(), x @ w @ w)

    def write(x):
        def body(i, h):
            v.assign_add(tf.zeros_like(v))
            return i + 1, h
        return tf.while_loop(lambda i, h: i < 2, body, (0, x))[1]
    g = gt.function(write, mesh=mesh, in_shardings=(P("data"),))
    with pytest.raises(gt.ShardingError, match=r"updates variable 'foreign_loop.*\(While "
                                               r"'while'\)"):
        g(x)


def test_dead_code_elimination_of_region_ops(mesh, xw):
    """A stateless loop whose results nobody reads is dropped; a stateful one (its body
    updates a variable) runs."""
    counter = gt.Variable(np.zeros((), np.float32), mesh, P(), name="dce_counter")

    def fn(x, w):
        tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h @ w), (0, x))
        def body(i):
            counter.assign_add(1.0)
            return i + 1
        tf.while_loop(lambda i: i < 2, body, (0,))
        return x + 1.0
    f = gt.function(fn, mesh=mesh, in_shardings=SPECS)
    assert_close(f(*xw).numpy(), xw[0] + 1)
    assert float(counter.numpy()) == 2.0
    kept = [n.op for n in f.lower(*xw).program.graph.nodes if n.regions]
    assert kept == ["While"]


def _region(op, value):
    """A region computing op(x, value) of its one parameter x: float32[2, 4]."""
    region = Graph()
    x = Ref(region.add(Node("x", "Placeholder", attrs={"dtype": attr_value(tf.float32)},
                            out_shapes=[(2, 4)], out_dtypes=[tf.float32])), 0)
    c = Ref(region.add(Node("c", "Const", attrs={
        "dtype": attr_value(tf.float32), "value": attr_value(np.asarray(value, np.float32))},
        out_shapes=[()], out_dtypes=[tf.float32])), 0)
    y = Ref(region.add(Node("y", op, [x, c], attrs={"T": attr_value(tf.float32)},
                            out_shapes=[(2, 4)], out_dtypes=[tf.float32])), 0)
    region.inputs, region.outputs = [x], [y]
    return region


@pytest.mark.parametrize("pred", [True, False])
def test_backend_builds_bodies_from_regions_alone(mesh, pred):
    """A hand-built SPMD program whose If names no existing function: LocalBackend runs
    the bodies its regions hold, on every device's own input."""
    program = Graph()
    x = Ref(program.add(Node("in", "gt.Input", out_shapes=[(2, 4)], out_dtypes=[tf.float32],
                             params={"index": 0})), 0)
    p = Ref(program.add(Node("p", "Const", attrs={
        "dtype": attr_value(tf.bool), "value": attr_value(np.asarray(pred))},
        out_shapes=[()], out_dtypes=[tf.bool])), 0)
    missing = attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name="no_such_fn"))
    branch = program.add(Node(
        "cond", "StatelessIf", [p, x],
        attrs={"Tcond": attr_value(tf.bool), "Tin": attr_value([tf.float32]),
               "Tout": attr_value([tf.float32]), "then_branch": missing,
               "else_branch": missing, "output_shapes": attr_value_pb2.AttrValue(
                   list=attr_value_pb2.AttrValue.ListValue(
                       shape=[tf.TensorShape([2, 4]).as_proto()]))},
        out_shapes=[(2, 4)], out_dtypes=[tf.float32],
        regions=[_region("Mul", 2.0), _region("AddV2", 1.0)]))
    program.inputs, program.outputs = [x], [Ref(branch, 0)]
    shards = [np.full((2, 4), d, np.float32) for d in range(mesh.size)]
    outs = LocalBackend(mesh).compile(program, "hand-built If")([shards])
    for d, out in enumerate(outs[0]):
        assert_close(out.numpy(), shards[d] * 2 if pred else shards[d] + 1, f"device {d}")


def test_while_body_softmax_is_within_one_ulp_of_single_device_tf():
    # The backend keeps a While functional (its body's collectives run once per
    # iteration); TF runs a functional body's ops on its Eigen kernels, where
    # single-device TF's lowered loop may run oneDNN's (TF_ENABLE_ONEDNN_OPTS=1, as
    # conftest sets): Eigen's Softmax of a one-element row is 1 - 6e-8, oneDNN's exactly
    # 1 (found by tests/test_random_pipeline.py as 1e-8 gradients of a one-class
    # cross-entropy, exactly 0 on one device, in the 1F1B loop). One ulp, no more.
    mesh = gt.Mesh.create((8,), ("x",))
    logits = randn(np.random.default_rng(9), 4, 5, 1)

    def softmax_in_loop(t):
        return tf.while_loop(lambda i, s: i < 1, lambda i, s: (i + 1, tf.nn.softmax(t)),
                             (0, tf.zeros_like(t)))[1]
    got = gt.function(softmax_in_loop, mesh=mesh, in_shardings=(P(),))(logits)
    np.testing.assert_array_max_ulp(got.numpy(), single_device(softmax_in_loop, [logits])[0],
                                    maxulp=1)
