"""A differential-testing kit for gspmd-tf: what the test suite and the benchmark scripts
share (nothing here is part of the partitioner; the library never imports it).

The random-program fuzzer, in the order data flows through it:
  program_space     meshes, dims, dtypes, op families; the generator's Tensor record
  generator         generate(seed, index): one random program (plain JSON-able data);
                    its op families are the mixins array_ops, compute_ops,
                    control_flow_ops
  program_text      source(program) (the Python text a worker executes), snippet,
                    describe
  differential      the worker process: runs a program on one device and partitioned
                    (python -m gspmd_tf.testing.differential) and compares them by
  accuracy          the comparison rules (tolerances, "as accurate as TF", shards)
  workers           the driver side: worker subprocesses, crash attribution, blame
  shrink            smaller variants of a failing program
benchmarks/fuzz.py is the command line over these.

Models and cases shared by tests and benchmarks: pipeline_model (a Transformer stack for
gt.pipeline), unet3d_model (a 3-D U-Net), bridge_cases (programs checked through XLA's
SPMD partitioner), collective_cases (reshard, dot and window cases compared with XLA),
keras_layouts (layout maps for keras_hub models that publish none).

The package's __init__ imports nothing: `import gspmd_tf.testing.X` loads X alone.
"""
