"""One output of one fuzzer program: TF's, gspmd-tf's and the float64 program's value,
and the magnitude of the terms it sums (the accuracy rule's scale, gspmd_tf/testing/accuracy.py).

    .venv/bin/python benchmarks/fuzz_cancellation.py --seed=24 --index=1489 --output=7

The program is drawn as benchmarks/fuzz.py draws it with its default flags. Prints, for
the output's element where gspmd-tf and TF differ most: the three values, the sum of the
magnitudes of the terms, and each error in units of float32's eps times that sum.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEED = flags.DEFINE_integer("seed", 24, "fuzzer run seed")
INDEX = flags.DEFINE_integer("index", 1489, "program index in that run")
OUTPUT = flags.DEFINE_integer("output", 7, "output of the program to analyse")


def main(argv):
    del argv
    import numpy as np

    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    import tensorflow as tf

    from gspmd_tf.testing.accuracy import summed_magnitude
    from gspmd_tf.testing.differential import as_float64, program_scope
    from gspmd_tf.testing.generator import generate
    from gspmd_tf.testing.program_text import source

    k = OUTPUT.value
    text = source(generate(SEED.value, INDEX.value))
    with tf.device("/device:CPU:0"):
        scope = program_scope(text, False, tf, gt)
        want = np.asarray(scope["f"](*[tf.convert_to_tensor(a) for a in scope["args"]])[k])
        scope = program_scope(as_float64(text), False, tf, gt)
        args = [tf.convert_to_tensor(a) for a in scope["args"]]
        exact = np.asarray(scope["f"](*args)[k])
        terms = tf.function(lambda *a: summed_magnitude(tf, tf.convert_to_tensor(
            scope["f"](*a)[k])), autograph=False)(*args).numpy()
    scope = program_scope(text, True, tf, gt)
    got = gt.function(scope["f"], mesh=scope["mesh"], in_shardings=scope["in_shardings"],
                      out_shardings=scope["out_shardings"])(*scope["args"])[k].numpy()
    g, w = got.astype(np.float64), want.astype(np.float64)
    at = np.unravel_index(np.argmax(np.abs(g - w)), w.shape)
    eps = np.finfo(want.dtype).eps * terms[at]
    print(f"seed {SEED.value} #{INDEX.value} output {k} {want.shape} {want.dtype}, at {at}:")
    print(f"  TF {w[at]:.7g}  gspmd-tf {g[at]:.7g}  float64 program {exact[at]:.7g}")
    print(f"  sum of |terms| {terms[at]:.7g}; error / (eps * sum|terms|): "
          f"TF {abs(w[at] - exact[at]) / eps:.2f}, gspmd-tf {abs(g[at] - exact[at]) / eps:.2f}")


if __name__ == "__main__":
    app.run(main)
