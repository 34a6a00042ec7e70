"""Collective keys come from the program: the same in every process that builds it,
disjoint between different programs of one process, fresh after a retirement."""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import collectives
from util import Background, run_together, session_environ

P = gt.P


@Background
def probe_runs():
    """tests/keys_probe.py after three sets of warm-up programs, side by side."""
    probe = os.path.join(os.path.dirname(__file__), "keys_probe.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(session_environ(), PYTHONPATH=root)
    return run_together([[sys.executable, probe, warm_ups]
                         for warm_ups in ("", "other_mesh,sum,gather", "gather,sum")],
                        timeout=300, env=env)


def test_processes_that_compiled_other_programs_first_agree_on_the_keys():
    keys = []
    for run in probe_runs.result():
        assert run.returncode == 0, run.stderr[-3000:]
        keys.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert keys[0] == keys[1] == keys[2]
    # the forward all-reduce and the gradients' collectives, each with its groups
    assert len(keys[0]) >= 2 and all(groups for _, _, groups in keys[0]), keys[0]
    assert len({instance for _, instance, _ in keys[0]}) == len(keys[0])


def _compiled(fn, mesh, spec, x):
    return gt.function(fn, mesh=mesh, in_shardings=(spec,)).lower(x).compile()


def test_programs_of_one_process_have_disjoint_instance_keys_unless_identical():
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    total = _compiled(lambda v: tf.reduce_sum(v), mesh, P("data", "model"), x)
    peak = _compiled(lambda v: tf.reduce_max(v), mesh, P("data", "model"), x)
    again = _compiled(lambda v: tf.reduce_sum(v), mesh, P("data", "model"), x)
    keys = [{k for _, _, k, _ in run.collective_keys()} for run in (total, peak, again)]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    # an identical program shares the keys, and the lock that keeps calls apart
    assert keys[2] == keys[0] and again.lock is total.lock and peak.lock is not total.lock
    assert all(collectives._KEY_BASE <= k < 1 << 31 for k in keys[0] | keys[1])
    np.testing.assert_allclose(total([[s for s in _shards(mesh, x)]])[0][0], x.sum())
    np.testing.assert_allclose(again([[s for s in _shards(mesh, x)]])[0][0], x.sum())


def _shards(mesh, x):
    """x split P("data", "model") on `mesh`: shard of each device id."""
    out = []
    for device in range(mesh.size):
        i, j = mesh.coords(device)
        out.append(tf.constant(x[2 * i:2 * i + 2, 2 * j:2 * j + 2]))
    return out


def test_group_keys_are_one_per_device_set_and_renewed_on_retirement():
    cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
    a = collectives.group_key(cpus[:4])
    assert collectives.group_key(cpus[3::-1]) == a  # a set, whatever its order
    assert collectives.group_key(cpus[4:]) != a
    assert collectives.group_key(cpus) not in (a, collectives.group_key(cpus[4:]))
    owners = dict(collectives._group_owner)
    assert len(set(owners)) == len(owners)
    collectives.retire_group_keys()
    fresh = collectives.group_key(cpus[:4])
    assert fresh != a and collectives.group_key(cpus[:4]) == fresh
    assert collectives._group_owner[a][1] == tuple(sorted(cpus[:4]))  # the old key stays bound
