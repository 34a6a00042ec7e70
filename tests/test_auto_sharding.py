"""gt.AUTO and memory_limit: the auto-sharding search (gspmd_tf/autoshard) chooses the
layouts of AUTO arguments within a per-device memory limit; its plan is readable
(auto_report) and runs with values equal to single-device TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.testing.conv_step import ConvConfig, make_conv_step
from gspmd_tf.testing.transformer_step import Config, make_step

P = gt.P
BATCH, D_MODEL, D_FF = 64, 128, 512


def ffn_train_step(layers):
    """An L-layer residual FFN's SGD step: (x, up_0, down_0, up_1, ...) -> new weights."""

    def step(x, *weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            h = x
            for layer in range(layers):
                with tf.name_scope(f"layer{layer}"):
                    up, down = weights[2 * layer], weights[2 * layer + 1]
                    h = h + tf.matmul(tf.nn.relu(tf.matmul(h, up, name="up")), down,
                                      name="down")
            loss = tf.reduce_sum(h * h)
        grads = tape.gradient(loss, weights)
        return [w - 0.01 * g for w, g in zip(weights, grads)]

    return step


def ffn_values(layers, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, D_MODEL)).astype(np.float32)
    weights = []
    for _ in range(layers):
        weights += [rng.normal(size=(D_MODEL, D_FF)).astype(np.float32) * 0.05,
                    rng.normal(size=(D_FF, D_MODEL)).astype(np.float32) * 0.05]
    return x, weights


def weight_bytes(layers):
    return layers * 2 * D_MODEL * D_FF * 4


# Replicated weights alone (arguments and the updated outputs) need 2x the weights'
# bytes on every device: this limit rules that out, not a plan splitting them 4 ways.
LIMIT = weight_bytes(2) * 3 // 4


def auto_step(mesh, layers, limit=LIMIT):
    return gt.function(ffn_train_step(layers), mesh=mesh,
                       in_shardings=(P("data"),) + (gt.AUTO,) * (2 * layers),
                       memory_limit=limit)


@pytest.fixture(scope="module")
def lowered(mesh):
    x, weights = ffn_values(2)
    return auto_step(mesh, 2).lower(x, *weights)


def test_auto_ffn_chooses_a_megatron_split_that_fits_the_memory_limit(lowered):
    layouts = lowered.program.input_layouts[1:5]
    for up, down in (layouts[0:2], layouts[2:4]):
        assert "model" in up.dims[1], up      # column-parallel first projection
        assert "model" in down.dims[0], down  # row-parallel second projection
    assert lowered.memory().peak <= LIMIT
    assert lowered.auto_plan.peak_bytes <= LIMIT
    assert [s for s in lowered.input_shardings[1:]] == [
        gt.Sharding.from_layout(lowered.mesh, l) for l in layouts]


def test_auto_plan_values_equal_single_device(mesh, lowered):
    x, weights = ffn_values(2)
    step = auto_step(mesh, 2)
    got = step(x, *weights)
    want = tf.function(ffn_train_step(2))(x, *weights)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def test_auto_report_lists_each_decision_with_alternatives_and_the_pinning_specs(lowered):
    text = lowered.auto_report()
    for name in ("weights_0", "weights_1", "weights_2", "weights_3"):
        assert any(line.startswith(name + " ") for line in text.splitlines()), text
    assert "argument 1" in text and "   or P()" in text and "over the limit" in text
    pinned = tuple(layout.to_spec() for layout in lowered.program.input_layouts[:5])
    assert f"pin the plan with in_shardings={pinned!r}" in text
    decision = lowered.auto_plan.decisions[0]
    assert decision.chosen.seconds <= min(o.seconds for o in decision.alternatives
                                          if o.peak_bytes <= LIMIT)


def test_explain_says_the_search_chose_a_layout(lowered):
    assert "auto-sharding search chose" in lowered.explain("weights_0")
    assert "auto-sharding search chose" not in lowered.explain("x")


def test_html_report_shows_the_auto_sharding_decisions(lowered):
    page = lowered.report(format="html")
    assert "<h2>Auto-sharding</h2>" in page and "weights_0" in page


def test_memory_limit_no_plan_fits_is_a_sharding_error_naming_the_smallest(mesh):
    x, weights = ffn_values(2)
    with pytest.raises(gt.ShardingError, match=r"memory_limit=1000 bytes.*smallest plan "
                                               r"the search found needs about \d+ bytes"):
        auto_step(mesh, 2, limit=1000).lower(x, *weights)


def test_clustering_gives_2_and_8_layers_the_same_number_of_variables():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    counts = []
    for layers in (2, 8):
        x, weights = ffn_values(layers)
        specs = [tf.TensorSpec(v.shape, tf.float32) for v in [x] + weights]
        plan = auto_step(mesh, layers, limit=None).lower(*specs).auto_plan
        counts.append((plan.num_classes, plan.num_variables))
    assert counts[0] == counts[1]


def test_auto_on_an_abstract_mesh_lowers_without_devices():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    x, weights = ffn_values(2)
    specs = [tf.TensorSpec(v.shape, tf.float32) for v in [x] + weights]
    low = auto_step(mesh, 2).lower(*specs)
    assert low.memory().peak <= LIMIT
    assert "model" in low.program.input_layouts[1].dims[1]


def test_auto_output_entry_takes_the_searched_layout(mesh):
    def matmul(x, w):
        return tf.matmul(x, w)

    low = gt.lower(matmul, mesh, (P("data"), P(None, "model")), (gt.AUTO,),
                   args=(tf.TensorSpec((16, 32)), tf.TensorSpec((32, 64))))
    assert low.output_shardings == [gt.Sharding.from_layout(mesh, low.auto_plan
                                                            .output_layouts[0])]
    assert low.auto_plan.decisions[0].entry == "output 0"


@pytest.mark.parametrize("limit", [-1, "1GB", True])
def test_bad_memory_limit_is_a_sharding_error(mesh, limit):
    with pytest.raises(gt.ShardingError, match="memory_limit"):
        gt.function(tf.identity, mesh=mesh, memory_limit=limit)


TRANSFORMER = Config(layers=1, d_model=32, heads=4, d_ff=128, seq=8, batch=8)


def transformer_lowered(mesh, plan, config=TRANSFORMER, memory_limit=None):
    return gt.lower(make_step(config), mesh, config.in_shardings(plan, gt.AUTO),
                    args=config.specs(), memory_limit=memory_limit)


def test_auto_transformer_adam_step_fits_where_data_parallel_does_not_and_sends_no_more_than_megatron():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    data = transformer_lowered(mesh, "data")
    megatron = transformer_lowered(mesh, "megatron")
    limit = (megatron.memory().peak + data.memory().peak) // 2
    auto = transformer_lowered(mesh, "auto", memory_limit=limit)
    assert data.memory().peak > limit >= auto.memory().peak

    def sent(lowered):
        return sum(c.bytes for c in lowered.collectives())
    assert sent(auto) <= 1.10 * sent(megatron)


@pytest.mark.long
def test_auto_transformer_adam_step_values_equal_single_device(mesh):
    config = Config(layers=2, d_model=32, heads=4, d_ff=128, seq=8, batch=8)
    values = config.values()
    step = gt.function(make_step(config), mesh=mesh,
                       in_shardings=config.in_shardings("auto", gt.AUTO),
                       memory_limit=2 ** 20)
    got = step(*values)
    want = tf.function(make_step(config))(*values)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def adam_ffn_step(x, up, down, up_m, down_m, up_v, down_v):
    """A 1-layer FFN's Adam step whose slots are named unlike their weights."""
    weights = (up, down)
    with tf.GradientTape() as tape:
        tape.watch(weights)
        h = x + tf.matmul(tf.nn.relu(tf.matmul(x, up)), down)
        loss = tf.reduce_sum(h * h)
    grads = tape.gradient(loss, weights)
    out = []
    with tf.name_scope("adam"):
        for w, m, v, g in zip(weights, (up_m, down_m), (up_v, down_v), grads):
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * tf.square(g)
            out += [w - 0.001 * m / (tf.sqrt(v) + 1e-7), m, v]
    return out


def test_adam_slots_take_their_weights_decision_and_the_update_sends_nothing():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    specs = [tf.TensorSpec((BATCH, D_MODEL))] + [
        tf.TensorSpec(s) for s in [(D_MODEL, D_FF), (D_FF, D_MODEL)] * 3]
    low = gt.lower(adam_ffn_step, mesh, (P("data"),) + (gt.AUTO,) * 6, args=specs,
                   memory_limit=3 * weight_bytes(1) // 2)
    up, down, up_m, down_m, up_v, down_v = low.program.input_layouts[1:]
    assert up == up_m == up_v and down == down_m == down_v
    # one decision: changing the weight's layout changes its slots' too, priced together
    decisions = low.auto_plan.decisions
    assert decisions[0].alternatives == decisions[2].alternatives == decisions[4].alternatives
    assert low.memory().peak <= 3 * weight_bytes(1) // 2
    assert not [c for c in low.collectives()
                if any(o.op.startswith("adam/") for o in c.origins)]


def test_three_axis_mesh_candidates_are_those_of_two_runs_of_axes():
    from gspmd_tf.autoshard.strategies import rule_strategies
    from gspmd_tf.propagation.oprule import einsum_rule
    mesh = gt.Mesh.abstract((2, 2, 2), ("data", "replica", "model"))
    rule = einsum_rule("bsm,mnk->bsnk", [(8, 8, 8), (8, 8, 8)], (8, 8, 8, 8))
    merged, full = rule_strategies(rule, mesh), rule_strategies(rule, mesh, merged=False)
    plain = [s for s in full if not s.scattered]  # reduce-scatter forms come on top
    assert len(plain) == 6 ** 3 and len(merged) < len(full) // 3
    assert set(merged) <= set(full)
    # each candidate splits at most two factors, the axes of each a run in mesh order
    for s in merged:
        assert len({dims for dims in s.operands[0].dims + s.operands[1].dims if dims}) <= 2


def test_contraction_candidates_include_reduce_scattering_the_partial_sum():
    from gspmd_tf.autoshard.strategies import rule_strategies
    from gspmd_tf.layout import Layout
    from gspmd_tf.propagation.oprule import einsum_rule
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    rule = einsum_rule("bh,hm->bm", [(16, 32), (32, 8)], (16, 8))
    # the row-parallel form: x split (data, model), w split on its input dim
    row = [s for s in rule_strategies(rule, mesh)
           if s.operands == (Layout((("data",), ("model",))), Layout((("model",), ())))]
    assert all(s.partial == ("model",) for s in row)
    assert {(s.results[0], s.scattered) for s in row} == {
        (Layout((("data",), ())), False),                # all-reduce
        (Layout((("data", "model"), ())), True),         # reduce-scatter into b
        (Layout((("data",), ("model",))), True)}         # reduce-scatter into m


def test_auto_on_a_three_axis_mesh_fits_and_equals_single_device():
    mesh = gt.Mesh.create((2, 2, 2), ("data", "replica", "model"))
    x, weights = ffn_values(2)
    step = gt.function(ffn_train_step(2), mesh=mesh,
                       in_shardings=(P("data"),) + (gt.AUTO,) * 4, memory_limit=LIMIT)
    assert step.lower(x, *weights).memory().peak <= LIMIT
    got = step(x, *weights)
    want = tf.function(ffn_train_step(2))(x, *weights)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def moe_sgd_step(x, wg, w_in, w_out):
    """A GShard MoE layer's SGD step, unannotated (gspmd_tf/moe.py)."""
    from gspmd_tf import moe
    weights = (wg, w_in, w_out)
    with tf.GradientTape() as tape:
        tape.watch(weights)
        y, aux = moe.moe_layer(x, *weights, k=2)
        loss = tf.reduce_mean(tf.square(y)) + 0.01 * aux
    return [w - 0.1 * g for w, g in zip(weights, tape.gradient(loss, weights))]


@pytest.mark.long
def test_auto_moe_step_splits_the_experts_within_the_limit_and_equals_single_device(mesh):
    rng = np.random.default_rng(0)
    experts, seq, m, h = 8, 16, 16, 32
    values = [rng.normal(size=s).astype(np.float32) * 0.3
              for s in [(experts, seq, m), (m, experts), (experts, m, h), (experts, h, m)]]
    # replicated, the experts' weights and their updates alone take the whole limit
    limit = 2 * sum(v.nbytes for v in values[2:])
    step = gt.function(moe_sgd_step, mesh=mesh, in_shardings=(P("model"),) + (gt.AUTO,) * 3,
                       memory_limit=limit)
    low = step.lower(*values)
    assert low.memory().peak <= limit
    assert any(low.program.input_layouts[2].dims[0]), low.program.input_layouts[2]
    got = step(*values)
    want = tf.function(moe_sgd_step)(*values)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def test_search_prices_a_reshard_as_the_backends_price_the_program_it_emits():
    from gspmd_tf.autoshard.problem import reshard_seconds
    from gspmd_tf.cost_model import CostModel
    from gspmd_tf.layout import Layout
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    model = CostModel.for_mesh(mesh)
    shape, replicated = (64, 128), Layout(((), ()))
    split = Layout(((), ("model",)))
    # a local slice is a kernel reading the tensor, not free
    assert reshard_seconds(replicated, split, shape, tf.float32, mesh, model) == \
        model.compute_seconds(0, bytes_touched=64 * 128 * 4)
    # a gather pays its collective's whole latency, as base.node_seconds counts it
    assert reshard_seconds(split, replicated, shape, tf.float32, mesh, model) == \
        model.collective_seconds("all-gather", 64 * 32 * 4, ("model",))


# batch 2 on a 2x4 mesh: data parallelism can split only over "data"; the search must split
# the activations further (spatially, with halos) to fit
CONV = ConvConfig(blocks=1, width=8, classes=4, image=8, batch=2)


def conv_lowered(mesh, plan, memory_limit=None):
    return gt.lower(make_conv_step(CONV), mesh, CONV.in_shardings(plan, gt.AUTO),
                    args=CONV.specs(), memory_limit=memory_limit)


def conv_limit(mesh):
    """Halfway between the hand spatial plan's peak and data parallel's."""
    return (conv_lowered(mesh, "spatial").memory().peak
            + conv_lowered(mesh, "data").memory().peak) // 2


@pytest.fixture(scope="module")
def conv_plans():
    """(data parallel, hand spatial, auto) Lowered of CONV on an abstract 2x4 mesh, and
    the memory_limit auto had."""
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    data, spatial = conv_lowered(mesh, "data"), conv_lowered(mesh, "spatial")
    limit = (spatial.memory().peak + data.memory().peak) // 2
    return data, spatial, conv_lowered(mesh, "auto", limit), limit


def collective_bytes(low):
    return sum(c.bytes for c in low.collectives())


def test_auto_conv_step_fits_where_data_parallel_does_not_and_sends_no_more_than_spatial(
        conv_plans):
    data, spatial, auto, limit = conv_plans
    assert data.memory().peak > limit >= auto.memory().peak
    assert collective_bytes(auto) <= 1.10 * collective_bytes(spatial)


def assert_pins_reproduce_the_plan(auto):
    """auto_report()'s pins (in_shardings and activation hints) give the plan's program,
    and none of them is a constant or a shape tensor (the partitioner derives those)."""
    from gspmd_tf.autoshard.pinning import activation_hints
    from gspmd_tf.autoshard.search import static_nodes
    from gspmd_tf.runtime.lowering import lower_seeded
    seeds = {ref: auto.propagation.layout(ref) for ref in auto.graph.inputs[:auto.num_args]}
    hints, left = activation_hints(auto.graph, auto.mesh, auto.auto_plan.layouts, seeds, None)
    assert left == 0
    static = static_nodes(auto.graph)
    assert static and not [auto.graph.tensor_name(r) for r in hints if r.node in static]
    pinned = lower_seeded(auto.graph, {**seeds, **hints}, auto.num_args, auto.options)
    assert (pinned.memory().peak, collective_bytes(pinned)) == \
        (auto.memory().peak, collective_bytes(auto))
    text = auto.auto_report()
    for ref, layout in hints.items():
        assert f"  {auto.graph.tensor_name(ref)}: {layout.to_spec()}" in text
    return hints


def test_auto_report_pins_in_shardings_and_activations_that_reproduce_the_plan(conv_plans):
    # pinning the in_shardings alone gives data parallelism again (the images' spatial
    # split is an activation's layout); with the listed activations it is the plan
    assert assert_pins_reproduce_the_plan(conv_plans[2])


def test_auto_report_pins_no_constant_or_shape_tensor_of_the_ffn_step(lowered):
    # the gradient's Const and Reshape shape operands were listed as pins (TUTORIAL.md)
    assert_pins_reproduce_the_plan(lowered)


@pytest.mark.long
def test_auto_conv_step_values_equal_single_device(mesh):
    values = CONV.values()
    got = gt.function(make_conv_step(CONV), mesh=mesh, memory_limit=conv_limit(mesh),
                      in_shardings=CONV.in_shardings("auto", gt.AUTO))(*values)
    want = tf.function(make_conv_step(CONV))(*values)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def _frustrated_triangle(offset):
    """Three classes of two strategies in a cycle whose edges cost 1 us where both ends
    choose alike (an odd cycle: one edge must), each strategy `offset` seconds: the
    linear relaxation takes every strategy half and prices no edge."""
    from gspmd_tf.autoshard.problem import EdgeGroup, NodeClass, Problem
    classes = [NodeClass([k], ["a", "b"], np.full(2, offset)) for k in range(3)]
    edges = [EdgeGroup(k, 0, (k + 1) % 3, 0, 1, 1e-6 * np.eye(2), np.arange(2), np.arange(2))
             for k in range(3)]
    return Problem(classes, edges, [])


@pytest.mark.parametrize("offset, settled_by", [(1e-4, "within"), (0.0, "Optimal")])
def test_a_fractional_relaxation_is_settled_by_its_support_only_within_the_stated_gap(
        offset, settled_by):
    # with a large common cost the support's best plan is proven within SUPPORT_GAP of
    # the optimum by the relaxation's bound; without it the whole MIP decides
    import itertools

    from gspmd_tf.autoshard.plan import Pricer
    from gspmd_tf.autoshard.solve import solve
    problem = _frustrated_triangle(offset)
    solution = solve(problem, None)
    assert settled_by in solution.status
    best = min(Pricer(problem, c).seconds for c in itertools.product(range(2), repeat=3))
    assert Pricer(problem, solution.choice).seconds == pytest.approx(best)
    assert best == pytest.approx(3 * offset + 1e-6)
