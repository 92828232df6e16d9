"""Predicates over ATen FX graphs: which nodes are FSDP collectives, waits,
and the cheap shaping ops that sit between a stored shard and its compute.

All functions here only read the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims
_funcol = torch.ops._c10d_functional

ALL_GATHER = _funcol.all_gather_into_tensor.default
REDUCE_SCATTER = _funcol.reduce_scatter_tensor.default
ALL_REDUCE = _funcol.all_reduce.default
WAIT = _funcol.wait_tensor.default
ALL_TO_ALL = _funcol.all_to_all_single.default

COLLECTIVE_KINDS = {
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_REDUCE: "all_reduce",
    ALL_TO_ALL: "all_to_all",
}
# The kinds FSDP's own collectives have (the ones bucketing merges).
FSDP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# Ops that only cast, pad, reshape or slice: what DTensor's redistribute and
# mixed precision put between a parameter shard and the tensor compute reads.
SHAPING_OPS = {
    aten._to_copy.default,
    prims.convert_element_type.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.cat.default,
    aten.constant_pad_nd.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    operator.getitem,
}

# Pure views of a gathered parameter (e.g. the weight transpose of a linear).
VIEW_OPS = {
    aten.t.default,
    aten.permute.default,
    aten.transpose.int,
    aten.expand.default,
    aten.as_strided.default,
    aten.detach.default,
    aten.view.dtype,  # float8 bytes seen as uint8 and back (Note: [Float8 all-gather])
}


def collective_kind(node: fx.Node) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``,
    ``"all_to_all"`` or ``None``."""
    if node.op != "call_function":
        return None
    return COLLECTIVE_KINDS.get(node.target)


def collective_group(node: fx.Node) -> str | None:
    """The process-group name a collective runs on (``None``: not a collective)."""
    kind = collective_kind(node)
    if kind is None:
        return None
    # all_gather(input, size, group), reduce_scatter(input, op, size, group),
    # all_reduce(input, op, group), all_to_all(input, out_splits, in_splits, group)
    group = node.args[3] if kind in ("reduce_scatter", "all_to_all") else node.args[2]
    return group if isinstance(group, str) else getattr(group, "group_name", str(group))


def collective_group_size(node: fx.Node) -> int:
    """The group size a collective names in its arguments: an all-gather's
    or reduce-scatter's, an all-to-all's number of splits; 0 where the
    graph does not say (an all-reduce, an all-to-all of even splits)."""
    kind = collective_kind(node)
    if kind == "all_gather":
        return int(node.args[1])
    if kind == "reduce_scatter":
        return int(node.args[2])
    if kind == "all_to_all":
        splits = next((a for a in node.args[1:3] if isinstance(a, (list, tuple))), None)
        return len(splits) if splits is not None else 0
    return 0


DATA_PARALLEL = "dp"
TENSOR_PARALLEL = "tp"
EXPERT_PARALLEL = "ep"
OTHER = "other"


@dataclass(frozen=True)
class CollectiveGroups:
    """Which process groups carry the data-parallel (FSDP) collectives.

    Note: [Data-parallel collectives only]
        A graph of a 2-D (data x tensor parallel) model also holds the tensor
        parallel plan's collectives (sequence-parallel all-gathers and
        reduce-scatters of activations, all-reduces of rowwise outputs and of
        replicated parameters' gradients). They sit where the TP plan needs
        them and carry activations, not parameters: bucketing and reordering
        act only on collectives whose process group is one of the model's
        data-parallel groups (the mesh's dim groups and hybrid submeshes),
        leave every other collective in place, and the report and cost model
        count them separately (role ``"tp"`` for the TP mesh's groups,
        ``"other"`` for any other group). ``data_parallel=None`` (a backend
        built without a model, hand-built test graphs) treats every
        collective as data parallel, as before 2-D support.

    Note: [All-to-alls of expert parallelism]
        The token dispatch and combine of expert parallelism (Note: [Expert
        parallelism]) are all-to-alls with data-dependent splits. Every
        all-to-all, on whatever process group (the ep mesh's group may be
        the very group the dense parameters are sharded over), has role
        ``"ep"``, as have the other collectives on the ep mesh's groups. The
        passes leave them in place, like the tensor-parallel ones; the report
        lists them apart and the cost model prices them on their link
        (``"ep:all_to_all/N"`` fit, else the all-gather fit of the same
        bytes: both move ``(N - 1) / N`` of the buffer per rank).

    Attributes:
        data_parallel: names of the data-parallel process groups; ``None``:
            every collective counts as data parallel (all-to-alls aside).
        tensor_parallel: names of the tensor-parallel mesh's process groups.
        expert_parallel: names of the expert-parallel (ep) mesh's process groups.
    """

    data_parallel: frozenset[str] | None = None
    tensor_parallel: frozenset[str] = frozenset()
    expert_parallel: frozenset[str] = frozenset()

    def role(self, node: fx.Node) -> str | None:
        """``"dp"``, ``"tp"``, ``"ep"``, ``"other"``; ``None`` if ``node`` is
        no collective."""
        group = collective_group(node)
        if group is None:
            return None
        if collective_kind(node) == "all_to_all":
            return EXPERT_PARALLEL
        if self.data_parallel is None or group in self.data_parallel:
            return DATA_PARALLEL
        if group in self.expert_parallel:
            return EXPERT_PARALLEL
        return TENSOR_PARALLEL if group in self.tensor_parallel else OTHER

    def is_data_parallel(self, node: fx.Node) -> bool:
        return self.role(node) == DATA_PARALLEL


# Every collective is data parallel (graphs without a known model).
ALL_DATA_PARALLEL = CollectiveGroups()


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def is_shaping(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SHAPING_OPS


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS


def is_compute(node: fx.Node) -> bool:
    """A node that does real work (not a collective, wait, view or reshape)."""
    return (
        node.op == "call_function"
        and collective_kind(node) is None
        and not is_wait(node)
        and not is_shaping(node)
        and not is_view(node)
    )


def wait_of(collective: fx.Node) -> fx.Node | None:
    """The ``wait_tensor`` consuming a collective's output, if it has one."""
    for user in collective.users:
        if is_wait(user):
            return user
    return None


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes]


def source_placeholder(node: fx.Node) -> fx.Node | None:
    """The graph input that ``node`` is a cast/reshape/pad of, if any.

    Follows the first tensor input through shaping ops (``cat`` only when all
    its inputs come from the same source, as in DTensor's padding).
    """
    current = node
    seen = 0
    while current.op != "placeholder":
        if not is_shaping(current) or seen > 64:
            return None
        inputs = tensor_inputs(current)
        if not inputs:
            return None
        sources = {source_placeholder(i) for i in inputs} if len(inputs) > 1 else None
        if sources is not None:
            return next(iter(sources)) if len(sources) == 1 else None
        current = inputs[0]
        seen += 1
    return current


def shaping_closure(start: fx.Node, include_views: bool) -> list[fx.Node]:
    """Nodes reachable from ``start`` through shaping (and optionally view)
    ops whose every tensor input is ``start`` or already in the closure."""
    closure: dict[fx.Node, None] = {}
    frontier = [start]
    members = {start}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in members:
                continue
            ok = is_shaping(user) or (include_views and is_view(user))
            if ok and all(i in members for i in tensor_inputs(user)):
                members.add(user)
                closure[user] = None
                frontier.append(user)
    return list(closure)


def path_from_placeholder(node: fx.Node) -> list[fx.Node]:
    """Shaping nodes between a source placeholder and ``node`` (exclusive)."""
    path: list[fx.Node] = []
    current = node
    while current.op != "placeholder" and is_shaping(current):
        path.append(current)
        inputs = tensor_inputs(current)
        if not inputs:
            break
        current = inputs[0]
    return list(reversed(path))


# Gradient accumulation of a parameter used twice (tied weights).
_ACCUMULATE_OPS = {aten.add.Tensor}


def downstream_output_index(node: fx.Node) -> list[int]:
    """Positions in the graph's output tuple that ``node`` flows into through
    shaping ops (e.g. a reduced gradient returned as a parameter's grad)."""
    frontier = [node]
    seen = {node}
    positions: list[int] = []
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user.op == "output":
                outs = user.args[0]
                flat = outs if isinstance(outs, (list, tuple)) else [outs]
                positions.extend(i for i, o in enumerate(flat) if o is current)
            elif user not in seen and (
                is_shaping(user)
                or is_wait(user)
                or user.target in _ACCUMULATE_OPS
                # hybrid sharding: a reduce-scatter's result is all-reduced next
                or user.target is ALL_REDUCE
            ):
                seen.add(user)
                frontier.append(user)
    return sorted(positions)


_BYTE_VIEWS = (aten.detach.default, aten.view.dtype)


def carries_float8(node: fx.Node) -> bool:
    """Whether ``node`` is a byte view (``uint8``, through detaches) of a
    float8 tensor: the input of a float8 all-gather (Note: [Float8 all-gather])."""
    return float8_dtype_of(node) is not None


def float8_dtype_of(node: fx.Node) -> torch.dtype | None:
    """The float8 dtype ``node`` is a byte view of (``None``: it is none)."""
    for _ in range(4):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        if node.target not in _BYTE_VIEWS:
            return None
        node = node.args[0]
        dtype = node_dtype(node) if isinstance(node, fx.Node) else None
        if dtype is not None and dtype.itemsize == 1 and dtype.is_floating_point:
            return dtype
    return None


def wire_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a collective input carries: the float8 dtype of float8 bytes
    (they travel as ``uint8``: gloo has no float8 type), else its own."""
    return float8_dtype_of(node) or node_dtype(node)


def gather_prep(collective: fx.Node) -> list[fx.Node]:
    """The nodes computing ``collective``'s input from graph inputs and
    earlier collectives' results, in graph order: its ancestors up to (not
    including) placeholders and waits. For a float8 all-gather, the scale
    from the all-reduced amax and the cast of the shard; for a plain one,
    its casts, pads and reshapes."""
    seen: set[fx.Node] = set()
    frontier = list(collective.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node in seen or node.op != "call_function" or is_wait(node):
            continue
        seen.add(node)
        frontier.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(collective.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def gather_source(node: fx.Node, primal_names: dict[str, str]) -> fx.Node | None:
    """The stored shard (graph input named in ``primal_names``) an
    all-gather's input ``node`` comes from: through shaping ops, or for
    float8 bytes through the cast (Note: [Float8 all-gather]), whose other
    inputs are the scale's (an all-reduce's result, or a saved scale)."""
    source = source_placeholder(node)
    if source is not None or not carries_float8(node):
        return source
    seen: set[fx.Node] = set()
    found: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        current = frontier.pop()
        if current in seen or is_wait(current) or collective_kind(current) is not None:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if current.name in primal_names:
                found.add(current)
            continue
        frontier.extend(current.all_input_nodes)
    return next(iter(found)) if len(found) == 1 else None


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def concrete(value) -> int:
    """An int for a size that may be symbolic (dynamic shapes): a symbol's
    hint, the size of the example being compiled, read without adding a guard
    to the shape environment (a guard would make Dynamo recompile at every
    new size, Note: [Plans from sizes, not guards]); 0 for an unbacked
    (data-dependent) size."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        node = value.node
        return int(node.hint) if node.has_hint() else 0
    return int(value)


def node_bytes(node: fx.Node) -> int:
    """Bytes of ``node``'s tensor value (0 for a non-tensor), as an int even
    for symbolic shapes (``concrete``)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return concrete(val.numel()) * val.element_size()
    return 0


def node_dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder ``graph`` topologically, keeping the current order wherever it
    is already valid (a node moves only to just after its last input)."""
    import heapq

    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    ordered: list[fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        ordered.append(node)
        for user in node.users:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, index[user])
    if len(ordered) != len(nodes):
        raise RuntimeError("graph has a cycle; cannot sort it topologically")
    output = ordered[-1]
    for node in ordered[:-1]:
        output.prepend(node)
