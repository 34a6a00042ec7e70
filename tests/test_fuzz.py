"""A bounded slice of the differential fuzzer (benchmarks/fuzz.py) for `make test`.

40 random programs of seed 0, run by the fuzzer's own machinery (a worker subprocess with
one TF import, per-program timeout, crash attribution), must all equal single-device TF.
A failure names the programs; reproduce one with

    .venv/bin/python benchmarks/fuzz.py --seed=0 --start=INDEX --programs=1 --ops=2-8

which also prints it shrunk to a standalone snippet.
"""

import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from fuzz import run_programs, signature  # noqa: E402
from fuzz_programs import describe, generate  # noqa: E402

SEED = 0
PROGRAMS = 40


def test_random_programs_match_single_device():
    programs = {i: generate(SEED, i, ops=(2, 8)) for i in range(PROGRAMS)}
    results = run_programs(programs, jobs=1, batch=PROGRAMS, timeout=120,
                           collective_timeout=30)
    assert len(results) == PROGRAMS
    failures = [f"#{i} {signature(r)} ({describe(programs[i])})"
                for i, r in sorted(results.items()) if r["status"] != "pass"]
    assert not failures, "\n".join(failures)


def test_programs_are_deterministic_per_seed():
    """Program i of a seed does not depend on how many programs are drawn."""
    assert generate(3, 17) == generate(3, 17)
    assert generate(3, 17) != generate(4, 17)
