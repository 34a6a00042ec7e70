"""Reference shardings chosen by XLA's sharding propagation (GSPMD and Shardy).

NEEDS JAX. JAX is optional and NOT a dependency of gspmd-tf: install it in a separate
venv and run this script with that interpreter, e.g.

    python3 -m venv /work/jaxref && /work/jaxref/bin/pip install jax jaxlib numpy absl-py
    /work/jaxref/bin/python benchmarks/xla_reference.py --case=all --partitioner=both

Each case is a small JAX function on a 2x4 mesh ("data", "model") of 8 host CPU devices
(devices 0..7 row major). Only what the case names is annotated: annotated arguments via
`in_shardings`, unannotated ones with `None`, which this JAX lowers without a sharding and
with XLA allowed to propagate into them. Every reported tensor is wrapped in a
`jax.named_scope`; the script dumps the HLO module right after the propagation pass
(`sharding-propagation` for GSPMD, `shardy-xla` for Shardy, i.e. just before
`spmd-partitioning`) and reads the `sharding={...}` of the instruction that leaves each
scope. Results are printed as markdown tables: HLO sharding text and the equivalent
PartitionSpec on the ("data", "model") mesh.
"""

import dataclasses
import glob
import itertools
import os
import re
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jaxlib  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

CASE = flags.DEFINE_string("case", "all", "case name, or 'all'")
PARTITIONER = flags.DEFINE_enum("partitioner", "both", ["gspmd", "shardy", "both"],
                                "XLA propagation to run")
VERBOSE = flags.DEFINE_bool("verbose", False,
                            "also print every instruction of the propagated module")

B, S, D, H, HEADS, HD, V = 8, 16, 32, 64, 4, 8, 64
MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
PASS_NAME = {"gspmd": "sharding-propagation", "shardy": "shardy-xla"}


def _t(name, fn):
    """Evaluates fn() inside named scope `name`, so its result can be found in the HLO."""
    with jax.named_scope(name):
        return fn()


def _wsc(x, *spec):
    """with_sharding_constraint on the case mesh."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(MESH, P(*spec)))


# ----------------------------------------------------------------------------- cases

def megatron_mlp(x, w1, w2):
    """Case 1: h = relu(x @ w1); y = h @ w2."""
    xw1 = _t("xw1", lambda: x @ w1)
    h = _t("relu", lambda: jax.nn.relu(xw1))
    return _t("y", lambda: h @ w2)


def attention(x, wq, wk, wv, wo):
    """Case 2: multi-head attention with a hand-written softmax."""
    q = _t("q", lambda: x @ wq)
    k = _t("k", lambda: x @ wk)
    v = _t("v", lambda: x @ wv)
    q4 = _t("q_reshaped", lambda: q.reshape(B, S, HEADS, HD))
    k4 = _t("k_reshaped", lambda: k.reshape(B, S, HEADS, HD))
    v4 = _t("v_reshaped", lambda: v.reshape(B, S, HEADS, HD))
    logits = _t("logits", lambda: jnp.einsum("bqhd,bkhd->bhqk", q4, k4))
    m = _t("softmax_max", lambda: jnp.max(logits, axis=-1, keepdims=True))
    z = _t("softmax_sub", lambda: logits - m)
    e = _t("softmax_exp", lambda: jnp.exp(z))
    s = _t("softmax_sum", lambda: jnp.sum(e, axis=-1, keepdims=True))
    p = _t("softmax_div", lambda: e / s)
    ctx = _t("ctx", lambda: jnp.einsum("bhqk,bkhd->bqhd", p, v4))
    ctx3 = _t("ctx_reshaped", lambda: ctx.reshape(B, S, HEADS * HD))
    return _t("out", lambda: ctx3 @ wo)


def layer_norm(x, gamma, beta):
    """Case 3: layer norm over the (split) last dim; gamma, beta unannotated."""
    mean = _t("mean", lambda: jnp.mean(x, axis=-1, keepdims=True))
    xc = _t("centered", lambda: x - mean)
    sq = _t("square", lambda: xc * xc)
    var = _t("var", lambda: jnp.mean(sq, axis=-1, keepdims=True))
    inv = _t("rsqrt", lambda: jax.lax.rsqrt(var + 1e-5))
    norm = _t("normalized", lambda: xc * inv)
    scaled = _t("scaled", lambda: norm * gamma)
    return _t("out", lambda: scaled + beta)


def embedding_take(table, ids):
    """Case 4a: jnp.take(table, ids, axis=0)."""
    return _t("out", lambda: jnp.take(table, ids, axis=0))


def embedding_index(table, ids):
    """Case 4b: table[ids]."""
    return _t("out", lambda: table[ids])


def reshape_split(x):
    """Case 5a: [B,S,HEADS*HD] -> [B,S,HEADS,HD], last dim split on model."""
    return _t("out", lambda: x.reshape(B, S, HEADS, HD))


def reshape_merge(x):
    """Case 5b/5c: [B,S,D] -> [B*S,D]."""
    return _t("out", lambda: x.reshape(B * S, D))


def transpose(x):
    """Case 6: transpose (2, 0, 1)."""
    return _t("out", lambda: jnp.transpose(x, (2, 0, 1)))


def reductions(x):
    """Case 7: four reductions of one input."""
    return (_t("sum_axis1", lambda: jnp.sum(x, axis=1)),
            _t("sum_axis0", lambda: jnp.sum(x, axis=0)),
            _t("max_axis1", lambda: jnp.max(x, axis=1)),
            _t("sum_all", lambda: jnp.sum(x)))


def dot_contract_split(a, b):
    """Case 8: contracting dim split on model on both sides."""
    return _t("c", lambda: a @ b)


def weight_backward(x, w):
    """Case 9: w unannotated, inferred back from a constraint on h."""
    h = _t("h", lambda: x @ w)
    return _t("h_constrained", lambda: _wsc(h, "data", "model"))


def bias_add(x, b):
    """Case 10a: x + b with b [D] unannotated."""
    return _t("out", lambda: x + b)


def mixed_add(x, y):
    """Case 10b: operands sharded on different dims."""
    return _t("out", lambda: x + y)


def cross_entropy(logits, labels):
    """Case 11: mean of -log_softmax(logits)[b, labels[b]] (log_softmax written out)."""
    m = _t("max", lambda: jnp.max(logits, axis=-1, keepdims=True))
    shifted = _t("shifted", lambda: logits - m)
    e = _t("exp", lambda: jnp.exp(shifted))
    se = _t("sumexp", lambda: jnp.sum(e, axis=-1, keepdims=True))
    lse = _t("log", lambda: jnp.log(se))
    logp = _t("log_softmax", lambda: shifted - lse)
    picked = _t("picked", lambda: jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0])
    return _t("loss", lambda: -jnp.mean(picked))


def uneven(x, w):
    """Case 12: x [6,10] over (data, model), 10 not divisible by 4 (constrained inside)."""
    xs = _t("x_constrained", lambda: _wsc(x, "data", "model"))
    ws = _t("w_constrained", lambda: _wsc(w, "model", None))
    return _t("y", lambda: xs @ ws)


def broadcast_priority(a, c):
    """Case 13a: a broadcast operand competes with an elementwise one (priority layers)."""
    b = _t("b", lambda: jnp.broadcast_to(a[:, None], (B, D)))
    return _t("d", lambda: b + c)


def broadcast_after_dot(a, c, w):
    """Case 13b: a broadcast operand competes with a dot's result."""
    b = _t("b", lambda: jnp.broadcast_to(a[:, None], (B, D)))
    y = _t("y", lambda: c @ w)
    return _t("d", lambda: b + y)


def elementwise_before_dot(x, w, c):
    """Case 13c: the dot's operand and an elementwise user disagree."""
    y = _t("y", lambda: x @ w)
    r = _t("r", lambda: jnp.tanh(y))
    return _t("d", lambda: r + c)


def elementwise_before_reduce(x, c):
    """Case 13d: the reduction's operand and an elementwise user disagree."""
    s = _t("s", lambda: jnp.sum(x, axis=1))
    return _t("d", lambda: s + c)


def reshape_tie(x, c):
    """Case 13e: equally split operands of an add: the first one wins."""
    r = _t("r", lambda: x.reshape(B, D))
    return _t("d", lambda: r + c)


def size1_hint(x):
    """Case 14: a hint splits a size-1 dim (x is [1, D])."""
    m = _t("m", lambda: x * 2)
    h = _t("h", lambda: _wsc(m, "data", "model"))
    return _t("r", lambda: jnp.tanh(h))


@dataclasses.dataclass
class Case:
    """A function and, per argument, (shape, dtype, PartitionSpec or None)."""
    name: str
    fn: object
    args: list


F, I = jnp.float32, jnp.int32
CASES = [
    Case("1_megatron_mlp", megatron_mlp,
         [((B, D), F, P("data", None)), ((D, H), F, P(None, "model")),
          ((H, D), F, P("model", None))]),
    Case("2_attention", attention,
         [((B, S, D), F, P("data", None, None))] + [((D, HEADS * HD), F, P(None, "model"))] * 3
         + [((HEADS * HD, D), F, P("model", None))]),
    Case("3_layer_norm", layer_norm,
         [((B, S, D), F, P("data", None, "model")), ((D,), F, None), ((D,), F, None)]),
    Case("4a_embedding_take", embedding_take,
         [((V, D), F, P("model", None)), ((B, S), I, P("data", None))]),
    Case("4b_embedding_index", embedding_index,
         [((V, D), F, P("model", None)), ((B, S), I, P("data", None))]),
    Case("5a_reshape_split", reshape_split, [((B, S, HEADS * HD), F, P("data", None, "model"))]),
    Case("5b_reshape_merge_batch", reshape_merge, [((B, S, D), F, P("data", None, None))]),
    Case("5c_reshape_merge_seq", reshape_merge, [((B, S, D), F, P(None, "data", None))]),
    Case("6_transpose", transpose, [((B, S, D), F, P("data", None, "model"))]),
    Case("7_reductions", reductions, [((B, D), F, P("data", "model"))]),
    Case("8_dot_contract_split", dot_contract_split,
         [((B, D), F, P(None, "model")), ((D, H), F, P("model", None))]),
    Case("9_weight_backward", weight_backward, [((B, D), F, P("data", None)), ((D, H), F, None)]),
    Case("10a_bias_add", bias_add, [((B, D), F, P("data", "model")), ((D,), F, None)]),
    Case("10b_mixed_add", mixed_add, [((B, D), F, P("data", None)), ((B, D), F, P(None, "model"))]),
    Case("11_cross_entropy", cross_entropy,
         [((B, V), F, P("data", "model")), ((B,), I, P("data"))]),
    Case("12_uneven", uneven, [((6, 10), F, None), ((10, 12), F, None)]),
    Case("13a_broadcast_priority", broadcast_priority,
         [((B,), F, P("model")), ((B, D), F, P(None, "model"))]),
    Case("13b_broadcast_after_dot", broadcast_after_dot,
         [((B,), F, P("model")), ((B, 16), F, None), ((16, D), F, P(None, "model"))]),
    Case("13c_elementwise_before_dot", elementwise_before_dot,
         [((B, 16), F, P("model", None)), ((16, D), F, None), ((B, D), F, P(None, "model"))]),
    Case("13d_elementwise_before_reduce", elementwise_before_reduce,
         [((B, 4, D), F, P(None, None, "model")), ((B, D), F, P("model", None))]),
    Case("13e_reshape_tie", reshape_tie,
         [((B, 4, D // 4), F, P(None, "model", None)), ((B, D), F, P("model", None))]),
    Case("14_size1_hint", size1_hint, [((1, D), F, None)]),
]


# ------------------------------------------------------------------ reading the HLO dump

@dataclasses.dataclass
class Instr:
    """One instruction of the ENTRY computation."""
    name: str
    opcode: str
    rank: int
    operands: list
    op_name: str
    sharding: str
    is_root: bool


def _braced(text, start):
    """The balanced {...} substring of text beginning at index start."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    raise ValueError(text)


def parse_entry(hlo_text):
    """Parses the ENTRY computation of an HLO module dump into a list of Instr."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[entry.index("{\n") + 2:entry.index("\n}")]
    out = []
    for line in entry.splitlines():
        m = re.match(r"\s*(ROOT\s+)?%(\S+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*)", line)
        if not m:
            continue
        root, name, shape, opcode, rest = m.groups()
        dims = re.match(r"\w+\[([\d,]*)\]", shape)
        sh = rest.find("sharding={")
        op = re.search(r'op_name="([^"]*)"', rest)
        out.append(Instr(name, opcode, len(dims.group(1).split(",")) if dims and dims.group(1)
                         else 0, re.findall(r"%([\w.\-]+)", rest), op.group(1) if op else "",
                         _braced(rest, sh + 9) if sh >= 0 else "", bool(root)))
    return out


def scope_outputs(instrs):
    """Maps each top-level named scope to the instruction carrying its value out of it."""
    scopes = {i.name: i.op_name.split("/")[1:-1][:1] for i in instrs}
    users = {}
    for i in instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i.name)
    result = {}
    for i in instrs:
        for tag in scopes[i.name]:
            if i.is_root or any(tag not in scopes.get(u, ()) for u in users.get(i.name, ())):
                result[tag] = i
    return result


# ------------------------------------------------------- HLO sharding -> PartitionSpec

def device_tiles(sharding, rank):
    """Maps device id -> tile coordinates of the data dims, or None if not tiled.

    No sharding at all (Shardy's export of a fully replicated value) means replicated.
    """
    if sharding in ("", "{replicated}"):
        return {d: (0,) * rank for d in range(MESH.size)}
    m = re.match(r"\{devices=\[([\d,]+)\](<=\[([\d,]+)\](T\(([\d,]+)\))?|[\d,]+)", sharding)
    if not m or "manual" in sharding:
        return None
    tile = [int(n) for n in m.group(1).split(",")]
    if m.group(3):
        ids = np.arange(np.prod(tile)).reshape([int(n) for n in m.group(3).split(",")])
        if m.group(5):
            ids = ids.transpose([int(n) for n in m.group(5).split(",")])
    else:
        ids = np.array([int(n) for n in m.group(2).split(",")])
    ids = ids.reshape(tile)
    return {int(ids[idx]): idx[:rank] for idx in np.ndindex(*ids.shape)}


# Device d sits at mesh position (d // 4, d % 4). "model" (size 4) is split into two
# size-2 sub-axes so that Shardy sub-axis shardings such as "model":(1)2 can be named too.
_FINE = {"data": lambda d: d // 4, "model:(1)2": lambda d: d % 4 // 2,
         "model:(2)2": lambda d: d % 2}


def _coord(device, axes):
    """Shard index of a device along fine axes (each of size 2), first axis major."""
    c = 0
    for a in axes:
        c = c * 2 + _FINE[a](device)
    return c


def _render(axes):
    """Spec entry text for a tuple of fine axes, merging the model halves back."""
    names = " ".join(axes).replace("model:(1)2 model:(2)2", "model").split()
    if not names:
        return "None"
    return f'"{names[0]}"' if len(names) == 1 else "(" + ", ".join(f'"{n}"' for n in names) + ")"


def to_spec(sharding, rank):
    """The PartitionSpec text equivalent to an HLO sharding on MESH, or '?'."""
    tiles = device_tiles(sharding, rank)
    if tiles is None:
        return "?"
    for slots in itertools.product(range(rank + 1), repeat=len(_FINE)):
        groups = [[a for a, s in zip(_FINE, slots) if s == dim] for dim in range(rank)]
        for order in itertools.product(*(itertools.permutations(g) for g in groups)):
            if all(tuple(_coord(d, axes) for axes in order) == tiles[d] for d in tiles):
                return "P(" + ", ".join(_render(axes) for axes in order) + ")"
    return "?"


# ------------------------------------------------------------------------- running

def propagate(case, partitioner):
    """Compiles the case.

    Returns {tensor name: Instr} (arguments, then scopes), all instrs, and a count of the
    collectives right after spmd-partitioning (later passes may combine them).
    """
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    shardings = tuple(None if spec is None else NamedSharding(MESH, spec)
                      for _, _, spec in case.args)
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in case.args]
    with tempfile.TemporaryDirectory() as dump:
        jax.jit(case.fn, in_shardings=shardings).lower(*args).compile(compiler_options={
            "xla_dump_to": dump,
            "xla_dump_hlo_pass_re": f"{PASS_NAME[partitioner]}|spmd-partitioning"})
        (path,) = glob.glob(f"{dump}/*.after_{PASS_NAME[partitioner]}.*")
        with open(path) as f:
            instrs = parse_entry(f.read())
        (path,) = glob.glob(f"{dump}/*.after_spmd-partitioning.*")
        with open(path) as f:
            partitioned = f.read()
    by_arg = {i.op_name: i for i in instrs if i.opcode == "parameter"}
    named = {a: by_arg[a] for a in case.fn.__code__.co_varnames[:len(case.args)]}
    ops = re.findall(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                     r"(?:-start)?\(", partitioned)
    collectives = ", ".join(f"{op} x{ops.count(op)}" for op in sorted(set(ops))) or "none"
    return {**named, **scope_outputs(instrs)}, instrs, collectives


def main(argv):
    del argv
    partitioners = ["gspmd", "shardy"] if PARTITIONER.value == "both" else [PARTITIONER.value]
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, mesh 2x4 ('data', 'model')\n")
    for case in CASES:
        if CASE.value not in ("all", case.name):
            continue
        annotated = ", ".join(f"{a}{list(s)} {'unannotated' if p is None else p}" for a, (s, _, p)
                              in zip(case.fn.__code__.co_varnames, case.args))
        print(f"## {case.name}\n\n{case.fn.__doc__}  Args: {annotated}\n")
        results = {p: propagate(case, p) for p in partitioners}
        header = ["tensor"] + [f"{p} {col}" for p in partitioners for col in ("spec", "HLO")]
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for name, instr in results[partitioners[0]][0].items():
            cells = [name]
            for p in partitioners:
                text = results[p][0][name].sharding
                cells += [to_spec(text, instr.rank), f"`{text or '(none)'}`"]
            print("| " + " | ".join(cells) + " |")
        for p in partitioners:
            print(f"\n{p} collectives right after spmd-partitioning: {results[p][2]}")
        print()
        if VERBOSE.value:
            for p in partitioners:
                for i in results[p][1]:
                    print(f"    {p:6s} {i.name:24s} {i.opcode:12s} {i.sharding:56s} {i.op_name}")
                print()


if __name__ == "__main__":
    app.run(main)
