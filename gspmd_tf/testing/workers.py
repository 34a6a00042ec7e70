"""The fuzzer's driver side: worker subprocesses (python -m gspmd_tf.testing.differential)
that run programs, and the policies that decide whose failure a failure is.

A worker imports TF once and runs programs one at a time, so the driver sees every crash
(the worker dies) and hang (no answer within the timeout) and charges it to the program
that was running; a crash is re-checked alone in a fresh worker and, when it only
happens after earlier programs, bisected to the shortest run of predecessors that
reproduces it. A crash or error is single-device TF's (status invalid) when the
program's reference alone, run BLAME_RUNS times in a fresh worker, kills it or raises and
gspmd-tf's partitioned program alone, run as often, does neither.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import gspmd_tf

# The directory gspmd_tf is imported from: the workers import it from there too.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(gspmd_tf.__file__)))
WORKER_MODULE = "gspmd_tf.testing.differential"
STDERR_TAIL = 2000  # characters of a dead worker's stderr kept with its crash


class Worker:
    """One worker subprocess; `run` sends a program and waits for its answer."""

    def __init__(self, timeout, collective_timeout, env=None):
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.env = env or {}
        self.proc = None
        self.stderr = None  # the running worker's stderr, a temporary file
        self.buffer = b""

    def start(self):
        """Start the worker subprocess and wait until it has imported TF. Its stderr
        goes to a temporary file (with Python's faulthandler on, so a fatal signal
        writes every thread's Python stack there): a crash reports its end."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   GSPMD_TF_COLLECTIVE_TIMEOUT=str(self.collective_timeout),
                   PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **self.env)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m",
                                      WORKER_MODULE],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env, cwd=PACKAGE_ROOT,
                                     start_new_session=True)
        self.buffer = b""
        ready = self._read_line(max(300.0, self.timeout))
        if ready is None or not ready.get("ready"):
            self.stop()
            raise RuntimeError("fuzz worker did not start")

    def _read_line(self, timeout):
        """The next JSON line, None on EOF; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, program, timeout=None, part=None, reference=None):
        """{"status", "detail", "seconds"} of one program (of only its "reference" or
        "partitioned" side, or its reference's "reference_values", if `part` says so;
        compared with `reference`, encoded values, if given); a dead worker is a crash,
        no answer within the timeout a hang (the worker is then killed)."""
        if self.proc is None:
            self.start()
        start = time.monotonic()
        request = {"id": 0, "program": program}
        if part is not None:
            request["part"] = part
        if reference is not None:
            request["reference"] = reference
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            answer = self._read_line(timeout or self.timeout)
        except TimeoutError:
            self.stop()
            return {"status": "hang", "detail": f"no answer in {timeout or self.timeout:g} s",
                    "seconds": time.monotonic() - start}
        except BrokenPipeError:
            answer = None
        if answer is None:
            code = self.proc.wait()
            self.proc = None
            what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return {"status": "crash", "detail": f"worker died: {what}",
                    "stderr": self._stderr_tail(), "seconds": time.monotonic() - start}
        return answer

    def _stderr_tail(self):
        """The last STDERR_TAIL characters the worker wrote to stderr, without
        faulthandler's list of loaded extension modules (and the file closed)."""
        stderr, self.stderr = self.stderr, None
        if stderr is None:
            return ""
        with stderr:
            stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - 8 * STDERR_TAIL))
            lines = stderr.read().decode(errors="replace").splitlines(keepends=True)
        return "".join(line for line in lines
                       if not line.startswith("Extension modules:"))[-STDERR_TAIL:]

    def stop(self):
        """End the worker (its whole process group)."""
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None


def run_fresh(programs, timeout, collective_timeout, part=None):
    """Run programs (only their `part`, if given) in order in a new worker; the result
    of the last one run: runs stop at a crash or hang, and with `part` (which compares
    nothing) at the first run that does not pass."""
    worker = Worker(timeout, collective_timeout)
    try:
        result = None
        for program in programs:
            result = worker.run(program, part=part)
            if result["status"] in ("crash", "hang") or (part and result["status"] != "pass"):
                break
        return result
    finally:
        worker.stop()


def attribute_crash(before, program, worker):
    """How a crash of `program` (after `before` in the same, now dead, worker)
    reproduces: alone, after the last k predecessors (the smallest such k), or not at
    all. The first re-run starts `worker` afresh, which then serves the rest of the
    batch if it survives."""
    timeout, collective_timeout = worker.timeout, worker.collective_timeout
    if worker.run(program)["status"] == "crash":
        return "reproduces alone"
    if run_fresh(before + [program], timeout, collective_timeout)["status"] != "crash":
        return "does not reproduce (flaky)"
    if not before:
        return "reproduces alone in a second fresh worker (flaky)"
    lo, hi = 1, len(before)  # the smallest k in [lo, hi] whose suffix reproduces
    while lo < hi:
        mid = (lo + hi) // 2
        if run_fresh(before[-mid:] + [program], timeout, collective_timeout)["status"] \
                == "crash":
            hi = mid
        else:
            lo = mid + 1
    return f"only after the {lo} program(s) before it in the batch"


# Runs of each side of a crashing program that decide whose crash it is: single-device
# TF's reference of seed 24 #3785 (oneDNN's batch matmul corrupting the heap) killed a
# fresh worker within 1-8 runs in 6 tries of 7 (the other survived 10); its partitioned
# program ran 300 calls without a fault (benchmarks/RESULTS.md §6, "The crash of the
# fourth run").
BLAME_RUNS = 100


def blame_reference(program, timeout, collective_timeout, runs=BLAME_RUNS):
    """The failure detail if single-device TF is to blame for a crash or error of
    `program`: its reference alone, run `runs` times in a fresh worker, kills the worker
    or raises, and gspmd-tf's partitioned program alone, run as often, does neither;
    else None. An error counts too: TF's oneDNN Conv2DBackpropFilter of seed 31 #814's
    reference (eager, alone) killed a fresh worker within 6-112 runs or raised
    AbortedError ("could not create a primitive descriptor for the reorder primitive");
    a reference that corrupted the heap without failing can make the partitioned program
    that follows it in the same worker raise instead (benchmarks/RESULTS.md §6)."""
    alone = [program] * runs
    reference = run_fresh(alone, timeout, collective_timeout, part="reference")
    if reference["status"] not in ("crash", "error"):
        return None
    if run_fresh(alone, timeout, collective_timeout, part="partitioned")["status"] != "pass":
        return None
    return reference["detail"]


# TF's CPU kernels without oneDNN (Eigen's) and with them: TF's documented switch, read
# at import (its default depends on the CPU: off on AMD EPYC).
EIGEN_KERNELS = {"TF_ENABLE_ONEDNN_OPTS": "0"}
KERNEL_SETS = {"Eigen": EIGEN_KERNELS, "oneDNN": {"TF_ENABLE_ONEDNN_OPTS": "1"}}


def equal_kernel_reference(program, worker):
    """The name of a CPU kernel set (KERNEL_SETS) with which single-device TF's values
    equal gspmd-tf's program's (run by `worker`, TF's default kernels), or None. Then
    single-device TF's own result depends on its kernel choice, and a mismatch says
    nothing about gspmd-tf: seed 27 #9392, float32 lowest * 1.03 + 2.7e38 in one matmul,
    is -1.26e38 with oneDNN's fused multiply-adds but -Inf with Eigen's kernels, and with
    any split of the contraction (XLA's GSPMD gives -Inf too; benchmarks/RESULTS.md §6);
    seed 58 #1953, Eigen's Conv3DBackpropFilter multiplies an Inf in input rows a stride
    skips by 0 (NaN in the filter gradient) where oneDNN's, XLA's and the same gradient
    with those rows zeroed or cut give finite values."""
    for name, env in KERNEL_SETS.items():
        other = Worker(worker.timeout, worker.collective_timeout, env=env)
        try:
            values = other.run(program, part="reference_values")
        finally:
            other.stop()
        if (values["status"] == "pass"
                and worker.run(program, reference=values["detail"])["status"] == "pass"):
            return name
    return None


def run_batch(programs, timeout, collective_timeout, report):
    """Run (index, program) pairs in workers, restarting after a crash or hang;
    calls report(index, result) for each."""
    worker = Worker(timeout, collective_timeout)
    ran = []
    try:
        for index, program in programs:
            result = worker.run(program)
            if result["status"] in ("crash", "error"):
                crashed = result["status"] == "crash"
                if crashed:
                    result["detail"] += "; " + attribute_crash(
                        [p for _, p in ran], program, worker)
                reference = blame_reference(program, timeout, collective_timeout)
                if reference:  # the program says nothing about gspmd-tf
                    result = dict(result, status="invalid", detail=(
                        f"single-device TF fails on it alone ({reference} within "
                        f"{BLAME_RUNS} runs of its reference; gspmd-tf's program alone "
                        f"does not): " + result["detail"]))
                ran = [] if crashed else ran + [(index, program)]
            elif result["status"] == "mismatch" and (
                    kernels := equal_kernel_reference(program, worker)):
                result = dict(result, status="pass", detail=(
                    f"equals single-device TF with its {kernels} kernels "
                    f"({KERNEL_SETS[kernels]}; its default kernels differ): "
                    + result["detail"]))
                ran.append((index, program))
            elif result["status"] == "hang":
                again = run_fresh([program], 2 * timeout, collective_timeout)
                if again["status"] != "hang":  # slow under load, not stuck
                    result = dict(again, detail=(again["detail"] + "; first run exceeded "
                                                 f"{timeout:.0f} s").strip("; "))
                ran = []
            else:
                ran.append((index, program))
            report(index, result)
    finally:
        worker.stop()


def run_programs(programs, jobs=2, batch=100, timeout=60.0, collective_timeout=20,
                 on_result=None):
    """Run {index: program} in `jobs` parallel workers, `batch` programs per worker
    process. Returns {index: result}."""
    results = {}
    lock = threading.Lock()
    items = sorted(programs.items())
    batches = queue.Queue()
    for i in range(0, len(items), batch):
        batches.put(items[i:i + batch])

    def report(index, result):
        with lock:
            results[index] = result
            if on_result:
                on_result(index, result)

    def serve():
        while True:
            try:
                chunk = batches.get_nowait()
            except queue.Empty:
                return
            run_batch(chunk, timeout, collective_timeout, report)

    threads = [threading.Thread(target=serve) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ---------------------------------------------------------------------------- shrinking
