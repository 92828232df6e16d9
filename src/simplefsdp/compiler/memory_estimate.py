"""Peak-memory estimate of a graph from tensor sizes and liveness.

A node's output is allocated when it runs and freed after the last use of
every tensor aliasing it (views, waits and getitems alias their input).
Graph inputs (parameter shards, the batch, tensors saved for backward) are
resident before the graph runs and are reported separately; graph outputs
stay alive. Copy-out reshapes of bucket slices are real copies.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from simplefsdp.compiler.patterns import is_wait, node_bytes

aten = torch.ops.aten

_ALIAS_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.t.default,
    aten.permute.default,
    aten.transpose.int,
    aten.expand.default,
    aten.slice.Tensor,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    operator.getitem,
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes: ``peak_bytes`` is the most memory the graph allocates at once
    (above its inputs); ``input_bytes`` are its resident inputs;
    ``output_bytes`` what it leaves alive (e.g. saved for backward)."""

    peak_bytes: int
    input_bytes: int
    output_bytes: int

    def to_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
        }


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _ALIAS_OPS or is_wait(node))


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` views (a getitem of a multi-output op,
    whose value is a tuple, is its own storage)."""
    while _is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        source = node.args[0]
        if node.target is operator.getitem and not isinstance(source.meta.get("val"), torch.Tensor):
            break
        node = source
    return node


def output_leaves(graph: fx.Graph) -> list:
    """The flattened arguments of ``graph``'s output node, in order."""
    output = next(iter(graph.find_nodes(op="output")))
    return torch.utils._pytree.arg_tree_leaves(*output.args)


def concrete_bytes(value) -> int:
    """A byte count as an int: a symbolic one (dynamic shapes) by its hint,
    the size of the example being compiled (no guard is added)."""
    if isinstance(value, torch.SymInt):
        node = value.node
        return int(node.hint) if node.has_hint() else 0  # unbacked: unknown
    return int(value)


def estimate_memory(gm: fx.GraphModule, ignore: set[fx.Node] | None = None) -> MemoryEstimate:
    """Liveness-based peak of the memory ``gm`` allocates while it runs
    (nodes in ``ignore`` are counted as allocating nothing)."""
    ignore = ignore or set()
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        inputs = node.all_input_nodes
        root[node] = root[inputs[0]] if _is_alias(node) and inputs else node
    output = nodes[-1]
    outputs = {root[n] for n in output.all_input_nodes}
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for user in node.users:
            r = root[node]
            last_use[r] = max(last_use.get(r, -1), index[user])
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last_use.items():
        if r not in outputs and r.op != "placeholder":
            frees.setdefault(i, []).append(r)
    live = peak = 0
    inputs_bytes = 0
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            inputs_bytes += node_bytes(node)
        elif root[node] is node and node.op == "call_function" and node not in ignore:
            live += node_bytes(node)
            peak = max(peak, live)
        for r in frees.get(i, ()):
            if r not in ignore:
                live -= node_bytes(r)
    output_bytes = sum(node_bytes(r) for r in outputs if r.op != "placeholder")
    return MemoryEstimate(peak_bytes=peak, input_bytes=inputs_bytes, output_bytes=output_bytes)
