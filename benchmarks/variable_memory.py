"""Peak memory of creating, saving and restoring a large gt.Variable, beside a tf.Variable.

    .venv/bin/python benchmarks/variable_memory.py --mib=1024 --mesh=2,4 --spec=data,model

Every (kind, phase) runs in a fresh subprocess on 8 logical CPU devices. The variable is
float32 of shape (--mib * 256, 1024), sharded by --spec over the --mesh (axes data,model)
for kind "gt", on one device for kind "plain". Phases:

  create   gt.Variable(init_fn, ...) with init_fn called per shard (plain: tf.Variable of
           a tf.fill value)
  save     tf.train.Checkpoint(w=v).save(...) of the created variable
  restore  tf.train.Checkpoint(w=v).restore(...) into the same variable (still holding
           its value), from the checkpoint the subprocess saved first

Reported per phase: the rise of peak RSS (VmHWM, reset through /proc/self/clear_refs
right before the phase) over RSS just before it, and the rise of RSS that stays after
it, in MiB. A phase that streams shards raises the peak by about one shard (or one copy
of the restored slices, as TF's RestoreV2 reads all of a process's slices in one op).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

MIB = flags.DEFINE_integer("mib", 1024, "size of the variable in MiB (float32)")
MESH = flags.DEFINE_string("mesh", "2,4", "mesh shape, axes data,model")
SPEC = flags.DEFINE_string("spec", "data,model", "the variable's spec: one mesh axis or "
                           "'none' per dim")
KINDS = flags.DEFINE_list("kinds", ["gt", "plain"], "gt and/or plain")
PHASES = flags.DEFINE_list("phases", ["create", "save", "restore"], "phases to measure")
CHILD = flags.DEFINE_string("child", None, "internal: run one 'kind:phase' and print JSON")


def _status_mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Peak:
    """Rise of peak and of resident memory over the block it wraps, in MiB."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
        self.before = _status_mib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = _status_mib("VmHWM") - self.before
        self.kept = _status_mib("VmRSS") - self.before


def _run_child(kind, phase):
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    import tensorflow as tf

    shape = (MIB.value * 256, 1024)
    mesh = gt.Mesh.create(tuple(int(s) for s in MESH.value.split(",")), ("data", "model"))
    spec = gt.P(*[None if a == "none" else a for a in SPEC.value.split(",")])

    def create():
        if kind == "gt":
            return gt.Variable(lambda s, d: tf.fill(s, tf.constant(1.0, d)), mesh, spec,
                               shape=shape, name="w")
        with tf.device("/device:CPU:0"):
            return tf.Variable(tf.fill(shape, 1.0), name="w")

    if phase == "create":
        with _Peak() as measured:
            variable = create()
    else:
        variable = create()
        with tempfile.TemporaryDirectory() as directory:
            prefix = os.path.join(directory, "ckpt")
            if phase == "save":
                with _Peak() as measured:
                    tf.train.Checkpoint(w=variable).save(prefix)
            else:
                path = tf.train.Checkpoint(w=variable).save(prefix)
                with _Peak() as measured:
                    tf.train.Checkpoint(w=variable).restore(path).assert_consumed()
    print(json.dumps({"peak": measured.peak, "kept": measured.kept}))


def _measure(kind, phase):
    args = [sys.executable, os.path.abspath(__file__), f"--child={kind}:{phase}",
            f"--mib={MIB.value}", f"--mesh={MESH.value}", f"--spec={SPEC.value}"]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv):
    del argv
    if CHILD.value:
        _run_child(*CHILD.value.split(":"))
        return
    print(f"variable {MIB.value} MiB float32, mesh {MESH.value}, spec {SPEC.value}")
    print(f"{'kind':6s} {'phase':8s} {'peak +MiB':>10s} {'kept +MiB':>10s}")
    for kind in KINDS.value:
        for phase in PHASES.value:
            result = _measure(kind, phase)
            print(f"{kind:6s} {phase:8s} {result['peak']:10.0f} {result['kept']:10.0f}",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
