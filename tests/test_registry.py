"""The op registry: every rule has an emitter or a declared replay, users register rules
for ops without one (gt.register_op), and the parallel gather (GatherV2 with batch_dims)
partitions without communication."""

import sys

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import registry
from gspmd_tf.layout import Layout
from gspmd_tf.propagation import rules
from gspmd_tf.spmd.handlers import replay
from util import Background, check_partitioned, randn, run_together, session_environ

P = gt.P


@pytest.fixture
def own_table(monkeypatch):
    """A private copy of the registry's table: registrations end with the test."""
    monkeypatch.setattr(registry, "_TABLE", dict(registry._TABLE))


@Background
def registry_alone():
    """The finished run of a process that imports only gspmd_tf.registry."""
    probe = ("from gspmd_tf.registry import op_def, ops_with_rules\n"
             "assert op_def('MatMul').emit is not None, 'MatMul has no emitter'\n"
             "assert op_def('Shape').fold is not None, 'Shape has no fold flag'\n"
             "print(len(ops_with_rules()))\n")
    done, = run_together([[sys.executable, "-c", probe]], timeout=300,
                         env=session_environ())
    return done


def test_the_table_is_complete_whatever_module_is_imported_first():
    """The built-in declarations are loaded by the package, not by a lookup: importing
    only the registry (or only propagation) gives the whole table."""
    done = registry_alone.result()
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == len(registry.ops_with_rules())


def test_every_rule_has_an_emitter_or_a_declared_replay():
    for op in registry.ops_with_rules():
        entry = registry.op_def(op)
        assert (entry.emit is not None) != entry.replay, op


def test_a_rule_without_emitter_or_replay_is_refused(own_table):
    with pytest.raises(gt.ShardingError, match="replay=True"):
        gt.register_op("CumulativeLogsumexp", rule="ij->ij")
    assert not registry.has_rule("CumulativeLogsumexp")  # nothing half-registered
    with pytest.raises(gt.ShardingError, match="not both"):
        gt.register_op("CumulativeLogsumexp", rule="ij->ij", replay=True,
                       emit=lambda *a: None)


def test_a_second_rule_needs_override(own_table):
    with pytest.raises(gt.ShardingError, match="override=True"):
        gt.register_op("MatMul", rule="ik,kj->ij", replay=True)
    gt.register_op("MatMul", rule="ik,kj->ij", replay=True, override=True)
    assert registry.op_def("MatMul").custom


def cumulative_rule(ctx):
    """CumulativeLogsumexp: the cumulative axis stays whole, every other dim passes (a
    user's rule, as the built-in one of Cumsum)."""
    axis = int(ctx.const(1)) % len(ctx.in_shapes[0])
    return rules.per_dim(ctx, {axis})


def cumulative(x):
    return tf.math.cumulative_logsumexp(x, axis=1, exclusive=True, name="cumulative")


def test_cumulative_logsumexp_runs_replicated_without_a_rule(mesh, rng):
    low = check_partitioned(cumulative, [randn(rng, 8, 6, 12)], mesh,
                            (P("data", None, "model"),))
    assert "cumulative" in low.program.replicated_ops


def test_registered_rule_partitions_the_op(mesh, rng, own_table):
    """A rule for CumulativeLogsumexp along a non-cumulative axis: the op runs on each
    device's block (no longer replicated), values equal single-device TF, and nothing
    is gathered."""
    gt.register_op("CumulativeLogsumexp", rule=cumulative_rule, replay=True)
    x = randn(rng, 8, 6, 12)
    low = check_partitioned(cumulative, [x], mesh, (P("data", None, "model"),))
    assert low.program.replicated_ops == []
    assert low.layout_of("cumulative").to_spec() == P("data", None, "model")
    assert low.collectives() == []


def test_registered_rule_keeps_the_cumulative_axis_whole(mesh, rng, own_table):
    """Split along the cumulative axis, the input is gathered on that axis (REPLICATE),
    the op still partitioned along the other dims."""
    gt.register_op("CumulativeLogsumexp", rule=cumulative_rule, replay=True)
    low = check_partitioned(cumulative, [randn(rng, 8, 6, 12)], mesh, (P("data", "model"),))
    assert low.program.replicated_ops == []
    assert low.layout_of("cumulative").to_spec() == P("data")


def test_einsum_string_rule_for_an_elementwise_op(mesh, rng, own_table):
    """An op without a rule (Dawsn) registered with an einsum equation."""
    gt.register_op("Dawsn", rule="ij->ij", replay=True)
    x = randn(rng, 6, 10)
    low = check_partitioned(lambda v: tf.raw_ops.Dawsn(x=v, name="dawsn"), [x], mesh,
                            (P("data", "model"),))
    assert low.program.replicated_ops == []
    assert low.layout_of("dawsn").to_spec() == P("data", "model")


def test_registered_emitter_emits_the_op(mesh, rng, own_table):
    """An op registered with emit=: the partitioner calls it with the operands resharded
    to the rule's split (here the emitter replays the op, as a handler may)."""
    seen = []

    def emit(ctx, operands, layouts):
        seen.append((ctx.node.name, operands[0].layout, layouts[0]))
        return replay(ctx, operands, layouts)

    gt.register_op("Dawsn", rule="ij->ij", emit=emit)
    x = randn(rng, 6, 10)
    check_partitioned(lambda v: tf.raw_ops.Dawsn(x=v, name="dawsn"), [x], mesh,
                      (P("data", "model"),))
    split = Layout((("data",), ("model",)))
    assert seen and all(s == ("dawsn", split, split) for s in seen)

# ------------------------------------------------------------------ parallel gather

def batch_gather(table, indices):
    return tf.gather(table, indices, axis=2, batch_dims=1, name="gathered")


def gather_args(rng, batch=6):
    table = randn(rng, batch, 5, 7, 8)
    indices = rng.integers(0, 7, size=(batch, 3)).astype(np.int32)
    return [table, indices]


@pytest.mark.parametrize("specs", [
    (P("data"), P("data")),
    (P("data", "model"), P("data")),
    (P("data", None, "model"), P("data", "model")),
    (P(None, None, "model"), P("data")),
    (P("model", None, None, "data"), P("model")),
], ids=str)
@pytest.mark.parametrize("batch", [6, 4])
def test_batch_gather_values(mesh, rng, specs, batch):
    low = check_partitioned(batch_gather, gather_args(rng, batch), mesh, specs)
    assert low.program.replicated_ops == []


@pytest.mark.parametrize("specs", [(P("data"), P("data")),
                                   (P(("data", "model")), P(("data", "model"))),
                                   (P("data", None, None, "model"), P("data"))],
                         ids=str)
def test_parallel_gather_sends_nothing(mesh, rng, specs):
    """Table and indices split alike on their batch dim: each device gathers from its own
    batch, no collective. XLA does the same: its SPMD partitioner sends nothing for these
    parallel gathers (benchmarks/xla_parallel_gather.py, JAX 0.10.2)."""
    low = check_partitioned(batch_gather, gather_args(rng, 8), mesh, specs)
    assert low.collectives() == [], low.report()
    batch_axes = specs[1][0] if isinstance(specs[1][0], tuple) else (specs[1][0],)
    assert low.layout_of("gathered").dims[0] == batch_axes


@pytest.mark.parametrize("spec, collectives", [(P("data"), []),
                                               (P("data", "model"), ["all-reduce"])])
def test_resource_gather_with_batch_dims(mesh, rng, spec, collectives):
    """A variable split on its batch dim: nothing sent; also split on the gathered dim
    (7 rows over 4 devices): a masked local lookup and one all-reduce."""
    table = gt.Variable(randn(rng, 4, 7, 8), mesh=mesh, spec=spec)
    indices = rng.integers(0, 7, size=(4, 3)).astype(np.int32)

    def fn(ids):
        return tf.raw_ops.ResourceGather(resource=table.handle, indices=ids,
                                         dtype=tf.float32, batch_dims=1)

    f = gt.function(fn, mesh=mesh, in_shardings=(P("data"),))
    got = f(indices).numpy()
    want = np.take_along_axis(table.numpy(), indices[:, :, None], axis=1)
    np.testing.assert_array_equal(got, want)
    low = f.lower(indices)
    assert low.program.replicated_ops == []
    assert [c.kind for c in low.collectives()] == collectives, low.report()


def test_batch_gather_gradient(mesh, rng):
    def step(table, indices):
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = tf.reduce_sum(tf.square(batch_gather(table, indices)))
        return loss, tape.gradient(loss, table)

    low = check_partitioned(step, gather_args(rng, 8), mesh, (P("data", "model"), P("data")))
    assert low.program.replicated_ops == [], low.report()


def test_a_registered_op_declares_its_whole_contract(own_table):
    """register_op takes the rest of the contract the built-in entries declare (stateful,
    multiply_adds, bytes_touched, xla_numerics, traits), checks it, and an override keeps
    what the entry declared of what it does not give."""
    count = lambda node, in_shapes: 7  # noqa: E731
    why = registry.on_floats("a custom kernel XLA rounds otherwise")
    gt.register_op("CumulativeLogsumexp", rule="ij->ij", replay=True, stateful=False,
                   multiply_adds=count, bytes_touched=registry.read_result_bytes,
                   xla_numerics=why, traits=[registry.DOT])
    entry = registry.op_def("CumulativeLogsumexp")
    assert (entry.stateful, entry.multiply_adds, entry.bytes_touched, entry.xla_numerics) == (
        False, count, registry.read_result_bytes, why)
    assert registry.has_trait("CumulativeLogsumexp", registry.DOT)
    matmul_count = registry.op_def("MatMul").multiply_adds
    gt.register_op("MatMul", rule="ik,kj->ij", replay=True, override=True)
    assert registry.op_def("MatMul").multiply_adds is matmul_count is not None
    with pytest.raises(gt.ShardingError, match="multiply_adds must be a callable"):
        gt.register_op("Dawsn", rule="ij->ij", replay=True, multiply_adds=3)
    with pytest.raises(gt.ShardingError, match="bytes_touched must be a callable"):
        gt.register_op("Dawsn", rule="ij->ij", replay=True, bytes_touched=16)
    with pytest.raises(gt.ShardingError, match="unknown traits"):
        gt.register_op("Dawsn", rule="ij->ij", replay=True, traits=["fast"])
    assert not registry.has_rule("Dawsn")  # nothing half-registered
