"""GShard mixture of experts (gspmd_tf/moe.py) partitioned: values and gradients equal
single-device TF, and the dispatch and combine are all-to-alls, never all-gathers."""


import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import moe
from gspmd_tf.cost_model import ring_bytes
from util import assert_close, check_partitioned, randn, single_device

P = gt.P

# mesh shape -> (axis names, MoeSpecs): GShard's layout, G split over every device, E over
# the "expert" axis, the expert buffers [E, G, C, M] split on E and on G over what is left
LAYOUTS = {
    (8,): (("expert",), moe.MoeSpecs(P("expert"), P("expert"), P("expert"))),
    (2, 4): (("data", "expert"),
             moe.MoeSpecs(P(("data", "expert")), P("expert"), P("expert", "data"))),
}

# (G, S, M, H, E, k, capacity_factor): even; uneven G and E with tokens dropped
# (capacity 2 for 2 * 10 choices of 12 experts); uneven E only; top-1 (ArgMax) with a
# capacity that drops tokens
SHAPES = {
    "even": (8, 16, 8, 16, 8, 2, 1.0),
    "uneven": (12, 10, 8, 16, 12, 2, 0.75),
    "uneven_experts": (16, 10, 8, 16, 6, 2, 0.75),
    "top1": (8, 12, 8, 16, 8, 1, 0.5),
}
FORWARD_CASES = [((8,), "even"), ((8,), "uneven"), ((8,), "top1"), ((2, 4), "even"),
                 ((2, 4), "uneven_experts"), ((2, 4), "top1")]
TRAIN_CASES = [((8,), "even"), ((8,), "uneven"), ((2, 4), "even"),
               ((2, 4), "uneven_experts"), ((2, 4), "top1")]
# G = 12 over (data, expert) has shards of 2, over data shards of 6: the expert axis's
# 4 x 2 rows per data shard are not the 6 the buffers' G split over data holds, so no
# all-to-all moves the split exactly and the planner gathers G (docs/DESIGN_LOG.md,
# "Mixture of experts"); values only
UNNESTED_CASES = [((2, 4), "uneven")]


def params(rng, g, s, m, h, e):
    """x, wg, w_in, w_out."""
    return (randn(rng, g, s, m), randn(rng, m, e), randn(rng, e, m, h) * 0.3,
            randn(rng, e, h, m) * 0.3)


def make_mesh(shape):
    names, specs = LAYOUTS[shape]
    return gt.Mesh.create(shape, names), specs


def in_shardings(specs):
    return (specs.groups, P(), specs.experts, specs.experts)


def forward_fn(mesh, specs, k, capacity_factor):
    def forward(x, wg, w_in, w_out):
        return moe.moe_layer(x, wg, w_in, w_out, k, capacity_factor, mesh, specs)
    return forward


def train_fn(mesh, specs, k, capacity_factor, annotate_gating=True):
    """Loss and the gradients of the gating and expert weights."""
    def train(x, wg, w_in, w_out):
        with tf.GradientTape() as tape:
            tape.watch([wg, w_in, w_out])
            y, aux = moe.moe_layer(x, wg, w_in, w_out, k, capacity_factor, mesh, specs,
                                   annotate_gating)
            loss = tf.reduce_mean(tf.square(y)) + 0.01 * aux
        return (loss,) + tuple(tape.gradient(loss, [wg, w_in, w_out]))
    return train


def all_to_all_sources(lowered):
    """Per all-to-all of the SPMD program, the traced op its operand comes from (walking
    back through the pads and slices a reshard adds, which have no traced name)."""
    g = lowered.program.graph
    traced = {n.name for n in lowered.graph.nodes}
    out = []
    for node in g.nodes:
        if node.op != "gt.AllToAll":
            continue
        ref = node.inputs[0]
        while g.nodes[ref.node].name not in traced:
            ref = g.nodes[ref.node].inputs[0]
        out.append(g.nodes[ref.node].name)
    return out


def assert_all_to_all_routing(lowered, train):
    """Dispatch and combine are all-to-alls of the [E, G, C, M] buffers (no all-gather or
    reduce-scatter anywhere); the only all-reduces are the gating weight's gradient and
    scalars; nothing runs replicated."""
    kinds = [c.kind for c in lowered.collectives()]
    assert "all-gather" not in kinds and "reduce-scatter" not in kinds, lowered.report()
    assert lowered.program.replicated_ops == []
    sources = all_to_all_sources(lowered)
    # forward: the dispatched tensor G -> E, the expert output E -> G; the gradient of
    # the expert output G -> E (the dispatched tensor's gradient is not needed: x and
    # the one-hot dispatch mask take no gradient)
    scopes = sorted(s.split("/")[0] if not s.startswith("gradient_tape/")
                    else "/".join(s.split("/")[:2]) for s in sources)
    want = ["dispatch", "experts"] + (["gradient_tape/combine"] if train else [])
    assert scopes == want, sources


@pytest.mark.parametrize("mesh_shape,case", FORWARD_CASES)
def test_moe_forward_matches_single_device(mesh_shape, case):
    g, s, m, h, e, k, cf = SHAPES[case]
    mesh, specs = make_mesh(mesh_shape)
    args = params(np.random.default_rng(0), g, s, m, h, e)
    lowered = check_partitioned(forward_fn(mesh, specs, k, cf), args, mesh,
                                in_shardings(specs),
                                reference=forward_fn(None, None, k, cf))
    assert_all_to_all_routing(lowered, train=False)
    # the gating keeps the G split: TopKV2/ArgMax, OneHot and Cumsum pass G through
    gating = [n for n in lowered.graph.nodes if n.op in ("TopKV2", "ArgMax", "OneHot", "Cumsum")]
    assert {n.op for n in gating} >= {"OneHot", "Cumsum", "TopKV2" if k > 1 else "ArgMax"}
    for node in gating:
        want = gt.Sharding.from_spec(mesh, specs.groups, len(node.out_shapes[0]))
        assert str(lowered.sharding_of(node.name)) == str(want), node.name


@pytest.mark.parametrize("mesh_shape,case", TRAIN_CASES)
def test_moe_training_gradients_match_single_device(mesh_shape, case):
    g, s, m, h, e, k, cf = SHAPES[case]
    mesh, specs = make_mesh(mesh_shape)
    args = params(np.random.default_rng(1), g, s, m, h, e)
    lowered = check_partitioned(train_fn(mesh, specs, k, cf), args, mesh,
                                in_shardings(specs), reference=train_fn(None, None, k, cf))
    assert_all_to_all_routing(lowered, train=True)


@pytest.mark.parametrize("mesh_shape,case", UNNESTED_CASES)
def test_moe_training_values_where_groups_do_not_nest(mesh_shape, case):
    g, s, m, h, e, k, cf = SHAPES[case]
    mesh, specs = make_mesh(mesh_shape)
    args = params(np.random.default_rng(3), g, s, m, h, e)
    lowered = check_partitioned(train_fn(mesh, specs, k, cf), args, mesh,
                                in_shardings(specs), reference=train_fn(None, None, k, cf))
    assert lowered.program.replicated_ops == []


@pytest.mark.parametrize("k,capacity_factor", [(1, 0.5), (2, 0.75), (2, 2.0)])
def test_gating_routes_as_gshard(k, capacity_factor):
    """top_k_gating on one device against a loop over tokens: first choices of a group
    take their expert's slots in token order before any second choice, tokens past the
    capacity are dropped, combine weights are the (renormalized) gates."""
    g, s, e = 3, 10, 4
    logits = randn(np.random.default_rng(2), g, s, e)
    cap = moe.capacity(s, e, k, capacity_factor)
    dispatch, combine, _ = single_device(
        lambda t: moe.top_k_gating(t, k, cap), [logits])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_dispatch = np.zeros((g, s, e, cap), np.float32)
    want_combine = np.zeros((g, s, e, cap), np.float32)
    for gi in range(g):
        order = np.argsort(-probs[gi], axis=-1, kind="stable")[:, :k]
        gates = np.take_along_axis(probs[gi], order, -1)
        gates = gates / gates.sum(-1, keepdims=True) if k > 1 else gates
        filled = np.zeros(e, int)
        for rank in range(k):
            for si in range(s):
                expert = order[si, rank]
                if filled[expert] < cap:
                    want_dispatch[gi, si, expert, filled[expert]] = 1
                    want_combine[gi, si, expert, filled[expert]] = gates[si, rank]
                filled[expert] += 1
    np.testing.assert_array_equal(dispatch, want_dispatch)
    assert_close(combine, want_combine)
    dropped = k * g * s - want_dispatch.sum()
    if capacity_factor < 1.0:  # fewer slots than choices: some tokens are dropped
        assert dropped > 0
    if cap >= s:  # an expert can take every token of a group: none is dropped
        assert dropped == 0


def test_sgd_steps_on_sharded_variables_match_single_device():
    """Three SGD steps with the expert weights held as gt.Variables split on E (each
    device stores its experts only) give single-device TF's losses and weights."""
    g, s, m, h, e, k, cf = SHAPES["uneven_experts"]
    mesh, specs = make_mesh((2, 4))
    x, *weights = params(np.random.default_rng(5), g, s, m, h, e)
    names, var_specs = ("wg", "w_in", "w_out"), (P(), specs.experts, specs.experts)

    def make_step(variables, mesh, specs):
        def step(x):
            with tf.GradientTape() as tape:
                y, aux = moe.moe_layer(x, *variables, k, cf, mesh, specs)
                loss = tf.reduce_mean(tf.square(y)) + 0.01 * aux
            for v, grad in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(0.5 * grad)
            return loss
        return step

    with tf.device("/device:CPU:0"):
        single = [tf.Variable(w) for w in weights]
        single_step = tf.function(make_step(single, None, None), autograph=False)
        want = [float(single_step(x)) for _ in range(3)]
    sharded = [gt.Variable(w, mesh, spec, name=n)
               for w, spec, n in zip(weights, var_specs, names)]
    step = gt.function(make_step(sharded, mesh, specs), mesh=mesh,
                       in_shardings=(specs.groups,))
    got = [float(step(x).numpy()) for _ in range(3)]
    assert_close(got, want, "losses")
    for n, v, w in zip(names, sharded, single):
        assert_close(v.numpy(), w.numpy(), n)
    assert max(sharded[1].shard_bytes()) < weights[1].nbytes // 2
    assert_all_to_all_routing(step.lower(x), train=True)


@pytest.mark.parametrize("mesh_shape", list(LAYOUTS))
def test_paper_annotations_only_still_match(mesh_shape):
    """The GShard paper's four annotations (gating unannotated): the combine weights come
    out split on E (docs/DESIGN_LOG.md), values and gradients still exact."""
    g, s, m, h, e, k, cf = SHAPES["even"]
    mesh, specs = make_mesh(mesh_shape)
    args = params(np.random.default_rng(4), g, s, m, h, e)
    lowered = check_partitioned(train_fn(mesh, specs, k, cf, annotate_gating=False), args,
                                mesh, in_shardings(specs),
                                reference=train_fn(None, None, k, cf))
    assert lowered.program.replicated_ops == []


# XLA's collectives for the "even" training step (kind, operand bytes per device, group
# size), recorded with
#   /work/jaxref/bin/python benchmarks/xla_moe.py --mesh=8 --train
#   /work/jaxref/bin/python benchmarks/xla_moe.py --mesh=2,4 --train
# (GSPMD and Shardy give the same lists). XLA all-gathers the gate probabilities for
# TopK (the 512-byte all-gather); gspmd-tf's TopKV2 rule keeps G split, so it has the
# same all-to-alls and all-reduces and no all-gather.
XLA_TRAIN = {
    (8,): [("all-gather", 512, 8), ("all-reduce", 264, 8), ("all-to-all", 1024, 8),
           ("all-to-all", 1024, 8), ("all-to-all", 1024, 8)],
    (2, 4): [("all-gather", 512, 8), ("all-reduce", 264, 8), ("all-reduce", 2048, 2),
             ("all-to-all", 1024, 4), ("all-to-all", 1024, 4), ("all-to-all", 1024, 4)],
}


@pytest.mark.parametrize("mesh_shape", list(XLA_TRAIN))
def test_training_step_collectives_against_xla(mesh_shape):
    g, s, m, h, e, k, cf = SHAPES["even"]
    mesh, specs = make_mesh(mesh_shape)
    args = [tf.TensorSpec(a.shape, tf.float32)
            for a in params(np.random.default_rng(0), g, s, m, h, e)]
    # XLA's lists are after its all-reduce combiner, as gspmd-tf's on every backend
    lowered = gt.lower(train_fn(mesh, specs, k, cf), mesh, in_shardings(specs), args=args)
    ours = sorted((c.kind, c.bytes, len(c.groups[0])) for c in lowered.collectives())
    assert ours == [c for c in XLA_TRAIN[mesh_shape] if c[0] != "all-gather"]


# XLA's collectives for the "even" training step on the (2, 2, 2) (data, expert, model)
# mesh, each expert's hidden dim on model (kind, operand bytes per device, group size):
#   /work/jaxref/bin/python benchmarks/xla_moe.py --mesh=2,2,2 --train
# (GSPMD and Shardy give the same list). XLA gathers the gate probabilities and, in the
# backward pass, the expert buffers over data and model; gspmd-tf keeps them split.
XLA_TRAIN_EXPERT_DATA_MODEL = [
    ("all-gather", 1024, 2), ("all-gather", 1024, 4), ("all-gather", 1024, 2),
    ("all-gather", 1024, 2), ("all-to-all", 4096, 2), ("all-to-all", 4096, 2),
    ("all-reduce", 2048, 2), ("all-reduce", 1024, 2), ("all-reduce", 2048, 2),
    ("all-reduce", 264, 4), ("collective-permute", 1024, 1)]


def ring_total(collectives):
    """Bytes a device sends for (kind, operand bytes, group size) collectives (ring)."""
    return sum(ring_bytes(kind, nbytes, group) for kind, nbytes, group in collectives)


def test_expert_data_and_model_axes_together_match_single_device():
    """Experts over "expert", groups over ("data", "expert"), each expert's hidden dim
    over "model" (w_in's columns, w_out's rows): top-2 training values and gradients
    equal single-device TF; the routing is still all-to-alls, the expert weights stay
    split on E and H, and the step moves less than XLA's on the same program."""
    g, s, m, h, e, k, cf = SHAPES["even"]
    mesh = gt.Mesh.create((2, 2, 2), ("data", "expert", "model"))
    specs = moe.MoeSpecs(P(("data", "expert")), P("expert"), P("expert", "data"),
                         hidden="model")
    args = params(np.random.default_rng(6), g, s, m, h, e)
    lowered = check_partitioned(
        train_fn(mesh, specs, k, cf), args, mesh,
        (specs.groups, P(), P("expert", None, "model"), P("expert", "model")),
        reference=train_fn(None, None, k, cf))
    kinds = [c.kind for c in lowered.collectives()]
    assert "all-gather" not in kinds and "all-to-all" in kinds, lowered.report()
    ours = [(c.kind, c.bytes, len(c.groups[0])) for c in lowered.collectives()]
    # 7,564 B against XLA's 16,780 B (benchmarks/RESULTS.md)
    assert ring_total(ours) < ring_total(XLA_TRAIN_EXPERT_DATA_MODEL), ours
    assert lowered.program.replicated_ops == []
    assert lowered.input_shardings[2] == gt.Sharding.from_spec(
        mesh, P("expert", None, "model"), 3)
    [hidden] = [n.name for n in lowered.graph.nodes
                if n.op == "Relu" and n.name.startswith("experts/")]
    assert str(lowered.sharding_of(hidden)) == str(gt.Sharding.from_spec(
        mesh, P("expert", "data", None, "model"), 4))


def test_load_balancing_loss_is_gshards():
    """aux = E * sum_e (fraction of the group's tokens whose first choice is e) * (mean
    gate probability of e), averaged over groups: 1 for a perfectly balanced routing,
    larger when the tokens crowd onto few experts."""
    g, s, e = 2, 8, 4
    logits = randn(np.random.default_rng(7), g, s, e)
    _, _, aux = single_device(lambda t: moe.top_k_gating(t, 2, 4), [logits])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    first = np.eye(e)[probs.argmax(-1)].mean(1)                  # [G, E]
    assert_close(aux, np.mean(e * (first * probs.mean(1)).sum(-1)), "aux")
    balanced = np.tile(np.eye(e) * 10.0, (g, s // e, 1))         # token i -> expert i % E
    crowded = np.tile(np.array([10.0, 0, 0, 0]), (g, s, 1))      # every token -> expert 0
    (_, _, aux_balanced), (_, _, aux_crowded) = (
        single_device(lambda t: moe.top_k_gating(t, 2, 4), [x.astype(np.float32)])
        for x in (balanced, crowded))
    assert abs(aux_balanced - 1.0) < 1e-3 and aux_crowded > 3.0
