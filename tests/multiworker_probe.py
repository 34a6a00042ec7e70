"""One worker process of a loopback cluster, run by tests/test_multiworker.py and
tests/test_multiworker_counts.py.

argv: the number of local devices, then the scenarios to run, in order. The cluster
comes from TF_CONFIG, the checkpoint prefix of "save" and "restore" from
MULTIWORKER_CHECKPOINT, the mesh shape from MULTIWORKER_MESH ("2,4" by default). The
scenarios run gt.functions on meshes spanning all workers, compare every result with
the same computation in plain TF on one device (float32, relative 1e-5), and the probe
prints one JSON line: {scenario: facts the test checks}.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gspmd_tf as gt  # noqa: E402

gt.configure_cpu_devices(int(sys.argv[1]))
cluster = gt.initialize_cluster()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from multiworker_values import checkpoint_values  # noqa: E402

from gspmd_tf.backends.collectives import barrier  # noqa: E402

P = gt.P
TOL = 1e-5
MESH_SHAPE = tuple(int(n) for n in os.environ.get("MULTIWORKER_MESH", "2,4").split(","))
mesh = gt.Mesh.create(MESH_SHAPE, ("data", "model"))
rng = np.random.default_rng(0)  # every worker draws the same global inputs


def check(name, got, want):
    """got (a ShardedTensor) equals want (numpy) to TOL; raises naming `name` if not."""
    got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    want = np.asarray(want)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    if got.shape != want.shape or not err <= TOL:
        raise AssertionError(f"{name}: shape {got.shape} vs {want.shape}, rel err {err}")
    return float(err)


def single_device(fn, *args):
    """fn on this worker's CPU:0 alone, as plain TF."""
    with tf.device(mesh.devices[mesh.addressable_ids[0]]):
        return tf.function(fn)(*args).numpy()


def programs():
    """Model + data split matmuls, an all-gather, an all-to-all and a halo convolution."""
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 16)).astype(np.float32)

    def ffn(x, w1, w2):
        return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    got = gt.function(ffn, mesh=mesh, in_shardings=(P("data"), P(None, "model"),
                                                    P("model")))(x, w1, w2)
    facts = {"ffn": check("ffn", got, single_device(ffn, x, w1, w2)),
             "addressable": sorted(got.addressable_shards)}

    def gram(x):
        return tf.matmul(x, x, transpose_b=True)
    got = gt.function(gram, mesh=mesh, in_shardings=(P(("data", "model")),),
                      out_shardings=(P(),))(x)
    facts["all_gather"] = check("all_gather", got, single_device(gram, x))

    def double(x):
        return x * 2.0
    f = gt.function(double, mesh=mesh, in_shardings=(P(None, "model"),),
                    out_shardings=(P("model"),))
    facts["all_to_all_ops"] = [c.kind for c in f.lower(x).collectives()]
    facts["all_to_all"] = check("all_to_all", f(x), single_device(double, x))

    image = rng.standard_normal((2, 16, 8, 3)).astype(np.float32)
    kernel = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)

    def conv(image, kernel):
        return tf.nn.conv2d(image, kernel, 1, "SAME")
    f = gt.function(conv, mesh=mesh, in_shardings=(P("data", "model"), P()))
    facts["conv_ops"] = sorted({c.kind for c in f.lower(image, kernel).collectives()})
    facts["conv"] = check("conv", f(image, kernel), single_device(conv, image, kernel))

    # a variable of this mesh read by a gt.function on another mesh (from copies)
    weights = gt.Variable(w1, mesh, P(None, "model"))
    other = gt.Mesh.create(MESH_SHAPE[::-1], ("a", "b"))
    got = gt.function(lambda x: tf.matmul(x, weights), mesh=other,
                      in_shardings=(P("a"),))(x)
    facts["other_mesh"] = check("other_mesh", got, x @ w1)
    return facts


def training():
    """Three SGD steps of a model- and data-split two-layer net on gt.Variables."""
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 16)).astype(np.float32)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((32, 16)).astype(np.float32) * 0.3

    def make_step(v1, v2):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.matmul(tf.tanh(tf.matmul(x, v1)), v2) - y) ** 2)
            g1, g2 = tape.gradient(loss, [v1, v2])
            v1.assign_sub(0.1 * g1)
            v2.assign_sub(0.1 * g2)
            return loss
        return step

    with tf.device(mesh.devices[mesh.addressable_ids[0]]):
        r1, r2 = tf.Variable(w1), tf.Variable(w2)
        reference = tf.function(make_step(r1, r2))
        want = [reference(x, y).numpy() for _ in range(3)]
    v1 = gt.Variable(w1, mesh, P(None, "model"), name="w1")
    v2 = gt.Variable(w2, mesh, P("model"), name="w2")
    step = gt.function(make_step(v1, v2), mesh=mesh, in_shardings=(P("data"), P("data")))
    got = [step(x, y) for _ in range(3)]
    held = [v1.shard_variables[d] is not None for d in range(mesh.size)]
    return {"losses": [check(f"loss {i}", g, w) for i, (g, w) in enumerate(zip(got, want))],
            "w1": check("w1", v1.numpy(), r1.numpy()), "w2": check("w2", v2, r2.numpy()),
            "held": held}


def save():
    """gt.Variables split several ways and a plain counter, saved by every worker."""
    values = checkpoint_values()
    variables = {"split": gt.Variable(values["split"], mesh, P("data", "model")),
                 "rows": gt.Variable(values["rows"], mesh, P(("data", "model"))),
                 "replicated": gt.Variable(values["replicated"], mesh, P())}
    checkpoint = tf.train.Checkpoint(step=tf.Variable(7, dtype=tf.int64), **variables)
    prefix = os.environ["MULTIWORKER_CHECKPOINT"]
    try:  # each worker would write its shards to the same files
        checkpoint.write(prefix + "_plain")
        plain_write = None
    except gt.ShardingError as e:
        plain_write = str(e)
    gt.save_checkpoint(checkpoint, prefix)
    held = sum(v is not None for v in variables["split"].shard_variables)
    return {"held": held, "saved": os.path.exists(prefix + ".index"),
            "plain_write": plain_write}


def restore():
    """The checkpoint of `save`, restored onto a mesh of the transposed shape ((4, 2) by
    default), other specs."""
    restored_mesh = gt.Mesh.create(MESH_SHAPE[::-1], ("a", "b"))
    values = checkpoint_values()
    variables = {"split": gt.Variable(np.zeros((8, 12), np.float32), restored_mesh,
                                      P("b", "a")),
                 "rows": gt.Variable(np.zeros((10, 3), np.float32), restored_mesh, P("a")),
                 "replicated": gt.Variable(np.zeros(5, np.float32), restored_mesh,
                                           P("a"))}
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(step=step, **variables)
    checkpoint.read(os.environ["MULTIWORKER_CHECKPOINT"]).assert_consumed()
    facts = {name: check(name, variables[name], values[name]) for name in values}
    return dict(facts, step=int(step.numpy()))


def keras_fit():
    """gt.keras.shard_model: one epoch of Adam on a Megatron-split MLP, against the same
    model fit on one device (the loss of every batch, then every weight and slot)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    def mlp():
        model = keras.Sequential([keras.Input((12,)),
                                  keras.layers.Dense(32, activation="relu", name="d1"),
                                  keras.layers.Dense(5, name="d2")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class BatchLosses(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.losses = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))

    keras.utils.set_random_seed(0)
    with tf.device(mesh.devices[mesh.addressable_ids[0]]):
        reference = mlp()
    sharded = mlp()
    sharded.set_weights(reference.get_weights())
    gt.keras.shard_model(sharded, mesh, {".*d1/kernel": P(None, "model"),
                                         ".*d2/kernel": P("model", None)})
    x = rng.standard_normal((24, 12)).astype(np.float32)
    y = rng.integers(0, 5, 24).astype(np.int32)
    losses = []
    for model in (reference, sharded):
        losses.append(BatchLosses())
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[losses[-1]])
    facts = {"losses": check("keras losses", losses[1].losses, losses[0].losses)}
    for want, got in zip(reference.variables + reference.optimizer.variables,
                         sharded.variables + sharded.optimizer.variables):
        facts[got.path] = check(got.path, got.numpy(), want.numpy())
    facts["sharded"] = isinstance(sharded.get_layer("d1").kernel._value, gt.Variable)
    return facts


def dead_peer():
    """Worker MULTIWORKER_DEAD_TASK (default: the last) leaves; the others run a program
    needing it, which must fail within the collective timeout."""
    # every worker past initialize_cluster first: the leader leaving while another is
    # still joining fails that one's start instead of its program
    barrier()
    if cluster.task_index == int(os.environ.get("MULTIWORKER_DEAD_TASK", "-1")) % \
            cluster.num_workers:
        time.sleep(1)  # the others' side of the barrier completes
        os._exit(0)
    x = np.ones((8, 16), np.float32)
    f = gt.function(lambda v: tf.reduce_sum(v), mesh=mesh, in_shardings=(P("data", "model"),))
    start = time.monotonic()
    try:
        f(x)
    except tf.errors.OpError as e:
        return {"error": type(e).__name__, "message": str(e)[:400],
                "seconds": time.monotonic() - start}
    return {"error": None}


def devices():
    """The mesh's device names in device id order, and the errors of a mesh one device
    larger than the cluster and of asking for one more local device once TF runs."""
    facts = {"devices": list(mesh.devices)}
    local = int(sys.argv[1])
    for fact, call in (("too_big", lambda: gt.Mesh.create((mesh.size + 1,), ("x",))),
                       ("one_more", lambda: gt.configure_cpu_devices(local + 1))):
        try:
            call()
            facts[fact] = None
        except gt.ShardingError as e:
            facts[fact] = str(e)
    return facts


SCENARIOS = {"devices": devices, "programs": programs, "training": training, "save": save,
             "restore": restore, "dead_peer": dead_peer, "keras_fit": keras_fit}

if __name__ == "__main__":
    results = {name: SCENARIOS[name]() for name in sys.argv[2:]}
    print(json.dumps(dict(results, task=cluster.task_index)), flush=True)
