"""Reshard, dot and window cases compared with XLA (shared by benchmarks/xla_collectives.py,
which runs under JAX and loads this file by its path, benchmarks/reshard_plans.py, which
runs gspmd-tf, and tests/test_slicing.py). Specs are PartitionSpec entries on a 2x4
("data", "model") mesh; tensors are float32. Pure Python: it must import nothing."""

# name -> (global shape, source spec, target spec)
RESHARDS = {
    "two_axes_one_all_to_all": ((8, 16, 32), (None, ("data", "model"), None),
                                (None, None, ("data", "model"))),
    "uneven_all_to_all": ((6, 10), ("model", None), (None, "model")),
    "slice_before_gather": ((16, 32), ("data", None), (None, "model")),
    "reorder_then_gather": ((16, 32), (("data", "model"), None), ("model", None)),
    "both_axes_move_right": ((8, 16, 32), ("data", "model", None), (None, "data", "model")),
    "xla_rematerializes": ((8, 16, 32), (("data", "model"), None, None),
                           (None, "data", "model")),
    "two_dims_one_all_to_all": ((8, 16, 32, 8), ("data", "model", None, None),
                                (None, None, "data", "model")),
    "crossed_dims_one_all_to_all": ((8, 16, 32, 8), ("data", "model", None, None),
                                    (None, None, "model", "data")),
}

# name -> (einsum equation, operand shapes, operand specs); the result is unconstrained
DOTS = {
    "conflict_keep_larger_lhs": ("mk,kn->mn", ((512, 64), (64, 32)),
                                 (("model", None), ("model", None))),
    "conflict_keep_larger_rhs": ("mk,kn->mn", ((32, 64), (64, 512)),
                                 ((None, "model"), (None, "model"))),
    "batch_and_contracting_2d": ("bk,kn->bn", ((64, 128), (128, 32)),
                                 (("data", "model"), ("model", None))),
    "batched_matmul_batch_contracting": ("bmk,bkn->bmn", ((8, 16, 64), (8, 64, 32)),
                                         (("data", None, "model"), ("data", "model", None))),
    "partial_match_non_contracting": ("mk,kn->mn", ((64, 32), (32, 16)),
                                      ((("data", "model"), None), (None, "model"))),
}

# name -> (global shape, spec of the operand and of the result, op): a pad ("pad",
# [(lo, hi) per dim]) or a slice ("slice", [(begin, end, stride) per dim]) of a split dim
WINDOWS = {
    "pad_split_dim": ((16, 32), ("model", None), ("pad", [(1, 2), (0, 0)])),
    "pad_uneven": ((14, 32), ("model", None), ("pad", [(3, 1), (0, 0)])),
    "pad_two_axes": ((16, 32), (("data", "model"), None), ("pad", [(2, 2), (0, 0)])),
    "slice_shift": ((16, 32), ("model", None), ("slice", [(1, 15, 1), (0, 32, 1)])),
    "slice_uneven": ((13, 32), ("model", None), ("slice", [(2, 11, 1), (0, 32, 1)])),
    "strided_slice": ((16, 32), ("model", None), ("slice", [(1, 15, 2), (0, 32, 1)])),
    "slice_one_block": ((16, 32), ("model", None), ("slice", [(4, 8, 1), (0, 32, 1)])),
    "slice_half": ((16, 32), ("model", None), ("slice", [(8, 16, 1), (0, 32, 1)])),
    # one element picked out of a split dim, the size-1 result dim split as the operand's
    "pick_last_block": ((4, 32), ("model", None), ("slice", [(3, 4, 1), (0, 32, 1)])),
    "pick_inside_a_block": ((8, 32), ("model", None), ("slice", [(5, 6, 1), (0, 32, 1)])),
    "pick_uneven": ((6, 32), ("model", None), ("slice", [(5, 6, 1), (0, 32, 1)])),
    "pick_first": ((8, 32), ("model", None), ("slice", [(1, 2, 1), (0, 32, 1)])),
    "pick_two_axes": ((4, 8, 16), ("model", "data", None),
                      ("slice", [(3, 4, 1), (0, 8, 1), (0, 16, 1)])),
}


def window_op(op, pad, getitem):
    """The function of a WINDOWS case's op, given the framework's pad(x, pairs) and
    x[slices] (so JAX and TF run the same op)."""
    kind, arg = op
    if kind == "pad":
        return lambda x: pad(x, arg)
    return lambda x: getitem(x, tuple(slice(*b) for b in arg))


def print_cases(case, describe_reshard, dot_case, window_case, spec):
    """Print the cases named `case` ("all": every one). `describe_reshard(shape, src, dst)`
    gives the lines under a reshard; `dot_case(equation, shapes, specs)` gives (collectives
    found as (kind, bytes, groups) triples, result sharding); `window_case(shape, spec,
    op)` the collectives of a WINDOWS case; `spec` makes a PartitionSpec of the caller's
    library from entries."""
    for name, (shape, src, dst) in RESHARDS.items():
        if case in ("all", name):
            print(f"{name}: {shape} {spec(*src)} -> {spec(*dst)}")
            for line in describe_reshard(shape, src, dst):
                print(f"    {line}")
    for name, (equation, shapes, specs) in DOTS.items():
        if case in ("all", name):
            found, out = dot_case(equation, shapes, specs)
            print(f"{name}: {equation} {shapes} {[spec(*s) for s in specs]} -> {out!r}")
            print(f"    {found}  total operand bytes {sum(b for _, b, _ in found)}")
    for name, (shape, operand_spec, op) in WINDOWS.items():
        if case in ("all", name):
            found = window_case(shape, operand_spec, op)
            print(f"{name}: {shape} {spec(*operand_spec)} {op}")
            print(f"    {found}  total operand bytes {sum(b for _, b, _ in found)}")
