"""Pipeline parallelism over the engines: stages that are sharded (and compiled)
by an engine and run by torch's own schedules (``torch.distributed.pipelining``).

:func:`parallelize_pipeline` splits a model into stages with a user
``split_fn`` (a model spec's ``pipeline_split``),
parallelises each stage of this rank with :func:`~.parallelize.parallelize` on
the job's mesh without its ``"pp"`` dim, and builds the schedule. The
:class:`PipelinedModel` it returns runs one step (:meth:`PipelinedModel.step`)
and exposes the rank's stages as one module under the whole model's names
(:attr:`PipelinedModel.module`) for the optimizer, gradient clipping and
distributed checkpoints, so checkpoints move between pipeline layouts.

Note: [Gradient reduction once per pipeline step]
    A pipeline schedule runs every micro-batch's forward before the
    backwards of the earlier ones finish (GPipe: all forwards first; 1F1B:
    the last forward before the last few backwards), so the last
    micro-batch's forward cannot carry the other micro-batches' gradients
    into its reduction, which is what ``simplefsdp.no_sync`` relies on. For
    engine ``simplefsdp`` (compiled or not) the whole schedule step runs
    inside ``no_sync`` of each stage: every backward sums its unreduced
    gradient on the rank; after the step :func:`simplefsdp.reduce_accumulated`
    reduces each parameter's sum once (a read whose backward gets the sum:
    one all-gather and one reduce-scatter per parameter and step, uncompiled,
    instead of a reduce-scatter per micro-batch). For ``fsdp2`` torch's
    stages call ``set_requires_gradient_sync`` themselves. Losses are scaled
    by ``1 / micro-batches`` in the loss function (``scale_grads=False``), so
    every engine gets the mean over micro-batches.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines.adapters import EngineSpec, InitFn, TensorParallelFn, parallelize
from simplefsdp.engines.distributed import pipeline_mesh, stage_mesh
from simplefsdp.engines.kinds import composition_errors
from simplefsdp.engines.parallel_model import ParallelModel, plain_loss
from simplefsdp.layout import Meshes
from simplefsdp.parallel_dims import INTERLEAVED_SCHEDULES, PIPELINE_SCHEDULES

#: :data:`PIPELINE_SCHEDULES` -> torch's schedule class.
_TORCH_SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}

#: split_fn(model, stage_ids, num_stages) -> one module per stage id
SplitFn = Callable[[nn.Module, Sequence[int], int], list[nn.Module]]


@dataclass
class PipelineSpec:
    """How to pipeline a model.

    Attributes:
        pp: pipeline ranks (the mesh's ``"pp"`` dim).
        schedule: one of :data:`PIPELINE_SCHEDULES`.
        microbatches: micro-batches per step (the batch must divide by it).
        stages_per_rank: stages each rank holds (``None``: 2 for interleaved
            schedules, else 1); interleaved schedules need >= 2, the others 1.
    """

    pp: int
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"pp must be an int >= 1, got {self.pp!r}")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"unknown pipeline schedule {self.schedule!r}; valid: "
                + ", ".join(PIPELINE_SCHEDULES)
            )
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        interleaved = self.schedule in INTERLEAVED_SCHEDULES
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if interleaved else 1
        if interleaved and self.stages_per_rank < 2:
            raise ValueError(
                f"schedule {self.schedule!r} needs stages_per_rank >= 2, got {self.stages_per_rank}"
            )
        if not interleaved and self.stages_per_rank != 1:
            raise ValueError(
                f"schedule {self.schedule!r} runs one stage per rank, got stages_per_rank "
                f"{self.stages_per_rank}; use 'interleaved_1f1b' for more"
            )

    @property
    def num_stages(self) -> int:
        assert self.stages_per_rank is not None
        return self.pp * self.stages_per_rank


def stage_view(parts: Sequence[nn.Module]) -> nn.Module:
    """One module holding ``parts``' submodules under the whole model's names.

    The parts are copies of one model that each keep some children (for
    Llama 3, layers under their original keys of ``layers``, the embedding on
    the first stage and the head on the last): children of the same name
    that are ``nn.ModuleDict`` are merged, others must be held by one part.
    ``view.parameters()`` are the parts' own parameters, and
    ``view.state_dict()`` has the same keys as the unsplit model's, so
    optimizers and distributed checkpoints see one model.

    Raises:
        ValueError: two parts hold a child of the same name that is not a
            ``ModuleDict``, or a part holds parameters of its own.
    """
    view = nn.Module()
    for part in parts:
        if any(p is not None for p in part._parameters.values()):
            raise ValueError(
                f"stage {type(part).__name__} holds parameters outside its submodules "
                f"({', '.join(part._parameters)}); stage_view merges submodules only"
            )
        for name, child in part.named_children():
            existing = view._modules.get(name)
            if isinstance(child, nn.ModuleDict):
                if existing is None:
                    existing = nn.ModuleDict()
                    view.add_module(name, existing)
                for key, sub in child.items():
                    existing[key] = sub
            elif existing is not None:
                raise ValueError(f"two pipeline stages hold the same submodule {name!r}")
            else:
                view.add_module(name, child)
    return view


@dataclass
class PipelineTimes:
    """Wall-clock seconds of this rank's last :meth:`PipelinedModel.step`.

    Attributes:
        step_s: the whole step (schedule and gradient reduction).
        busy_s: inside this rank's stages' forward and backward computations
            (their data-parallel collectives included) and the gradient
            reduction after the schedule.
    """

    step_s: float = 0.0
    busy_s: float = 0.0

    @property
    def bubble_fraction(self) -> float | None:
        """The share of the step this rank waited on its pipeline neighbours."""
        return None if self.step_s <= 0 else max(0.0, 1.0 - self.busy_s / self.step_s)


class PipelinedModel:
    """This rank's pipeline stages, each an engine's :class:`ParallelModel`, and
    the schedule that runs them (see :func:`parallelize_pipeline`).

    Attributes:
        parts: one :class:`ParallelModel` per stage of this rank.
        stage_ids: the stages' indices (model order).
        num_stages: stages in the whole pipeline.
        module: :func:`stage_view` of the parts (optimizer, clipping, checkpoints).
        engine: the engine's name.
        mesh: the data-parallel mesh of the stages.
        tp_mesh: the tensor-parallel mesh (``None`` without TP).
        pp_mesh: the pipeline mesh.
        spec: the :class:`PipelineSpec`.
        compiled: whether the stages are compiled.
        has_first / has_last: this rank holds the first / last stage (it
            feeds the inputs / computes the loss).
        times: the last step's :class:`PipelineTimes`, measured when
            ``measure_times`` (on CUDA each stage computation then
            synchronises the device, which costs overlap).
    """

    def __init__(
        self,
        parts: list[ParallelModel],
        stage_ids: list[int],
        spec: PipelineSpec,
        pp_mesh: DeviceMesh,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        measure_times: bool = False,
        sequence: Any = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.parts = parts
        self.stage_ids = stage_ids
        self.spec = spec
        self.num_stages = spec.num_stages
        self.pp_mesh = pp_mesh
        self.engine = parts[0].engine
        self.mesh = parts[0].mesh
        self.tp_mesh = parts[0].tp_mesh
        self.compiled = parts[0].compiled
        self.notes = parts[0].notes
        self.module = stage_view([p.module for p in parts])
        self.has_first = 0 in stage_ids
        self.has_last = self.num_stages - 1 in stage_ids
        self._loss_fn = loss_fn
        self._scale = 1.0
        self._device = device
        self.measure_times = measure_times
        self.times = PipelineTimes()
        self.sequence = sequence
        self._context: Any = None
        submods = [p.forward if isinstance(p.forward, nn.Module) else p.module for p in parts]
        if sequence is not None and sequence.active:
            for submod in submods:  # outside any compiled region: the context is an input
                submod.register_forward_pre_hook(self._pass_context, with_kwargs=True)
        stages = [
            PipelineStage(submod, stage_id, self.num_stages, device, group=pp_mesh.get_group())
            for stage_id, submod in zip(stage_ids, submods)
        ]
        for stage in stages:  # the schedule calls these per micro-batch
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                method = getattr(stage, name, None)
                if method is not None:
                    setattr(stage, name, self._timed(method))
        self.stages = stages
        cls = getattr(schedules, _TORCH_SCHEDULES[spec.schedule])
        self.schedule = cls(
            stages if spec.schedule in INTERLEAVED_SCHEDULES else stages[0],
            n_microbatches=spec.microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=False,
        )

    def _pass_context(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A stage's forward gets the step's sequence context (Note: [Context
        parallelism in pipeline stages])."""
        return args, {**kwargs, "context": self._context}

    def _split(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's share of the sequences, and the step's context for every stage.

        Note: [Context parallelism in pipeline stages]
            Every pipeline rank of a replica gets the same batch, so each
            splits it itself: the first stage feeds its share of the tokens,
            the last computes the loss on its share of the targets, and every
            stage's attention gets the context by a forward pre-hook on the
            stage module (so a compiled stage takes it as an input). The
            schedule splits the batch into micro-batches along the rows, so
            the context must not depend on the rows: causal splits only
            (document masks are refused with pipelines).
        """
        if self.sequence is None or not self.sequence.active:
            return inputs, targets
        reference = inputs if inputs is not None else targets
        assert reference is not None, "a pipeline rank gets the batch"
        _, _, self._context = self.sequence.prepare(reference[:, :1].expand_as(reference))
        index = self._context.index[self._context.rank]
        return (
            None if inputs is None else inputs[:, index],
            None if targets is None else targets[:, index],
        )

    def _sync(self) -> None:
        if self.measure_times and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.measure_times:
                return fn(*args, **kwargs)
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.times.busy_s += time.perf_counter() - start

        return timed

    @property
    def has_loss(self) -> bool:
        """Whether :meth:`step` and :meth:`eval_loss` return a loss on this
        rank (it holds the last stage)."""
        return self.has_last

    @property
    def can_evaluate(self) -> bool:
        """Whether this torch's schedules can run :meth:`eval_loss`."""
        return hasattr(self.schedule, "eval")

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target) * self._scale

    def after_optimizer_step(self) -> None:
        """Each part's :meth:`ParallelModel.after_optimizer_step`."""
        for part in self.parts:
            part.after_optimizer_step()

    @contextlib.contextmanager
    def compile_context(self) -> Iterator[None]:
        """The parts' Inductor patches (see :meth:`ParallelModel.compile_context`)."""
        with self.parts[0].compile_context():
            yield

    @contextlib.contextmanager
    def _accumulating(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        from simplefsdp.frontend.accumulation import no_sync

        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(no_sync(part.module))
            yield

    def step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        scale: float = 1.0,
        sync: bool = True,
    ) -> torch.Tensor | None:
        """One forward and backward of the pipeline over ``spec.microbatches``
        micro-batches of ``inputs``; gradients go to ``param.grad``.

        Every pipeline rank of one data-parallel replica calls it with the
        same batch (the first stage reads ``inputs``, the last ``targets``).

        Args:
            scale: multiplies the loss (e.g. ``1 / grad_accum_steps``); the
                mean over micro-batches is applied on top.
            sync: reduce the gradients after this step (``False``: keep
                summing them on the rank, for gradient accumulation over
                several steps; the next ``sync=True`` step reduces all).

        Returns:
            On a rank holding the last stage, the scaled mean loss of the
            micro-batches (detached); elsewhere ``None``.
        """
        self._scale = scale / self.spec.microbatches
        self.times = PipelineTimes()
        self._sync()
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        accumulate = self.engine == "simplefsdp"
        inputs, targets = self._split(inputs, targets)
        args = (inputs,) if self.has_first else ()
        with self._accumulating(accumulate):
            if self.engine == "fsdp2" and not sync:
                for part in self.parts:
                    part.module.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                self.schedule.step(*args, target=targets if self.has_last else None, losses=losses)
            finally:
                if self.engine == "fsdp2" and not sync:
                    for part in self.parts:
                        part.module.set_requires_gradient_sync(True)  # type: ignore[operator]
        if accumulate and sync:
            self._timed(self._reduce)()
        self._sync()
        self.times.step_s = time.perf_counter() - start
        if not self.has_last:
            return None
        return torch.stack([plain_loss(loss).detach() for loss in losses]).sum()

    def _reduce(self) -> None:
        from simplefsdp.frontend.accumulation import reduce_accumulated

        for part in self.parts:
            reduce_accumulated(part.module)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> Any:
        """The mean loss of a forward-only pass (last stage; ``None`` elsewhere).

        Raises:
            NotImplementedError: this torch's schedules have no ``eval``.
        """
        if not hasattr(self.schedule, "eval"):
            raise NotImplementedError("this torch's pipeline schedules cannot evaluate")
        self._scale = 1.0 / self.spec.microbatches
        losses: list[torch.Tensor] = []
        inputs, targets = self._split(inputs, targets)
        args = (inputs,) if self.has_first else ()
        self.schedule.eval(*args, target=targets if self.has_last else None, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([plain_loss(loss).detach() for loss in losses]).sum()


def parallelize_pipeline(
    model: nn.Module,
    spec: EngineSpec,
    pipeline: PipelineSpec,
    mesh: DeviceMesh | Meshes,
    device: torch.device,
    *,
    split_fn: SplitFn,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    init_fn: InitFn | None = None,
    tp_fn: TensorParallelFn | None = None,
    measure_times: bool = False,
    sequence: Any = None,
) -> PipelinedModel:
    """Split ``model`` into stages and parallelise this rank's with ``spec``.

    Args:
        model: the whole model, best on the meta device (each stage is a copy).
        spec: the engine spec each stage gets (an engine with the ``"pp"`` capability).
        pipeline: the schedule, micro-batches and stages per rank.
        mesh: the job's meshes with a ``pp`` role of size ``pipeline.pp``
            (``Layout(pp=...).build(...)``), or its world mesh.
        device: the training device.
        split_fn: ``split_fn(model, stage_ids, num_stages)``, one module per
            stage id (e.g. a model spec's ``pipeline_split``).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a mean.
        init_fn / tp_fn: as for :func:`~.parallelize.parallelize`, per stage.
        measure_times: record :attr:`PipelinedModel.times` each step.
        sequence: how steps split their sequences over context-parallel
            ranks (a :class:`simplefsdp.context_parallel.SequenceOptions`
            without document masks; Note: [Context parallelism in pipeline
            stages]).

    Raises:
        ValueError: an engine that cannot be pipelined, or a mesh whose
            ``"pp"`` dim does not match ``pipeline.pp``.
    """
    errors = composition_errors(spec.engine, pp=pipeline.pp)
    if errors:
        raise ValueError(errors[0])
    world = mesh.world if isinstance(mesh, Meshes) else mesh
    pp_mesh = mesh.pp if isinstance(mesh, Meshes) else pipeline_mesh(mesh)
    pp_size = pp_mesh.size() if pp_mesh is not None else 1
    if pp_mesh is None or pp_size != pipeline.pp:
        raise ValueError(
            f"the mesh {world.mesh_dim_names} {tuple(world.shape)} has a pipeline size of "
            f"{pp_size} but pipeline.pp is {pipeline.pp}; build it with "
            f"Layout(pp={pipeline.pp})"
        )
    assert pipeline.stages_per_rank is not None
    # torch's "loop" placement, as simplefsdp.models.common.stages.stage_ids_for_rank
    pp_rank = pp_mesh.get_local_rank()
    stage_ids = [pp_rank + k * pipeline.pp for k in range(pipeline.stages_per_rank)]
    modules = split_fn(model, stage_ids, pipeline.num_stages)
    rest = mesh if isinstance(mesh, Meshes) else stage_mesh(mesh)
    # a stage of dense blocks only (a model's leading ones) has no experts
    parts = [
        parallelize(module, spec, rest, device, init_fn=init_fn, tp_fn=tp_fn, need_experts=False)
        for module in modules
    ]
    return PipelinedModel(
        parts,
        stage_ids,
        pipeline,
        pp_mesh,
        device,
        loss_fn,
        measure_times=measure_times,
        sequence=sequence,
    )
