"""The local backend's build and first execution with the program's own ordering against
tf.function's automatic control dependencies (ACD), with and without the all-reduce
combiner: one process, the same lowered FFN train step (benchmarks/train_step.py's
model and flags), the four variants built and run alternately --rounds times.

    .venv/bin/python benchmarks/own_order.py --layers=64 --d_model=64 --d_ff=256 \\
        --batch=2 --seq=8 --rounds=3

Variants: "own order" (backends/ordering.py, the default) or "ACD" (the lowering with
orders_state off, as before branch h/ownorder); "combined" (the program lowered with
GSPMD_TF_ALL_REDUCE_COMBINE_BYTES=262144, the combiner's default) or "not combined"
(the local backend's own choice for copy all-reduces). Each build traces a new
function, so each first execution instantiates it anew. Prints per variant the median
CPU and wall seconds of the build and of the first execution, the FunctionDef's nodes
and control inputs, and the median steady step (--steps per build).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import train_step  # noqa: E402  (defines the model's flags)

ROUNDS = flags.DEFINE_integer("rounds", 3, "builds of each variant (alternating)")
flags.FLAGS.set_default("steps", 3)


def _timed(fn):
    """(fn(), wall s, process CPU s)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv):
    del argv
    import gspmd_tf as gt
    shape = tuple(int(s) for s in train_step.MESH.value.split(","))
    gt.configure_cpu_devices(math.prod(shape))
    import tensorflow as tf
    from gspmd_tf.backends import emitter, local
    from gspmd_tf.runtime.variables import variable_of_handle
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    class AcdCompiled(local.CompiledProgram):
        def _lowering(self):
            lowering = emitter.DeviceEmitter(self.mesh, self.keys, order=self.order,
                                             copy_collectives=self.copy_collectives,
                                             replicated_once=self.replicated_once)
            lowering.orders_state = False  # tf.function's automatic control deps order it
            return lowering

    specs, values, x, target = train_step.make_problem(gt)
    mesh = gt.Mesh.create(shape, train_step.AXES)
    gvars = [{n: gt.Variable(layer[n], mesh, specs[n], name=f"{n}_{i}")
              for n in train_step.NAMES} for i, layer in enumerate(values)]
    programs = {}
    for combined in (True, False):
        if combined:
            os.environ["GSPMD_TF_ALL_REDUCE_COMBINE_BYTES"] = "262144"
        step = gt.function(train_step.make_step(tf, gvars, train_step.LR.value), mesh=mesh,
                           in_shardings=(gt.P("data"), gt.P("data")))
        lowered = step.lower(tf.TensorSpec(x.shape, tf.float32),
                             tf.TensorSpec(target.shape, tf.float32))
        os.environ.pop("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", None)
        args = [gt.ShardedTensor.from_value(v, mesh, s.to_layout(mesh, v.ndim))
                for v, s in zip((x, target), lowered.input_shardings)]
        # program inputs: the arguments' shards, then the variables' shard handles
        shards = [list(a.shards) for a in args] + [
            [v.handle for v in variable_of_handle(h).shard_variables]
            for h in lowered.graph.captures]
        programs["combined" if combined else "not combined"] = (lowered.program.graph,
                                                                 shards)
    backend = local.LocalBackend(mesh)
    rows = {}
    print(f"# layers={train_step.LAYERS.value} batch={train_step.BATCH.value} "
          f"seq={train_step.SEQ.value} d_model={train_step.D_MODEL.value} "
          f"d_ff={train_step.D_FF.value} mesh={shape}, TF {tf.__version__}, load average "
          f"at start {os.getloadavg()[0]:.2f}\n")
    for _ in range(ROUNDS.value):
        for combine in programs:
            program, shards = programs[combine]
            for order in ("own order", "ACD"):
                cls = local.CompiledProgram if order == "own order" else AcdCompiled
                run, build_wall, build_cpu = _timed(lambda: cls(
                    mesh, program, backend.settings.collective_timeout, "ffn",
                    copy_collectives=True, replicated_once=True))
                _, first_wall, first_cpu = _timed(lambda: run(shards))
                steps = [_timed(lambda: run(shards))[1] for _ in range(train_step.STEPS.value)]
                definition = run.function.definition
                control = sum(i.startswith("^") for n in definition.node_def for i in n.input)
                row = rows.setdefault((order, combine), [])
                row.append((build_cpu, build_wall, first_cpu, first_wall,
                            statistics.median(steps), len(definition.node_def), control,
                            len(program.nodes)))
                del run
    print("| variant | program nodes | FunctionDef nodes | control inputs | build CPU s "
          "(wall) | first execution CPU s (wall) | steady step wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (order, combine), runs in rows.items():
        med = [statistics.median(r[k] for r in runs) for k in range(5)]
        print(f"| {order}, {combine} | {runs[0][7]} | {runs[0][5]} | {runs[0][6]} | "
              f"{med[0]:.2f} ({med[1]:.2f}) | {med[2]:.2f} ({med[3]:.2f}) | {med[4]:.3f} |")
    print(f"\n{ROUNDS.value} builds of each, medians; load average at end "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
