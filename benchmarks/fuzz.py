"""Differential fuzzer: random programs partitioned by gspmd-tf vs single-device TF.

    .venv/bin/python benchmarks/fuzz.py --programs=1000 --seed=0 --jobs=2 --out=fuzz.txt

Each program (benchmarks/fuzz_programs.py) is 2-12 random ops over every op family with
a sharding rule (and a few without), on a random 1-D/2-D/3-D mesh of the 8 logical CPU
devices (size-1 axes included), with random PartitionSpecs on the inputs (several axes on
one dim, uneven, size-1 and zero-size dims), NaN/Inf values, float16/bfloat16/float64/
int32/bool tensors, gt.mesh_split hints on intermediates, out_shardings and sometimes a
gradient; some programs also read and update gt.Variables (run twice, the variables
compared shard by shard with tf.Variables). A worker subprocess (benchmarks/fuzz_worker.py) imports TF once per batch of
--batch programs and runs them one at a time, so the driver sees every crash (the worker
dies) and hang (no answer within --timeout) and charges it to the program that was
running; a crash is re-checked alone in a fresh worker and, when it only happens after
earlier programs, bisected to the shortest run of predecessors that reproduces it. A crash
or error is single-device TF's (status invalid) when the program's reference alone, run
BLAME_RUNS times in a fresh worker, kills it or raises and gspmd-tf's partitioned program
alone, run as often, does neither.

Failures are shrunk (drop ops and outputs, cut the program at an op, turn intermediates
into inputs, drop hints, out_shardings, NaNs and spec entries, shrink the mesh) while the
same failure remains, and written to --out as standalone Python snippets. The last line
printed is the summary. Everything is deterministic per --seed (program i of seed s is
the same program whatever --programs, --jobs or --batch say).
"""

from __future__ import annotations

import copy
import json
import math
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fuzz_programs import FLOATS, MESHES, all_families, describe, generate, snippet  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "benchmarks", "fuzz_worker.py")
FAILURES = ("mismatch", "error", "crash", "hang", "invalid")

PROGRAMS = flags.DEFINE_integer("programs", 200, "number of programs")
SEED = flags.DEFINE_integer("seed", 0, "run seed (program i of a seed is always the same)")
START = flags.DEFINE_integer("start", 0, "index of the first program (to re-run one)")
MESHES_FLAG = flags.DEFINE_list("meshes", ["all"],
                                "mesh shapes to draw from, e.g. 8,2x4,2x2x2 (all: every "
                                "1-D/2-D/3-D mesh of up to 8 devices the generator knows)")
OPS = flags.DEFINE_string("ops", "2-12", "number of ops per program, MIN-MAX (short "
                          "programs are drawn more often: mean about 5 for 2-12)")
FAMILIES = flags.DEFINE_list("families", ["all"], "op families to draw from: all or some of "
                             + ",".join(all_families()))
GRAD = flags.DEFINE_float("grad_prob", 0.15, "fraction of programs that take a gradient")
VARIABLES = flags.DEFINE_float("variable_prob", 0.1, "fraction of programs that read and "
                               "update gt.Variables (run twice, variables compared)")
VOLUMES = flags.DEFINE_float("volume_prob", 0.25, "fraction of programs whose conv and "
                             "pool ops are 3-D (Conv3D, MaxPool3D, AvgPool3D)")
CONTROL_FLOW = flags.DEFINE_float("control_flow_prob", 0.2, "fraction of programs that "
                                  "may also draw tf.roll, tf.while_loop and tf.cond ops "
                                  "(always when --families names roll, while or cond)")
ZERO = flags.DEFINE_float("zero_prob", 0.04, "chance of a zero-size dim in each drawn dim "
                          "(0: only slices empty a dim)")
BATCH = flags.DEFINE_integer("batch", 100, "programs per worker process (one TF import)")
JOBS = flags.DEFINE_integer("jobs", 2, "worker processes running at once")
TIMEOUT = flags.DEFINE_float("timeout", 60, "seconds one program may take before it "
                             "counts as a hang")
COLLECTIVE_TIMEOUT = flags.DEFINE_integer("collective_timeout", 20,
                                          "GSPMD_TF_COLLECTIVE_TIMEOUT for the workers")
BACKEND = flags.DEFINE_enum("backend", "local", ["local", "xla", "auto", "default"],
                            "gspmd-tf backend the programs run on (GSPMD_TF_BACKEND for the "
                            "workers and the reproducers; default: the package's, by "
                            "platform, the local one on CPUs; auto picks one of local and "
                            "xla per program); with xla or auto a value equal to "
                            "single-device TF's under jit_compile passes")
SHRINK = flags.DEFINE_integer("shrink", 20, "failures to shrink (distinct kinds first); 0: "
                              "none")
SHRINK_BUDGET = flags.DEFINE_integer("shrink_budget", 150, "candidate runs per shrink")
OUT = flags.DEFINE_string("out", None, "file for the shrunk reproducers (Python snippets)")
VERBOSE = flags.DEFINE_bool("verbose", False, "print every failure as it is found")


# ---------------------------------------------------------------------------- workers

class Worker:
    """One worker subprocess; `run` sends a program and waits for its answer."""

    def __init__(self, timeout, collective_timeout, env=None):
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.env = env or {}
        self.proc = None
        self.buffer = b""

    def start(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   GSPMD_TF_COLLECTIVE_TIMEOUT=str(self.collective_timeout),
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **self.env)
        self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd=REPO, start_new_session=True)
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
                    "seconds": time.monotonic() - start}
        return answer

    def stop(self):
        """End the worker (its whole process group)."""
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


# TF's CPU kernels without oneDNN (Eigen's): TF's documented switch, read at import.
EIGEN_KERNELS = {"TF_ENABLE_ONEDNN_OPTS": "0"}


def equals_eigen_reference(program, worker):
    """Whether gspmd-tf's program (run by `worker`, TF's default kernels) equals
    single-device TF run with its Eigen kernels. Then single-device TF's own result
    depends on its kernel choice, and a mismatch says nothing about gspmd-tf: seed 27
    #9392, float32 lowest * 1.03 + 2.7e38 in one matmul, is -1.26e38 with oneDNN's fused
    multiply-adds but -Inf with Eigen's kernels, and with any split of the contraction
    (XLA's GSPMD gives -Inf too; benchmarks/RESULTS.md §6)."""
    eigen = Worker(worker.timeout, worker.collective_timeout, env=EIGEN_KERNELS)
    try:
        values = eigen.run(program, part="reference_values")
    finally:
        eigen.stop()
    if values["status"] != "pass":
        return False
    return worker.run(program, reference=values["detail"])["status"] == "pass"


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
            elif result["status"] == "mismatch" and equals_eigen_reference(program, worker):
                result = dict(result, status="pass", detail=(
                    "equals single-device TF with its Eigen kernels (TF_ENABLE_ONEDNN_OPTS=0; "
                    "its oneDNN kernels differ): " + result["detail"]))
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

def failure_class(result):
    """What must stay the same while shrinking: the status, and for an error its
    exception type and where in gspmd_tf it was raised."""
    if result["status"] != "error":
        return result["status"]
    detail = result["detail"]
    where = re.search(r"\[([\w.]+:\d+)\]$", detail)
    return ("error", detail.split(":", 1)[0], where.group(1) if where else "")


def signature(result):
    """A coarse key grouping failures that are likely the same bug."""
    detail = re.sub(r"\d+", "#", result["detail"])
    detail = re.sub(r"'[^']*'", "'…'", detail)
    return result["status"] + ": " + detail[:160]


def dead_code_eliminated(program):
    """Drop ops no output or variable update depends on, inputs nothing reads and
    variables nothing reads or updates."""
    if "updates" in program and not program["grad"]:  # a gradient step needs the gradient
        program["updates"] = [u for u in program["updates"] if u["arg"]]
    updates = program.get("updates", ())
    needed = set(program["outputs"]) | {u["arg"] for u in updates if u["arg"]}
    kept = []
    for op in reversed(program["ops"]):
        if op["out"] in needed:
            kept.append(op)
            needed.update(op["args"])
    program["ops"] = kept[::-1]
    program["inputs"] = [i for i in program["inputs"] if i["name"] in needed]
    if "variables" in program:
        used = {u["variable"] for u in updates} | {
            v["name"] for v in program["variables"] for op in kept
            if re.search(rf"\b{v['name']}\b", op["expr"])}
        program["variables"] = [v for v in program["variables"] if v["name"] in used]
    return program


def with_outputs(program, outputs):
    p = copy.deepcopy(program)
    dtypes = {op["out"]: op["dtype"] for op in p["ops"]}
    if p["out_shardings"] is not None:
        old = dict(zip(program["outputs"], program["out_shardings"]))
        p["out_shardings"] = [old.get(o) for o in outputs]
    p["outputs"] = outputs
    p["grad"] = p["grad"] and any(dtypes[o] in FLOATS for o in outputs)
    return dead_code_eliminated(p)


def promoted(program, k):
    """Op k replaced by a fresh unsplit input of its shape and dtype."""
    p = copy.deepcopy(program)
    op = p["ops"][k]
    kind = "normal" if op["dtype"] in FLOATS else "bool" if op["dtype"] == "bool" \
        else "int32"
    p["inputs"].append({"name": "p" + op["out"][1:], "shape": op["shape"],
                        "dtype": op["dtype"], "kind": kind, "bound": None,
                        "seed": 1000 + k, "special": [], "spec": []})
    name = p["inputs"][-1]["name"]
    del p["ops"][k]
    for other in p["ops"]:
        other["args"] = [name if a == op["out"] else a for a in other["args"]]
    p["outputs"] = [name if o == op["out"] else o for o in p["outputs"]]
    for update in p.get("updates", ()):
        if update["arg"] == op["out"]:
            update["arg"] = name
    if op["out"] in program["outputs"]:
        return None  # an input as an output tests nothing
    return dead_code_eliminated(p)


def simplified(program, k, variant):
    """Op k in a simpler form (a while with fewer trips or body steps, one branch of a
    cond); None where the form changes the shape of a value other ops read."""
    p = copy.deepcopy(program)
    op = p["ops"][k]
    if variant["shape"] != op["shape"] and any(op["out"] in o["args"] for o in p["ops"]):
        return None
    op.update(expr=variant["expr"], args=list(variant["args"]), shape=list(variant["shape"]))
    if op["hint"] is not None and len(op["hint"]) > len(op["shape"]):
        op["hint"] = None
    op["variants"] = [v for v in op["variants"] if v is not variant and
                      v["expr"] != variant["expr"]]
    return dead_code_eliminated(p)


def candidates(program):
    """Smaller or simpler variants of a program, most aggressive first."""
    p = program
    if p["grad"]:
        yield dead_code_eliminated(dict(copy.deepcopy(p), grad=False))
    for k, op in enumerate(p["ops"]):
        if [op["out"]] != p["outputs"]:
            yield with_outputs(p, [op["out"]])
    if len(p["outputs"]) > 1:
        for o in p["outputs"]:
            yield with_outputs(p, [x for x in p["outputs"] if x != o])
    for k in range(len(p.get("updates", ()))):
        c = copy.deepcopy(p)
        del c["updates"][k]
        yield dead_code_eliminated(c)
    for k in range(len(p["ops"])):
        c = promoted(p, k)
        if c is not None:
            yield c
    for k, op in enumerate(p["ops"]):
        for variant in op.get("variants", ()):
            c = simplified(p, k, variant)
            if c is not None:
                yield c
    if p["out_shardings"] is not None:
        yield dict(copy.deepcopy(p), out_shardings=None)
        for i, s in enumerate(p["out_shardings"]):
            if s is not None:
                c = copy.deepcopy(p)
                c["out_shardings"][i] = None
                yield c
    for k, op in enumerate(p["ops"]):
        if op["hint"] is not None:
            c = copy.deepcopy(p)
            c["ops"][k]["hint"] = None
            yield c
    for i, var in enumerate(p.get("variables", ())):
        for d, entry in enumerate(var["spec"]):
            if entry is not None:
                c = copy.deepcopy(p)
                c["variables"][i]["spec"][d] = None
                yield c
    for i, inp in enumerate(p["inputs"]):
        if inp["special"]:
            c = copy.deepcopy(p)
            c["inputs"][i]["special"] = []
            yield c
        for d, entry in enumerate(inp["spec"]):
            if entry is None:
                continue
            c = copy.deepcopy(p)
            c["inputs"][i]["spec"][d] = None
            yield c
            if isinstance(entry, list):
                for axis in entry:
                    c = copy.deepcopy(p)
                    c["inputs"][i]["spec"][d] = axis
                    yield c
    for hint_owner in [op for op in p["ops"] if op["hint"]]:
        for d, entry in enumerate(hint_owner["hint"]):
            if entry is not None:
                c = copy.deepcopy(p)
                next(o for o in c["ops"] if o["out"] == hint_owner["out"])["hint"][d] = None
                yield c
    for a, size in enumerate(p["mesh"]["shape"]):
        for smaller in sorted({1, size // 2} - {size, 0}):
            c = copy.deepcopy(p)
            c["mesh"]["shape"][a] = smaller
            yield c


def shrink(program, result, worker, budget):
    """The smallest variant of `program` that still fails as `result` did."""
    target = failure_class(result)
    best, best_result = program, result
    tried = set()
    while budget > 0:
        for cand in candidates(best):
            key = json.dumps(cand, sort_keys=True)
            if key in tried:
                continue
            tried.add(key)
            budget -= 1
            got = worker.run(cand)
            if got["status"] != "invalid" and failure_class(got) == target:
                best, best_result = cand, got
                break
            if budget <= 0:
                break
        else:
            break
    return best, best_result


def pick_for_shrinking(failures, count):
    """Up to `count` (index, result) failures, one per signature first, small first."""
    by_sig = {}
    for index, result, size in sorted(failures, key=lambda f: (f[2], f[0])):
        by_sig.setdefault(signature(result), []).append((index, result))
    picked = []
    while len(picked) < count and any(by_sig.values()):
        for sig in list(by_sig):
            if by_sig[sig] and len(picked) < count:
                picked.append(by_sig[sig].pop(0))
    return picked


def shrink_all(picked, programs, jobs, timeout, collective_timeout, budget, on_done):
    """Shrink each picked failure in `jobs` parallel workers; on_done(index, program,
    result) for each."""
    work = queue.Queue()
    for item in picked:
        work.put(item)

    def serve():
        worker = Worker(timeout, collective_timeout)
        try:
            while True:
                try:
                    index, result = work.get_nowait()
                except queue.Empty:
                    return
                small, small_result = shrink(programs[index], result, worker, budget)
                on_done(index, small, small_result)
        finally:
            worker.stop()

    threads = [threading.Thread(target=serve) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---------------------------------------------------------------------------- main

def parse_meshes(names):
    if names == ["all"]:
        return None
    return [tuple(int(n) for n in name.split("x")) for name in names]


def summary(results, seconds):
    """The one-line summary of a run."""
    counts = {s: sum(1 for r in results.values() if r["status"] == s)
              for s in ("pass",) + FAILURES}
    n = len(results)
    cpu = [r["cpu"] for r in results.values() if "cpu" in r]
    return (f"programs={n} passed={counts['pass']} mismatches={counts['mismatch']} "
            f"errors={counts['error']} crashes={counts['crash']} hangs={counts['hang']} "
            f"invalid={counts['invalid']} seconds={seconds:.0f} "
            f"throughput={n / max(seconds, 1e-9):.2f} programs/s "
            f"(worker CPU {sum(cpu) / max(len(cpu), 1):.2f} s/program, "
            f"load average {os.getloadavg()[0]:.1f})")


def reproducer_text(index, seed, original, result, small):
    head = (f"# {result['status']}: {result['detail']}\n"
            f"# program {index} of --seed={seed} ({describe(original)}); shrunk to "
            f"{describe(small)}\n")
    return head + snippet(small)


def main(argv):
    del argv
    os.environ["GSPMD_TF_BACKEND"] = BACKEND.value  # the workers inherit it
    lo, hi = (int(v) for v in OPS.value.split("-"))
    families = None if FAMILIES.value == ["all"] else FAMILIES.value
    meshes = parse_meshes(MESHES_FLAG.value)
    for shape in meshes or []:
        if shape not in MESHES and (len(shape) > 3 or math.prod(shape) > 8):
            raise app.UsageError(f"mesh {shape}: use at most 3 axes and 8 devices")
    indices = range(START.value, START.value + PROGRAMS.value)
    programs = {i: generate(SEED.value, i, (lo, hi), families, GRAD.value, meshes,
                            ZERO.value, VARIABLES.value, VOLUMES.value, CONTROL_FLOW.value)
                for i in indices}
    print(f"fuzz: {len(programs)} programs, seed {SEED.value}, {JOBS.value} workers of "
          f"{BATCH.value} programs, load average {os.getloadavg()[0]:.2f}", flush=True)
    start = time.monotonic()
    done = [0]

    def on_result(index, result):
        done[0] += 1
        if result["status"] != "pass" and VERBOSE.value:
            print(f"  #{index} {result['status']}: {result['detail']}", flush=True)
        if done[0] % 100 == 0:
            elapsed = time.monotonic() - start
            print(f"  {done[0]}/{len(programs)} done, {done[0] / elapsed:.2f} programs/s",
                  flush=True)

    results = run_programs(programs, JOBS.value, BATCH.value, TIMEOUT.value,
                           COLLECTIVE_TIMEOUT.value, on_result)
    seconds = time.monotonic() - start
    failures = [(i, r, len(programs[i]["ops"])) for i, r in sorted(results.items())
                if r["status"] != "pass"]
    # an invalid program is the generator's bug: reported above, not shrunk
    real = [f for f in failures if f[1]["status"] != "invalid"]
    groups = {}
    for i, r, _ in failures:
        groups.setdefault(signature(r), []).append(i)
    print(f"failure kinds: {len(groups)}")
    for sig, members in sorted(groups.items(), key=lambda g: -len(g[1])):
        print(f"  {len(members):4d} x {sig}   e.g. #{members[0]}")
    out = open(OUT.value, "w") if OUT.value else None
    lock = threading.Lock()

    def on_done(index, small, small_result):
        text = reproducer_text(index, SEED.value, programs[index], results[index], small)
        with lock:
            print("\n" + text, flush=True)
            if out:
                out.write(text + "\n\n")
                out.flush()

    if SHRINK.value and real:
        picked = pick_for_shrinking(real, SHRINK.value)
        print(f"shrinking {len(picked)} failure(s)", flush=True)
        shrink_all(picked, programs, JOBS.value, TIMEOUT.value, COLLECTIVE_TIMEOUT.value,
                   SHRINK_BUDGET.value, on_done)
    if out:
        out.close()
    print(summary(results, seconds))


if __name__ == "__main__":
    app.run(main)
