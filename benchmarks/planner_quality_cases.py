"""Reshard, dot and reshape cases where XLA's reshards were cheaper than gspmd-tf's
planner (issue 7, "Partitioning quality"), shared by xla_planner_quality.py (runs under
JAX and records XLA's collectives) and planner_quality.py (prints gspmd-tf's). Meshes are
a 2x4 ("data", "model") mesh and a 1-D mesh of 4 ("x",); tensors are float32.

The reshards are small copies of those in one layer of transformer_scale.py's 1T-16x32
training step (mesh axes x=16, y=32 there; data=2, model=4 here): an activation
[B, S, M] split [X, -, Y] constrained to [-, -, X] before a dot with a weight, and the
partial sum over Y of a dot's [B, S, M] result, split [-, -, X], constrained back to
[X, -, Y]. Sizes are large enough that the planner's latency term
(planner.LATENCY_WEIGHT of a link's latency per collective) does not decide.
"""

# name -> (global shape, source spec, target spec) on the 2x4 mesh
RESHARDS = {
    "batch_to_model_dim": ((2, 128, 256), ("data", None, "model"), (None, None, "data")),
    "swap_axes": ((64, 256), ("data", "model"), ("model", "data")),
}

# name -> (einsum equation, operand shapes, operand specs, result spec) on the 2x4 mesh:
# the result is constrained, so the dot's partial sum is resharded to it
DOTS = {
    "partial_sum_to_batch_split": ("bsh,hm->bsm", ((2, 128, 64), (64, 256)),
                                   ((None, None, "model"), ("model", "data")),
                                   ("data", None, "model")),
}

# name -> (global shape, source spec, result spec or None (left to the partitioner)) on
# the 1-D mesh of 4: the tensor reshaped to one dim
RESHAPES = {
    "merge_even_major_split": ((8, 6), ("x",), ("x",)),
    "merge_minor_split": ((6, 8), (None, "x"), ("x",)),
    "merge_uneven_major_split": ((6, 8), ("x",), ("x",)),
    "merge_uneven_major_split_6x6": ((6, 6), ("x",), ("x",)),
    "merge_uneven_major_split_10x4": ((10, 4), ("x",), ("x",)),
    "merge_minor_split_all_to_all": ((4, 6), (None, "x"), ("x",)),
    "merge_uneven_minor_split": ((6, 10), (None, "x"), ("x",)),
}

# name -> (dim size, new shape): a dim split over x (4 devices) reshaped to `new shape`,
# whose major dim is split over x (the reverse of the merges above)
SPLITS = {
    "split_into_uneven_major": (48, (6, 8)),
    "split_into_uneven_major_6x6": (36, (6, 6)),
    "split_into_uneven_major_10x4": (40, (10, 4)),
}

# name -> (mesh: "line" (4,) ("x",) or "2x4" ("data", "model"), global shape, source spec,
# new shape): a Reshape merging dims (or splitting one) with the result's sharding LEFT
# TO THE PARTITIONER (issue 7; RESULTS section 7.3), followed by a consumer that is
# itself free (the sum of squares) or replicated (the result times 3, constrained)
FREE_RESHAPES = {
    "merge_uneven_major": ("line", (6, 8), ("x",), (48,)),
    "merge_uneven_major_6x6": ("line", (6, 6), ("x",), (36,)),
    "merge_uneven_major_10x4": ("line", (10, 4), ("x",), (40,)),
    "merge_uneven_major_6x10": ("line", (6, 10), ("x",), (60,)),
    "merge_major_smaller_than_axis": ("line", (2, 4), ("x",), (8,)),
    "merge_even_major": ("line", (8, 6), ("x",), (48,)),
    "merge_minor": ("line", (6, 8), (None, "x"), (48,)),
    "merge_minor_all_to_all": ("line", (4, 6), (None, "x"), (24,)),
    "merge_uneven_major_two_axes": ("2x4", (6, 8), (("data", "model"),), (48,)),
    "merge_uneven_middle_2d": ("2x4", (2, 6, 8), ("data", "model"), (2, 48)),
    "split_into_uneven_major": ("line", (48,), ("x",), (6, 8)),
    "split_into_uneven_major_10x4": ("line", (40,), ("x",), (10, 4)),
    "split_into_major_smaller_than_axis": ("line", (8,), ("x",), (2, 4)),
    "split_into_even_major": ("line", (48,), ("x",), (8, 6)),
}


def flat_size(shape):
    """Elements of a shape."""
    n = 1
    for d in shape:
        n *= d
    return n
