"""Programs for checking the annotated global graph through XLA's SPMD partitioner.

    .venv/bin/python benchmarks/bridge_cases.py --out=/tmp/bridge \
        --scale_configs=128B-8x16,1T-16x32
    /work/jaxref/bin/python benchmarks/xla_spmd_check.py --cases=/tmp/bridge

The first command (TensorFlow, no JAX) lowers each case with gspmd-tf on a 2x4
("data", "model") mesh and writes, per case, into --out:
  NAME.hlo.pb   the HloModuleProto TF's XLA bridge makes of the annotated global graph
                (gt.Lowered.as_text("hlo") is its text), parameters carrying shardings
  NAME.npz      the inputs (in0, in1, ...) and the single-device TF outputs (out0, ...)
  NAME.json     input and output shardings (XLA text), the device count and gspmd-tf's
                own collectives (kind, bytes of one device's operand)
--scale_configs adds one layer of benchmarks/transformer_scale.py's training step at a
configuration's real shapes and mesh (HLO and JSON only: checked for bytes, not values),
twice: as gt.Lowered.as_text("hlo") makes it (tensors and the partitioner's operand
reshards annotated) and with the tensors' shardings only (NAME_tensors_only).
The second (JAX's XLA, test-only) compiles each module for 8 partitions with XLA's SPMD
partitioner, runs it on 8 XLA CPU devices, and compares values and collective bytes.
tests/test_tpu_bridge.py runs both on a temporary directory when GSPMD_TF_JAX_PYTHON names
JAX's python.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gspmd_tf.testing.bridge_cases import CASES, write_case, write_program  # noqa: E402


def write_scale_case(config, out_dir, layers=1):
    """benchmarks/transformer_scale.py's training step for `config` with `layers` layers
    at its real shapes on its mesh: the HLO and shardings only (no values: the check
    compiles it and compares collective bytes). Returns the Lowered."""
    import gspmd_tf as gt
    import tensorflow as tf
    import transformer_scale
    lowered = transformer_scale.lower_step(gt, tf, transformer_scale.CONFIGS[config], layers)
    name = f"scale_{config}_{layers}layer"
    write_program(lowered, name, out_dir)
    # the same with tensor shardings only: XLA chooses how to partition each op
    write_program(lowered, name + "_tensors_only", out_dir, operand_shardings=False)
    return lowered


def main(argv):
    del argv
    import logging
    from absl import flags
    logging.getLogger("gspmd_tf").setLevel(logging.WARNING)
    from gspmd_tf.devices import configure_cpu_devices
    configure_cpu_devices(8)  # before TF starts: the variable cases need 8 devices
    out = flags.FLAGS.out
    os.makedirs(out, exist_ok=True)
    names = list(CASES) if flags.FLAGS.case == "all" else flags.FLAGS.case.split(",")
    written = [(name, write_case(name, out)) for name in names if name]
    written += [(f"scale_{c}", write_scale_case(c, out)) for c in
                flags.FLAGS.scale_configs.split(",") if c]
    for name, lowered in written:
        total = sum(c.bytes for c in lowered.collectives())
        print(f"{name}: {len(lowered.collectives())} gspmd-tf collectives, {total} bytes "
              f"per device -> {out}")


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_string("out", "/tmp/bridge", "directory for the case files")
    flags.DEFINE_string("case", "all", "comma-separated case names, or 'all': "
                        + ", ".join(CASES))
    flags.DEFINE_string("scale_configs", "", "also write one layer of these "
                        "transformer_scale.py configs (HLO only, checked for bytes)")
    app.run(main)
