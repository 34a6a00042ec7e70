"""Checkpoints that do not fit (gt.restore_checkpoint): a wrong shape, a corrupt file,
no file: a gt.ShardingError naming the file, the entry and what to change, and every
variable as it was before the restore (issue 25 item 4)."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


def _variables(mesh, b_rows=8, fill=None):
    """a split over "data", b over "model" (`b_rows` rows), c replicated; each filled
    with `fill` (default: distinct values)."""
    shapes = {"a": ((4, 4), P("data")), "b": ((b_rows, 4), P(None, "model")),
              "c": ((3,), P())}
    return {name: gt.Variable(np.full(shape, fill, np.float32) if fill is not None else
                              np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + k,
                              mesh, spec, name=name)
            for k, (name, (shape, spec)) in enumerate(shapes.items())}


@pytest.fixture(scope="module")
def saved(mesh, tmp_path_factory):
    """The prefix of a checkpoint of _variables(mesh)."""
    directory = tmp_path_factory.mktemp("checkpoint")
    return tf.train.Checkpoint(**_variables(mesh)).write(str(directory / "ckpt"))


def _corrupt_copy(saved, tmp_path):
    """A copy of checkpoint `saved` in `tmp_path` whose stored values are garbled (their
    checksum fails); its prefix."""
    copy = str(tmp_path / "ckpt")
    for path in glob.glob(saved + ".*"):
        data = open(path, "rb").read()
        if ".data-" in path:
            data = data[:8] + bytes(b ^ 0xFF for b in data[8:48]) + data[48:]
        open(copy + path[len(saved):], "wb").write(data)
    return copy


def _assert_unchanged(variables, fill):
    for name, variable in variables.items():
        np.testing.assert_array_equal(variable.numpy(), np.full(variable.shape, fill),
                                      err_msg=name)


def test_a_checkpoint_that_fits_restores_every_variable(mesh, saved):
    restored = _variables(mesh, fill=-1.0)
    gt.restore_checkpoint(tf.train.Checkpoint(**restored), saved).assert_consumed()
    for name, variable in _variables(mesh).items():
        np.testing.assert_array_equal(restored[name].numpy(), variable.numpy())


def test_an_entry_of_another_shape_changes_no_variable(mesh, saved):
    restored = _variables(mesh, b_rows=6, fill=-1.0)
    with pytest.raises(gt.ShardingError, match=r"entry 'b' does not fit .*\[6,4\].*"
                       r"\[8,4\].*restore into a variable of the saved shape") as caught:
        gt.restore_checkpoint(tf.train.Checkpoint(**restored), saved)
    assert isinstance(caught.value.__cause__, tf.errors.InvalidArgumentError)
    assert saved in str(caught.value)
    _assert_unchanged(restored, -1.0)


def test_a_corrupt_file_changes_no_variable(mesh, saved, tmp_path):
    copy = _corrupt_copy(saved, tmp_path)
    restored = _variables(mesh, fill=-1.0)
    with pytest.raises(gt.ShardingError, match=r"is corrupt .*restore from an intact copy"):
        gt.restore_checkpoint(tf.train.Checkpoint(**restored), copy)
    _assert_unchanged(restored, -1.0)


def test_a_wrong_shape_and_a_corrupt_file_together_change_no_variable(mesh, saved, tmp_path):
    copy = _corrupt_copy(saved, tmp_path)
    restored = _variables(mesh, b_rows=6, fill=-1.0)
    with pytest.raises(gt.ShardingError, match=copy):
        gt.restore_checkpoint(tf.train.Checkpoint(**restored), copy)
    _assert_unchanged(restored, -1.0)


def test_no_checkpoint_at_the_prefix_names_it(mesh, tmp_path):
    missing = str(tmp_path / "never-written")
    with pytest.raises(gt.ShardingError, match=r"no checkpoint at .*never-written.*"
                       r"tf.train.latest_checkpoint"):
        gt.restore_checkpoint(tf.train.Checkpoint(**_variables(mesh)), missing)
    assert not os.path.exists(missing + ".index")


@pytest.mark.parametrize("method", ["read", "restore"])
def test_tf_checkpoint_read_of_an_entry_of_another_shape_raises_sharding_error(
        mesh, saved, method):
    restored = _variables(mesh, b_rows=6, fill=-1.0)
    with pytest.raises(gt.ShardingError, match=r"entry 'b' does not fit .*"
                       r"restore into a variable of the saved shape") as caught:
        getattr(tf.train.Checkpoint(**restored), method)(saved)
    assert isinstance(caught.value.__cause__, tf.errors.InvalidArgumentError)
    assert saved in str(caught.value)
    _assert_unchanged(restored, -1.0)


def test_tf_checkpoint_read_of_a_corrupt_file_raises_sharding_error(mesh, saved, tmp_path):
    copy = _corrupt_copy(saved, tmp_path)
    restored = _variables(mesh, fill=-1.0)
    with pytest.raises(gt.ShardingError, match=r"is corrupt .*restore from an intact copy"):
        tf.train.Checkpoint(**restored).read(copy)
    _assert_unchanged(restored, -1.0)


def test_tf_checkpoint_read_of_a_missing_prefix_raises_sharding_error(mesh, tmp_path):
    with pytest.raises(gt.ShardingError, match=r"no checkpoint at .*never-written"):
        tf.train.Checkpoint(**_variables(mesh)).read(str(tmp_path / "never-written"))


def test_a_checkpoint_without_gt_variables_keeps_tf_errors(tmp_path):
    with pytest.raises(tf.errors.NotFoundError):
        tf.train.Checkpoint(v=tf.Variable(1.0)).read(str(tmp_path / "never-written"))
