"""IdentityN becomes one Identity per output.

An IdentityN hands on independent values: tf.custom_gradient wraps a function's outputs
and inputs in one (its gradient is the user's), Keras' optimizer and tf.nn.silu pass
tensors through one. The partitioner decides one mesh axis per factor of an op, so as
one op its operands could not all keep a split over the same axis (every operand after
the first was gathered); as separate Identity ops each keeps its own layout. The tensor
names stay: "name:k" is an alias of output k's Identity ("name/output_k").
"""

from __future__ import annotations

from gspmd_tf.graph.ir import Node, Ref, attr_value
from gspmd_tf.graph.sparse_rows import renumber


def identities_apart(graph):
    """`graph` with every IdentityN split into Identity ops (module docstring)."""
    if all(node.op != "IdentityN" for node in graph.nodes):
        return graph
    old_nodes = graph.nodes
    new_index, new_ref, aliases = {}, {}, {}
    graph.nodes, graph._by_name = [], {}
    for i, node in enumerate(old_nodes):
        if node.op != "IdentityN":
            new_index[i] = graph.add(node)
            continue
        for k, (ref, shape, dtype) in enumerate(zip(node.inputs, node.out_shapes,
                                                    node.out_dtypes)):
            identity = Node(f"{node.name}/output_{k}", "Identity", [ref],
                            attrs={"T": attr_value(dtype)}, out_shapes=[shape],
                            out_dtypes=[dtype], control_inputs=node.control_inputs)
            new_ref[(i, k)] = Ref(graph.add(identity), 0)
            aliases[f"{node.name}:{k}"] = (i, k)
            # control edges on the IdentityN go to its first Identity
            new_index.setdefault(i, new_ref[(i, k)].node)
    renumber(graph, new_index, new_ref)
    graph.aliases.update({name: new_ref[key] for name, key in aliases.items()})
    return graph
