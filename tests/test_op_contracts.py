"""The op registry as each op's whole contract: one stateful predicate (an op TF does not
know is stateful everywhere), multiply-adds from the op's entry (depthwise convolutions
and gradients counted right), and numerics: an op whose XLA kernel differs from TF's
runs on TF's kernel under the XLA backend, so its values equal single-device TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import registry
from gspmd_tf.backends import ordering, replicas, schedule, segments
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.graph import dce
from util import assert_close, explicitly_padded_input_gradient, single_device

P = gt.P


def _program_of(op, out_shapes=((2,),), dtype=tf.float32):
    """A program of one gt.Input (shape (2,)) feeding one node of type `op`."""
    graph = Graph()
    source = graph.add(Node("x", "gt.Input", out_shapes=[(2,)], out_dtypes=[dtype],
                            params={"index": 0}))
    node = graph.add(Node("op", op, [Ref(source, 0)], out_shapes=list(out_shapes),
                          out_dtypes=[dtype] * len(out_shapes)))
    graph.outputs = []
    return graph, graph.nodes[node]


def test_an_op_tf_does_not_know_is_stateful_everywhere():
    """DCE keeps it, the scheduler and the ordering chain it, the replica analysis runs it
    on every device and the XLA backend's cut runs it op by op: one answer."""
    assert registry.is_stateful("NoSuchOpAnywhere")
    program, node = _program_of("NoSuchOpAnywhere")
    assert dce.has_effect(node)
    assert dce.live_nodes(program)[1]
    assert ordering.stateful(node.op)
    assert schedule._chained(program, node)
    assert not replicas.runs_once(node)
    assert segments.why_not_compiled(program, node) is not None


def test_declared_statefulness_wins_over_tf_registry():
    assert not registry.is_stateful("AddV2")
    assert registry.is_stateful("AssignVariableOp")
    assert not registry.is_stateful("gt.AllReduce")


def _multiply_adds(op, in_shapes, out_shape, **attrs):
    node = Node("n", op, out_shapes=[out_shape], out_dtypes=[tf.float32])
    for key, value in attrs.items():
        node.attrs[key] = tf.compat.v1.AttrValue(**value)
    return registry.multiply_adds(node, in_shapes)


def test_multiply_adds_of_depthwise_convolutions_and_gradients():
    """A depthwise convolution sums over its window only (not the channels); each
    gradient does its forward's multiply-adds."""
    image, kernel, out = (1, 6, 6, 4), (3, 3, 4, 2), (1, 4, 4, 8)
    forward = _multiply_adds("DepthwiseConv2dNative", [image, kernel], out)
    assert forward == 4 * 4 * 8 * 3 * 3
    assert _multiply_adds("DepthwiseConv2dNativeBackpropInput", [(4,), kernel, out],
                          image) == forward
    assert _multiply_adds("DepthwiseConv2dNativeBackpropFilter", [image, (4,), out],
                          kernel) == forward
    conv = _multiply_adds("Conv2D", [image, (3, 3, 4, 8)], out)
    assert conv == 4 * 4 * 8 * 3 * 3 * 4
    assert _multiply_adds("Conv2DBackpropFilter", [image, (4,), out], (3, 3, 4, 8)) == conv


def test_multiply_adds_of_an_einsum_with_an_ellipsis():
    equation = {"s": b"...ij,...jk->...ik"}
    assert _multiply_adds("Einsum", [(5, 2, 3), (5, 3, 4)], (5, 2, 4),
                          equation=equation) == 5 * 2 * 4 * 3
    assert _multiply_adds("Relu", [(5, 2)], (5, 2)) == 0


@pytest.mark.parametrize("op,dtype,differs", [
    ("Maximum", tf.float32, True), ("Maximum", tf.int32, False), ("EluGrad", tf.float32, True),
    ("FloorDiv", tf.int32, True), ("FloorDiv", tf.float32, False), ("AddV2", tf.float32, False),
    ("StatelessRandomUniformV2", tf.float32, True),
    ("RandomGamma", tf.float32, True), ("StatelessRandomGetKeyCounter", tf.int64, True),
    ("SomeRandomOpNobodyDeclared", tf.float32, False),  # the contract declares, not names
])
def test_numerics_that_differ_under_xla(op, dtype, differs):
    _, node = _program_of(op, dtype=dtype)
    assert (registry.xla_numerics_differ(node, dtype) is not None) == differs


def test_every_random_op_of_tf_declares_its_xla_numerics():
    """Each TF op that draws random numbers (as tf.raw_ops lists them; dataset, queue
    and seed-generator resources aside) declares on its entry that XLA draws others."""
    drawing = [name for name in dir(tf.raw_ops)
               if any(word in name for word in ("Random", "Multinomial", "TruncatedNormal"))
               and not any(word in name for word in ("Dataset", "Queue", "SeedGenerator"))]
    assert len(drawing) > 30, drawing
    undeclared = [name for name in drawing if registry.op_def(name).xla_numerics is None]
    assert not undeclared, undeclared


def test_explicitly_padded_conv_input_gradient_on_the_xla_backend(rng):
    """XLA:CPU's Conv2DBackpropInput with EXPLICIT padding gives garbage (1e23, NaN) for a
    2x2 filter over rows padded by 3 in front (issue 25 item 3): the XLA backend runs it on
    TF's kernel, and the value equals single-device TF."""
    mesh = gt.Mesh.create((2,), ("x",))

    input_gradient, args = explicitly_padded_input_gradient(rng)
    want = single_device(input_gradient, args)[0]
    f = gt.function(input_gradient, mesh=mesh, in_shardings=(None, None),
                    backend=lambda m: XlaBackend(m))
    for _ in range(2):  # XLA's garbage changed from call to call
        got = f(*args).numpy()
        assert np.isfinite(got).all()
        assert_close(got, want)
    program = f.lower(*args).compile().program
    grads = [n for n in program.nodes if n.op == "Conv2DBackpropInput"]
    assert grads and all(segments.why_not_compiled(program, n) is not None for n in grads)


def _bytes_touched(op, in_shapes, out_shapes, dtype=tf.float32):
    graph = Graph()
    node = Node("op", op, [], out_shapes=list(out_shapes), out_dtypes=[dtype] * len(out_shapes))
    return registry.bytes_touched(node, in_shapes, [dtype] * len(in_shapes))


def test_bytes_touched_by_elementwise_ops_views_and_slices():
    """An op without a declaration reads each operand and writes each result once; a
    view touches nothing; a slice or gather reads and writes only what it keeps; a
    handle or an unknown shape holds no bytes."""
    assert _bytes_touched("AddV2", [(4, 8), (8,)], [(4, 8)]) == 4 * (32 + 8 + 32)
    assert _bytes_touched("Reshape", [(4, 8), (2,)], [(8, 4)]) == 0
    assert _bytes_touched("StridedSlice", [(100, 8), (2,), (2,), (2,)], [(3, 8)]) == 2 * 96
    assert _bytes_touched("AddV2", [(None, 8), (8,)], [(None, 8)]) == 32
    assert registry.dense_bytes((3,), tf.resource) == registry.dense_bytes(None, tf.float32) == 0


def test_the_cost_model_prices_memory_bound_ops_by_bytes_touched():
    """backends.base.node_seconds prices an op without multiply-adds by the bytes its
    contract says it touches, a view by its kernel launch alone."""
    from gspmd_tf.backends.base import node_seconds
    from gspmd_tf.cost_model import CostModel
    model = CostModel({"x": 8})
    graph, add = _program_of("AddV2", out_shapes=((2,),))
    assert node_seconds(graph, add, model) == pytest.approx(
        model.kernel_seconds + 16 / model.memory_bytes_per_second)
    graph, reshape = _program_of("Reshape", out_shapes=((2,),))
    assert node_seconds(graph, reshape, model) == pytest.approx(model.kernel_seconds)
