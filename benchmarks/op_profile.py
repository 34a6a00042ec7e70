"""Helpers of the step profiles (benchmarks/step_profile.py, resnet_step.py
--trace_steps): steps timed as wall and CPU time, and per op type the kernels of a
traced step from TF's profiler."""

import collections
import glob
import os
import re
import statistics
import tempfile
import time

# a kernel's trace event: "node name:op type"
_KERNEL = re.compile(r"[^:\s]+:[A-Za-z_][A-Za-z0-9_]*")


def time_steps(runs, repeats):
    """Wall and process-CPU seconds of `repeats` calls of each run, alternating."""
    wall, cpu = [[] for _ in runs], [[] for _ in runs]
    for _ in range(repeats):
        for k, run in enumerate(runs):
            w, c = time.perf_counter(), time.process_time()
            run()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return wall, cpu


def print_times(names, wall, cpu):
    """The table of time_steps' results, ratios to the first system's medians."""
    print("| system | median wall ms | ratio | median CPU ms | ratio | paired wall ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, name in enumerate(names):
        paired = statistics.median(w / s for w, s in zip(wall[k], wall[0]))
        print(f"| {name} | {statistics.median(wall[k]) * 1e3:.2f} "
              f"| {statistics.median(wall[k]) / statistics.median(wall[0]):.2f} "
              f"| {statistics.median(cpu[k]) * 1e3:.2f} "
              f"| {statistics.median(cpu[k]) / statistics.median(cpu[0]):.2f} "
              f"| {paired:.2f} |")


def op_table(tf, run, steps):
    """{op type: (kernels per step, summed kernel ms per step)} of `steps` traced calls
    of run, with "(executor outside kernels)" for the executor's own time."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            run()
        tf.profiler.experimental.stop()
        path, = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        with open(path, "rb") as f:
            space = xplane_pb2.XSpace.FromString(f.read())
    count, ps = collections.Counter(), collections.Counter()
    executor = 0
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                name = names[event.metadata_id]
                if name == "ExecutorState::Process":
                    executor += event.duration_ps
                elif _KERNEL.fullmatch(name):  # a kernel: "node name:op type"
                    op = name.rsplit(":", 1)[1]
                    count[op] += 1
                    ps[op] += event.duration_ps
    table = {op: (count[op] / steps, ps[op] / steps / 1e9) for op in count}
    table["(executor outside kernels)"] = (0, (executor - sum(ps.values())) / steps / 1e9)
    return table


def print_op_table(tables, top):
    """Per op type (the `top` largest by kernel time), each system's kernels per step and ms."""
    names = list(tables)
    ops = sorted({op for t in tables.values() for op in t},
                 key=lambda op: -max(t.get(op, (0, 0))[1] for t in tables.values()))
    print("| op type | " + " | ".join(f"{n} kernels | {n} ms" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for op in ops[:top] + ["(total)"]:
        cells = []
        for name in names:
            if op == "(total)":
                kernels = sum(c for o, (c, _) in tables[name].items())
                ms = sum(m for o, (_, m) in tables[name].items()
                         if not o.startswith("(executor"))
            else:
                kernels, ms = tables[name].get(op, (0, 0))
            cells.append(f"{kernels:.0f} | {ms:.2f}")
        print(f"| {op} | " + " | ".join(cells) + " |")
    print()
