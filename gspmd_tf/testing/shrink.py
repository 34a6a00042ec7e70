"""Shrinking a failing fuzzer program: smaller or simpler variants (drop ops and outputs,
cut the program at an op, turn intermediates into inputs, drop hints, out_shardings, NaNs
and spec entries, shrink the mesh) tried while the same failure remains."""

from __future__ import annotations

import copy
import json
import queue
import re
import threading

from gspmd_tf.testing.program_space import FLOATS
from gspmd_tf.testing.workers import Worker

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
    """The program with only `outputs` kept (and what they need)."""
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
