"""The graph IR (Graph, Node, Ref) and the importer from traced TensorFlow functions."""

from gspmd_tf.graph.importer import import_graph
from gspmd_tf.graph.ir import Graph, Node, Ref, attr_value, decode_attr

__all__ = ["Graph", "Node", "Ref", "attr_value", "decode_attr", "import_graph"]
