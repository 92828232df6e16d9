"""What the compiler saw and did, as JSON-serialisable data and as a table."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import torch.fx as fx

from simplefsdp.compiler.patterns import (
    collective_kind,
    downstream_output_index,
    is_compute,
    is_wait,
    node_bytes,
    node_dtype,
    source_placeholder,
    wait_of,
)


@dataclass
class CollectiveInfo:
    """One collective in a graph.

    ``issue_pos``/``wait_pos`` count the compute nodes that precede the
    collective / its wait in graph order (0 = before any compute), out of the
    graph's ``num_compute_nodes``.
    """

    kind: str
    node: str
    dtype: str
    bytes: int  # the unsharded buffer: all-gather output, reduce-scatter input
    group_size: int
    params: list[str]
    issue_pos: int
    wait_pos: int | None


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

    def count(self, kind: str) -> int:
        return sum(1 for c in self.collectives if c.kind == kind)

    def total_bytes(self, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.collectives if kind is None or c.kind == kind)


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

    def count(self, graph: str, kind: str) -> int:
        return sum(g.count(kind) for g in self.graphs if g.graph == graph)

    def to_dict(self) -> dict:
        return {"options": self.options, "graphs": [asdict(g) for g in self.graphs]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return format_report(self)


def _fmt_bytes(n: int) -> str:
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


def format_report(report: CommReport) -> str:
    """A readable multi-table view of ``report``."""
    lines = []
    for g in report.graphs:
        counts = ", ".join(
            f"{g.count(k)} {k}" for k in ("all_gather", "reduce_scatter", "all_reduce")
        )
        lines.append(
            f"== {g.graph} graph {g.graph_id}: {counts}; {_fmt_bytes(g.total_bytes())} "
            f"communicated; {g.num_compute_nodes} compute nodes"
        )
        if g.predicted:
            lines.append("   predicted: " + ", ".join(f"{k}={v}" for k, v in g.predicted.items()))
        for note in g.notes:
            lines.append(f"   note: {note}")
        if g.buckets:
            lines.append(f"   {'bucket':<28} {'kind':<15} {'dtype':<9} {'bytes':>10}  params")
            for b in g.buckets:
                lines.append(
                    f"   {b.name[:28]:<28} {b.kind:<15} {b.dtype:<9} {_fmt_bytes(b.bytes):>10}  "
                    f"{_fmt_params(b.params)}"
                )
        header = f"   {'#':>3} {'collective':<15} {'dtype':<9} {'bytes':>10} {'issue@':>7} {'wait@':>6}  params"
        lines.append(header)
        for i, c in enumerate(g.collectives):
            wait = "-" if c.wait_pos is None else str(c.wait_pos)
            lines.append(
                f"   {i:>3} {c.kind:<15} {c.dtype:<9} {_fmt_bytes(c.bytes):>10} "
                f"{c.issue_pos:>7} {wait:>6}  {_fmt_params(c.params)}"
            )
    return "\n".join(lines)


def _collective_params(
    node: fx.Node, kind: str, primal_fqns: dict[str, str], output_fqns: dict[int, str]
) -> list[str]:
    tagged = node.meta.get("simplefsdp_params")
    if tagged is not None:
        return list(tagged)
    if kind == "all_gather":
        source = source_placeholder(node.args[0])
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
) -> GraphReport:
    """Describe the collectives of ``gm`` (after our passes ran on it).

    Args:
        primal_fqns: placeholder name -> parameter FQN (stored shards).
        output_fqns: output position -> parameter FQN (gradients, backward).
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
            group_size = int(node.args[2]) if kind != "all_reduce" else 0
            size = node_bytes(node) if kind == "all_gather" else node_bytes(node.args[0])
            info = CollectiveInfo(
                kind=kind,
                node=node.name,
                dtype=str(node_dtype(node)).replace("torch.", ""),
                bytes=size,
                group_size=group_size,
                params=_collective_params(node, kind, primal_fqns, output_fqns),
                issue_pos=compute_seen,
                wait_pos=None,
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


# Overlap: how many collectives have compute between their issue and their
# wait, in our FX graph (as planned) and in Inductor's generated wrapper code
# (what runs, after Inductor's fusions and scheduling).

_ISSUE_LINE = re.compile(
    r"^(\w+) = torch\.ops\._c10d_functional\."
    r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)\w*\.default\("
)
_WAIT_LINE = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)\)")
_KERNEL_LINE = re.compile(r"^(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+)\(|\.run\(")


def inductor_overlap(source: str) -> tuple[int, int]:
    """(collectives with at least one compute kernel between issue and wait,
    all collectives) in Inductor's generated wrapper code."""
    open_issues: dict[str, int] = {}  # buffer -> kernels seen since its issue
    overlapped = total = 0
    for raw in source.splitlines():
        line = raw.strip()
        issue = _ISSUE_LINE.match(line)
        if issue:
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


def fx_overlap(gm: fx.GraphModule) -> tuple[int, int]:
    """The same count on an FX graph (compute nodes between issue and wait)."""
    open_issues: dict[fx.Node, int] = {}
    overlapped = total = 0
    for node in gm.graph.nodes:
        if collective_kind(node) is not None:
            open_issues[node] = 0
            total += 1
        elif is_wait(node) and node.args[0] in open_issues:
            overlapped += open_issues.pop(node.args[0]) > 0
        elif is_compute(node):
            for key in open_issues:
                open_issues[key] += 1
    return overlapped, total
