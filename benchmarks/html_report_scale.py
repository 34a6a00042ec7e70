"""The HTML report of a GPT-2-like train step at scale, checked in a headless browser.

    .venv/bin/python benchmarks/html_report_scale.py --layers=12 --out=/tmp/report \
        [--chromium=chromium]

Builds an SGD step of a decoder of --layers blocks (layer norm, attention with
Megatron-style head-split weights, a GELU MLP; every block under its own name scope,
"gpt/block_K/attention" ...), lowers it on an abstract --mesh (nothing runs), and writes
report.html to --out: ops grouped by layer (collapsible), collectives marked at the ops
that need them, the per-device memory timeline. With Debian's chromium on PATH (or
--chromium) it also loads the page headless and saves a screenshot (screenshot.png)
and the DOM it built. Prints the op count, collectives, layers and the page size.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import tensorflow as tf  # noqa: E402

import gspmd_tf as gt  # noqa: E402

LAYERS = flags.DEFINE_integer("layers", 12, "decoder blocks")
WIDTH = flags.DEFINE_integer("width", 64, "model width (heads of 16)")
SEQ = flags.DEFINE_integer("seq", 32, "sequence length")
BATCH = flags.DEFINE_integer("batch", 8, "batch size")
MESH = flags.DEFINE_string("mesh", "2x4", "abstract mesh data x model")
OUT = flags.DEFINE_string("out", "/tmp/gspmd_tf_html_report", "output directory")
CHROMIUM = flags.DEFINE_string("chromium", "chromium", "headless browser binary")


def _norm(h):
    mean = tf.reduce_mean(h, axis=-1, keepdims=True)
    var = tf.reduce_mean(tf.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * tf.math.rsqrt(var + 1e-5)


def _block(h, qkv, out, up, down):
    batch, seq, width = h.shape
    heads = width // 16
    with tf.name_scope("attention"):
        q, k, v = tf.split(tf.einsum("bsd,de->bse", _norm(h), qkv), 3, axis=-1)
        q, k, v = (tf.reshape(t, (batch, seq, heads, 16)) for t in (q, k, v))
        scores = tf.nn.softmax(tf.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, axis=-1)
        att = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", scores, v), (batch, seq, width))
        h = h + tf.einsum("bsd,de->bse", att, out)
    with tf.name_scope("mlp"):
        hidden = tf.nn.gelu(tf.einsum("bsd,df->bsf", _norm(h), up))
        return h + tf.einsum("bsf,fd->bsd", hidden, down)


def _step(x, *weights):
    with tf.GradientTape() as tape:
        tape.watch(weights)
        h = x
        with tf.name_scope("gpt"):
            for k in range(len(weights) // 4):
                with tf.name_scope(f"block_{k}"):
                    h = _block(h, *weights[4 * k:4 * k + 4])
        loss = tf.reduce_mean(tf.square(h))
    grads = tape.gradient(loss, weights)
    return [w - 0.01 * g for w, g in zip(weights, grads)]


def main(argv):
    del argv
    data, model = (int(n) for n in MESH.value.split("x"))
    mesh = gt.Mesh.abstract((data, model), ("data", "model"))
    width, P = WIDTH.value, gt.P
    shapes = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]
    specs = [P(None, "model"), P("model"), P(None, "model"), P("model")]
    args = [tf.TensorSpec((BATCH.value, SEQ.value, width))]
    args += [tf.TensorSpec(s) for _ in range(LAYERS.value) for s in shapes]
    low = gt.lower(_step, mesh, [P("data")] + specs * LAYERS.value, args=args)
    os.makedirs(OUT.value, exist_ok=True)
    page = os.path.join(OUT.value, "report.html")
    low.report(format="html", path=page)
    print(f"{len(low.graph.nodes)} ops, {len(low.collectives())} collectives, "
          f"{len(low.layers())} layers; {page}: {os.path.getsize(page)} bytes")
    browser = shutil.which(CHROMIUM.value)
    if browser is None:
        print(f"no {CHROMIUM.value} on PATH: no screenshot (apt-get install chromium)")
        return
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--disable-background-networking", "--disable-component-update",
              "--disable-sync", f"--user-data-dir={os.path.join(OUT.value, 'profile')}"]
    uri = "file://" + os.path.abspath(page)
    dom = subprocess.run(common + ["--dump-dom", uri], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    with open(os.path.join(OUT.value, "dom.html"), "w", encoding="utf-8") as f:
        f.write(dom)
    shot = os.path.join(OUT.value, "screenshot.png")
    subprocess.run(common + [f"--screenshot={shot}", "--window-size=1400,1800", uri],
                   capture_output=True, timeout=300, check=True)
    print(f"browser built {dom.count('<details')} layer sections; screenshot {shot} "
          f"({os.path.getsize(shot)} bytes)")


if __name__ == "__main__":
    app.run(main)
