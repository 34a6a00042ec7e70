"""Training steps: tf.GradientTape inside gt.function partitions with a rule for every
op of the gradient graph (nothing runs replicated for lack of a rule) and gives the
single-device values. Weights are plain tensor arguments watched by the tape.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P


def check_training(fn, args, mesh, in_shardings, out_shardings=None):
    """Values equal single-device TF and no op ran replicated for want of a rule."""
    low = check_partitioned(fn, args, mesh, in_shardings, out_shardings)
    assert low.program.replicated_ops == [], low.report()
    return low


def mlp_step(x, y, w1, b1, w2):
    """Megatron MLP with relu and a mean-squared loss; gradients w.r.t. all inputs."""
    with tf.GradientTape() as tape:
        tape.watch([x, w1, b1, w2])
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1))
        out = tf.matmul(h, w2)
        loss = tf.reduce_mean(tf.square(out - y))
    return (loss,) + tuple(tape.gradient(loss, [x, w1, b1, w2]))


MLP_SPECS = (P("data"), P("data"), P(None, "model"), P("model"), P("model"))


def mlp_args(rng, batch, d, hidden):
    return (randn(rng, batch, d), randn(rng, batch, d), randn(rng, d, hidden),
            randn(rng, hidden), randn(rng, hidden, d))


def test_megatron_mlp(mesh, rng):
    check_training(mlp_step, mlp_args(rng, 8, 16, 32), mesh, MLP_SPECS)


@pytest.mark.parametrize("batch, hidden", [(6, 10), (7, 10)])
def test_uneven_dims(mesh, rng, batch, hidden):
    def step(x, y, w1, b1, w2):
        with tf.GradientTape() as tape:
            tape.watch([x, w1, b1, w2])
            h = tf.tanh(x @ w1 + b1)
            out = h @ w2
            loss = (tf.reduce_mean(tf.math.squared_difference(out, y))
                    + 0.1 * tf.reduce_sum(tf.pow(w1, 2.0)))
        return (loss,) + tuple(tape.gradient(loss, [x, w1, b1, w2]))

    check_training(step, mlp_args(rng, batch, 5, hidden), mesh, MLP_SPECS)


def test_layer_norm_over_split_last_dim(mesh, rng):
    def step(x, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            mean = tf.reduce_mean(x, axis=-1, keepdims=True)
            var = tf.reduce_mean(tf.math.squared_difference(x, mean), axis=-1, keepdims=True)
            y = (x - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta
            loss = tf.reduce_sum(tf.tanh(y) * tf.sigmoid(y))
        return (loss,) + tuple(tape.gradient(loss, [x, gamma, beta]))

    args = (randn(rng, 6, 12), randn(rng, 12), randn(rng, 12))
    check_training(step, args, mesh, (P("data", "model"), P("model"), P("model")))


def test_embedding_dense_sparse_cross_entropy(mesh, rng):
    """The table's gradient is an UnsortedSegmentSum (TF's IndexedSlices made dense);
    the update gives it the table's vocabulary split, so each device sums the ids of
    its block."""
    def step(table, ids, w, labels):
        with tf.GradientTape() as tape:
            tape.watch([table, w])
            pooled = tf.reduce_mean(tf.gather(table, ids), axis=1)
            logits = pooled @ w
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        d_table, d_w = tape.gradient(loss, [table, w])
        d_table = tf.convert_to_tensor(d_table)
        return loss, d_table, table - 0.5 * d_table, d_w

    args = (randn(rng, 20, 8), rng.integers(0, 20, (4, 3)).astype(np.int32),
            randn(rng, 8, 10), rng.integers(0, 10, (4,)).astype(np.int32))
    low = check_training(step, args, mesh, (P("model"), P("data"), P(None, "model"),
                                            P("data")))
    segment_sum = [n.name for n in low.graph.nodes if n.op == "UnsortedSegmentSum"]
    assert segment_sum and low.layout_of(segment_sum[0]).to_spec() == P("model")


def test_gather_of_captured_table(mesh, rng):
    table = tf.constant(randn(rng, 20, 8))

    def step(ids, w):
        with tf.GradientTape() as tape:
            tape.watch([table, w])
            e = tf.gather(table, ids)
            loss = tf.reduce_sum(tf.tanh(tf.einsum("bsd,de->bse", e, w)))
        d_table, d_w = tape.gradient(loss, [table, w])
        return loss, tf.convert_to_tensor(d_table), d_w

    args = (rng.integers(0, 20, (4, 3)).astype(np.int32), randn(rng, 8, 6))
    check_training(step, args, mesh, (P("data"), P(None, "model")))


@pytest.mark.parametrize("spec", [P(), P(None, "model"), P("data", "model")])
@pytest.mark.parametrize("constant_ids", [False, True])
def test_gather_of_concat_sums_each_inputs_rows(mesh, rng, spec, constant_ids):
    """TF's gradient of a ConcatV2 fed the sparse gradient of a GatherV2 picks each
    input's rows with a Where on the ids (no static shape): the picks become masks
    (graph/sparse_rows.py). x0 is concatenated twice: its two sparse gradients are
    concatenated before the sum (fuzzer, seed 20 #2294)."""
    id_values = rng.integers(0, 9, (4, 5)).astype(np.int32)

    def step(x0, x1, ids):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            t = tf.gather(tf.concat([x0, x0, x1], 0),
                          tf.constant(id_values) if constant_ids else ids, axis=0)
            loss = tf.reduce_sum(tf.sin(t))
        return [t] + [tf.convert_to_tensor(g) for g in tape.gradient(loss, [x0, x1])]

    check_partitioned(step, (randn(rng, 3, 6), randn(rng, 3, 6), id_values), mesh,
                      (spec, spec, None))


@pytest.mark.parametrize("index", [0, 3, 9])
def test_gather_of_concat_with_an_input_not_differentiated(mesh, index):
    """The tape differentiates every input of the concat, also the constant a: the rows
    picked for a's gradient are used by nothing, and go with their Where (fuzzer seed 38
    #9023: a scalar index into [a, x, a])."""
    def step(x, a, i):
        with tf.GradientTape() as tape:
            tape.watch(x)
            picked = tf.gather(tf.concat([a, x, a], axis=-1), i)
            loss = tf.reduce_sum(picked * picked)
        return picked, tf.convert_to_tensor(tape.gradient(loss, x))

    rng = np.random.default_rng(9023)
    check_partitioned(step, (randn(rng, 8), randn(rng, 1), np.int32(index)), mesh,
                      (P(("data", "model")), P(), P()))


def test_picked_rows_used_unsummed_keep_their_data_dependent_shape(mesh, rng):
    """The sparse gradient's own values (not summed into a dense one) have as many rows
    as ids fall in x0's range: a ShardingError naming the Where, not a masked guess."""
    def step(x0, x1, ids):
        with tf.GradientTape() as tape:
            tape.watch(x0)
            loss = tf.reduce_sum(tf.gather(tf.concat([x0, x1], 0), ids))
        return tape.gradient(loss, x0).values

    with pytest.raises(gt.ShardingError, match=r"Where.*depends on the input's values"):
        gt.function(step, mesh=mesh)(randn(rng, 3, 6), randn(rng, 3, 6),
                                     np.array([0, 4, 1], np.int32))


def test_tied_embedding_dense_cross_entropy(mesh, rng):
    """The table's gradient adds a gather's (IndexedSlices, made dense by an
    UnsortedSegmentSum) and a batch matmul's."""
    def step(table, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch(table)
            logits = tf.matmul(tf.gather(table, ids), table, transpose_b=True)
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
                tf.one_hot(labels, 20), logits))
        return loss, tape.gradient(loss, table)

    ids, labels = (rng.integers(0, 20, (4, 3)).astype(np.int32) for _ in range(2))
    check_training(step, (randn(rng, 20, 8), ids, labels), mesh,
                   (P("model"), P("data"), P("data")))


def test_batch_matmul_adjoints(mesh, rng):
    def step(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            c = tf.linalg.matmul(a, b, adjoint_b=True)  # batch dims broadcast
            d = tf.linalg.matmul(c, c, adjoint_a=True)
            loss = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(tf.nn.softmax(d), d))
        return (loss,) + tuple(tape.gradient(loss, [a, b]))

    check_training(step, (randn(rng, 4, 6, 8), randn(rng, 5, 8)), mesh,
                   (P("data", None, "model"), P(None, "model")))


def test_attention_block(mesh, rng):
    b, s, d, heads = 2, 4, 16, 4
    hd = d // heads

    def step(x, wq, wk, wv, wo):
        with tf.GradientTape() as tape:
            tape.watch([x, wq, wk, wv, wo])

            def split_heads(w):
                return tf.reshape(tf.einsum("bsd,de->bse", x, w), [b, s, heads, hd])

            q, k, v = split_heads(wq), split_heads(wk), split_heads(wv)
            probs = tf.nn.softmax(tf.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(hd)))
            ctx = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", probs, v), [b, s, d])
            loss = tf.reduce_mean(tf.square(tf.einsum("bse,ed->bsd", ctx, wo)))
        return (loss,) + tuple(tape.gradient(loss, [x, wq, wk, wv, wo]))

    args = (randn(rng, b, s, d),) + tuple(randn(rng, d, d) * 0.3 for _ in range(4))
    w = P(None, "model")
    low = check_training(step, args, mesh, (P("data"), w, w, w, P("model")))
    # heads split over "model" throughout: no collective moves activations around
    assert {c.kind for c in low.collectives()} == {"all-reduce"}


def test_elementwise_and_slicing_gradients(mesh, rng):
    """Pow, Log, Select, Maximum/Minimum, BroadcastTo, Tile, StridedSliceGrad,
    LogSoftmax, Softmax, Reciprocal, Sqrt, Softplus, StopGradient, Cast gradients."""
    def step(x, y, z):
        with tf.GradientTape() as tape:
            tape.watch([x, y, z])
            a = tf.pow(tf.abs(x) + 1.0, y)
            c = tf.maximum(x, tf.tile(z, [1, 2])) + tf.minimum(x, 0.5)
            c += tf.broadcast_to(z[:, :1], x.shape) * tf.tile(z, [1, 2])[:, :8]
            d = tf.nn.log_softmax(x) + tf.math.reciprocal(tf.abs(y) + 1.0)
            e = tf.where(x > 0, tf.sqrt(tf.abs(x) + 1.0), tf.nn.softplus(x))
            f = tf.stop_gradient(x) * tf.cast(tf.cast(y, tf.float16), tf.float32)
            loss = (tf.reduce_sum(a * c) + tf.reduce_mean(d + e * f)
                    + tf.reduce_sum(tf.nn.softmax(x) * y))
        return (loss,) + tuple(tape.gradient(loss, [x, y, z]))

    args = (randn(rng, 6, 8), randn(rng, 6, 8), randn(rng, 6, 4))
    check_training(step, args, mesh, (P("data", "model"), P("data", "model"), P("data")))


@pytest.mark.parametrize("spec", [P("data", "model"), P("model", "data"), P(None, "model")])
def test_tile_broadcast_to_and_slice_gradients_uneven(mesh, rng, spec):
    def step(x, v):
        with tf.GradientTape() as tape:
            tape.watch([x, v])
            t = tf.tile(v, [5, 1]) + tf.tile(x[:, :2], [1, 4])[:, :7]  # [5, 7]
            u = tf.broadcast_to(v, [5, 7]) * x + tf.reduce_sum(x[1:4, ::2]) * x[:, 3:4]
            u += x[::-1, ::-1] * 0.5  # reversed dims keep their size, not their blocks
            loss = tf.reduce_sum(tf.sin(t) * u)
        return (loss,) + tuple(tape.gradient(loss, [x, v]))

    check_training(step, (randn(rng, 5, 7), randn(rng, 1, 7)), mesh, (spec, P(None, spec[1])))


def test_unsorted_segment_ops_with_split_segments(mesh, rng):
    def f(data, ids):
        return (tf.math.unsorted_segment_sum(data, ids, 10),
                tf.math.unsorted_segment_max(data, ids, 10))

    ids = rng.integers(0, 9, (4, 3)).astype(np.int32)  # segment 9 stays empty
    args = (randn(rng, 4, 3, 6), ids)
    low = check_training(f, args, mesh, (P("data"), P("data")), (P("model"), P("model")))
    for node in low.graph.nodes:
        if node.op.startswith("UnsortedSegment"):  # 10 segments in blocks of 3
            assert low.layout_of(node.name).to_spec() == P("model")
    # partial over the batch ("data") only; no gather of the segments
    assert {(c.kind, c.axes) for c in low.collectives()} == {("all-reduce", ("data",))}


def test_megatron_step_collectives_match_xla(monkeypatch):
    """XLA's partitioning of this step (x P("data"), W1 P(None, "model"), b1 P("model"),
    W2 P("model")): the forward pass needs one "model" all-reduce, of the partial sums
    of h @ W2 (h is split on its contracted hidden dim); the backward pass the matching
    one, of dx = dh @ W1^T (contracted over the split hidden dim again). The gradients
    of the weights keep the weights' "model" split and are partial only over the batch
    ("data"): one "data" all-reduce each for dW1, db1, dW2, plus one for the loss (a
    mean over the data-split batch). Nothing is gathered or moved between dims.
    """
    # XLA's answer is recorded right after partitioning, before its combiner runs
    monkeypatch.setenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", "0")
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    b, d, h = 8, 16, 32
    f = gt.function(mlp_step, mesh=mesh, in_shardings=MLP_SPECS)
    low = f.lower(*(tf.TensorSpec(s, tf.float32)
                    for s in [(b, d), (b, d), (d, h), (h,), (h, d)]))
    assert low.program.replicated_ops == []
    got = collections.Counter((c.kind, c.axes, c.shape) for c in low.collectives())
    assert got == collections.Counter({
        ("all-reduce", ("model",), (b // 2, d)): 2,  # y = h @ W2 forward; dx backward
        ("all-reduce", ("data",), ()): 1,  # the loss
        ("all-reduce", ("data",), (d, h // 4)): 1,  # dW1
        ("all-reduce", ("data",), (h // 4,)): 1,  # db1
        ("all-reduce", ("data",), (h // 4, d)): 1,  # dW2
    }), low.report()
    # the forward one comes first, the backward one after the loss
    first = low.collectives()[0]
    assert (first.kind, first.axes) == ("all-reduce", ("model",))
    assert [str(s) for s in low.output_shardings[2:]] == [
        "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}",  # dW1 like W1
        "{devices=[4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}",  # db1 like b1
        "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}",  # dW2 like W2
    ]


def test_shrinking_slices_and_their_gradients(mesh, rng):
    """x[:, 0]-style slices (shrink_axis_mask) keep the other dims split, forward and
    backward (StridedSliceGrad)."""
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.square(x[:, 0]) * tf.reduce_sum(x[1, :, ::2]))
        return y, tape.gradient(y, x)

    low = check_partitioned(f, (randn(rng, 4, 3, 8),), mesh, (P("data", None, "model"),))
    assert low.program.replicated_ops == []


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 4)])
def test_masking_a_tile_gradient_of_ten_dims(mesh_shape):
    """Seed 28 #1986: the gradient of a rank-5 Tile sums a rank-10 view; with the tiled
    result split unevenly (2 over 4) the padding mask is a SelectV2 of 10 dims, which TF
    cannot broadcast ("Broadcast between [1,...] and [...] is not supported yet"): the
    mask runs on a three-dim view of the tensor."""
    p = np.random.default_rng(1000).standard_normal((2, 3, 1, 2, 1)).astype(np.float32)
    weights = np.random.default_rng(0).uniform(0.5, 1.5, (2, 9, 1, 6, 2)).astype(np.float32)
    mesh = gt.Mesh.create(mesh_shape, ("a", "b"))

    def f(p):
        with tf.GradientTape() as tape:
            tape.watch(p)
            tiled = tf.tile(p, [1, 3, 1, 3, 2])
            loss = tf.reduce_sum(tiled * weights)
        return [tiled, tape.gradient(loss, p)]
    want = f(tf.convert_to_tensor(p))
    got = gt.function(f, mesh=mesh, in_shardings=(gt.P(),),
                      out_shardings=[gt.P("a", None, None, None, "b"), None])(p)
    assert got[0].layout.dims[4] == ("b",)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5)


@pytest.mark.parametrize("mesh_shape, spec, pool", [
    ((2,), P(None, None, "data"), "2d"), ((2, 4), P(None, "model", "data"), "2d"),
    ((2, 4), P(None, "model", "data"), "3d")])
def test_max_pool_gradient_of_a_nan_first_in_a_padded_window(mesh_shape, spec, pool):
    """Seed 28 #7859: TF's max-pool gradient goes to the first element of a window (TF
    clips windows to x) unless a later one is larger, so a NaN first in a window takes
    it; behind a -inf halo pad it did not (0.0 vs 2.21). The device whose window starts
    before x runs the op with its own explicit padding (2-D); MaxPool3DGrad, which takes
    none, runs whole."""
    rng = np.random.default_rng(830756739)
    shape = (2, 6, 7, 1) if pool == "2d" else (2, 6, 7, 3, 1)
    x = rng.standard_normal(shape).astype(np.float32)
    x[(0, 3, 3) + (0,) * (len(shape) - 3)] = np.nan
    x[(1, 3, 0) + (0,) * (len(shape) - 3)] = np.nan
    x[(1, 0, 4) + (0,) * (len(shape) - 3)] = np.nan
    mesh = gt.Mesh.create(mesh_shape, ("data",) if len(mesh_shape) == 1 else ("data", "model"))

    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if pool == "2d":
                y = tf.nn.max_pool2d(x, ksize=[3, 3], strides=[1, 2], padding="SAME")
            else:
                y = tf.nn.max_pool3d(x, ksize=[3, 3, 2], strides=[1, 2, 1], padding="SAME")
            weights = tf.reshape(tf.range(1, tf.size(y) + 1, dtype=tf.float32), tf.shape(y))
            loss = tf.reduce_sum(y * weights)
        return [y, tape.gradient(loss, x)]
    want = f(tf.convert_to_tensor(x))  # single-device eager TF
    got = gt.function(f, mesh=mesh, in_shardings=(spec,))(x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5)
