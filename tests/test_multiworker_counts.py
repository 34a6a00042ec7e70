"""Workers with different numbers of local devices: 2 loopback workers with 4 and 2 CPU
devices (tests/multiworker_probe.py on a (2, 3) mesh). The mesh spans the 6 devices
worker-major on both workers; programs whose collectives cross the workers (all-gather,
all-to-all, the halo permutes of a convolution), SGD steps on gt.Variables and a
checkpoint saved on (2, 3) and restored on (3, 2) with other specs equal single-device TF
on every worker; a mesh larger than the cluster and a worker that never starts are clear
errors, not hangs."""

import json
import os
import sys

import pytest

from gspmd_tf import cluster
from multiworker_values import check_plain_restore
from test_multiworker import LAUNCH_TIMEOUT, ROOT, launch
from util import Background, job_directory, run_together, session_environ

COUNTS = [4, 2]  # local devices of worker 0 and worker 1
TASK_OF_DEVICE = [0, 0, 0, 0, 1, 1]  # by global device id: worker 0's first


@Background
def counts_launch():
    """One launch of every scenario (each launch costs 15-30 s); (results, prefix)."""
    prefix = os.path.join(job_directory("multiworker_counts"), "ckpt")
    results = launch(2, COUNTS, ["devices", "programs", "training", "save", "restore"],
                     MULTIWORKER_MESH="2,3", MULTIWORKER_CHECKPOINT=prefix)
    return results, prefix


@pytest.fixture(scope="module")
def counts_run():
    """counts_launch's (results, prefix), both workers' results there."""
    results, prefix = counts_launch.result()
    assert sorted(results) == [0, 1]
    return results, prefix


def test_mesh_spans_every_workers_devices_worker_major(counts_run):
    results, _ = counts_run
    want = [f"/job:worker/replica:0/task:{task}/device:CPU:{index}"
            for task, count in enumerate(COUNTS) for index in range(count)]
    for task, facts in results.items():
        assert facts["devices"]["devices"] == want
        too_big = facts["devices"]["too_big"]
        assert "mesh (7,) needs 7 devices but the cluster's 2 workers have 6" in too_big
        assert "(worker: devices {0: 4, 1: 2})" in too_big
        # this worker's devices count, not the cluster's
        one_more = COUNTS[task] + 1
        assert (f"configure_cpu_devices({one_more}): TensorFlow already started with "
                f"{COUNTS[task]} CPU device(s)") in facts["devices"]["one_more"]


def test_programs_crossing_workers_equal_single_device(counts_run):
    results, _ = counts_run
    for task, facts in results.items():
        programs = facts["programs"]
        assert programs["addressable"] == [d for d in range(6) if TASK_OF_DEVICE[d] == task]
        assert programs["all_to_all_ops"] == ["all-to-all"]
        assert "collective-permute" in programs["conv_ops"]
        for name in ("ffn", "all_gather", "all_to_all", "conv", "other_mesh"):
            assert programs[name] <= 1e-5, (task, name, programs[name])


def test_training_steps_update_each_workers_shards(counts_run):
    results, _ = counts_run
    for task, facts in results.items():
        training = facts["training"]
        assert max(training["losses"]) <= 1e-5, training
        assert training["w1"] <= 1e-5 and training["w2"] <= 1e-5, training
        assert training["held"] == [t == task for t in TASK_OF_DEVICE]


def test_checkpoint_saved_on_2x3_restores_on_3x2_and_into_plain_variables(counts_run):
    results, prefix = counts_run
    for task, facts in results.items():
        save = facts["save"]
        assert save["saved"] and save["held"] == COUNTS[task]
        restored = facts["restore"]
        assert restored["step"] == 7
        assert max(restored[n] for n in ("split", "rows", "replicated")) <= 1e-5, restored
    check_plain_restore(prefix)


@Background
def lone_worker():
    """(The finished run of worker 0 of 2 alone, the addresses it was given)."""
    # worker 0 alone: the coordination service leader, which waits for every worker
    addresses = cluster.loopback_addresses(2)
    code = ("import json, time, gspmd_tf as gt, tensorflow as tf\n"
            "gt.configure_cpu_devices(2)\n"
            "start = time.monotonic()\n"
            "try:\n"
            f"    gt.initialize_cluster({addresses!r}, 0)\n"
            "except tf.errors.DeadlineExceededError as e:\n"
            "    print(json.dumps([e.message, time.monotonic() - start]))\n")
    run, = run_together([[sys.executable, "-c", code]], timeout=LAUNCH_TIMEOUT,
                        env=dict(session_environ(), PYTHONPATH=ROOT,
                                 TF_CPP_MIN_LOG_LEVEL="3", GSPMD_TF_COLLECTIVE_TIMEOUT="3"))
    return run, addresses


def test_worker_that_never_starts_fails_initialize_cluster_within_the_timeout():
    run, addresses = lone_worker.result()
    assert run.returncode == 0, run.stderr[-3000:]
    message, seconds = json.loads(run.stdout.strip().splitlines()[-1])
    assert f"the 2 workers {addresses} did not all start within 3 s" in message
    assert "Barrier timed out" in message  # TF's words follow
    assert seconds < 3 + 30  # the timeout, plus TF's retries at most
