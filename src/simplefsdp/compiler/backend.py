"""The torch.compile backend: resharding, our passes, and the report.

Note: [Backend pipeline]
    Dynamo hands us an FX graph of the model (parameters are DTensor inputs).
    AOTAutograd traces the joint forward-backward ATen graph; there the
    reshard pass tags the FSDP all-gather chains (see Note: [Resharding by
    recompute tags]); the min-cut partitioner splits forward and backward
    (plus one repair, Note: [RNG states saved next to opaque objects]).
    Each partitioned graph then runs through our graph passes (bucketing,
    reordering) and is described in the communication report before it goes
    to the executing compiler: Inductor (``compile_fx_inner``) or, for
    ``backend="aot_eager"``, plain FX execution (bitwise equal to eager).
    Inductor settings we need are applied with ``config_patches`` for the
    duration of our compilation only; the user's global config is untouched.
    The names of the model's data-parallel and tensor-parallel process groups
    (``CollectiveGroups``, from its ``DataParallelState``) go to every pass,
    the report and the cost model: only data-parallel collectives are
    bucketed and reordered (Note: [Data-parallel collectives only]).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from simplefsdp.bucket_plan import BucketPlan, resolve_plan
from simplefsdp.compiler import estimate_check, keep_gathered
from simplefsdp.compiler.cost_model import CostModel, calibrated_cost_model, simulate
from simplefsdp.compiler.inductor_cache import cache_processed_graph
from simplefsdp.compiler.keep_gathered import bucket_lookup, free_keep_count, search_keep
from simplefsdp.compiler.memory_estimate import estimate_memory, staged_by
from simplefsdp.compiler.options import CompileOptions
from simplefsdp.compiler.partition import inductor_partitioner, partition
from simplefsdp.compiler.pass_sequence import run_graph_passes
from simplefsdp.compiler.passes.bucketing import CollectiveSite
from simplefsdp.compiler.passes.one_rank import mark_one_rank_casts, one_rank_gathers
from simplefsdp.compiler.passes.reshard import drop_unused_gathers, kept_buckets, mark_reshard
from simplefsdp.compiler.patterns import ALL_DATA_PARALLEL, CollectiveGroups, placeholders
from simplefsdp.compiler.report import (
    CommReport,
    GraphReport,
    build_graph_report,
    format_bytes,
    fx_overlap,
    inductor_overlap,
)
from simplefsdp.compiler.wrapped_model import (
    collective_groups,
    ep_mesh_groups,
    group_backends,
    mesh_device_type,
    mesh_groups,
    reshard_groups_of,
    tp_mesh_groups,
)
from simplefsdp.frontend import rank_check

logger = logging.getLogger(__name__)

LOG_ENV_VAR = "SIMPLEFSDP_LOG"


def _fqn_from_source(source_name: str) -> str | None:
    """``L['self']._modules['a']._parameters['w']`` -> ``a.w`` (Dynamo sources)."""
    if "_parameters[" not in source_name:
        return None
    parts = [m.group(1) for m in re.finditer(r"_(?:modules|parameters)\['([^']+)'\]", source_name)]
    return ".".join(parts) if parts else None


def _flat_slots(value: Any, local: bool = False) -> list[bool]:
    """AOTAutograd's flattening of one graph input: one slot per leaf, True for
    the slot holding a DTensor's local tensor (``local``: ``value`` is one),
    also where that local tensor is a subclass itself (torchao's float8
    weights, Note: [Float8 all-gather])."""
    if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
        attrs, _ = value.__tensor_flatten__()
        slots: list[bool] = []
        for attr in attrs:
            inner = getattr(value, attr)
            is_local = local or attr == "_local_tensor"
            if isinstance(inner, torch.Tensor) and is_traceable_wrapper_subclass(inner):
                slots.extend(_flat_slots(inner, is_local))
            else:
                slots.append(is_local)
        return slots
    return [local]


def primal_fqns(
    gm: fx.GraphModule, example_inputs: Sequence[Any], fqn_by_id: dict[int, str]
) -> list[str | None]:
    """The parameter FQN of each AOTAutograd primal (``primals_1`` is index 0)."""
    result: list[str | None] = []
    for node, value in zip(placeholders(gm.graph), example_inputs):
        fqn = fqn_by_id.get(id(value))
        if fqn is None:
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            if source is not None:
                name = source.name() if callable(source.name) else source.name
                fqn = _fqn_from_source(str(name))
        for is_local in _flat_slots(value):
            result.append(fqn if is_local else None)
    return result


def resolve_bucketing(model: nn.Module, bucketing: Any) -> BucketPlan | None:
    """The static plan for a ``bucketing`` option: ``None`` for ``"none"``;
    for ``"auto"`` the per-block plan (the planner's reference; replaced by
    the auto plan when each forward graph is compiled)."""
    if isinstance(bucketing, str) and bucketing == "none":
        return None
    if isinstance(bucketing, str) and bucketing == "auto":
        return resolve_plan(model, "per_block")
    return resolve_plan(model, bucketing)


class _GraphCompilation:
    """State for compiling one Dynamo graph (its joint, forward and backward)."""

    def __init__(self, backend: SimpleFSDPBackend, graph_id: int, fqns: list[str | None]):
        self.backend = backend
        self.graph_id = graph_id
        self.fqns = fqns
        self.primal_names = {f"primals_{i + 1}": f for i, f in enumerate(fqns) if f}
        # The plan of this graph: the static one, or the auto plan once the
        # forward graph is planned (the backward graph reuses it).
        self.plan = backend.plan()
        self.planned = not backend.is_auto
        self.plan_notes: list[str] = []
        # The auto planner's collective sites of the forward graph, handed to
        # the bucketing pass so it does not find them again.
        self.planned_sites: list[CollectiveSite] | None = None
        # What the joint pass kept gathered (keep_gathered), for the forward report.
        self.kept_gathered: dict = {}
        self.plan_notes_joint: list[str] = []
        # The default budget found by the keep search (Note: [Keeping what
        # eager FSDP2 would hold]), for the forward graph's auto plan.
        self.default_budget_bytes: int | None = None
        # The partitioned backward graph, unchanged, while the forward graph's
        # auto plan may still be checked against it.
        self.backward_graph: fx.GraphModule | None = None
        self.keep_search: dict = {}
        self.kept_fqns: set[str] = set()  # kept gathered, for the auto plan
        # The partitioner's num_fwd_outputs: the forward graph's outputs after
        # these are saved for backward (None: not partitioned by us).
        self.num_fwd_outputs: int | None = None

    def searches_keep(self) -> bool:
        """Whether ``keep_gathered="auto"`` is decided by the budgeted search
        of Note: [Keeping what eager FSDP2 would hold]. Not where every
        parameter is read without a collective (Note: [Resharding a one-rank
        gather]): there is no gathered bucket to keep."""
        options, one_rank = self.backend.options, self.backend.one_rank_gathers
        return (
            options.resolved_keep_gathered() == "auto"
            and options.reshard_after_forward is True
            and not self.backend.partial_groups
            and self.backend.plan() is not None
            and not (one_rank and all(f in one_rank for f in self.fqns if f))
        )

    def partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        """Tag ``joint`` (Note: [Resharding by recompute tags]), deciding first
        what to keep gathered when ``searches_keep()``, then partition it."""
        keep = None
        self.num_fwd_outputs = kwargs["num_fwd_outputs"]  # required by every partitioner
        if self.searches_keep():
            keep = self._search_keep(joint, joint_inputs, kwargs)
        record = self.backend.saved_activations is not None
        if record:  # read before the joint pass tags the graph
            eager = keep_gathered.eager_saved_bytes(joint.graph, self.num_fwd_outputs)
            gathered = keep_gathered.gather_chain_names(joint.graph)
        self.joint_pass(joint.graph, keep_count=keep)
        joint.recompile()
        forward, backward = partition(joint, joint_inputs, **kwargs)
        self.backward_graph = backward if keep is not None else None
        if record:
            saved = (eager, keep_gathered.compiled_saved_bytes(backward, gathered))
            self.backend.saved_activations.append(saved)
        return forward, backward

    def _search_keep(self, joint: fx.GraphModule, joint_inputs, kwargs: dict) -> int:
        """How many of the last buckets to keep; sets ``default_budget_bytes``."""

        def trial_partition(trial: fx.GraphModule, free: int):
            self.joint_pass(trial.graph, keep_count=free, record=False)
            trial.recompile()
            return partition(trial, joint_inputs, **kwargs)

        options, plan = self.backend.options, self.backend.plan()
        free = free_keep_count(options.prefetch_distance, options.reorder)

        def search():
            found = search_keep(
                joint,
                trial_partition,
                free=free,
                plan=plan,
                bucket_of=bucket_lookup(plan),
                primal_names=self.primal_names,
                num_fwd_outputs=self.num_fwd_outputs,
                groups=self.backend.groups,
                memory_budget_bytes=options.memory_budget_bytes,
            )
            if options.memory_budget_bytes is None:
                self.default_budget_bytes = found.budget_bytes
            self.keep_search = found.to_dict()
            self.plan_notes_joint.append(found.note())
            return found.count

        # Once per parameters, or without sizes: Note: [Plans from sizes, not guards].
        return self._keep_count(search, free)

    def decision_key(self, kind: str) -> tuple:
        """Under what a decision about this graph is recorded for later
        graphs of the same parameters (Note: [Plans from sizes, not guards])."""
        return (kind, tuple(f for f in dict.fromkeys(self.fqns) if f))

    def _keep_count(self, search: Callable[[], int], free: int) -> int:
        """How many of the last buckets the joint graph keeps gathered:
        ``search()``'s answer for the first joint graph over its parameters,
        reused by later ones (Note: [Plans from sizes, not guards]); ``free``
        (the buckets gathered at the boundary anyway) when the ranks' first
        inputs differed (Note: [Ranks' first inputs])."""
        backend = self.backend
        key = self.decision_key("keep")
        if key in backend.decisions:
            count, self.default_budget_bytes, self.keep_search, graph_id = backend.decisions[key]
            self.plan_notes_joint.append(
                f"keep_gathered: {count} buckets, as decided for graph {graph_id} (same parameters)"
            )
            return count
        if "forward" in backend.size_independent:
            count = free
            self.plan_notes_joint.append(
                f"keep_gathered: {count} buckets (the ranks' first inputs differ in shape)"
            )
        else:
            count = search()
        backend.decisions[key] = (count, self.default_budget_bytes, self.keep_search, self.graph_id)
        return count

    def _plan_forward(self, gm: fx.GraphModule, graph_name: str) -> None:
        """Plan the auto buckets of the forward (or inference) graph ``gm``
        (Note: [Checking the plan with the estimator]), or reuse the plan of
        an earlier graph of the same parameters (Note: [Plans from sizes, not
        guards]); sets ``plan``, ``plan_notes`` and ``planned_sites``."""
        backend = self.backend
        key = self.decision_key(graph_name)
        backward, self.backward_graph = self.backward_graph, None  # needed only here
        if key in backend.decisions:
            plan, notes, graph_id = backend.decisions[key]
            note = f"auto plan: the plan of graph {graph_id} (same parameters), not planned again"
            decided = estimate_check.GraphPlan(plan, None, [note, *notes])
        else:
            if graph_name in backend.size_independent:  # Note: [Ranks' first inputs]
                note = "auto plan: the ranks' first inputs differ in shape; the per-block plan"
                decided = estimate_check.GraphPlan(backend.plan(), None, [note])
            else:
                decided = estimate_check.plan_graph(self, gm, backward)
            backend.decisions[key] = (decided.plan, decided.notes, self.graph_id)
        self.planned = True
        self.plan, self.planned_sites, self.plan_notes = decided.plan, decided.sites, decided.notes

    def joint_pass(
        self, graph: fx.Graph, keep_count: int | None = None, record: bool = True
    ) -> None:
        """Tag (and for partial resharding rewrite) ``graph``'s gather chains.

        ``keep_count``: keep the last N buckets instead of what
        ``keep_gathered`` says; ``record``: add the report's notes (not for
        a trial partition's copy)."""
        primals = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
        if len(primals) != len(self.fqns):
            logger.debug(
                "graph %d: %d primals but %d flattened inputs; FQNs in the report may be missing",
                self.graph_id,
                len(primals),
                len(self.fqns),
            )
        options = self.backend.options
        keep: set[str] = set()
        wanted = options.resolved_keep_gathered() if keep_count is None else keep_count
        if options.reshard_after_forward and wanted not in (None, 0):
            keep = self._kept(graph, options, wanted, record)
        done = mark_reshard(
            graph, bool(options.reshard_after_forward), keep, self.backend.partial_groups
        )
        one_rank = mark_one_rank_casts(  # Note: [Resharding a one-rank gather]
            graph, options, self.primal_names, self.backend.one_rank_gathers,
            bucket_lookup(self.backend.plan()),
            free_keep_count(options.prefetch_distance, options.reorder),
        )  # fmt: skip
        if not record:
            return
        if one_rank.note():
            self.plan_notes_joint.append(one_rank.note())
        for piece, primal in done.pieces.items():  # names the backward's regathers
            if primal in self.primal_names:
                self.primal_names[piece] = self.primal_names[primal]
        if self.backend.partial_groups:
            size = options.reshard_after_forward
            self.plan_notes_joint.append(
                f"resharded to groups of {size} after forward: {done.partial} parameters "
                f"({format_bytes(done.partial_bytes)} of pieces held from forward to backward)"
                + (
                    f"; {done.partial_skipped} fully (activation checkpointing or uneven rows)"
                    if done.partial_skipped
                    else ""
                )  # fmt: skip
            )

    def _kept(self, graph: fx.Graph, options: CompileOptions, keep: Any, record: bool) -> set[str]:
        """The shards kept gathered (Note: [Keeping gathered parameters]),
        with a note for the forward graph's report."""
        bucket_of = bucket_lookup(self.backend.plan())
        if keep == "auto":  # the buckets gathered at the forward/backward boundary anyway
            keep = free_keep_count(options.prefetch_distance, options.reorder)
        kept, names, nbytes = kept_buckets(graph, bucket_of, keep, self.primal_names.get)
        if not record:
            return kept
        self.kept_fqns = {self.primal_names[k] for k in kept if k in self.primal_names}
        self.kept_gathered = {"buckets": names, "bytes": nbytes, **self.keep_search}
        if names:
            self.plan_notes_joint.append(
                f"kept gathered for backward (not resharded): {', '.join(names)} "
                f"({format_bytes(nbytes)} held from forward to backward)"
            )
        elif not self.backend.one_rank_gathers:  # else the one-rank note says what was kept
            self.plan_notes_joint.append("kept gathered for backward: none matched keep_gathered")
        return kept

    def check_inductor_order(self, graph_name: str, gm: fx.GraphModule, source: str | None) -> None:
        """Record how many collectives still overlap compute in Inductor's code.

        Inductor fuses across our collective boundaries (e.g. a block's last
        add with the next block's norm), which can pull a wait earlier; what
        matters is that compute still runs between each issue and its wait.
        """
        if source is None:
            return
        groups = self.backend.groups
        planned = fx_overlap(gm, groups)
        kept = inductor_overlap(source, groups.data_parallel)
        report = self.backend.report.graph(graph_name, self.graph_id)
        report.overlap = {"planned": list(planned), "inductor": list(kept)}
        report.notes.append(
            f"overlap: {planned[0]}/{planned[1]} collectives overlap compute as planned, "
            f"{kept[0]}/{kept[1]} in Inductor's generated code"
        )

    def process(self, gm: fx.GraphModule, graph_name: str) -> None:
        """Run our passes on a partitioned graph, then record it in the report."""
        output_fqns = dict(enumerate(self.fqns)) if graph_name == "backward" else {}
        notes: list[str] = []
        sites = None
        partial = {g.group_name for g in self.backend.partial_groups.values()}
        if partial and graph_name == "forward" and drop_unused_gathers(gm.graph, partial):
            gm.recompile()  # Note: [Partial resharding in the graph]
        if not self.planned and graph_name in ("forward", "inference"):
            # Note: [Checking the plan with the estimator]
            self._plan_forward(gm, graph_name)
            notes.extend(self.plan_notes)
            # Found on this very graph, not yet changed: reuse them.
            sites, self.planned_sites = self.planned_sites, None
        extra = run_graph_passes(
            gm,
            graph_name,
            self.backend.options,
            self.plan,
            self.primal_names,
            output_fqns,
            sites=sites,
            groups=self.backend.groups,
        )
        groups = self.backend.groups
        report = build_graph_report(
            gm, graph_name, self.graph_id, self.primal_names, output_fqns, groups
        )
        report.notes.extend(notes + extra.get("notes", []))
        if graph_name == "forward":
            report.notes.extend(self.plan_notes_joint)
            report.kept_gathered = dict(self.kept_gathered)
        cost_model = self.backend.cost_model(required=False)
        if cost_model is not None:
            report.predicted.update(simulate(gm, cost_model, groups))
            report.predicted.update(estimate_memory(gm, staged=self.backend.staging).to_dict())
        report.buckets.extend(extra.get("buckets", []))
        report.predicted.update(extra.get("predicted", {}))
        report.overlap = {"planned": list(fx_overlap(gm, groups))}
        self.backend.report.graphs.append(report)
        self.backend.graph_modules.append((graph_name, gm))
        self.backend.log_graph(report)


class SimpleFSDPBackend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=SimpleFSDPBackend(...))``.

    Holds the communication report of everything it compiled (``.report``).
    Build it with ``simplefsdp.compile_backend``.
    """

    def __init__(self, options: CompileOptions, model: nn.Module | None = None) -> None:
        self.options = options
        self.report = CommReport(options=options.describe())
        self._fqn_by_id: dict[int, str] = {}
        self._plan: BucketPlan | None = None
        self._cost_model: CostModel | None = None
        self._mesh_groups: list = []
        self._tp_mesh_groups: list = []
        self._ep_mesh_groups: list = []
        # Which collectives stage a copy (gloo): Note: [Collective buffers until the wait].
        self.staging = staged_by({})
        self._mesh_device_type: str | None = None
        # Data-parallel vs tensor-parallel process groups of the graphs.
        self.groups: CollectiveGroups = ALL_DATA_PARALLEL
        # reshard_after_forward=N: shard group name -> PartialReshardGroup.
        self.partial_groups: dict[str, Any] = {}
        self.one_rank_gathers: frozenset[str] = frozenset()  # Note: [Resharding a one-rank gather]
        # Note: [Checking the plan with the estimator]: only on even shards.
        self.shards_evenly = False
        if model is not None:
            self.shards_evenly = estimate_check.shards_evenly(model)
            self._fqn_by_id = {id(p): n for n, p in model.named_parameters()}
            self._mesh_groups = mesh_groups(model)
            self._tp_mesh_groups = tp_mesh_groups(model)
            self._ep_mesh_groups = ep_mesh_groups(model)
            self.staging = staged_by(group_backends(self._mesh_groups + self._tp_mesh_groups))
            self.groups = collective_groups(model)
            self._mesh_device_type = mesh_device_type(model)
            self._plan = resolve_bucketing(model, options.bucketing)
            self.partial_groups = reshard_groups_of(model, options.reshard_after_forward)
            self.one_rank_gathers = one_rank_gathers(model)
        elif options.bucketing != "none" or not isinstance(options.reshard_after_forward, bool):
            raise ValueError(
                f"bucketing={options.bucketing!r} and reshard_after_forward="
                f"{options.reshard_after_forward!r} need the model (module names, process "
                "groups): pass compile_backend(..., model=model), or use simplefsdp.compile(model)"
            )
        self._graph_ids = itertools.count()
        # Plans and keep decisions by graph kind and parameters, reused by
        # recompiles: Note: [Plans from sizes, not guards].
        self.decisions: dict[tuple, Any] = {}
        # Graph kinds whose first inputs differed between ranks: Note: [Ranks' first inputs].
        self.size_independent: set[str] = set()
        # fullgraph=False: record graph runs (Note: [Same gathers on every rank]).
        self.record_graph_runs = False
        # (graph name, graph module after our passes), for inspection and tests.
        self.graph_modules: list[tuple[str, fx.GraphModule]] = []
        # Set to a list to record, per partitioned joint graph, (activation
        # bytes eager autograd would save, bytes the partitioned forward
        # saves) (Note: [Keeping what eager FSDP2 would hold], steps 1-2):
        # ``simplefsdp plan`` does, for its eager engine (Note: [Plan model]).
        self.saved_activations: list[tuple[int, int]] | None = None

    def plan(self) -> BucketPlan | None:
        """The static bucket plan (``None``: no bucketing; for ``"auto"``, the
        per-block reference plan)."""
        return self._plan

    @property
    def is_auto(self) -> bool:
        return isinstance(self.options.bucketing, str) and self.options.bucketing == "auto"

    def cost_model(self, required: bool) -> CostModel | None:
        """The injected or prepared (calibrated) cost model. Never
        communicates: when ``required`` and there is none, the defaults."""
        if self._cost_model is None and self.options.cost_model is not None:
            self._cost_model = self.options.cost_model
        if self._cost_model is None and required:
            # Only reached when no cost model was prepared at construction
            # (e.g. a graph compiled on one rank only): plan with the defaults
            # rather than communicate during compilation, which could hang.
            logger.warning("simplefsdp auto plan: no calibrated cost model; using defaults")
            self._cost_model = CostModel()
        return self._cost_model

    def prepare(self) -> None:
        """Calibrate the cost model now (collective: call on every rank),
        outside compilation. See Note: [Identical plans without
        compile-time collectives]."""
        if self.is_auto and self.options.cost_model is None and self._cost_model is None:
            self._cost_model = calibrated_cost_model(
                self._mesh_groups,
                self._mesh_device_type,
                self._tp_mesh_groups,
                self._ep_mesh_groups,
            )

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        compilation = _GraphCompilation(
            self, next(self._graph_ids), primal_fqns(gm, example_inputs, self._fqn_by_id)
        )
        if self.options.backend == "aot_eager":
            compiled = _compile_aot_eager(gm, example_inputs, compilation)
        else:
            compiled = _compile_inductor(gm, example_inputs, compilation)
        if self.record_graph_runs:  # Note: [Same gathers on every rank]
            fqns = ",".join(f for f in compilation.fqns if f)
            positions = [i for i, v in enumerate(example_inputs) if id(v) in self._fqn_by_id]
            return rank_check.recorded(compiled, fqns, self._fqn_by_id, positions)
        return compiled

    def log_graph(self, report: GraphReport) -> None:
        single = CommReport(graphs=[report], options=self.report.options)
        if os.environ.get(LOG_ENV_VAR, "").lower() in ("1", "report", "true", "info"):
            print(f"[simplefsdp] communication report\n{single}", flush=True)
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug("communication report\n%s", single)


def _partition(compilation: _GraphCompilation, joint: fx.GraphModule, joint_inputs, **kwargs):
    return compilation.partition(joint, joint_inputs, **kwargs)


def _eager_compiler(compilation: _GraphCompilation, graph_name: str, gm, example_inputs):
    from torch._functorch._aot_autograd.utils import make_boxed_func

    compilation.process(gm, graph_name)
    gm.recompile()
    return make_boxed_func(gm.forward)


def _compile_aot_eager(gm, example_inputs, compilation: _GraphCompilation):
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(
        fw_compiler=functools.partial(_eager_compiler, compilation, "forward"),
        bw_compiler=functools.partial(_eager_compiler, compilation, "backward"),
        inference_compiler=functools.partial(_eager_compiler, compilation, "inference"),
        partition_fn=functools.partial(_partition, compilation),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _compile_inductor(gm, example_inputs, compilation: _GraphCompilation):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    use_cache = bool(torch._inductor.config.fx_graph_cache)  # the user's setting

    def inner_compile(graph_module, inputs, *args, **kwargs):
        if kwargs.get("is_backward"):
            name = "backward"
        elif kwargs.get("is_inference"):
            name = "inference"
        else:
            name = "forward"
        compilation.process(graph_module, name)
        graph_module.recompile()
        # The graph is final here (our passes ran): Inductor may serve it from
        # its FX graph cache (Note: [Inductor's cache for processed graphs]).
        with cache_processed_graph(use_cache):
            compiled = compile_fx_inner(graph_module, inputs, *args, **kwargs)
        compilation.check_inductor_order(name, graph_module, getattr(compiled, "source_code", None))
        return compiled

    config_patches = {
        # Not before our passes: a graph is cached only once they have run
        # (Note: [Inductor's cache for processed graphs]).
        "fx_graph_cache": False,
        # Inductor's peak-memory reordering sinks our prefetched all-gathers
        # back next to their waits (undoing the overlap); our order is already
        # memory-bounded (Note: [Reordering rules]).
        "reorder_for_peak_memory": False,
    }
    # Our tags must be applied to the joint graph right before partitioning:
    # by our partitioner (which may search what to keep gathered first), or
    # where this torch has no partitioner hook, by Inductor's last joint pass.
    partitioner = inductor_partitioner(compilation.partition)
    if partitioner is not None:  # also Note: [RNG states saved next to opaque objects]
        config_patches["custom_partitioner_fn"] = partitioner
    else:
        config_patches["joint_custom_post_pass"] = compilation.joint_pass
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(
            gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches
        )
