"""The demo Transformer (gspmd_tf.demo): Megatron shardings inferred, loss as on one device."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import demo

CFG = demo.ModelConfig(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=4)


def _single_device_loss(cfg, values):
    with tf.device("/device:CPU:0"):
        return float(tf.function(demo.make_loss_fn(cfg), autograph=False)(*values).numpy())


@pytest.fixture(scope="module")
def one_device():
    """(values, their single-device loss) of CFG, computed once for both meshes."""
    values = [demo.make_batch(CFG)] + demo.init_params(CFG)
    return values, _single_device_loss(CFG, values)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_demo_loss_matches_single_device(one_device, shape):
    mesh = gt.Mesh.create(shape, demo.AXES)
    values, want = one_device
    f = gt.function(demo.make_loss_fn(CFG), mesh=mesh, in_shardings=demo.in_specs(CFG))
    got = float(f(*values).numpy())
    assert abs(got - want) <= 1e-5 * abs(want)


def test_demo_megatron_collectives():
    """Only weights and batch annotated; activations stay split, so the forward pass has
    one all-reduce over "model" for the embedding lookup and two per layer (attention and
    MLP outputs), plus the vocab-split cross-entropy's and the loss mean's reductions."""
    mesh = gt.Mesh.abstract((2, 4), demo.AXES)
    f = gt.function(demo.make_loss_fn(CFG), mesh=mesh, in_shardings=demo.in_specs(CFG))
    low = f.lower(*demo.input_specs(CFG))
    kinds = {c.kind for c in low.collectives()}
    assert kinds == {"all-reduce"}
    local = (CFG.batch // 2, CFG.seq, CFG.d_model)
    activations = [c for c in low.collectives() if c.shape == local]
    assert len(activations) == 1 + 2 * CFG.layers
    assert all(c.axes == ("model",) for c in activations)
    # layer norm scales were not annotated: inferred replicated; x stays split on batch
    names = ["tokens"] + demo.param_names(CFG)
    for name, sharding in zip(names, low.input_shardings):
        if name.endswith(("gamma", "beta")):
            assert sharding.is_replicated
    annotated, inferred = low.counts()
    assert annotated == 2 + 6 * CFG.layers
    assert inferred > annotated
    assert np.isclose(sum(c.bytes for c in activations),
                      (1 + 2 * CFG.layers) * np.prod(local) * 4)
