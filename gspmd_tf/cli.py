"""`python -m gspmd_tf inspect SAVED_MODEL ...`: how a SavedModel's signature would be
partitioned, without running it.

    python -m gspmd_tf inspect /tmp/model --mesh=2x4 --axes=data,model \\
        --shard 'x=data' --shard '.*kernel=None,model' [--shape x=32,16] [--html=report.html]

SAVED_MODEL is the directory tf.saved_model.save (or a Keras model's export) wrote:
saved_model.pb and variables/. The CLI loads the SavedModel, imports the signature's graph, seeds the shardings that --shard
gives (each REGEX is matched with re.fullmatch against the signature's input names and
the variable names, as gt.keras' layout_map: an exact name first, a name matching two
regexes is an error), then propagates and partitions on an abstract mesh (no devices
are needed). Prints the sharding report (every tensor, every collective with its bytes)
and the per-device memory. Unmatched inputs get inferred shardings; unmatched variables
stay replicated. A signature with unknown dims (a Keras export's batch) is traced again
for the sizes --shape gives.

SPEC: one entry per dim, comma separated; an entry is a mesh axis name, several names
joined by '+' (one dim split over several axes), or None / '-' / '' (not split).
"""

from __future__ import annotations

import sys

import tensorflow as tf
from absl import app, flags

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.importer import import_graph
from gspmd_tf.layout_map import LayoutRules
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.runtime.lowering import lower_seeded, seed_annotations
from gspmd_tf.runtime.options import LowerOptions

FLAGS = flags.FLAGS
flags.DEFINE_string("mesh", None, "(required) mesh shape, e.g. 2x4: an abstract mesh, no "
                    "devices needed")
flags.DEFINE_list("axes", None, "mesh axis names, one per mesh dim, e.g. data,model")
flags.DEFINE_multi_string("shard", [], "REGEX=SPEC: shard the inputs and variables whose "
                          "names match REGEX by SPEC (e.g. 'x=data', '.*kernel=None,model')")
flags.DEFINE_multi_string("shape", [], "NAME=D0,D1,...: the shape of an input whose "
                          "signature leaves dims unknown (e.g. the batch: 'x=32,16')")
flags.DEFINE_string("signature", "serving_default", "the SavedModel signature to lower")
flags.DEFINE_string("html", None, "also write the HTML report to this path")


def parse_spec(text):
    """A PartitionSpec from 'data,None', 'data+model,-' or '' (replicated)."""
    entries = []
    for entry in text.split(",") if text.strip() else []:
        entry = entry.strip()
        if entry in ("None", "-", ""):
            entries.append(None)
        else:
            names = tuple(n.strip() for n in entry.split("+"))
            entries.append(names[0] if len(names) == 1 else names)
    return PartitionSpec(*entries)


def parse_shard_flags(values):
    """{regex: PartitionSpec} from REGEX=SPEC strings (split at the last '=')."""
    rules = {}
    for value in values:
        regex, sep, spec = value.rpartition("=")
        if not sep or not regex:
            raise ShardingError(f"--shard {value!r}: write REGEX=SPEC, e.g. 'x=data,None'")
        rules[regex] = parse_spec(spec)
    return rules


def parse_mesh(shape, axes):
    """An abstract gt.Mesh from '2x4' and ['data', 'model']."""
    try:
        dims = tuple(int(d) for d in shape.lower().split("x"))
    except (AttributeError, ValueError):
        raise ShardingError(f"--mesh={shape!r}: give the mesh shape as e.g. 2x4") from None
    return Mesh.abstract(dims, tuple(axes or ()))


def parse_shape_flags(values):
    """{input name: shape tuple} from NAME=D0,D1,... strings."""
    shapes = {}
    for value in values:
        name, sep, dims = value.rpartition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ShardingError(f"--shape {value!r}: write NAME=D0,D1,..., e.g. 'x=32,16'")
    return shapes


def _static_signature(signature_fn, shapes, signature):
    """`signature_fn` traced again for static input shapes (a signature exported with
    unknown dims, e.g. the batch, gets them from `shapes`; TF infers the rest)."""
    specs = tf.nest.flatten(signature_fn.structured_input_signature)
    static = []
    for spec in specs:
        shape = tf.TensorShape(shapes.get(spec.name, spec.shape))
        if not shape.is_compatible_with(spec.shape):
            raise ShardingError(f"--shape {spec.name}={shape}: signature {signature!r} takes "
                                f"{spec.name!r} of shape {spec.shape}")
        if not shape.is_fully_defined():
            raise ShardingError(f"input {spec.name!r} of signature {signature!r} has shape "
                                f"{spec.shape}: give its size, e.g. --shape "
                                f"{spec.name}={','.join(str(d or 32) for d in spec.shape)}")
        static.append(tf.TensorSpec(shape, spec.dtype, name=spec.name))
    unknown = set(shapes) - {spec.name for spec in specs}
    if unknown:
        raise ShardingError(f"--shape names {sorted(unknown)} are not inputs of signature "
                            f"{signature!r} (its inputs: {[spec.name for spec in specs]})")
    if all(a.shape == b.shape for a, b in zip(specs, static)):
        return signature_fn
    names = [spec.name for spec in specs]
    # signature functions take keyword arguments only
    return tf.function(lambda *xs: signature_fn(**dict(zip(names, xs))),
                       autograph=False).get_concrete_function(*static)


def lower_saved_model(path, mesh, shard_rules, signature="serving_default", shapes=None):
    """The gt.Lowered of SavedModel `path`'s `signature` on `mesh` with `shard_rules`
    ({name regex: PartitionSpec} over input and variable names); `shapes` ({input name:
    shape}) fixes dims the signature leaves unknown. Nothing runs."""
    loaded = tf.saved_model.load(path)
    if signature not in loaded.signatures:
        raise ShardingError(f"SavedModel {path!r} has no signature {signature!r}; it has "
                            f"{sorted(loaded.signatures)} (pass --signature)")
    signature_fn = loaded.signatures[signature]
    concrete = _static_signature(signature_fn, shapes or {}, signature)
    graph = import_graph(concrete)
    rules, used = LayoutRules(shard_rules), set()
    specs = tf.nest.flatten(concrete.structured_input_signature)
    variables = {id(v.handle): v for v in signature_fn.variables}
    named = [(spec.name, ref, spec.shape) for spec, ref in zip(specs, graph.inputs)]
    first_capture = len(graph.inputs) - len(graph.captures)
    for ref, handle in zip(graph.inputs[first_capture:], graph.captures):
        variable = variables.get(id(handle))
        if variable is not None:
            named.append((variable.name.split(":")[0], ref, variable.shape))
    seeds = {}
    for name, ref, shape in named:
        key, spec = rules.lookup_path(name)
        if key is not None:
            used.add(key)
            seeds[ref] = Layout.from_spec(mesh, spec, len(shape), f"{name!r} (--shard {key!r})")
        elif graph.dtype(ref) == tf.resource:  # a variable enters the program whole
            seeds[ref] = Layout.replicated(len(shape))
    unused = [key for key, _ in rules.items if key not in used]
    if unused:
        raise ShardingError(f"--shard regex(es) {unused} match no input or variable; the "
                            f"names are {[name for name, _, _ in named]}")
    # annotations inside the graph (tf2xla XlaSharding) are seeded as gt.function does
    seed_annotations(mesh, graph, seeds)
    # an abstract mesh never compiles, so no backend is needed; the program is called
    # "SavedModel PATH signature 'NAME'"
    options = LowerOptions(mesh, None, signature, caller=f"SavedModel {path} signature")
    # the signature's input and variable names beside their graph tensors (TF names a
    # captured variable's placeholder "unknown")
    return lower_seeded(graph, seeds, len(specs), options,
                        named_inputs=tuple((name, graph.tensor_name(ref))
                                           for name, ref, _ in named))


def _inspect(argv):
    if len(argv) != 3 or argv[1] != "inspect":
        raise app.UsageError("usage: python -m gspmd_tf inspect SAVED_MODEL --mesh=2x4 "
                             "--axes=data,model --shard 'REGEX=SPEC' ...")
    if FLAGS.mesh is None:
        raise app.UsageError("--mesh is required (e.g. --mesh=2x4 --axes=data,model)")
    try:
        mesh = parse_mesh(FLAGS.mesh, FLAGS.axes)
        lowered = lower_saved_model(argv[2], mesh, parse_shard_flags(FLAGS.shard),
                                    FLAGS.signature, parse_shape_flags(FLAGS.shape))
    except ShardingError as e:
        print(f"gspmd_tf inspect: {e}", file=sys.stderr)
        return 2
    print("inputs and variables:")
    for name, tensor in lowered.named_inputs:
        print(f"  {name:30s} {lowered.layout_of(tensor).to_spec()!r:24s} (tensor {tensor})")
    print()
    print(lowered.report())
    print("\nper-device memory (every device runs the same program; peak estimated in "
          "program order)")
    print(lowered.memory().text())
    if FLAGS.html:
        lowered.report(format="html", path=FLAGS.html)
        print(f"\nHTML report written to {FLAGS.html}")
    return 0


def main():
    """Entry point of `python -m gspmd_tf`."""
    app.run(_inspect)
