"""What the compiler saw and did, as JSON-serialisable data and as a table.

Each collective carries its process group and its ``role``: ``"dp"`` for the
data-parallel (FSDP) collectives our passes bucket and reorder, ``"tp"`` for
the tensor-parallel mesh's, ``"ep"`` for expert parallelism's all-to-alls
(Note: [All-to-alls of expert parallelism]), ``"other"`` for any other group
(Note: [Data-parallel collectives only]). Counts and bytes take an optional
role; without one they cover every collective of the graph, as the profiler
sees them. A collective's ``dtype`` is what it carries (float8 for float8
bytes, ``"+"``-joined dtypes for a bucket of several, Note: [Mixed dtypes in
one all-gather bucket]) and ``dtype_bytes`` its bytes per dtype.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import torch.fx as fx

from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    FSDP_KINDS,
    OTHER,
    TENSOR_PARALLEL,
    CollectiveGroups,
    collective_group,
    collective_group_size,
    collective_kind,
    downstream_output_index,
    gather_source,
    is_compute,
    is_wait,
    node_bytes,
    wait_of,
    wire_dtype,
)


@dataclass
class CollectiveInfo:
    """One collective in a graph.

    ``issue_pos``/``wait_pos`` count the compute nodes that precede the
    collective / its wait in graph order (0 = before any compute), out of the
    graph's ``num_compute_nodes``. ``group`` is the process group's name and
    ``role`` is ``"dp"``, ``"tp"``, ``"ep"`` or ``"other"`` (see the module
    docstring). ``bytes``: an all-to-all's input (what this rank sends).
    ``dtype_bytes``: ``bytes`` by carried dtype.
    """

    kind: str
    node: str
    dtype: str
    bytes: int  # the unsharded buffer: all-gather output, reduce-scatter input
    group_size: int
    params: list[str]
    issue_pos: int
    wait_pos: int | None
    group: str = ""
    role: str = DATA_PARALLEL
    dtype_bytes: dict[str, int] = field(default_factory=dict)


ROLES = (DATA_PARALLEL, TENSOR_PARALLEL, EXPERT_PARALLEL, OTHER)
KINDS = FSDP_KINDS
ALL_KINDS = (*FSDP_KINDS, "all_to_all")


@dataclass
class BucketInfo:
    """A bucket the bucketing pass formed in a graph."""

    kind: str
    name: str
    params: list[str]
    bytes: int
    dtype: str


@dataclass
class GraphReport:
    """Collectives of one compiled graph (forward or backward)."""

    graph: str  # "forward" | "backward" | "inference"
    graph_id: int
    num_compute_nodes: int
    collectives: list[CollectiveInfo] = field(default_factory=list)
    buckets: list[BucketInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    predicted: dict = field(default_factory=dict)
    # Collectives with compute between issue and wait: {"planned": [n, total]}
    # in our graph and, under Inductor, {"inductor": [n, total]} in its code.
    overlap: dict = field(default_factory=dict)
    # Forward graphs: the buckets kept gathered for backward (keep_gathered)
    # and their gathered bytes: {"buckets": [names], "bytes": n}.
    kept_gathered: dict = field(default_factory=dict)

    def count(self, kind: str, role: str | None = None) -> int:
        """Collectives of ``kind`` (of ``role`` only, if given)."""
        return sum(
            1 for c in self.collectives if c.kind == kind and (role is None or c.role == role)
        )

    def total_bytes(self, kind: str | None = None, role: str | None = None) -> int:
        return sum(
            c.bytes
            for c in self.collectives
            if (kind is None or c.kind == kind) and (role is None or c.role == role)
        )

    def by_role(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{role: {kind: {"count": n, "bytes": b}}}`` for the roles present."""
        result: dict[str, dict[str, dict[str, int]]] = {}
        for c in self.collectives:
            entry = result.setdefault(c.role, {}).setdefault(c.kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += c.bytes
        return result


@dataclass
class CommReport:
    """Per graph, the collectives after all passes ran. See ``comm_report``."""

    graphs: list[GraphReport] = field(default_factory=list)
    options: dict = field(default_factory=dict)

    def graph(self, name: str, graph_id: int | None = None) -> GraphReport:
        """The last compiled graph called ``name`` (optionally of ``graph_id``)."""
        for report in reversed(self.graphs):
            if report.graph == name and (graph_id is None or report.graph_id == graph_id):
                return report
        raise KeyError(f"no {name!r} graph in the report; have {[g.graph for g in self.graphs]}")

    def count(self, graph: str, kind: str, role: str | None = None) -> int:
        return sum(g.count(kind, role) for g in self.graphs if g.graph == graph)

    def to_dict(self) -> dict:
        """JSON-ready data: per graph its fields plus ``by_role`` (counts and
        bytes per role and kind)."""
        return {
            "options": self.options,
            "graphs": [{**asdict(g), "by_role": g.by_role()} for g in self.graphs],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return format_report(self)


def _carried(node: fx.Node, size: int) -> tuple[str, dict[str, int]]:
    """A collective's carried dtype name and its bytes by dtype: a float8
    tensor's bytes travel as ``uint8`` (gloo has no float8 type) and are
    reported as the float8 dtype (Note: [Float8 all-gather]); a bucket of
    several dtypes travels as bytes (Note: [Mixed dtypes in one all-gather
    bucket]) and is reported as its dtypes."""
    tagged = node.meta.get("simplefsdp_dtype_bytes")
    if tagged:
        return "+".join(tagged), dict(tagged)
    source = node.args[0] if node.args else None
    dtype = wire_dtype(source) if isinstance(source, fx.Node) else None
    name = str(dtype).replace("torch.", "")
    return name, {name: size}


def format_bytes(n: int) -> str:
    """``123.4 MiB``-style text of a byte count (the compiler's logs and reports)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_params(params: list[str], limit: int = 3) -> str:
    if not params:
        return "-"
    shown = ", ".join(params[:limit])
    return shown + (f", +{len(params) - limit} more" if len(params) > limit else "")


_ROLE_TITLES = {
    TENSOR_PARALLEL: "tensor-parallel collectives",
    EXPERT_PARALLEL: "expert-parallel collectives",
    OTHER: "collectives of other process groups",
}


def _collective_lines(collectives: list[CollectiveInfo], width: int = 9) -> list[str]:
    lines = [
        f"   {'#':>3} {'collective':<15} {'dtype':<{width}} {'bytes':>10} {'issue@':>7} "
        f"{'wait@':>6}  params"
    ]
    for i, c in enumerate(collectives):
        wait = "-" if c.wait_pos is None else str(c.wait_pos)
        lines.append(
            f"   {i:>3} {c.kind:<15} {c.dtype:<{width}} {format_bytes(c.bytes):>10} "
            f"{c.issue_pos:>7} {wait:>6}  {_fmt_params(c.params)}"
        )
    return lines


def format_report(report: CommReport) -> str:
    """A readable multi-table view of ``report``.

    The header and the main table show the data-parallel collectives; those
    of other roles (tensor parallelism's, expert parallelism's all-to-alls)
    follow in their own sections.
    """
    lines = []
    for g in report.graphs:
        # The dtype column fits the graph's longest (float8, mixed buckets).
        width = max([9, *(len(x.dtype) for x in (*g.collectives, *g.buckets))])
        others = [r for r in ROLES[1:] if any(c.role == r for c in g.collectives)]
        dp = DATA_PARALLEL if others else None
        counts = ", ".join(f"{g.count(k, dp)} {k}" for k in KINDS)
        lines.append(
            f"== {g.graph} graph {g.graph_id}: {'data parallel: ' if dp else ''}{counts}; "
            f"{format_bytes(g.total_bytes(role=dp))} communicated; "
            f"{g.num_compute_nodes} compute nodes"
        )
        for role in others:
            counts = ", ".join(f"{g.count(k, role)} {k}" for k in ALL_KINDS if g.count(k, role))
            lines.append(
                f"   {_ROLE_TITLES[role]} (left in place): {counts}; "
                f"{format_bytes(g.total_bytes(role=role))}"
            )
        if g.predicted:
            lines.append("   predicted: " + ", ".join(f"{k}={v}" for k, v in g.predicted.items()))
        for note in g.notes:
            lines.append(f"   note: {note}")
        if g.buckets:
            lines.append(f"   {'bucket':<28} {'kind':<15} {'dtype':<{width}} {'bytes':>10}  params")
            for b in g.buckets:
                lines.append(
                    f"   {b.name[:28]:<28} {b.kind:<15} {b.dtype:<{width}} "
                    f"{format_bytes(b.bytes):>10}  "
                    f"{_fmt_params(b.params)}"
                )
        dp_rows = [c for c in g.collectives if c.role == DATA_PARALLEL]
        lines.extend(_collective_lines(dp_rows, width))
        for role in others:
            lines.append(f"   {_ROLE_TITLES[role]}:")
            lines.extend(_collective_lines([c for c in g.collectives if c.role == role], width))
    return "\n".join(lines)


def _collective_params(
    node: fx.Node, kind: str, primal_fqns: dict[str, str], output_fqns: dict[int, str], role: str
) -> list[str]:
    if role != DATA_PARALLEL:  # activations (or a gradient on its way to the DP reduction)
        return []
    tagged = node.meta.get("simplefsdp_params")
    if tagged is not None:
        return list(tagged)
    if kind == "all_gather":
        source = gather_source(node.args[0], primal_fqns)
        fqn = primal_fqns.get(source.name) if source is not None else None
        return [fqn] if fqn else []
    wait = wait_of(node)
    positions = downstream_output_index(wait if wait is not None else node)
    return [output_fqns[p] for p in positions if p in output_fqns]


def build_graph_report(
    gm: fx.GraphModule,
    graph_name: str,
    graph_id: int,
    primal_fqns: dict[str, str],
    output_fqns: dict[int, str],
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
) -> GraphReport:
    """Describe the collectives of ``gm`` (after our passes ran on it).

    Args:
        primal_fqns: placeholder name -> parameter FQN (stored shards).
        output_fqns: output position -> parameter FQN (gradients, backward).
        groups: which process groups are data parallel (the ``role``s).
    """
    compute_seen = 0
    issued: dict[fx.Node, CollectiveInfo] = {}
    collectives: list[CollectiveInfo] = []
    for node in gm.graph.nodes:
        if is_compute(node):
            compute_seen += 1
            continue
        kind = collective_kind(node)
        if kind is not None:
            group_size = collective_group_size(node)
            size = node_bytes(node) if kind == "all_gather" else node_bytes(node.args[0])
            role = groups.role(node)
            dtype, by_dtype = _carried(node, size)
            info = CollectiveInfo(
                kind=kind,
                node=node.name,
                dtype=dtype,
                bytes=size,
                group_size=group_size,
                params=_collective_params(node, kind, primal_fqns, output_fqns, role),
                issue_pos=compute_seen,
                wait_pos=None,
                group=str(collective_group(node)),
                role=role,
                dtype_bytes=by_dtype,
            )
            issued[node] = info
            collectives.append(info)
        elif is_wait(node) and node.args[0] in issued:
            issued[node.args[0]].wait_pos = compute_seen
    return GraphReport(
        graph=graph_name,
        graph_id=graph_id,
        num_compute_nodes=compute_seen,
        collectives=collectives,
    )


# Overlap: how many (data-parallel) collectives have compute between their
# issue and their wait, in our FX graph (as planned) and in Inductor's
# generated wrapper code (what runs, after Inductor's fusions and scheduling).
# Tensor-parallel collectives are waited on where the TP plan needs their
# result and are not ours to overlap, so they are not counted.

_ISSUE_LINE = re.compile(
    r"^(\w+) = torch\.ops\._c10d_functional\."
    r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)\w*\.default\("
)
_WAIT_LINE = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)\)")
_KERNEL_LINE = re.compile(r"^(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+)\(|\.run\(")
# The group name is a collective's last argument, a string literal.
_STRING_LITERAL = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def _issue_group(line: str) -> str | None:
    literals = _STRING_LITERAL.findall(line)
    return (literals[-1][0] or literals[-1][1]) if literals else None


def inductor_overlap(
    source: str, data_parallel_groups: frozenset[str] | None = None
) -> tuple[int, int]:
    """(collectives with at least one compute kernel between issue and wait,
    all collectives) in Inductor's generated wrapper code; only those on
    ``data_parallel_groups`` when given (a line whose group cannot be read
    counts)."""
    open_issues: dict[str, int] = {}  # buffer -> kernels seen since its issue
    overlapped = total = 0
    for raw in source.splitlines():
        line = raw.strip()
        issue = _ISSUE_LINE.match(line)
        if issue:
            group = _issue_group(line)
            if data_parallel_groups is not None and group is not None:
                if group not in data_parallel_groups:
                    continue
            open_issues[issue.group(1)] = 0
            total += 1
            continue
        wait = _WAIT_LINE.search(line)
        if wait and wait.group(1) in open_issues:
            overlapped += open_issues.pop(wait.group(1)) > 0
            continue
        if _KERNEL_LINE.search(line):
            for buf in open_issues:
                open_issues[buf] += 1
    return overlapped, total


def fx_overlap(gm: fx.GraphModule, groups: CollectiveGroups = ALL_DATA_PARALLEL) -> tuple[int, int]:
    """The same count on an FX graph (compute nodes between issue and wait),
    of the data-parallel collectives of ``groups``."""
    open_issues: dict[fx.Node, int] = {}
    overlapped = total = 0
    for node in gm.graph.nodes:
        if collective_kind(node) is not None and groups.is_data_parallel(node):
            open_issues[node] = 0
            total += 1
        elif is_wait(node) and node.args[0] in open_issues:
            overlapped += open_issues.pop(node.args[0]) > 0
        elif is_compute(node):
            for key in open_issues:
                open_issues[key] += 1
    return overlapped, total
