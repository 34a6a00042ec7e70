"""Randomized differential tests of the GShard MoE layer (gspmd_tf/moe.py).

Each example draws a mesh of the 8 CPU devices with an expert axis (and maybe data and
model axes), GShard's annotations over them (groups over any of the axes, the expert
buffers' G split over the data axis or not, each expert's hidden dim over the model
axis or not), the shardings of the inputs (the layer's own or random ones), experts E,
top-k, the capacity factor (tokens dropped or not), groups G, tokens per group S, the
model and hidden widths (uneven splits included), and the forward or a training step
(loss with the load-balancing loss, gradients of the gating and expert weights; the
gating annotated as Lingvo does or only as the paper does). The
values must equal the same layer on single-device TF. More examples:
GSPMD_TF_EXAMPLES=200, or HYPOTHESIS_PROFILE=fuzz.
"""

import numpy as np
from hypothesis import event, given, settings, strategies as st

import gspmd_tf as gt
from gspmd_tf import moe
from test_moe import forward_fn, in_shardings, params, train_fn
from util import check_partitioned, examples, specs

P = gt.P
# (shape, names): always an expert axis
MESHES = [((8,), ("expert",)), ((2, 4), ("data", "expert")), ((4, 2), ("data", "expert")),
          ((2, 4), ("expert", "model")), ((2, 2, 2), ("data", "expert", "model"))]


@st.composite
def layers(draw):
    """A random MoE layer and its sharding: a dict of the drawn choices."""
    shape, names = draw(st.sampled_from(MESHES))
    data = "data" if "data" in names else None
    group_axes = draw(st.sampled_from([("expert",), (data, "expert"), ("expert", data),
                                       (data,)]))
    group_axes = tuple(a for a in group_axes if a is not None) or (None,)
    layer_specs = moe.MoeSpecs(
        groups=P(group_axes if len(group_axes) > 1 else group_axes[0]),
        experts=P("expert"),
        expert_buffers=P("expert", draw(st.sampled_from([None, data]))),
        hidden=draw(st.sampled_from([None, "model"])) if "model" in names else None)
    experts = draw(st.integers(1, 10))
    sizes = dict(g=draw(st.integers(1, 16)), s=draw(st.integers(1, 16)),
                 m=draw(st.integers(1, 6)), h=draw(st.integers(1, 8)), e=experts)
    own = draw(st.booleans())
    return dict(shape=shape, names=names, specs=layer_specs, sizes=sizes,
                k=draw(st.integers(1, min(3, experts))),
                capacity_factor=draw(st.sampled_from([0.5, 0.75, 1.0, 1.25, 2.0])),
                train=draw(st.booleans()), annotate_gating=draw(st.booleans()),
                in_specs=(in_shardings(layer_specs) if own else
                          tuple(draw(specs(names, rank)) for rank in (3, 2, 3, 3))),
                seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=examples())
@given(layers())
def test_moe_layer_equals_single_device(case):
    """The random layer `case` partitioned equals it on single-device TF."""
    sizes, k, cf = case["sizes"], case["k"], case["capacity_factor"]
    event(f"k={k} E={sizes['e']} {'train' if case['train'] else 'forward'}")
    mesh = gt.Mesh.create(case["shape"], case["names"])
    args = params(np.random.default_rng(case["seed"]), sizes["g"], sizes["s"], sizes["m"],
                  sizes["h"], sizes["e"])
    if case["train"]:  # the gating annotated as Lingvo does, or only as the paper does
        fn = train_fn(mesh, case["specs"], k, cf, case["annotate_gating"])
        reference = train_fn(None, None, k, cf)
    else:
        fn, reference = forward_fn(mesh, case["specs"], k, cf), forward_fn(None, None, k, cf)
    check_partitioned(fn, args, mesh, case["in_specs"], reference=reference)
