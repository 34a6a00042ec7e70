# cython: boundscheck=False, wraparound=False, language_level=3
"""The per-node loop of the propagation encoder (see gspmd_tf/propagation/propagate.py).

Three passes: the first interns each tensor's shape; the second finds each node's
encoded rule (one per distinct rule key, built by a Python callback) and writes the
node's slots while the node is at hand; the third copies each op's dims and factors from
its EncodedRule into the core's int arrays, so no per-node Python list grows.
"""

import numpy as np

# Priority layers (see csrc/propagation.pyx and docs/INTERNALS.md): XLA's aggressiveness
# levels 0, 1 and 2, told apart by the rule's structure rather than by op type.
PASS_THROUGH, ALL_OPS, BROADCAST = 0, 1, 2

cdef class EncodedRule:
    """An OpRule flattened once for every node that shares it: the operand and result
    positions that take part, the factor ids of each of their dims, factor data."""

    cdef readonly object rule
    cdef readonly tuple inputs, outputs
    cdef int[::1] dim_factors, dim_counts
    cdef unsigned char[::1] dim_uneven  # per slot dim: 1 if in OpRule.uneven_major
    cdef long long[::1] sizes  # dim sizes may pass 2**31
    cdef signed char[::1] kinds
    cdef unsigned char[::1] layers  # per slot (inputs then outputs)
    cdef int[::1] input_pos, output_pos  # `inputs` and `outputs` as C ints

    def __init__(self, rule):
        self.rule = rule
        self.inputs = tuple(i for i, dims in enumerate(rule.operands) if dims is not None)
        self.outputs = tuple(k for k, dims in enumerate(rule.results) if dims is not None)
        dims_lists = [rule.operands[i] for i in self.inputs] + \
            [rule.results[k] for k in self.outputs]
        self.dim_factors = np.asarray([f for dims in dims_lists for fs in dims for f in fs],
                                      np.int32)
        self.dim_counts = np.asarray([len(fs) for dims in dims_lists for fs in dims],
                                     np.int32)
        self.dim_uneven = np.asarray(
            [0 for i in self.inputs for _ in rule.operands[i]]
            + [(k, d) in rule.uneven_major
               for k in self.outputs for d in range(len(rule.results[k]))], np.uint8)
        self.sizes = np.asarray(rule.factor_sizes, np.int64)
        self.kinds = np.asarray(rule.factor_kinds, np.int8)
        self.layers = np.asarray(_slot_layers(rule, dims_lists, len(self.inputs)), np.uint8)
        self.input_pos = np.asarray(self.inputs, np.int32)
        self.output_pos = np.asarray(self.outputs, np.int32)


def _slot_layers(rule, dims_lists, num_inputs):
    """The priority layer of each slot of `rule`.

    A pass-through op (XLA's aggressiveness 0: elementwise, transpose, reshape) has only
    PASS factors and every result holds all of them; its slots take part from the first
    layer, except an operand lacking some factor (one that broadcasts, as a bias or the
    operand of BroadcastTo), which waits for the broadcast layer (XLA: a broadcast
    propagates from aggressiveness 2). Every other op (dots, reductions, slices,
    gathers...) takes part from the second layer."""
    every = set(range(len(rule.factor_sizes)))
    held = [{f for fs in dims for f in fs} for dims in dims_lists]
    results = held[num_inputs:]
    only_pass = all(kind == 0 for kind in rule.factor_kinds)  # 0: PASS
    if not results or not only_pass or any(factors != every for factors in results):
        return [ALL_OPS] * len(held)
    return [PASS_THROUGH if i >= num_inputs or factors == every else BROADCAST
            for i, factors in enumerate(held)]


cdef tuple _rule_key(list nodes, object node, list tensor_shape, long long[::1] base,
                     dict const_ids, long long t0):
    """What a rule may depend on, as a flat tuple: op type, input shapes, constant
    inputs' values, output shapes and attrs. Shapes and constants enter as small ints
    interned per graph (`tensor_shape` by tensor id; `const_ids` by serialized value,
    memoized per Const node), so building and hashing the key stays cheap. Shape ids are
    >= 0 and constant ids <= -2 (-1 ends the inputs), so keys of ops with different
    numbers of inputs cannot coincide."""
    cdef list parts = [node.op]
    cdef Py_ssize_t j, k
    cdef tuple r
    for ref in <list>node.inputs:
        r = <tuple>ref  # a Ref (a tuple subclass): read its fields as tuple items
        j = r[0]
        parts.append(tensor_shape[base[j] + <Py_ssize_t>r[1]])
        src = nodes[j]
        if src.op == "Const":
            parts.append(-2 - <Py_ssize_t>_const_id(src, j, const_ids))
    parts.append(-1)
    for k in range(len(node.out_shapes)):
        parts.append(tensor_shape[t0 + k])
    attrs = node.attrs
    if attrs:
        for name, value in attrs.items():
            parts.append(name)
            parts.append(value.SerializeToString())
    return tuple(parts)


cdef object _const_id(object src, Py_ssize_t j, dict const_ids):
    """A small int per distinct constant value (memoized per node index as -j - 1)."""
    memo = const_ids.get(-j - 1)
    if memo is None:
        value = src.attrs["value"].SerializeToString()
        memo = const_ids.get(value)
        if memo is None:
            memo = const_ids[value] = len(const_ids)
        const_ids[-j - 1] = memo
    return memo


def encode_rules(list nodes, object has_rule, object make_rule):
    """The rules of `nodes` as the core's arrays.

    has_rule(op_type) says whether an op type has a rule builder; make_rule(index) builds
    the OpRule of node `index` (None: no rule). Returns (rules, ranks, tensor_base,
    slot_tensor, dim_factors, dim_counts, dim_uneven, factor_size, factor_kind, op_slots,
    op_factors, tensor_op_start, tensor_ops, slot_layer, op_node): `rules` per node (None
    for ops without a rule), the rest int numpy
    arrays (see csrc/propagation.pyx; op_node[op] is the node index of core op `op`).
    """
    cdef Py_ssize_t n = len(nodes), i, k, d, f, op, num_tensors = 0
    cdef Py_ssize_t num_slots = 0, num_dims = 0, num_factors = 0, num_ops = 0, num_df = 0
    cdef long long[::1] base = np.zeros(n + 1, np.int64)
    cdef int[::1] enc_of = np.full(n, -1, np.int32)
    cdef dict cache = {}, const_ids = {}, known = {}, shape_ids = {}
    cdef list rules = [None] * n, encs = [], ranks = [], tensor_shape = []
    cdef EncodedRule enc
    cdef tuple r
    # pass 0: tensor ids, ranks and interned shapes
    for i in range(n):
        base[i] = num_tensors
        for shape in nodes[i].out_shapes:
            ranks.append(len(shape))
            sid = shape_ids.get(shape)
            if sid is None:
                sid = shape_ids[shape] = len(shape_ids)
            tensor_shape.append(sid)
            num_tensors += 1
    base[n] = num_tensors
    # pass 1: rules, sizes and the slots (written while the node is at hand, into arrays
    # that grow when needed)
    cdef Py_ssize_t cap = 2 * n + 16
    slot_tensor_a = np.empty(cap, np.int32)
    slot_op_a = np.empty(cap, np.int32)
    slot_layer_a = np.empty(cap, np.uint8)
    op_node_a = np.empty(n, np.int32)
    cdef int[::1] slot_tensor = slot_tensor_a, slot_op = slot_op_a, op_node = op_node_a
    cdef unsigned char[::1] slot_layer = slot_layer_a
    for i in range(n):
        node = nodes[i]
        op_type = node.op
        ok = known.get(op_type)
        if ok is None:
            ok = known[op_type] = bool(has_rule(op_type))
        if not ok:
            continue
        key = _rule_key(nodes, node, tensor_shape, base, const_ids, base[i])
        entry = cache.get(key)
        if entry is None:
            rule = make_rule(i)
            if rule is None:
                entry = cache[key] = -1
            else:
                encs.append(EncodedRule(rule))
                entry = cache[key] = len(encs) - 1
        if entry < 0:
            continue
        enc = encs[entry]
        enc_of[i] = entry
        rules[i] = enc.rule
        if num_slots + enc.layers.shape[0] > cap:
            cap = 2 * cap + enc.layers.shape[0]
            slot_tensor_a = np.concatenate([slot_tensor_a, np.empty(cap - len(slot_tensor_a),
                                                                    np.int32)])
            slot_op_a = np.concatenate([slot_op_a, np.empty(cap - len(slot_op_a), np.int32)])
            slot_layer_a = np.concatenate([slot_layer_a,
                                           np.empty(cap - len(slot_layer_a), np.uint8)])
            slot_tensor, slot_op, slot_layer = slot_tensor_a, slot_op_a, slot_layer_a
        inputs = <list>node.inputs
        for k in range(enc.layers.shape[0]):
            slot_layer[num_slots + k] = enc.layers[k]
        for k in range(enc.input_pos.shape[0]):
            r = <tuple>inputs[enc.input_pos[k]]
            slot_tensor[num_slots] = base[<Py_ssize_t>r[0]] + <Py_ssize_t>r[1]
            slot_op[num_slots] = num_ops
            num_slots += 1
        for k in range(enc.output_pos.shape[0]):
            slot_tensor[num_slots] = base[i] + enc.output_pos[k]
            slot_op[num_slots] = num_ops
            num_slots += 1
        op_node[num_ops] = i
        num_dims += enc.dim_counts.shape[0]
        num_df += enc.dim_factors.shape[0]
        num_factors += enc.sizes.shape[0]
        num_ops += 1
    slot_tensor_a, slot_op_a = slot_tensor_a[:num_slots], slot_op_a[:num_slots]
    slot_layer_a, op_node_a = slot_layer_a[:num_slots], op_node_a[:num_ops]
    # pass 2: the per-op arrays, copied from each op's EncodedRule
    dim_counts_a = np.empty(num_dims, np.int32)
    dim_uneven_a = np.empty(num_dims, np.uint8)
    dim_factors_a = np.empty(num_df, np.int32)
    factor_size_a = np.empty(num_factors, np.int64)
    factor_kind_a = np.empty(num_factors, np.int8)
    op_slots_a = np.empty(num_ops, np.int32)
    op_factors_a = np.empty(num_ops, np.int32)
    cdef int[::1] dim_counts = dim_counts_a
    cdef unsigned char[::1] dim_uneven = dim_uneven_a
    cdef long long[::1] factor_size = factor_size_a
    cdef int[::1] dim_factors = dim_factors_a
    cdef signed char[::1] factor_kind = factor_kind_a
    cdef int[::1] op_slots = op_slots_a, op_factors = op_factors_a
    cdef Py_ssize_t ns, e = 0
    d = f = 0
    for op in range(num_ops):
        enc = encs[enc_of[op_node[op]]]
        op_slots[op] = enc.layers.shape[0]
        for k in range(enc.dim_counts.shape[0]):
            dim_counts[d] = enc.dim_counts[k]
            dim_uneven[d] = enc.dim_uneven[k]
            d += 1
        ns = enc.sizes.shape[0]
        for k in range(ns):
            factor_size[f] = enc.sizes[k]
            factor_kind[f] = enc.kinds[k]
            f += 1
        op_factors[op] = ns
        for k in range(enc.dim_factors.shape[0]):
            dim_factors[e] = enc.dim_factors[k]
            e += 1
    tensor_op_start_a, tensor_ops_a = _users(slot_tensor_a, slot_op_a, num_tensors)
    return (rules, np.asarray(ranks, np.int32), np.asarray(base), slot_tensor_a,
            dim_factors_a, dim_counts_a, dim_uneven_a, factor_size_a, factor_kind_a, op_slots_a,
            op_factors_a, tensor_op_start_a, tensor_ops_a, slot_layer_a, op_node_a)


cdef tuple _users(int[::1] slot_tensor, int[::1] slot_op, Py_ssize_t num_tensors):
    """The ops that read or write each tensor, grouped by tensor in op order (a counting
    sort of the slots): tensor t's ops are tensor_ops[tensor_op_start[t]:...[t + 1]]."""
    start_a = np.zeros(num_tensors + 1, np.int32)
    ops_a = np.empty(slot_tensor.shape[0], np.int32)
    cdef int[::1] start = start_a, ops = ops_a
    cdef Py_ssize_t s, t
    for s in range(slot_tensor.shape[0]):
        start[slot_tensor[s] + 1] += 1
    for t in range(num_tensors):
        start[t + 1] += start[t]
    cdef int[::1] fill = start_a[:-1].copy()
    for s in range(slot_tensor.shape[0]):
        t = slot_tensor[s]
        ops[fill[t]] = slot_op[s]
        fill[t] += 1
    return start_a, ops_a
