"""DiagPart keeps its rows' split: each device reads the diagonal of the rows it holds
(its columns cut to the same block), the result split like the rows; uneven blocks and
tensors of rank 4 and 6; values equal single-device TF (issue 25 item 1)."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P
RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


def diag_part(x):
    return tf.raw_ops.DiagPart(input=x, name="diag")


@pytest.mark.parametrize("shape, spec, out", [
    ((8, 8), P("model"), P("model")),                     # even blocks, no collective
    ((7, 7), P(("model", "data")), P(("model", "data"))),  # 7 over 8 devices
    ((6, 5, 6, 5), P("data", "model"), P("data", "model")),  # rank 4, both halves
    ((2, 3, 4, 2, 3, 4), P(None, None, "model"), P(None, None, "model")),  # rank 6
])
def test_diag_part_of_split_rows_stays_split(shape, spec, out, mesh):
    low = check_partitioned(diag_part, (randn(RNG, *shape),), mesh, (spec,))
    assert low.layout_of("diag").to_spec() == out
    assert not low.collectives(), low.collectives()
    assert not low.program.replicated_ops


def test_diag_part_of_split_columns_gathers_only_the_columns(mesh):
    """Columns split: they are gathered (the diagonal needs the row block's columns),
    the rows keep their split and the result is split like them."""
    low = check_partitioned(diag_part, (randn(RNG, 8, 8),), mesh, (P("data", "model"),))
    assert [c.kind for c in low.collectives()] == ["all-gather"]
    assert low.layout_of("diag").to_spec() == P("data")
