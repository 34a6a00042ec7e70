"""Disjoint sets (union-find) over hashable keys, for the passes that group things
connected by a relation: TensorList families (graph/tensor_lists.py), factors that meet
in one tensor (OpRule.independent_groups), AUTO inputs tied by element-wise ops
(autoshard/ties.py). A leaf module: it imports nothing of gspmd_tf."""

from __future__ import annotations

from typing import Hashable


class DisjointSets:
    """Sets of keys, each key alone until `union`ed; `find` gives a set's root key."""

    def __init__(self):
        self.parent = {}

    def find(self, key: Hashable) -> Hashable:
        """The root key of `key`'s set (paths compressed on the way)."""
        root = key
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while key != root:
            self.parent[key], key = root, self.parent.get(key, key)
        return root

    def union(self, a: Hashable, b: Hashable) -> None:
        """Join the sets of `a` and `b`; the root of `a`'s set is the joined set's root."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
