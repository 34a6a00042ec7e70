"""Multi-worker meshes with loopback worker processes (tests/multiworker_probe.py): each
worker's results equal single-device TF, a training step updates the shards each worker
holds, Keras fit through gt.keras.shard_model equals one device, a checkpoint saved by 2
workers x 4 devices restores on 4 workers x 2, and a dead worker makes the others fail
within the collective timeout."""

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import cluster
from multiworker_values import check_plain_restore
from util import Background, Started, job_directory, session_environ

PROBE = os.path.join(os.path.dirname(__file__), "multiworker_probe.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A loopback cluster that takes longer than this is hung: the test fails, nothing waits.
LAUNCH_TIMEOUT = 150


def launch(workers, local_devices, scenarios, collective_timeout=60, **env):
    """Runs the probe's `scenarios` on `workers` loopback processes with `local_devices`
    each (or one count per worker); returns {task: {scenario: facts}} of the workers that
    printed results."""
    counts = local_devices if isinstance(local_devices, (list, tuple)) else \
        [local_devices] * workers
    addresses = cluster.loopback_addresses(workers)
    commands, envs = [], []
    for task in range(workers):
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": task}}
        commands.append([sys.executable, PROBE, str(counts[task])] + scenarios)
        envs.append(dict(session_environ(), PYTHONPATH=ROOT, TF_CONFIG=json.dumps(config),
                         GSPMD_TF_COLLECTIVE_TIMEOUT=str(collective_timeout), **env))
    results, failures = {}, []
    for task, run in enumerate(Started(commands, envs).wait(LAUNCH_TIMEOUT)):
        lines = run.stdout.strip().splitlines()
        if run.returncode == 0 and lines:
            results[task] = json.loads(lines[-1])
        elif run.returncode:
            failures.append(f"worker {task} exited {run.returncode}:\n{run.stderr[-3000:]}")
    assert not failures, "\n".join(failures)
    return results


@Background
def saved_2x4():
    """2 workers x 4 devices: programs, training, Keras fit and a checkpoint saved to a
    prefix."""
    prefix = os.path.join(job_directory("multiworker"), "ckpt")
    results = launch(2, 4, ["programs", "training", "keras_fit", "save"],
                     MULTIWORKER_CHECKPOINT=prefix)
    return results, prefix


@Background
def restored_4x2():
    """4 workers x 2 devices: programs, and saved_2x4's checkpoint restored."""
    _, prefix = saved_2x4.result()
    return launch(4, 2, ["programs", "restore"], MULTIWORKER_CHECKPOINT=prefix)


@Background
def dead_peer():
    """2 workers x 4 devices whose worker 0 dies before a collective (timeout 5 s)."""
    # worker 0 is the collective leader, which resolves every group: the harder loss
    return launch(2, 4, ["dead_peer"], collective_timeout=5, MULTIWORKER_DEAD_TASK="0")


def check_programs(results, workers, local_devices):
    assert sorted(results) == list(range(workers))
    for task, facts in results.items():
        programs = facts["programs"]
        assert programs["addressable"] == list(range(task * local_devices,
                                                     (task + 1) * local_devices))
        assert programs["all_to_all_ops"] == ["all-to-all"]
        assert programs["conv_ops"] == ["collective-permute"]
        for name in ("ffn", "all_gather", "all_to_all", "conv", "other_mesh"):
            assert programs[name] <= 1e-5, (task, name, programs[name])


def test_programs_and_training_on_2_workers_x_4_devices():
    results, _ = saved_2x4.result()
    check_programs(results, 2, 4)
    for task, facts in results.items():
        training = facts["training"]
        assert max(training["losses"]) <= 1e-5 and training["w1"] <= 1e-5
        assert training["w2"] <= 1e-5
        # each worker holds the shards of its own devices only
        assert training["held"] == [task == d // 4 for d in range(8)]
        save = facts["save"]
        assert save["held"] == 4 and save["saved"]
        assert "gt.save_checkpoint(checkpoint, prefix) on every worker" in save["plain_write"]


def test_keras_shard_model_fit_on_2_workers_matches_single_device():
    results, _ = saved_2x4.result()
    for facts in results.values():
        fit = facts["keras_fit"]
        assert fit.pop("sharded") is True
        assert len(fit) == 15  # the losses, 4 weights, 2 counters and 8 Adam slots
        assert max(fit.values()) <= 1e-5, fit


def test_checkpoint_of_2x4_restores_on_4_workers_x_2_devices_with_other_specs():
    results = restored_4x2.result()
    check_programs(results, 4, 2)
    for facts in results.values():
        restored = facts["restore"]
        assert restored["step"] == 7
        assert max(restored[n] for n in ("split", "rows", "replicated")) <= 1e-5


def test_checkpoint_of_2x4_is_one_tf_checkpoint_plain_variables_restore():
    _, prefix = saved_2x4.result()
    check_plain_restore(prefix)
    # one bundle, merged from the workers' parts, which are gone
    assert os.path.exists(prefix + ".index") and not os.path.exists(prefix + "_parts")


def test_dead_worker_fails_the_others_within_the_collective_timeout():
    results = dead_peer.result()
    assert list(results) == [1]  # worker 0 left without a word
    facts = results[1]["dead_peer"]
    # the watchdog's timeout, or TF's runtime finding the peer gone first (under load)
    assert facts["error"] in ("DeadlineExceededError", "UnavailableError"), facts
    assert facts["error"] == "UnavailableError" or "did not finish within 5 s" in facts[
        "message"]
    assert "a worker of the cluster may have died" in facts["message"]
    assert facts["seconds"] < 5 + 30  # the timeout, plus the watchdog's grace at most


@pytest.mark.parametrize("config, problem", [
    ("not json", "not JSON"),
    ('{"cluster": {"worker": ["localhost:1"]}}', "needs a \"cluster\" and a \"task\""),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "chief", "index": 0}}',
     "task type 'chief'"),
    ('{"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]}, '
     '"task": {"type": "worker", "index": 0}}', "only \"worker\" tasks"),
    ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}',
     "list of \"host:port\""),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 1}}',
     "task index 1"),
])
def test_bad_tf_config_is_a_sharding_error(monkeypatch, config, problem):
    monkeypatch.setenv("TF_CONFIG", config)
    with pytest.raises(gt.ShardingError, match="initialize_cluster") as error:
        gt.initialize_cluster()
    assert problem in str(error.value)
    assert cluster.current() is None


def test_initialize_cluster_after_tensorflow_started_is_a_sharding_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(gt.ShardingError, match="TF_CONFIG is not set"):
        gt.initialize_cluster()
    tf.constant(1.0)  # TF runs in this test process
    with pytest.raises(gt.ShardingError, match="already started"):
        gt.initialize_cluster({"worker": ["localhost:1", "localhost:2"]}, 0)
    assert cluster.current() is None


def test_one_process_mesh_is_fully_addressable():
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    assert mesh.addressable_ids == tuple(range(8)) and mesh.is_fully_addressable
    layout = gt.Sharding.from_spec(mesh, gt.P("model"), 1).to_layout(mesh, 1)
    x = gt.ShardedTensor.from_value(np.arange(8.0), mesh, layout)
    assert sorted(x.addressable_shards) == list(range(8))
    np.testing.assert_array_equal(x.numpy(), np.arange(8.0))
