"""The training loop of ``simplefsdp train``: one :class:`Trainer` per rank.

The trainer is split into small steps, each a method::

    Trainer(job)
      .setup()        process group, seeds, data, model (parallelize), optimizer +
                      schedule, checkpointer, the run (resume or new, see
                      simplefsdp.train.runs), metrics
      .train()        for each step: train_step (micro-batches, clip, optimizer,
                      schedule) -> log -> validate -> checkpoint -> stop on
                      SIGINT/SIGTERM (simplefsdp.train.interrupts)
      .close()        flush logs, destroy the process group

Run it under ``torchrun`` (or ``simplefsdp train``, which starts the
processes); with no process-group environment it trains in a single process.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simplefsdp._faults import maybe_kill_at_step, maybe_sleep_after_step
from simplefsdp.checkpoint import (
    Checkpointer,
    resume_checkpoint,
    step_dir_name,
)
from simplefsdp.compiler.inductor_cache import inductor_cache_counts
from simplefsdp.engines import (
    MemoryProbe,
    ParallelModel,
    PipelinedModel,
    clip_grad_norm_,
    comm_device,
    init_distributed,
    lower_mmap_threshold,
    pick_device,
    teardown_process_group,
)
from simplefsdp.models.record import model_record
from simplefsdp.train.config import JobConfig, config_hash, config_to_dict
from simplefsdp.train.interrupts import StopAgreement, StopRequest
from simplefsdp.train.launch import (
    ERROR_DIR_ENV,
    STOPPED_MARK,
    launcher_error_dir,
    note_step,
    note_stoppable,
)
from simplefsdp.train.metrics import (
    MMAP_THRESHOLD_BYTES,
    CompileWatch,
    Heartbeat,
    MetricsWriter,
    ProgressDisplay,
    TrainSummary,
    format_step_line,
    mfu,
    peak_flops_for,
)
from simplefsdp.train.parallelism import (
    hf_model,
    job_mesh,
    model_config,
    model_spec,
    parallelize_job,
)
from simplefsdp.train.resume import start_run_files
from simplefsdp.train.runs import (
    RUN_ID_ENV,
    describe_runs,
    new_run_id,
    run_checkpoint_folder,
    run_folder,
)
from simplefsdp.train.schedule import build_lr_scheduler, json_ready

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- setup helpers


@contextlib.contextmanager
def _compile_errors() -> Iterator[None]:
    """A damaged compile cache (``simplefsdp.train.compile_errors``) becomes one line."""
    try:
        yield
    except Exception as exc:
        from simplefsdp.train.compile_errors import describe_compile_error

        message = describe_compile_error(exc)
        if message is None:
            raise
        raise TrainingError(message) from exc


class TrainingError(RuntimeError):
    """A failure the user can act on, reported as one line (exit code 1)."""


# --------------------------------------------------------------------------- trainer


class Trainer:
    """Trains a model of any registered family per a validated :class:`JobConfig` on this rank.

    Args:
        job: the job configuration (already validated by ``load_config``).
    """

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.device = pick_device()
        self.step = 0
        self.summary = TrainSummary(output_dir=job.metrics.output_dir)
        self.run_id = ""
        self.run_dir: Path | None = None  # Note: [One run per folder] in train/runs.py
        self.exit_code = 0
        self._writer: MetricsWriter | None = None
        self._progress: ProgressDisplay | None = None
        self._stop_agreement: StopAgreement | None = None
        self._staging_wait_s = 0.0  # waited for asynchronous saves' copies since the last log

    # -- setup -------------------------------------------------------------

    def setup(self) -> None:
        """Build everything; resume from the latest checkpoint if asked to."""
        self.rank, self.world_size = init_distributed(self.device)
        self.mesh = job_mesh(self.job, self.device)
        self.dp_rank, self.dp_size = self.mesh.batch_rank, self.mesh.batch_size
        self._seed()
        self._build_data()
        if self.device.type == "cpu":
            lower_mmap_threshold(MMAP_THRESHOLD_BYTES)  # see [Peak memory on CPU] in metrics.py
        self.memory = MemoryProbe(self.device)
        self.memory.reset()
        self._build_model()
        self._probe_float8()
        self._build_optimizer()
        resume_step = self._start_run()
        self._build_checkpointer()
        if resume_step < 0 and self.job.checkpoint.init_from_hf is not None:
            self._init_from_hf()
        self._build_metrics()
        self._maybe_resume(resume_step)

    def _seed(self) -> None:
        t = self.job.training
        torch.manual_seed(t.seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(t.seed)
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False

    def _build_data(self) -> None:
        from simplefsdp.data import build_data

        # Each node verifies its own copy of token shards, split over its ranks.
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        bundle = build_data(
            self.job.data,
            rank=self.dp_rank,
            world_size=self.dp_size,
            seed=self.job.training.seed,
            report=self.rank == 0,
            vocab_size=self.job.model.vocab_size,
            verify=(local, per_node),
        )
        self.tokenizer, self.loader = bundle.tokenizer, bundle.loader
        # Chat data trains on the assistant's tokens only: counted per step.
        self._trained_tokens = 0 if self.loader.has_loss_mask else None
        self._trained_in_window = 0
        self._micro_trained = -1  # targets trained on in the last micro-batch (-1: not counted)
        self._check_same_data(self.loader.fingerprint)

    def _check_same_data(self, fingerprint: dict[str, int]) -> None:
        """Every rank must have read the same tokens (each node reads its own
        copy of ``data.path`` in a multi-node job)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, fingerprint)
        differ = [r for r, f in enumerate(gathered) if f != gathered[0]]
        if differ:
            raise ValueError(
                f"ranks {differ} read other data than rank 0 ({gathered[differ[0]]} vs "
                f"{gathered[0]}: tokens and hash of the training split); every node must see "
                f"the same data.path {self.job.data.path!r} and tokenizer"
            )

    def _model_args(self) -> Any:
        if self.job.checkpoint.init_from_hf is not None:
            return self._hf_model_args()
        m, overrides = self.job.model, {}
        overrides["vocab_size"] = m.vocab_size or self.tokenizer.vocab_size
        if m.max_seq_len is not None:
            overrides["max_seq_len"] = m.max_seq_len
        args = model_config(self.job, **overrides)
        if self.job.data.seq_len > args.max_seq_len:
            raise ValueError(
                f"data.seq_len {self.job.data.seq_len} exceeds the max_seq_len "
                f"{args.max_seq_len} of model {m.name!r}; lower data.seq_len or raise model.max_seq_len"
            )
        return args

    def _hf_model_args(self) -> Any:
        """The model of ``checkpoint.init_from_hf``'s config.json (its family's
        configuration, see ``hf_model``), checked against the tokenizer and
        ``data.seq_len``."""
        from simplefsdp.checkpoint.hf import CONFIG_FILE

        source = str(Path(self.job.checkpoint.init_from_hf or "") / CONFIG_FILE)
        args = hf_model(self.job)[1]
        if self.tokenizer.vocab_size > args.vocab_size:
            raise ValueError(
                f"the tokenizer's {self.tokenizer.vocab_size} tokens do not fit the "
                f"vocab_size {args.vocab_size} of {source}; use the checkpoint's tokenizer "
                "(data.tokenizer)"
            )
        if self.job.data.seq_len > args.max_seq_len:
            raise ValueError(
                f"data.seq_len {self.job.data.seq_len} exceeds max_position_embeddings "
                f"{args.max_seq_len} of {source}; lower data.seq_len or raise model.max_seq_len"
            )
        return args

    def _init_from_hf(self) -> None:
        """Overwrite the initial weights with ``checkpoint.init_from_hf``'s (this rank's slices)."""
        from simplefsdp.checkpoint.hf import load_hf_weights

        folder = self.job.checkpoint.init_from_hf
        start = time.perf_counter()
        elements = load_hf_weights(self.model, folder, args=self.model_args)
        logger.info(
            "initialised from Hugging Face checkpoint %s: %.2fM elements on this rank in %.1f s",
            folder,
            elements / 1e6,
            time.perf_counter() - start,
        )

    def _build_model(self) -> None:
        self.model_args = self._model_args()
        self.spec = model_spec(self.job)
        self._step_metrics: dict[str, Any] = {}
        # Note: [Weights on CPU]: a CPU mesh initialises each shard of a meta
        # model from this rank's generator, the same on every rank (CUDA
        # meshes use DTensor's offset-based RNG tracker), so one rank's rows
        # would repeat another's: experts that are copies of each other (and
        # stay so: tied router scores) and an initialisation that depends on
        # the world size. On CPU a model therefore starts from one full
        # initialisation, which the parallel layout scatters, as in one process.
        build_on = "cpu" if self.device.type == "cpu" else "meta"
        with torch.device(build_on):
            model = self.spec.build(self.model_args)
        self.parallel: ParallelModel | PipelinedModel = parallelize_job(
            model, self.job, self.device, self.mesh, eos_id=self.tokenizer.eos_id
        )
        # A pipeline's loss exists on its last stage only: see _global_mean.
        self._loss_weight = 1.0 if self.parallel.has_loss else 0.0
        self.model = self.parallel.module
        self.flops_per_token = self.spec.flops_per_token(self.model_args, self.job.data.seq_len)
        self.peak_flops = peak_flops_for(self.device)
        logger.info(
            "model %s: %.2fM parameters, %.3g FLOPs/token",
            self.job.checkpoint.init_from_hf or self.job.model.name,
            self.spec.num_params(self.model_args) / 1e6,
            self.flops_per_token,
        )

    def _probe_float8(self) -> None:
        """Say so when float8 matmuls are much slower than bf16 on this CPU
        (Note: [Float8 on CPU] in simplefsdp.train.float8_probe)."""
        if not (self.job.float8.enable and self.device.type == "cpu" and self.rank == 0):
            return
        from simplefsdp.train.float8_probe import float8_warning

        dim = int(getattr(self.model_args, "dim", 0))
        hidden = getattr(self.model_args, "ffn_hidden_dim", None)
        hidden = int(hidden() if callable(hidden) else hidden or 4 * dim)
        warning = float8_warning(dim, hidden) if dim else None
        if warning is not None:
            logger.warning("%s", warning)

    def _flavor(self) -> str | None:
        """The canonical flavor name, ``None`` for a model from a Hugging Face folder."""
        from simplefsdp.models.registry import canonical_flavor

        if self.job.checkpoint.init_from_hf is not None:
            return None
        return canonical_flavor(self.job.model.name)

    def _build_optimizer(self) -> None:
        t = self.job.training
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=True
        )
        self.scheduler = build_lr_scheduler(self.optimizer, self.job)

    def _build_checkpointer(self) -> None:
        self.checkpointer = Checkpointer(
            self.checkpoint_dir,
            model=self.model,
            optimizer=self.optimizer,
            device=self.device,
            keep_last=self.job.checkpoint.keep_last,
            config_hash=config_hash(self.job),
            config_json={
                "job": config_to_dict(self.job),
                "model_args": asdict(self.model_args),
                "model": model_record(self.spec, self.model_args, self._flavor()),
            },
            async_mode=self.job.checkpoint.async_mode,
        )

    def _build_metrics(self) -> None:
        if self.rank == 0:
            assert self.run_dir is not None
            mt = self.job.metrics
            self._writer = MetricsWriter(
                self.run_dir,
                tensorboard=mt.tensorboard,
                run_id=self.run_id,
                wandb=mt.wandb,
                wandb_project=mt.wandb_project,
                wandb_run_name=mt.wandb_run_name,
                config=config_to_dict(self.job) if mt.wandb else None,
            )
            self.summary.metrics_path = str(self._writer.path)
            tb = self._writer.tensorboard_dir
            self.summary.tensorboard_dir = None if tb is None else str(tb)

    def _start_run(self) -> int:
        """Decide (on rank 0) whether this run resumes, and its id and folders.

        See Note: [One run per folder] in :mod:`simplefsdp.train.runs`. Under
        ``simplefsdp train`` the launcher has written the run's files; under
        torchrun rank 0 writes them here.

        Returns:
            The step of the checkpoint to resume from, or -1 for a new run.

        Raises:
            ValueError: ``checkpoint.resume`` is set and there is nothing to resume.
        """
        decision: list[Any] = [None]
        if self.rank == 0:
            decision = [self._decide_run()]
        dist.broadcast_object_list(decision, src=0, device=comm_device(self.device))
        step, run_id, error = decision[0]
        if error:
            raise ValueError(error)
        self.run_id = self.summary.run_id = run_id
        self.run_dir = run_folder(self.job.metrics.output_dir, run_id)
        self.checkpoint_dir = run_checkpoint_folder(self.job.checkpoint.folder, self.run_dir)
        self.summary.output_dir = str(self.run_dir)
        if self.rank == 0 and not os.environ.get(ERROR_DIR_ENV):
            start_run_files(self.job, run_id, self.run_dir, resumed=step >= 0)
        return step

    def _decide_run(self) -> tuple[int, str, str | None]:
        """``(resume step, run id, error)``; rank 0 only."""
        ck, mt = self.job.checkpoint, self.job.metrics
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        elastic_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        run_id = os.environ.get(RUN_ID_ENV) or (elastic_id if elastic_id != "none" else "")
        run_id = run_id or new_run_id()
        folder = run_checkpoint_folder(ck.folder, run_folder(mt.output_dir, run_id))
        if ck.resume or ck.resume_if_possible or (restarted and ck.enable):
            try:  # a restart continues from the latest, not from load_step again
                info = resume_checkpoint(folder, -1 if restarted else ck.load_step, report=True)
            except ValueError as exc:  # a damaged checkpoint: see [Damaged checkpoints]
                return -1, run_id, str(exc)
            if info is not None:
                return info.step, run_id, None
            if ck.resume and not restarted:
                return (
                    -1,
                    run_id,
                    (
                        f"--resume: run {run_id} has no complete checkpoint in {folder} "
                        f"({describe_runs(mt.output_dir)})"
                    ),
                )
        return -1, run_id, None

    def _maybe_resume(self, step: int) -> None:
        if step >= 0:
            folder = self.checkpoint_dir / step_dir_name(step)
            state = self.checkpointer.load(folder)
            self.loader.load_state_dict(state["data_loader"])
            self.step = int(state["step"])
            # The LR follows the step and the current config, not the saved schedule.
            self.scheduler = build_lr_scheduler(self.optimizer, self.job, start_step=self.step)
            self.summary.checkpoint = str(folder)
        if self._writer is not None:
            event = "run_resumed" if step >= 0 else "run_started"
            self._writer.write({"event": event, "world_size": self.world_size}, step=self.step)

    # -- one step ----------------------------------------------------------

    def _eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's loss of a forward-only pass, zero on a pipeline rank
        without the last stage (see _global_mean)."""
        loss = self.parallel.eval_loss(inputs.to(self.device), targets.to(self.device))
        return torch.zeros((), device=self.device) if loss is None else loss

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Where the loss and its backward run: torch's ``loss_parallel`` when on."""
        p = self.job.parallel
        if not (p.tp > 1 and p.loss_parallel):
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over ``grad_accum_steps`` micro-batches.

        Returns:
            ``(loss, grad_norm, lr)``: this rank's mean micro-batch loss, the
            global gradient norm before clipping, and the step's learning rate.
        """
        accum = self.job.training.grad_accum_steps
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            inputs, targets = self._next_batch()
            with self._loss_context():  # forward and backward; reduced on the last micro-batch
                loss = self.parallel.step(
                    inputs.to(self.device),
                    targets.to(self.device),
                    scale=1 / accum,
                    sync=micro == accum - 1,
                )
            # None: a pipeline rank without the last stage. A micro-batch of chat
            # data without an assistant token has a NaN mean loss (and zero
            # gradients): it adds nothing.
            if loss is not None and self._micro_trained != 0:
                loss_sum += loss
        grad_norm = clip_grad_norm_(self.params, self.job.training.max_norm)
        # A save copying the parameters in the background must finish copying first.
        self._staging_wait_s += self.checkpointer.wait_staged()
        self.optimizer.step()
        self.parallel.after_optimizer_step()
        self.scheduler.step()
        if self.spec.after_optimizer_step is not None:
            # The model's own update (e.g. MoE routing biases from the tokens
            # each expert received on all ranks), and its metrics.
            self._step_metrics = dict(self.spec.after_optimizer_step(self.model) or {})
        return loss_sum, grad_norm, float(lr)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The loader's next batch; damaged token data is a :class:`TrainingError`;
        with a loss mask the targets trained on are counted."""
        from simplefsdp.data import IGNORE_INDEX, DataError

        try:
            inputs, targets = next(self.loader)
        except DataError as exc:
            raise TrainingError(str(exc)) from None
        if self._trained_tokens is not None:
            self._micro_trained = int((targets != IGNORE_INDEX).sum())
            self._trained_in_window += self._micro_trained
        return inputs, targets

    def _global_mean(self, value: torch.Tensor) -> float:
        """The mean of ``value`` over the ranks that hold a loss (a pipeline's
        last stage; every rank otherwise)."""
        weight = torch.tensor(self._loss_weight, dtype=torch.float32, device=value.device)
        pair = torch.stack([value.detach().float() * weight, weight]).to(comm_device(self.device))
        dist.all_reduce(pair)
        total, count = pair.tolist()
        return total / count

    def _global_sum(self, value: float) -> float:
        reduced = torch.tensor([value], dtype=torch.float64, device=comm_device(self.device))
        dist.all_reduce(reduced)
        return float(reduced.item())

    def _global_max(self, value: float) -> float:
        reduced = torch.tensor([value], dtype=torch.float64, device=comm_device(self.device))
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return float(reduced.item())

    # -- validation --------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> float | None:
        """Mean loss over ``metrics.val_batches`` validation batches (global mean).

        Runs the model the training step runs (compiled, if enabled; the first
        call under ``no_grad`` compiles an inference graph once); a pipeline
        runs its schedule's forward-only ``eval`` (where a torch lacks it:
        then no validation, with a warning).
        """
        n = self.job.metrics.val_batches
        if n <= 0 or not self.parallel.can_evaluate:
            if n > 0 and self.rank == 0:
                logger.warning("this torch's pipeline schedules cannot evaluate: no val_loss")
            return None
        from simplefsdp.data import DataError

        total, count = torch.zeros((), device=self.device), 0
        try:
            for inputs, targets in self.loader.val_batches(n):
                with self._loss_context():
                    total += self._eval_loss(inputs, targets)
                count += 1
        except DataError as exc:  # a damaged validation shard
            raise TrainingError(str(exc)) from None
        if self.spec.discard_step_state is not None:  # training mode: these forwards counted
            self.spec.discard_step_state(self.model)
        if count == 0:
            return None
        return self._global_mean(total / count)

    # -- the loop ----------------------------------------------------------

    def _tokens_per_step(self) -> float:
        """Tokens per step per rank: the ranks of a tensor-parallel, context-parallel
        or pipeline group share their batch (global tokens / world size)."""
        d = self.job.data
        batches = self.mesh.batch_size
        return (
            d.batch_size
            * d.seq_len
            * self.job.training.grad_accum_steps
            * batches
            / (self.world_size)
        )

    def _sync(self) -> None:
        """Wait for queued device work, so wall-clock windows measure it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _log(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, window: tuple[int, float]
    ) -> dict[str, Any]:
        """The metrics record of a log step; ``window`` is ``(steps, seconds)`` since the last."""
        steps_in_window, elapsed = window
        tps = steps_in_window * self._tokens_per_step() / max(elapsed, 1e-9)
        record = {
            "loss": self._global_mean(loss),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s_per_rank": tps,
            "mfu_pct": mfu(tps, self.flops_per_token, self.peak_flops),
            "peak_memory_bytes": int(self._global_max(self.memory.peak_bytes() or 0)),
        }
        record.update(self._step_metrics)
        if self._trained_tokens is not None:  # chat data: the assistant's tokens
            trained = self._trained_in_window / (self.job.parallel.tp * self.job.parallel.pp)
            self._trained_tokens += self._trained_in_window
            self._trained_in_window = 0
            record["trained_tokens_per_s_per_rank"] = trained / max(elapsed, 1e-9)
            record["trained_tokens_pct"] = (
                100 * trained / max(steps_in_window * self._tokens_per_step(), 1)
            )
        return record

    def _should(self, interval: int, step: int) -> bool:
        return interval > 0 and (step % interval == 0 or step == self.job.training.steps)

    def _validates_or_saves(self, step: int) -> bool:
        ck = self.job.checkpoint
        return self._should(self.job.metrics.val_interval, step) or (
            ck.enable and self._should(ck.interval, step)
        )

    def _after_step(self, step: int, record: dict[str, Any] | None) -> None:
        """Validate, write metrics and progress, and checkpoint after ``step``."""
        if self._should(self.job.metrics.val_interval, step):
            val = self.validate()
            if val is not None and record is not None:
                record["val_loss"] = val
            self.summary.final_val_loss = val
        if self._progress is not None:
            self._progress.update(step)  # the bar (on a terminal) moves every step
        ck = self.job.checkpoint
        if ck.enable and self._should(ck.interval, step):
            path = self.checkpointer.save(step, self._trainer_state(step))
            self.summary.checkpoint = str(path)
            if record is not None:
                record["checkpoint_blocking_s"] = self.checkpointer.last_blocking_s
        if record is not None and self._staging_wait_s > 0:
            record["checkpoint_staging_wait_s"] = self._staging_wait_s
            self._staging_wait_s = 0.0
        if record is not None and self.rank == 0:
            assert self._writer is not None and self._progress is not None
            self._writer.write(record, step=step)
            line = format_step_line(step, self.job.training.steps, record)
            if "trained_tokens_pct" in record:  # chat data: the share trained on
                line += f" | trained {record['trained_tokens_pct']:.0f}% of tokens"
            self._progress.line(line)

    def _trainer_state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "run_id": self.run_id,
            "scheduler": json_ready(self.scheduler.state_dict()),
            "data_loader": self.loader.state_dict(),
            "tokens_per_step_per_rank": self._tokens_per_step(),
        }

    def train(self) -> TrainSummary:
        """Run the remaining steps; return the summary (complete on rank 0).

        Throughput windows time the training steps only (not validation or
        checkpointing); the summary's ``tokens_per_s`` leaves out the first
        step, which includes compilation.
        """
        total = self.job.training.steps
        start_step = self.summary.start_step = self.step
        self._progress = ProgressDisplay(total, start_step, enabled=self.rank == 0)
        if start_step >= total:
            logger.warning("checkpoint is at step %d >= training.steps %d", start_step, total)
        run_start = time.perf_counter()
        window_steps, window_s, steady_s = 0, 0.0, 0.0
        with StopRequest() as stop:
            note_stoppable()  # the launcher may pass signals on (Note: [Stops that save])
            for step in range(start_step + 1, total + 1):
                note_step(step)  # for the launcher, should this rank die (Note: [Worker failures])
                is_log = self._should(self.job.metrics.log_interval, step) or step == start_step + 1
                t0 = time.perf_counter()
                with self._first_step_notice(step == start_step + 1, step), _compile_errors():
                    loss, grad_norm, lr = self.train_step()
                # Test-only fault injection (SIMPLEFSDP_TEST_KILL_AT_STEP); a no-op otherwise.
                maybe_kill_at_step(step, self.rank, self.world_size, self.job.metrics.output_dir)
                maybe_sleep_after_step()  # test-only slow step (SIMPLEFSDP_TEST_STEP_SLEEP_S)
                if is_log or self._validates_or_saves(step):
                    # Queued device work must land in this step's window, not in
                    # the validation/checkpoint that follows (on GPU).
                    self._sync()
                step_s = time.perf_counter() - t0
                self.step, window_steps, window_s = step, window_steps + 1, window_s + step_s
                steady_s += step_s if step > start_step + 1 else 0.0
                record = None
                if is_log:
                    record = self._log(loss, grad_norm, lr, (window_steps, window_s))
                    self._record_summary(record)
                    window_steps, window_s = 0, 0.0
                self._after_step(step, record)
                if agreed := self._stop_agreed(stop):
                    self._stop_cleanly(step, stop, agreed)
                    break
            else:
                self._finish_saves()
        self._finish_summary(time.perf_counter() - run_start, steady_s)
        return self.summary

    @contextlib.contextmanager
    def _first_step_notice(self, first: bool, step: int) -> Iterator[None]:
        """Say that the first step (``step``; after a resume not 1) compiles, every
        30 s how long it has taken, and the total."""
        if not (first and self.parallel.compiled):
            yield
            return
        assert self._progress is not None
        self._progress.line(
            f"step {step} compiles the model ({self.job.compile.backend}); "
            "this takes a while on CPU"
        )
        start = time.perf_counter()
        with CompileWatch() as watch, Heartbeat(watch.message, self._progress.line):
            yield
        self.summary.compile_s = time.perf_counter() - start
        cache = inductor_cache_counts()
        served = ""
        if any(cache.values()):
            served = f" (Inductor cache: {cache['hit']} hits, {cache['miss']} misses)"
        self._progress.line(
            f"compiled and ran step {step} in {self.summary.compile_s:.1f}s{served}"
        )

    def _stop_agreed(self, stop: StopRequest) -> int:
        """The signal any rank was stopped by (0: none), agreed one step late so
        that all ranks stop after the same step (Note: [Clean stop])."""
        if self._stop_agreement is None:
            self._stop_agreement = StopAgreement(comm_device(self.device), self.world_size)
        return self._stop_agreement.after_step(stop.signum)

    def _stop_cleanly(self, step: int, stop: StopRequest, agreed: int) -> None:
        """Save a checkpoint of ``step`` (unless just saved) and report; see Note: [Clean stop]."""
        ck = self.job.checkpoint
        saved = ck.enable and self._should(ck.interval, step)
        if ck.enable and not saved:
            self.summary.checkpoint = str(self.checkpointer.save(step, self._trainer_state(step)))
        self._finish_saves()
        signal_name = self.summary.interrupted_by = stop.settle(agreed)
        self.exit_code = stop.exit_code
        if self.rank == 0:
            where = (
                f"saved {self.summary.checkpoint}; continue with: "
                f"simplefsdp train --resume {self.run_dir}"
                if ck.enable
                else "checkpoints are off (checkpoint.enable false), nothing saved"
            )
            print(
                f"simplefsdp train: stopped by {signal_name} after step {step}: {where}", flush=True
            )
            error_dir = launcher_error_dir()
            if error_dir is not None:  # the stop was reported, and why
                (error_dir / STOPPED_MARK).write_text(str(stop.signum), encoding="utf-8")

    def _finish_saves(self) -> None:
        """Wait for a checkpoint still being written in the background, saying so."""
        pending = self.checkpointer.pending
        if pending is not None and self._progress is not None:
            self._progress.line(f"waiting for checkpoint {pending.name} to be written")
        self.checkpointer.finish()

    def _record_summary(self, record: dict[str, Any]) -> None:
        if self.summary.first_loss is None:
            self.summary.first_loss = record["loss"]
        self.summary.final_loss = record["loss"]
        self.summary.losses.append(record["loss"])

    def _finish_summary(self, elapsed_s: float, steady_s: float) -> None:
        s = self.summary
        s.steps, s.elapsed_s, s.memory_kind = self.step, elapsed_s, self.memory.kind
        steady_steps = self.step - s.start_step - 1
        if steady_steps > 0 and steady_s > 0:
            s.tokens_per_s = steady_steps * self._tokens_per_step() / steady_s
        s.peak_memory_bytes = int(self._global_max(self.memory.peak_bytes() or 0))
        if self._trained_tokens is not None:  # global counts: every rank's batch once
            self._trained_tokens += self._trained_in_window
            self._trained_in_window = 0
            p = self.job.parallel
            steps = self.step - s.start_step
            read = steps * self._tokens_per_step() * self.world_size
            trained = self._global_sum(self._trained_tokens) / (p.tp * p.pp)
            s.tokens_read, s.tokens_trained = int(read), int(trained)

    def close(self, *, clean: bool = True) -> None:
        """Flush metrics and destroy the process group.

        Args:
            clean: every rank got here normally. After an error the ranks may
                not all arrive: then the final barrier waits at most 10 s (gloo),
                or is skipped (NCCL), so that this process exits and the
                launcher stops the others.
        """
        if self._progress is not None:
            self._progress.close()
        if self._writer is not None:
            self._writer.close()
        checkpointer = self.__dict__.get("checkpointer")
        if clean and checkpointer is not None:
            checkpointer.close()
        if not dist.is_initialized():
            return
        # Let every rank finish its last collective before any rank tears down
        # gloo's threads (a peer exiting early can abort the other).
        if clean:
            dist.barrier()
        elif dist.get_backend() == "gloo":
            with contextlib.suppress(Exception):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
        # The model goes before the group (Note: [Process group teardown]).
        for name in ("parallel", "model", "params", "optimizer",
                     "scheduler", "checkpointer"):  # fmt: skip
            self.__dict__.pop(name, None)
        teardown_process_group()
