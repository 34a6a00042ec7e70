"""Runs the HLO that TF's XLA bridge makes of gspmd-tf's annotated global graph through
XLA's SPMD partitioner on 8 XLA CPU devices (JAX's jaxlib as the XLA client).

NEEDS JAX (test-only; not a dependency of gspmd-tf; see benchmarks/xla_reference.py for
the venv). Case files come from benchmarks/bridge_cases.py:

    .venv/bin/python benchmarks/bridge_cases.py --out=/tmp/bridge
    /work/jaxref/bin/python benchmarks/xla_spmd_check.py --cases=/tmp/bridge

Per case: the HloModuleProto is converted to StableHLO (jaxlib's hlo_to_stablehlo; the
parameters keep the shardings TF's bridge put on them), the results are given gspmd-tf's
output shardings, and the module is compiled with num_partitions = the case's device
count (8, or the mesh of a transformer_scale config) and use_spmd_partitioning (XLA's
GSPMD partitioner, not Shardy) for as many host CPU devices. Where the case has values
(NAME.npz), every input is fed as the shards its parameter sharding names; the outputs
are reassembled and compared with the single-device TF outputs (float32 relative error
1e-5 of the largest magnitude); scale cases are compiled only. The
collectives of the partitioned, optimized module are counted as
benchmarks/xla_collectives.py does (bytes of one device's operand) beside gspmd-tf's own
program's. Prints a markdown table; exits 1 if any case fails a check.
"""

import glob
import json
import os
import sys

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib import _jax, xla_client  # noqa: E402
from jax._src.sharding_impls import GSPMDSharding  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402

CASES = flags.DEFINE_string("cases", "/tmp/bridge", "directory written by bridge_cases.py")
RTOL = 1e-5


def stablehlo_with_result_shardings(hlo_proto, output_shardings):
    """The StableHLO text of an HloModuleProto, its entry results annotated."""
    bytecode = _jax.mlir.hlo_to_stablehlo(hlo_proto)
    with mlir.make_ir_context():
        module = ir.Module.parse(bytecode)
        main = next(op for op in module.body.operations
                    if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        main.attributes["res_attrs"] = ir.ArrayAttr.get([
            ir.DictAttr.get({"mhlo.sharding": ir.StringAttr.get(s)})
            for s in output_shardings])
        return str(module)


def compile_spmd(text, devices):
    """The module compiled for len(devices) partitions by XLA's GSPMD partitioner."""
    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_partitions = len(devices)
    build.num_replicas = 1
    build.use_spmd_partitioning = True
    build.use_shardy_partitioner = False
    build.device_assignment = xla_client.DeviceAssignment.create(
        np.arange(len(devices)).reshape(1, -1))
    options.num_partitions = len(devices)
    client = devices[0].client
    return client.compile_and_load(text, _jax.DeviceList(tuple(devices)), options)


def _sharding(text, devices):
    proto = xla_client.HloSharding.from_string(text).to_proto()
    return GSPMDSharding(devices, proto)


def check_case(path):
    """{name, rel_err (None without values), xla and gt collectives and bytes, devices,
    ok} of one case."""
    name = os.path.basename(path)[:-len(".hlo.pb")]
    base = path[:-len(".hlo.pb")]
    with open(base + ".json") as f:
        meta = json.load(f)
    from xla_collectives import collectives
    devices = jax.devices()[:meta.get("num_devices", 8)]
    with open(path, "rb") as f:
        text = stablehlo_with_result_shardings(f.read(), meta["output_shardings"])
    compiled = compile_spmd(text, devices)
    hlo = compiled.hlo_modules()[0].to_string()
    xla = [(kind, nbytes) for kind, nbytes, _ in collectives(hlo)]
    gt_bytes = sum(b for _, b in meta["gt_collectives"])
    xla_bytes = sum(b for _, b in xla)
    result = dict(name=name, rel_err=None, xla=xla, gt=meta["gt_collectives"],
                  xla_bytes=xla_bytes, gt_bytes=gt_bytes, devices=len(devices),
                  ok=xla_bytes <= gt_bytes)
    if os.path.exists(base + ".npz"):
        result["rel_err"] = run_and_compare(compiled, meta, np.load(base + ".npz"), devices)
        result["ok"] = result["ok"] and result["rel_err"] <= RTOL
    return result


def run_and_compare(compiled, meta, data, devices):
    """Max relative error of the compiled program's outputs on the case's inputs."""
    inputs = []
    for i, shard_text in enumerate(meta["input_shardings"]):
        value = data[f"in{i}"]
        inputs.append(jax.make_array_from_callback(
            value.shape, _sharding(shard_text, devices), lambda index, v=value: v[index]))
    results = compiled.execute_sharded(inputs).disassemble_into_single_device_arrays()
    rel_err = 0.0
    for j, shard_text in enumerate(meta["output_shardings"]):
        expected = data[f"out{j}"]
        got = np.asarray(jax.make_array_from_single_device_arrays(
            expected.shape, _sharding(shard_text, devices), results[j]))
        scale = max(float(np.max(np.abs(expected))), 1e-30) if expected.size else 1.0
        err = float(np.max(np.abs(got - expected))) / scale if expected.size else 0.0
        rel_err = max(rel_err, err)
    return rel_err


def _kinds(pairs):
    counts = {}
    for kind, _ in pairs:
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"


def main(argv):
    del argv
    paths = sorted(glob.glob(os.path.join(CASES.value, "*.hlo.pb")))
    if not paths:
        sys.exit(f"no *.hlo.pb in {CASES.value}: run benchmarks/bridge_cases.py first")
    counts = []
    for path in paths:
        with open(path[:-len(".hlo.pb")] + ".json") as f:
            counts.append(json.load(f).get("num_devices", 8))
    jax.config.update("jax_num_cpu_devices", max(counts))  # before the backend starts
    print(f"JAX {jax.__version__}, XLA CPU devices, GSPMD partitioner\n")
    print("| case | devices | max rel. err vs single device | XLA collectives "
          "| XLA bytes/device | gspmd-tf collectives | gspmd-tf bytes/device | ok |")
    print("|---|---:|---:|---|---:|---|---:|---|")
    failed = False
    for path in paths:
        r = check_case(path)
        failed |= not r["ok"]
        err = "- (compiled only)" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"| {r['name']} | {r['devices']} | {err} | {_kinds(r['xla'])} | {r['xla_bytes']} "
              f"| {_kinds(r['gt'])} | {r['gt_bytes']} | {'yes' if r['ok'] else 'NO'} |",
              flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
