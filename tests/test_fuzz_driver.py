"""The fuzzer's driver (gspmd_tf/testing/workers.py, shrink.py): a worker runs either side of
a program alone, crashes and errors are attributed to the program and blamed on
single-device TF only when its reference alone fails, a crash reports the end of the dead
worker's stderr, and the shrinker's variants of control-flow programs are still
programs."""

import os
import signal

import pytest

from gspmd_tf.testing import workers
from gspmd_tf.testing.generator import generate
from gspmd_tf.testing.program_text import source
from gspmd_tf.testing.shrink import candidates
from util import Background


class _ScriptedWorker:
    """A workers.Worker stand-in answering each run with the next scripted status."""

    def __init__(self, statuses, timeout=60, collective_timeout=20, env=None):
        self.statuses, self.runs = list(statuses), []
        self.timeout, self.collective_timeout = timeout, collective_timeout

    def run(self, program, timeout=None, part=None, reference=None):
        self.runs.append(part)
        return {"status": self.statuses.pop(0), "detail": "AbortedError: reorder primitive"}

    def stop(self):
        pass


@pytest.mark.parametrize("part, runs, status", [("reference", 2, "error"), (None, 3, "pass")])
def test_one_side_runs_stop_at_the_first_failure(monkeypatch, part, runs, status):
    """run_fresh of one side (which compares nothing) stops at its first run that does
    not pass; whole programs run on past an error (only a crash or hang stops them)."""
    worker = _ScriptedWorker(["pass", "error", "pass"])
    monkeypatch.setattr(workers, "Worker", lambda *a, **k: worker)
    assert workers.run_fresh([{}] * 3, 60, 20, part=part)["status"] == status
    assert len(worker.runs) == runs


@pytest.mark.parametrize("reference, partitioned, blamed", [
    ("error", "pass", True), ("error", "error", False), ("crash", "error", False),
    ("pass", "pass", False)])
def test_reference_error_alone_blames_tf(monkeypatch, reference, partitioned, blamed):
    """A failure is TF's when the reference alone raises or dies and gspmd-tf's program
    alone neither raises nor dies (#814's reference raised AbortedError in oneDNN's
    filter gradient in 4 of 5 fresh workers, and killed the fifth)."""
    answers = {"reference": reference, "partitioned": partitioned}
    monkeypatch.setattr(workers, "run_fresh", lambda programs, timeout, collective_timeout,
                        part=None: {"status": answers[part], "detail": "AbortedError: x"})
    detail = workers.blame_reference({"ops": []}, 60, 20, runs=5)
    assert (detail == "AbortedError: x") if blamed else detail is None


@pytest.mark.parametrize("blamed", [True, False])
def test_error_of_a_program_is_invalid_only_when_tf_is_to_blame(monkeypatch, blamed):
    """run_batch turns an error into "invalid" (naming the reference's failure) exactly
    when blame_reference blames single-device TF, and keeps the worker for the rest of
    the batch."""
    worker = _ScriptedWorker(["error", "pass"])
    monkeypatch.setattr(workers, "Worker", lambda *a, **k: worker)
    monkeypatch.setattr(workers, "blame_reference",
                        lambda *a: "AbortedError: y" if blamed else None)
    results = {}
    workers.run_batch([(814, {}), (815, {})], 60, 20, lambda i, r: results.setdefault(i, r))
    assert results[814]["status"] == ("invalid" if blamed else "error")
    assert ("AbortedError: y" in results[814]["detail"]) == blamed
    assert results[815]["status"] == "pass" and worker.runs == [None, None]


@pytest.mark.parametrize("fresh, before, said", [
    ("crash", [], "reproduces alone in a second fresh worker (flaky)"),
    ("pass", [], "does not reproduce (flaky)"),
    ("crash", [{}], "only after the 1 program(s) before it in the batch")])
def test_crash_attribution_names_how_it_reproduces(monkeypatch, fresh, before, said):
    """attribute_crash: a crash that the worker's re-run alone survives but a second
    fresh worker does not is flaky alone, not "after 1 program" when none came before."""
    monkeypatch.setattr(workers, "run_fresh", lambda programs, timeout, collective_timeout,
                        part=None: {"status": fresh if len(programs) == len(before) + 1
                                    else "pass"})
    assert workers.attribute_crash(before, {}, _ScriptedWorker(["pass"])) == said


@Background
def one_sided_runs():
    """{part: a worker's result of running only that side of seed 24 #3785}."""
    worker = workers.Worker(120, 30)
    try:
        return {part: worker.run(generate(24, 3785), part=part)
                for part in ("reference", "partitioned")}
    finally:
        worker.stop()


@Background
def aborted_worker_run():
    """A worker's result of a run after the worker died of SIGABRT."""
    worker = workers.Worker(120, 30)
    try:
        worker.start()
        os.kill(worker.proc.pid, signal.SIGABRT)
        worker.proc.wait()
        return worker.run(generate(24, 3785))
    finally:
        worker.stop()


def test_a_dead_worker_s_crash_carries_the_end_of_its_stderr():
    # what a native crash leaves to diagnose it: the signal, and the Python stack of
    # every thread, which the worker's faulthandler writes to its stderr
    result = aborted_worker_run.result()
    assert result["status"] == "crash" and "signal SIGABRT" in result["detail"], result
    assert "Fatal Python error: Aborted" in result["stderr"], result


def test_worker_runs_either_side_of_a_program_alone():
    """The worker runs only a program's reference or only its partitioned program on
    request (what the fuzzer's crash attribution asks of it)."""
    for part, result in one_sided_runs.result().items():
        assert result["status"] == "pass", (part, result)


@pytest.mark.parametrize("reference, partitioned, blamed", [
    ("crash", "pass", True), ("crash", "crash", False), ("pass", "pass", False)])
def test_crash_is_tf_s_only_if_the_reference_alone_dies(monkeypatch, reference, partitioned,
                                                       blamed):
    """A crash is charged to single-device TF only when its reference alone kills a fresh
    worker and gspmd-tf's program alone does not (here with the workers' answers
    given)."""
    answers = {"reference": reference, "partitioned": partitioned}
    seen = []

    def run_fresh(programs, timeout, collective_timeout, part=None):
        seen.append((len(programs), part))
        return {"status": answers[part], "detail": "worker died: signal SIGSEGV"}

    monkeypatch.setattr(workers, "run_fresh", run_fresh)
    detail = workers.blame_reference({"ops": []}, 60, 20, runs=7)
    assert (detail == "worker died: signal SIGSEGV") if blamed else detail is None
    assert seen[0] == (7, "reference") and all(n == 7 for n, _ in seen)


def test_shrinker_candidates_of_control_flow_programs_are_programs():
    """The shrinker's simpler forms of while/cond ops (fewer trips or body steps, one
    branch) render to Python and keep every op's declared shape consistent."""
    simplified = 0
    for index in range(12):
        program = generate(100, index, families=["while", "cond", "roll"])
        for candidate in candidates(program):
            compile(source(candidate), "<candidate>", "exec")
            ops = {op["out"]: op for op in candidate["ops"]}
            simplified += any(op["expr"] != ops.get(op["out"], op)["expr"]
                              for op in program["ops"] if op["out"] in ops)
    assert simplified > 0
