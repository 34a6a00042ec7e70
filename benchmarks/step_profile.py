"""Where the steady step goes: the LM training step of benchmarks/step_time.py on the
local backend against single-device TF, op type by op type.

    .venv/bin/python benchmarks/step_profile.py --meshes=8,1 --train \
        --backends=local,local_each --repeats=20 --trace_steps=5

Takes step_time.py's flags (model, --meshes, --train, --backends, --repeats, --warmup)
and builds the same systems: "single" (tf.function on one device) and one gt.function per
backend of --backends (benchmarks/backend_names.py; local_each is the local backend
running every op on every device, replicated_once=False) and, on data-parallel meshes
(n,1), "shards": single-device TF's step on each device's batch in turn, the kernels of
the per-device program without its collectives or the multi-device executor. For each
mesh:
  1. the step timed, the systems alternating, as wall time and as this process's CPU
     time (on a machine shared with other jobs the CPU time varies less: it is what the
     step costs, whoever else runs);
  2. with --trace_steps=N, N steps of each system under TF's profiler
     (tf.profiler.experimental); from its trace, per op type: the kernels run per step
     (the executed program, after grappler) and their summed duration (summed over
     threads: kernels running at the same time on 2 cores each count their own wall
     time, unless --inter_op_threads=1 runs one kernel at a time), and the executor's
     time outside kernels.
"""

from __future__ import annotations

import os
import dataclasses
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

import op_profile  # noqa: E402
import step_time  # noqa: E402  (its flags: model, meshes, backends, repeats, warmup)
from gspmd_tf import demo  # noqa: E402

TRACE_STEPS = flags.DEFINE_integer("trace_steps", 0, "steps of each system traced by TF's "
                                   "profiler for the op table (0: no table)")
INTER_OP = flags.DEFINE_integer("inter_op_threads", 0, "TF's inter-op threads (0: TF's "
                                "default); 1 runs one kernel at a time, so that the op "
                                "table's kernel times do not overlap")
SHARDS = flags.DEFINE_bool("shards", True, "on data-parallel meshes (n,1), also time "
                            "\"shards\": single-device TF's step on one device's batch "
                            "(batch / n), n times in a row: the per-device kernels alone")
TOP = flags.DEFINE_integer("top", 25, "op types shown in the op table (by the largest "
                           "kernel time of any system)")

def main(argv):
    del argv
    meshes = [tuple(int(x) for x in m.split(",")) for m in step_time.MESHES.value.split(";")
              if m]
    import gspmd_tf as gt
    gt.configure_cpu_devices(max(int(np.prod(m)) for m in meshes))
    import tensorflow as tf
    import logging
    if INTER_OP.value:
        tf.config.threading.set_inter_op_parallelism_threads(INTER_OP.value)
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    cfg = demo.ModelConfig(
        layers=step_time.LAYERS.value, d_model=step_time.D_MODEL.value,
        heads=step_time.HEADS.value, d_ff=step_time.D_FF.value, vocab=step_time.VOCAB.value,
        seq=step_time.SEQ.value, batch=step_time.BATCH.value)
    params, tokens = demo.init_params(cfg), demo.make_batch(cfg)
    cpu0 = tf.config.list_logical_devices("CPU")[0].name
    step = "Adam training step" if step_time.TRAIN.value else "forward step"
    print(f"# {step} profile: local backend vs single-device TF\n")
    print(f"{os.cpu_count()} cores, TF {tf.__version__}, load average at start "
          f"{os.getloadavg()[0]:.2f}; model {cfg}\n")
    for shape in meshes:
        mesh = gt.Mesh.create(shape, demo.AXES)
        systems = {"single": step_time.single_step(tf, cfg, params, tokens, cpu0, jit=False)}
        for backend in [b for b in step_time.BACKENDS.value.split(",") if b]:
            systems[backend] = step_time.sharded_step(gt, tf, cfg, mesh, backend, params,
                                                      tokens)
        if SHARDS.value and shape[1] == 1 and cfg.batch % shape[0] == 0:
            systems["shards"] = shards_step(tf, cfg, params, tokens, cpu0, shape[0])
        for run in systems.values():
            for _ in range(step_time.WARMUP.value):
                run()
        wall, cpu = op_profile.time_steps(list(systems.values()), step_time.REPEATS.value)
        print(f"## mesh {shape[0]}x{shape[1]}\n")
        op_profile.print_times(list(systems), wall, cpu)
        print(f"\n(load average {os.getloadavg()[0]:.2f})\n")
        if TRACE_STEPS.value:
            tables = {name: op_profile.op_table(tf, run, TRACE_STEPS.value)
                      for name, run in systems.items()}
            op_profile.print_op_table(tables, TOP.value)


def shards_step(tf, cfg, params, tokens, device, n):
    """run(): single-device TF's step on each of the n per-device batches in turn (their
    own variables, so that each starts from the same weights)."""
    per = cfg.batch // n
    runs = [step_time.single_step(tf, dataclasses.replace(cfg, batch=per), params,
                                  tokens[k * per:(k + 1) * per], device, jit=False)
            for k in range(n)]
    return lambda: [run() for run in runs][0]


if __name__ == "__main__":
    app.run(main)
