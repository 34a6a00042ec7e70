"""Shared test helpers: compare a partitioned function with the single-device one."""

import numpy as np
import tensorflow as tf

import gspmd_tf as gt

RTOL = 1e-5  # float32 relative error, measured on the whole tensor


def single_device(fn, args):
    """`fn` run by plain TF on one device, as numpy leaves."""
    with tf.device("/device:CPU:0"):
        out = tf.function(fn, autograph=False)(*args)
    return [np.asarray(t) for t in tf.nest.flatten(out)]


def assert_close(got, want, what=""):
    """Floats: relative error (norm) within RTOL; everything else exact."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if np.issubdtype(want.dtype, np.floating):
        scale = max(np.linalg.norm(want.astype(np.float64)), 1e-30)
        err = np.linalg.norm((got.astype(np.float64) - want)) / scale
        assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def assert_same_values(got, want, what=""):
    """Like assert_close, for values that may hold NaN or +-Inf: NaN and +-Inf at exactly
    the same positions, the finite values within RTOL (norm over the finite values)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not np.issubdtype(want.dtype, np.floating):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN")
    for inf in (np.inf, -np.inf):
        np.testing.assert_array_equal(got == inf, want == inf, err_msg=f"{what}: {inf}")
    finite = np.isfinite(want)
    assert_close(got[finite], want[finite], what)


def check_partitioned(fn, args, mesh, in_shardings, out_shardings=None, compare=assert_close):
    """Run `fn` partitioned and on one device; assert equal values (by `compare`).
    Returns Lowered."""
    f = gt.function(fn, mesh=mesh, in_shardings=in_shardings, out_shardings=out_shardings)
    got = tf.nest.flatten(f(*args))
    want = single_device(fn, args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, gt.ShardedTensor)
        compare(g.numpy(), w, f"output {i}")
    return f.lower(*args)


def randn(rng, *shape):
    """float32 normal values."""
    return rng.standard_normal(shape).astype(np.float32)
