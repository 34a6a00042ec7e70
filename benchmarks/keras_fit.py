"""Keras fit on the mesh vs single-device Keras fit, in one process (issue 21, item 6).

    .venv/bin/python benchmarks/keras_fit.py --model=gpt2 --path=distribution --steps=10
    .venv/bin/python benchmarks/keras_fit.py --model=resnet50 --mesh=8,1 --batch=16
    .venv/bin/python benchmarks/keras_fit.py --model=mobilenetv2 --mesh=8,1 --image=64

Models (--model): gpt2 (keras_hub GPT2CausalLM built from --layers/--d_model/--heads/
--vocab/--seq, Megatron layout: attention heads and the MLP's inner dim over "model"),
resnet50 and mobilenetv2 (keras.applications, weights=None, --image pixels square,
--classes outputs; data parallel: every variable replicated). Both runs build the model
from the same seed and start from the same weights.

How the mesh run is set up (--path):
  distribution  Keras' own API, as a JAX script writes it: keras.distribution
                ModelParallel(layout_map=..., batch_dim_name="batch") on a DeviceMesh
                ("batch", "model") of --mesh, the model built under it (gspmd-tf is
                the TF backend of keras.distribution after `import gspmd_tf`)
  shard_model   gt.keras.shard_model(model, mesh, layout_map, batch_spec=P("batch"))
Each run's first fit call (one step: build, trace, lower, first step) and then --steps
steps (fit over that many batches, after a --warmup fit) are timed; the table gives the
mesh's time over single-device Keras's for both, in wall seconds and in the process's CPU
seconds (all threads; steadier than wall time on a shared, loaded machine). The CPU of a
step is also given per thread (Linux): on a quiet machine a step whose wall time equals
its CPU time with one thread doing nearly all of it ran on one core. The logical
devices share the host's cores, so the ratio is the overhead of running on the mesh, not
a speed-up.

Equality: the first fit call (one step from the same weights) must give the loss and
the weight update of single-device Keras: the step's loss to relative error --rtol, and
every weight to --rtol of the step's largest update (the update, not the weight, is what
the step computes; a weight the step barely moves, such as an attention key bias whose
gradient is zero up to rounding, is judged on that scale too). The benchmark fails
otherwise. Later steps are not compared: a few steps of SGD amplify rounding differently
in each run (batch norm over a few samples, especially).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from gspmd_tf.testing.keras_layouts import gpt2_megatron_layout_map  # noqa: E402

MODEL = flags.DEFINE_enum("model", "gpt2", ["gpt2", "resnet50", "mobilenetv2"], "model")
PATH = flags.DEFINE_enum("path", "distribution", ["distribution", "shard_model"],
                         "how the mesh run is set up")
MESH = flags.DEFINE_string("mesh", "2,4", "mesh shape batch,model")
BATCH = flags.DEFINE_integer("batch", 16, "global batch size")
STEPS = flags.DEFINE_integer("steps", 10, "timed steps of each run")
WARMUP = flags.DEFINE_integer("warmup", 2, "untimed steps of each run first")
LAYERS = flags.DEFINE_integer("layers", 2, "gpt2: transformer layers")
D_MODEL = flags.DEFINE_integer("d_model", 256, "gpt2: model width")
HEADS = flags.DEFINE_integer("heads", 4, "gpt2: attention heads")
VOCAB = flags.DEFINE_integer("vocab", 1024, "gpt2: vocabulary size")
SEQ = flags.DEFINE_integer("seq", 128, "gpt2: sequence length")
IMAGE = flags.DEFINE_integer("image", 64, "resnet50/mobilenetv2: image side in pixels")
CLASSES = flags.DEFINE_integer("classes", 10, "resnet50/mobilenetv2: classes")
FLOATX = flags.DEFINE_enum("floatx", "float32", ["float32", "float64"], "Keras' float type "
                           "(float64: whether a difference is float32 rounding shows as "
                           "a difference that shrinks by ~1e9)")
RTOL = flags.DEFINE_float("rtol", 1e-4, "largest relative error of a weight after the first "
                          "fit step (float32; the steps differ in summation order)")


def _model():
    import keras
    keras.config.set_floatx(FLOATX.value)
    if MODEL.value == "gpt2":
        import keras_hub
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB.value, num_layers=LAYERS.value, num_heads=HEADS.value,
            hidden_dim=D_MODEL.value, intermediate_dim=4 * D_MODEL.value, dropout=0.0,
            max_sequence_length=SEQ.value)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        application = {"resnet50": keras.applications.ResNet50,
                       "mobilenetv2": keras.applications.MobileNetV2}[MODEL.value]
        model = application(weights=None, input_shape=(IMAGE.value, IMAGE.value, 3),
                            classes=CLASSES.value)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=MODEL.value == "gpt2"), jit_compile=False)
    return model


def _layout_map(device_mesh):
    """Megatron's split of GPT-2; the image models are data parallel (an empty map)."""
    import keras
    if MODEL.value == "gpt2":
        return gpt2_megatron_layout_map(device_mesh)
    return keras.distribution.LayoutMap(device_mesh)


def _data(steps):
    rng = np.random.default_rng(0)
    n = BATCH.value * steps
    if MODEL.value == "gpt2":
        x = {"token_ids": rng.integers(0, VOCAB.value, (n, SEQ.value)).astype(np.int32),
             "padding_mask": np.ones((n, SEQ.value), np.int32)}
        return x, rng.integers(0, VOCAB.value, (n, SEQ.value)).astype(np.int32)
    x = rng.standard_normal((n, IMAGE.value, IMAGE.value, 3)).astype(FLOATX.value)
    return x, rng.integers(0, CLASSES.value, n).astype(np.int32)


def _thread_cpu():
    """{thread id: CPU seconds} of this process's threads (Linux /proc; {} elsewhere)."""
    seconds = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return seconds
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[tid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return seconds


def _timed_fit(model, steps):
    """(wall seconds, CPU seconds, last loss, CPU seconds of each thread that worked,
    largest first) of one fit over `steps` batches."""
    x, y = _data(steps)
    threads = _thread_cpu()
    start, cpu = time.perf_counter(), time.process_time()
    history = model.fit(x, y, batch_size=BATCH.value, epochs=1, shuffle=False, verbose=0)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = _thread_cpu()
    busy = sorted((after[t] - threads.get(t, 0.0) for t in after), reverse=True)
    return wall, cpu, history.history["loss"][-1], [s for s in busy if s >= 0.01 * cpu]


def _run(model, scope):
    """{"first": (wall s, CPU s) of the first fit call, "step": per step, "first_loss",
    "weights" after the first step, "loss" of the last step}."""
    with scope:
        initial = model.get_weights()
        first_wall, first_cpu, first_loss, _ = _timed_fit(model, 1)
        weights = model.get_weights()
        if WARMUP.value:
            _timed_fit(model, WARMUP.value)
        wall, cpu, loss, threads = _timed_fit(model, STEPS.value)
    return {"first": (first_wall, first_cpu), "first_loss": first_loss,
            "initial": initial, "weights": weights,
            "step": (wall / STEPS.value, cpu / STEPS.value), "loss": loss,
            "threads": [s / STEPS.value for s in threads]}


def _update_error(initial, mesh_weights, single_weights):
    """(largest |mesh - single| of a weight after the step over the largest |update| of
    the single-device step, index of the weight where it is largest)."""
    def largest(a):
        return float(np.max(np.abs(a))) if np.size(a) else 0.0
    update = max(largest(np.asarray(b, np.float64) - w)
                 for w, b in zip(initial, single_weights))
    diffs = [largest(np.asarray(a, np.float64) - b)
             for a, b in zip(mesh_weights, single_weights)]
    worst = int(np.argmax(diffs))
    return (diffs[worst] / update if update else diffs[worst]), worst


def main(argv):
    del argv
    import contextlib

    import gspmd_tf as gt
    shape = tuple(int(n) for n in MESH.value.split(","))
    gt.configure_cpu_devices(int(np.prod(shape)))
    import keras
    kd = keras.distribution
    keras.utils.set_random_seed(0)
    single = _model()
    device_mesh = kd.DeviceMesh(shape, ("batch", "model"), devices=kd.list_devices())
    if PATH.value == "distribution":
        distribution = kd.ModelParallel(layout_map=_layout_map(device_mesh),
                                        batch_dim_name="batch")
        with distribution.scope():
            mesh_model = _model()
        scope = distribution.scope()
    else:
        mesh_model = _model()
        scope = contextlib.nullcontext()
    mesh_model.set_weights(single.get_weights())
    if PATH.value == "shard_model":
        gt.keras.shard_model(mesh_model, layout_map=_layout_map(device_mesh),
                             batch_spec=gt.P("batch"))
    single_run = _run(single, contextlib.nullcontext())
    mesh_run = _run(mesh_model, scope)
    print(f"{MODEL.value} on mesh {shape} ({PATH.value}), batch {BATCH.value}, "
          f"{STEPS.value} steps; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':14}{'first fit s':>12}{'(cpu s)':>9}{'step s':>10}{'(cpu s)':>9}"
          f"{'step-1 loss':>13}{'last loss':>12}")
    for name, run in (("single", single_run), ("mesh", mesh_run)):
        print(f"{name:14}{run['first'][0]:12.3f}{run['first'][1]:9.2f}{run['step'][0]:10.4f}"
              f"{run['step'][1]:9.3f}{run['first_loss']:13.6f}{run['loss']:12.5f}")
    for name, run in (("single", single_run), ("mesh", mesh_run)):
        # how many cores a step kept busy: one thread doing most of the CPU means the
        # step ran serially, whatever the load
        print(f"{name} step CPU s by thread (>= 1% of it): "
              + " ".join(f"{s:.3f}" for s in run["threads"]))
    print(f"{'mesh/single':14}" + "".join(
        f"{mesh_run[k][i] / single_run[k][i]:{w}.2f}"
        for k, i, w in (("first", 0, 12), ("first", 1, 9), ("step", 0, 10), ("step", 1, 9))))
    error, worst = _update_error(single_run["initial"], mesh_run["weights"],
                                 single_run["weights"])
    loss_error = abs(mesh_run["first_loss"] - single_run["first_loss"]) / \
        abs(single_run["first_loss"])
    print(f"equality after the first step: weights max error {error:.2e} of the largest "
          f"update (at {single.weights[worst].path}), loss rel. error {loss_error:.2e} "
          f"(rtol {RTOL.value:g})")
    if max(error, loss_error) > RTOL.value:
        raise SystemExit(f"mesh fit differs from single-device Keras fit beyond rtol "
                         f"{RTOL.value:g}")


if __name__ == "__main__":
    app.run(main)
