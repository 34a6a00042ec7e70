"""XLA's SPMD overhead on the feed-forward training step of lowering_time.py --model=ffn_train.

NEEDS JAX (not a dependency of gspmd-tf; see xla_reference.py for the separate venv):

    /work/jaxref/bin/python benchmarks/xla_lowering_time.py --layers=256 --batch=16 \
        --seq=128 --d_model=512 --d_ff=2048 --repeats=5

The program is the one benchmarks/lowering_time.py builds with --model=ffn_train, written
in JAX: per layer x -> relu(x @ W1 + b1) @ W2 + b2 + x, loss = mean((out - target)^2),
one SGD step returning (loss, new weights). Megatron shardings on a 2x4 mesh ("data",
"model") of host CPU devices: x and target P("data"), W1 P(None, "model"), b1 P("model"),
W2 P("model"), b2 replicated; the new weights keep their weights' shardings, the loss is
replicated. Nothing is allocated: arguments are jax.ShapeDtypeStructs.

Timed, per repeat, on a fresh function object (so no JAX cache is hit):
  sharded    jax.jit(step, in_shardings, out_shardings).lower(*args).compile()
  unsharded  jax.jit(step).lower(*args).compile()   (one device)
The two alternate; XLA's SPMD overhead is median(sharded) - median(unsharded): sharding
propagation, the SPMD partitioner and what the partitioned program adds to compiling.
Tracing and lowering to StableHLO are in both and cancel.
"""

import os
import platform
import statistics
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ffn_flags  # noqa: E402

LAYERS = flags.DEFINE_integer("layers", 256, "feed-forward blocks")
BATCH, SEQ, D_MODEL, D_FF, REPEATS = ffn_flags.define_sizes(batch=16, d_model=512, d_ff=2048)
WEIGHT_SPECS = tuple(P(*s) for s in ffn_flags.WEIGHT_SPECS)  # w1, b1, w2, b2


def make_step(layers):
    """A new train-step function (a new object each call, so JAX caches miss)."""
    def step(x, target, *weights):
        def loss_fn(weights):
            h = x
            for i in range(layers):
                w1, b1, w2, b2 = weights[4 * i:4 * i + 4]
                hidden = jax.nn.relu(jnp.einsum("bsd,df->bsf", h, w1) + b1)
                h = jnp.einsum("bsf,fd->bsd", hidden, w2) + b2 + h
            return jnp.mean(jnp.square(h - target))
        loss, grads = jax.value_and_grad(loss_fn)(list(weights))
        return (loss,) + tuple(w - ffn_flags.LR * g for w, g in zip(weights, grads))
    return step


def arguments(layers, batch, seq, d, f):
    """ShapeDtypeStructs of (x, target, w1, b1, w2, b2, ...)."""
    f32 = jnp.float32
    act = jax.ShapeDtypeStruct((batch, seq, d), f32)
    per_layer = [jax.ShapeDtypeStruct(s, f32) for s in ((d, f), (f,), (f, d), (d,))]
    return [act, act] + per_layer * layers


def compile_seconds(args, shardings):
    """(wall, process CPU) seconds to lower and compile a fresh step (sharded if
    `shardings` is given)."""
    step = make_step(LAYERS.value)
    if shardings is None:
        jitted = jax.jit(step)
    else:
        jitted = jax.jit(step, in_shardings=tuple(shardings[0]),
                         out_shardings=tuple(shardings[1]))
    start, cpu = time.perf_counter(), time.process_time()
    jitted.lower(*args).compile()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv):
    del argv
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    layers = LAYERS.value
    ins = [named(P("data")), named(P("data"))] + [named(s) for s in WEIGHT_SPECS] * layers
    outs = [named(P())] + [named(s) for s in WEIGHT_SPECS] * layers
    args = arguments(layers, BATCH.value, SEQ.value, D_MODEL.value, D_FF.value)
    print(f"# XLA's SPMD overhead (jax {jax.__version__}, jaxlib backend "
          f"{jax.default_backend()})\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; load average at start "
          f"{os.getloadavg()[0]:.2f}; layers={layers} batch={BATCH.value} seq={SEQ.value} "
          f"d_model={D_MODEL.value} d_ff={D_FF.value} mesh 2x4; median of "
          f"{REPEATS.value} repeats after one warm-up each\n")
    compile_seconds(args, (ins, outs))
    compile_seconds(args, None)
    sharded, unsharded = [], []
    for _ in range(REPEATS.value):
        sharded.append(compile_seconds(args, (ins, outs)))
        unsharded.append(compile_seconds(args, None))
    print("| variant | lower + compile s (median) | CPU s (median) | all repeats, wall s |")
    print("|---|---:|---:|---|")
    medians = {}
    for label, runs in (("sharded (2x4)", sharded), ("unsharded (1 device)", unsharded)):
        wall = statistics.median(t for t, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        medians[label] = wall, cpu
        print(f"| {label} | {wall:.3f} | {cpu:.3f} | {', '.join(f'{t:.2f}' for t, _ in runs)} |")
    (s, sc), (u, uc) = medians.values()
    print(f"\nXLA SPMD overhead (sharded - unsharded): {s - u:.3f} s wall, {sc - uc:.3f} s CPU")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
