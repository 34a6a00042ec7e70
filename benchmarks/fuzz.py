"""Differential fuzzer: random programs partitioned by gspmd-tf vs single-device TF.

    .venv/bin/python benchmarks/fuzz.py --programs=1000 --seed=0 --jobs=2 --out=fuzz.txt

Each program (gspmd_tf/testing/generator.py) is 2-12 random ops over every op family with
a sharding rule (and a few without), on a random 1-D/2-D/3-D mesh of the 8 logical CPU
devices (size-1 axes included), with random PartitionSpecs on the inputs (several axes on
one dim, uneven, size-1 and zero-size dims), NaN/Inf values, float16/bfloat16/float64/
int32/bool tensors, gt.mesh_split hints on intermediates, out_shardings and sometimes a
gradient; some programs also read and update gt.Variables (run twice, the variables
compared shard by shard with tf.Variables). A worker subprocess (gspmd_tf/testing/differential.py) imports TF once per batch of
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

import math
import os
import sys
import threading
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gspmd_tf.testing.generator import generate  # noqa: E402
from gspmd_tf.testing.program_space import MESHES  # noqa: E402
from gspmd_tf.testing.program_text import all_families, describe, snippet  # noqa: E402
from gspmd_tf.testing.shrink import pick_for_shrinking, shrink_all, signature  # noqa: E402
from gspmd_tf.testing.workers import run_programs  # noqa: E402

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
                            "single-device TF's running the XLA backend's segments under "
                            "jit_compile passes (testing/differential.py "
                            "one_device_segments)")
SHRINK = flags.DEFINE_integer("shrink", 20, "failures to shrink (distinct kinds first); 0: "
                              "none")
SHRINK_BUDGET = flags.DEFINE_integer("shrink_budget", 150, "candidate runs per shrink")
OUT = flags.DEFINE_string("out", None, "file for the shrunk reproducers (Python snippets)")
VERBOSE = flags.DEFINE_bool("verbose", False, "print every failure as it is found")

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
    return head + _commented_stderr(result) + snippet(small)


def _commented_stderr(result):
    """A crashed worker's stderr tail as comment lines ("" for other results)."""
    lines = result.get("stderr", "").strip().splitlines()
    return "".join(f"# stderr| {line}\n" for line in lines)


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
            print(_commented_stderr(result), end="", flush=True)
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
