"""Peak-memory estimate of a graph from tensor sizes and liveness.

A node's output is allocated when it runs and freed after the last use of
every tensor aliasing it (views, waits and getitems alias their input).
Graph inputs (parameter shards, the batch, tensors saved for backward) are
resident before the graph runs and are reported separately; graph outputs
stay alive. Copy-out reshapes of bucket slices are real copies.

Note: [Collective buffers until the wait]
    An asynchronous collective holds its input until it completes: the
    process group's work object keeps a reference, so the input of a
    reduce-scatter issued early and waited late (the reordering pass overlaps
    it with the next bucket's backward) is alive up to its wait, not only up
    to its issue. Some backends also stage: gloo's all-gather into a tensor
    gathers into a flat buffer of its own and copies it out, and its
    reduce-scatter reduces a copy of its input, so on gloo an all-gather
    holds a second output-sized buffer and a reduce-scatter a second
    input-sized one from issue to wait (``staged``; NCCL works in place).
    The compiler asks each process group which backend serves the
    collective's device (``staged_by``); a group it cannot ask is taken to
    be gloo on CPU and not to stage elsewhere (``staged_on_cpu``).
    Both matter: without them the estimate of a bucketed, reordered gloo
    graph falls far below the memory the step measures (docs/benchmarks.md).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from simplefsdp.compiler.patterns import (
    collective_group,
    collective_kind,
    is_wait,
    node_bytes,
    wait_of,
)

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
    ``output_bytes`` what it leaves alive (e.g. saved for backward);
    ``live_peak_bytes`` the most memory alive at once beyond the training
    state: the inputs that are not state (activations saved for backward,
    tangents), each freed after its last use as the compiled code does, plus
    what the graph allocates; ``transient_peak_bytes`` the most memory it
    allocates at once beyond its outputs allocated so far (a backward's
    peak is often reached before most gradients exist, so ``peak_bytes -
    output_bytes`` understates what it needs beside all of them)."""

    peak_bytes: int
    input_bytes: int
    output_bytes: int
    live_peak_bytes: int
    transient_peak_bytes: int = 0

    def to_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "live_peak_bytes": self.live_peak_bytes,
            "transient_peak_bytes": self.transient_peak_bytes,
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


def _device_type(node: fx.Node) -> str | None:
    value = node.meta.get("val")
    return value.device.type if isinstance(value, torch.Tensor) else None


def staged_on_cpu(node: fx.Node) -> bool:
    """Whether collective ``node`` runs on CPU tensors, so (where nothing
    says which backend serves them) on gloo, which stages (Note: [Collective
    buffers until the wait])."""
    return _device_type(node) == "cpu"


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a process group's backend string (``dist.get_backend``:
    ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``) uses for ``device_type``
    (``None``: none named for it)."""
    if ":" not in backend:
        return backend
    for pair in backend.split(","):
        device, _, name = pair.partition(":")
        if device.strip() == device_type:
            return name.strip()
    return None


def staged_by(backends: dict[str, str]) -> Callable[[fx.Node], bool]:
    """A ``staged`` rule from each process group's backend string, by group
    name: a collective stages where its group serves its tensors' device
    with gloo; a group not in ``backends`` falls back to ``staged_on_cpu``."""

    def staged(node: fx.Node) -> bool:
        backend = backends.get(collective_group(node) or "")
        if backend is None:
            return staged_on_cpu(node)
        return backend_for(backend, _device_type(node) or "cpu") == "gloo"

    return staged


def _collective_waits(nodes: list[fx.Node], index: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Per collective node with a wait, the position of that wait."""
    waits = {n: wait_of(n) for n in nodes if collective_kind(n) is not None}
    return {n: index[w] for n, w in waits.items() if w is not None}


def _staging(
    waits: dict[fx.Node, int],
    index: dict[fx.Node, int],
    staged: Callable[[fx.Node], bool] | None,
    ignore: set[fx.Node],
) -> tuple[dict[int, int], dict[int, int]]:
    """Staging bytes taken at each collective's issue and released after its
    wait, by position: an all-gather's output size, a reduction's input size."""
    take: dict[int, int] = {}
    release: dict[int, int] = {}
    for node, wait in waits.items():
        if staged is None or node in ignore or not staged(node):
            continue
        if collective_kind(node) == "all_gather":
            held = node_bytes(node)
        else:
            held = sum(node_bytes(a) for a in node.all_input_nodes)
        take[index[node]] = take.get(index[node], 0) + held
        release[wait] = release.get(wait, 0) + held
    return take, release


def estimate_memory(
    gm: fx.GraphModule,
    ignore: set[fx.Node] | None = None,
    *,
    staged: Callable[[fx.Node], bool] | None = None,
) -> MemoryEstimate:
    """Liveness-based peak of the memory ``gm`` allocates while it runs
    (nodes in ``ignore`` are counted as allocating nothing).

    A collective's inputs live until its wait, and ``staged(node)`` says
    whether a collective holds a staging buffer from issue to wait (Note:
    [Collective buffers until the wait]; the backend passes ``staged_by``
    its process groups' backends, ``staged_on_cpu`` decides by device alone).
    ``live_peak_bytes`` leaves out the training state: the placeholders
    named ``primals*`` (AOTAutograd's name for the forward's inputs, also
    where backward reads them again).
    """
    ignore = ignore or set()
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    state = {n for n in nodes if n.op == "placeholder" and n.name.startswith("primals")}
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        source = storage_root(node)
        root[node] = node if source is node else root[source]
    output = nodes[-1]
    outputs = {root[n] for n in output.all_input_nodes}
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for user in node.users:
            r = root[node]
            last_use[r] = max(last_use.get(r, -1), index[user])
    waits = _collective_waits(nodes, index)
    for node, wait in waits.items():
        for arg in node.all_input_nodes:
            last_use[root[arg]] = max(last_use[root[arg]], wait)
    take, release = _staging(waits, index, staged, ignore)
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last_use.items():
        if r not in outputs:
            frees.setdefault(i, []).append(r)
    live = peak = 0
    outputs_live = transient_peak = 0  # outputs allocated so far: never freed
    inputs_bytes = 0
    # Inputs that are not state (saved activations, tangents), until their last use.
    inputs_alive = sum(
        node_bytes(n) for n in nodes if n.op == "placeholder" and n not in state and n not in ignore
    )
    live_peak = inputs_alive
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            inputs_bytes += node_bytes(node)
        elif root[node] is node and node.op == "call_function" and node not in ignore:
            live += node_bytes(node)
            if node in outputs:
                outputs_live += node_bytes(node)
        live += take.get(i, 0)
        peak = max(peak, live)
        transient_peak = max(transient_peak, live - outputs_live)
        live_peak = max(live_peak, live + inputs_alive)
        live -= release.get(i, 0)
        for r in frees.get(i, ()):
            if r in ignore:
                continue
            if r.op != "placeholder":
                live -= node_bytes(r)
            elif r not in state:
                inputs_alive -= node_bytes(r)
    output_bytes = sum(node_bytes(r) for r in outputs if r.op != "placeholder")
    return MemoryEstimate(
        peak_bytes=peak,
        input_bytes=inputs_bytes,
        output_bytes=output_bytes,
        live_peak_bytes=live_peak,
        transient_peak_bytes=transient_peak,
    )
