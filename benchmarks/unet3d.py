"""A small 3-D U-Net (the GSPMD paper's spatially partitioned model) and the collectives
gspmd-tf emits for one training step's loss and gradients on a 2x2x2 spatial split.

    .venv/bin/python benchmarks/unet3d.py [--size=8] [--upsample=transpose]

Prints each collective of the step (kind, local shape, bytes per device) and the totals
by kind; benchmarks/xla_unet3d.py prints XLA's for the same network (RESULTS.md).
The model is gspmd_tf/testing/unet3d_model.py; tests/test_unet3d.py checks its values
against single-device TF.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from gspmd_tf.testing.unet3d_model import NAMES, init, loss_and_grads  # noqa: E402

SIZE = flags.DEFINE_integer("size", 8, "spatial size of the input volume (D = H = W)")
UPSAMPLE = flags.DEFINE_enum("upsample", "transpose", ["transpose", "repeat"],
                             "upsampling: Conv3DTranspose or voxel repeats")


def main(argv):
    del argv
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    mesh = gt.Mesh.create((2, 2, 2), ("a", "b", "c"))
    weights, x, target = init(np.random.default_rng(0), SIZE.value)
    spatial = gt.P(None, "a", "b", "c")
    step = gt.function(loss_and_grads(UPSAMPLE.value), mesh=mesh,
                       in_shardings=(spatial, spatial) + (gt.P(),) * len(NAMES))
    totals = {}
    for c in step.lower(x, target, *[weights[n] for n in NAMES]).collectives():
        nbytes = int(np.prod(c.shape)) * 4
        totals[c.kind] = totals.get(c.kind, 0) + nbytes
        print(f"{c.kind:20s} {str(c.shape):22s} {nbytes:8d}")
    for kind, nbytes in sorted(totals.items()):
        print(f"total {kind}: {nbytes} bytes per device")


if __name__ == "__main__":
    app.run(main)
