"""Which run ``simplefsdp train`` continues, and with which configuration.

``--resume RUN`` / ``--resume`` / ``--resume-if-possible`` (and the
``checkpoint.resume*`` fields) pick a run (see Note: [One run per folder] in
:mod:`simplefsdp.train.runs`); the run's saved ``config.toml`` is the base
configuration and the command line's overrides apply on top. A change that a
checkpoint cannot take (the model's shape: any ``model.*`` field, or
``data.tokenizer``, which fixes the vocabulary) is refused here, before any
process starts. Nothing in this module imports torch except the search for
complete checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simplefsdp.train.config import JobConfig, config_to_dict, format_config, load_config
from simplefsdp.train.runs import (
    CONFIG_FILE,
    RUN_ID_ENV,
    RunInfo,
    describe_runs,
    find_run,
    new_run_id,
    newest_resumable_run,
    run_checkpoint_folder,
    run_folder,
    write_run_files,
)

#: Settings a resumed run cannot change: they change the model's shape.
FIXED_ON_RESUME = ("model.*", "data.tokenizer")
_FLAGS = ("checkpoint.resume", "checkpoint.resume_if_possible")


@dataclass(frozen=True)
class Resume:
    """The run to continue, its newest complete step and the settings changed on top."""

    run: RunInfo
    step: int
    changes: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    given: tuple[str, ...] = ()  # the settings named on the command line

    def line(self) -> str:
        """``resuming run ID at step N (FOLDER)[; changed: a 1 -> 2, ...]``."""
        text = f"resuming run {self.run.run_id} at step {self.step} ({self.run.path})"
        if self.changes:
            text += "; changed: " + ", ".join(self.changes)
        if self.unused:
            text += "; it keeps its folders: " + ", ".join(self.unused)
        return text


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def resolve_resume(
    job: JobConfig, spec: str | None, overrides: list[str]
) -> tuple[JobConfig, Resume | None]:
    """The configuration to train with and the run it continues (``None``: a new run).

    Args:
        job: the configuration from ``--config`` and ``overrides``.
        spec: the run given to ``--resume`` (an id under ``metrics.output_dir``
            or a run folder), or ``None`` for the newest run with a complete
            checkpoint.
        overrides: the command line's dotted overrides.

    Raises:
        ValueError: one line: no such run, no complete checkpoint (listing the
            runs that exist), or a change that the checkpoint cannot take.
    """
    ck, root = job.checkpoint, job.metrics.output_dir
    if not (ck.resume or ck.resume_if_possible):
        return job, None
    if spec:
        try:
            run = find_run(spec, root)
        except ValueError as exc:
            raise ValueError(f"--resume: {exc}") from exc
        unused = _unused_folders(job, run, overrides)
        job, changes = _restored(job, run, overrides)  # refused changes first: no torch yet
        step = _resume_step(job, run)
        if step is None:
            raise ValueError(
                f"--resume {spec}: run {run.run_id} has no complete checkpoint in "
                f"{run.checkpoint_folder} ({describe_runs(run.path.parent)})"
            )
        return job, Resume(run, step, changes, unused, _given(overrides))
    found = newest_resumable_run(root)
    if found is None:
        if ck.resume and not _restarted():
            raise ValueError(
                f"--resume: no run in {root} has a complete checkpoint "
                f"({describe_runs(root)}); leave out --resume to start a new run, "
                "or pass --resume-if-possible"
            )
        return job, None
    run, _ = found
    unused = _unused_folders(job, run, overrides)
    job, changes = _restored(job, run, overrides)
    step = _resume_step(job, run)
    assert step is not None, "newest_resumable_run found a complete checkpoint"
    return job, Resume(run, step, changes, unused, _given(overrides))


def _given(overrides: list[str]) -> tuple[str, ...]:
    return tuple(o.split("=", 1)[0].lstrip("-") for o in overrides if o.startswith("--"))


def _saved_layout(resume: Resume) -> tuple[int, int, int, int] | None:
    """``(world size, data-parallel ranks, batch size, accumulation)`` of the
    checkpoint ``resume`` continues from (its ``manifest.json`` and
    ``config.json``), or ``None`` where they do not say."""
    folder = resume.run.checkpoint_folder / f"step-{resume.step}"
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        job = json.loads((folder / "config.json").read_text(encoding="utf-8"))["job"]
        world = int(manifest["world_size"])
        p = job["parallel"]
        dp = world // (int(p.get("tp", 1)) * int(p.get("pp", 1)))
        return world, dp, int(job["data"]["batch_size"]), int(job["training"]["grad_accum_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_global_batch(
    job: JobConfig, resume: Resume | None, world_size: int
) -> tuple[JobConfig, Resume | None]:
    """Keep the global batch of the checkpoint a run resumes from on ``world_size`` processes.

    Note: [Global batch on resume]
        The global batch (sequences per optimizer step: ``data.batch_size x
        training.grad_accum_steps x`` data-parallel ranks) is part of the
        optimisation: a resumed run on another number of processes (or
        another ``parallel.tp``/``pp``) keeps it by changing the per-rank
        batch (keeping the accumulation), else the accumulation (keeping the
        batch), else both (the whole per-rank share in one batch). The data
        position is counted in sequences of the data order, so the next step
        reads the sequences the saving run would have read next. The
        ``changed:`` line names the process count, the new per-rank batch or
        accumulation and the kept global batch. Where the global batch does
        not divide over the data-parallel ranks, resuming is refused in one
        line naming ``--data.batch_size``, which accepts a new global batch,
        as does naming either setting on the command line.

    Args:
        job: the configuration of the resumed run (saved config and overrides).
        resume: the run it continues (``None``: a new run, nothing to do).
        world_size: the processes of this run.

    Returns:
        ``(job, resume)``, the batch settings and the changes updated.

    Raises:
        ValueError: the global batch does not divide over this run's ranks.
    """
    if resume is None:
        return job, resume
    saved = _saved_layout(resume)
    if saved is None:
        return job, resume
    saved_world, saved_dp, saved_bs, saved_accum = saved
    global_batch = saved_dp * saved_bs * saved_accum
    p, d, t = job.parallel, job.data, job.training
    dp = max(1, world_size // (p.tp * p.pp))
    changes = list(resume.changes)
    if saved_world != world_size:
        changes.append(f"processes {saved_world} -> {world_size}")
    now = dp * d.batch_size * t.grad_accum_steps
    chosen = {"data.batch_size", "training.grad_accum_steps"} & set(resume.given)
    if now != global_batch and chosen:  # asked for: said, not undone
        changes.append(f"global batch {global_batch} -> {now} sequences")
    elif now != global_batch:
        if global_batch % dp:
            raise ValueError(
                f"--resume: the global batch of {global_batch} sequences of run "
                f"{resume.run.run_id} does not divide over {dp} data-parallel ranks "
                f"({world_size} processes); pass --data.batch_size N to train on with "
                f"{dp} x N sequences per step, or use a process count whose data-parallel "
                f"ranks divide {global_batch}"
            )
        share = global_batch // dp
        micro = p.microbatches or p.pp
        if share % t.grad_accum_steps == 0 and (share // t.grad_accum_steps) % micro == 0:
            batch, accum = share // t.grad_accum_steps, t.grad_accum_steps
        elif share % d.batch_size == 0:
            batch, accum = d.batch_size, share // d.batch_size
        else:
            batch, accum = share, 1
        if batch != d.batch_size:
            changes.append(f"data.batch_size {d.batch_size} -> {batch}")
        if accum != t.grad_accum_steps:
            changes.append(f"training.grad_accum_steps {t.grad_accum_steps} -> {accum}")
        changes.append(f"global batch kept at {global_batch} sequences")
        job = dataclasses.replace(
            job,
            data=dataclasses.replace(d, batch_size=batch),
            training=dataclasses.replace(t, grad_accum_steps=accum),
        )
    return job, dataclasses.replace(resume, changes=tuple(changes))


def _resume_step(job: JobConfig, run: RunInfo) -> int | None:
    """The step the run resumes from (:meth:`RunInfo.resume_step`): a restart
    resumes from the newest checkpoint, not from ``checkpoint.load_step`` again."""
    return run.resume_step(-1 if _restarted() else job.checkpoint.load_step)


def _restored(
    job: JobConfig, run: RunInfo, overrides: list[str]
) -> tuple[JobConfig, tuple[str, ...]]:
    """The run's saved configuration with ``overrides`` on top, and the changes.

    A run folder without ``config.toml`` (made by hand) trains with ``job``.
    """
    saved = run.path / CONFIG_FILE
    if not saved.is_file():
        return _placed(job, run), ()
    base = _placed(load_config(str(saved)), run)
    final = _placed(load_config(str(saved), overrides), run)
    changes = _changes(config_to_dict(base), config_to_dict(final))
    _check_fixed(changes, run)
    return final, tuple(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in changes)


def _unused_folders(job: JobConfig, run: RunInfo, overrides: list[str]) -> tuple[str, ...]:
    """A resumed run keeps its folders: the output or checkpoint folders given
    on the command line that are not the run's, said in the resume line."""
    given = {o.split("=", 1)[0].lstrip("-") for o in overrides}
    where = {
        "metrics.output_dir": (job.metrics.output_dir, Path(job.metrics.output_dir), run.path),
        "checkpoint.folder": (
            job.checkpoint.folder,
            run_checkpoint_folder(job.checkpoint.folder, run.path),
            run.checkpoint_folder,
        ),
    }
    parent = {"metrics.output_dir": run.path.parent}
    return tuple(
        f"{key} {value!r} not used (the run's {'folder' if key.startswith('metrics') else 'checkpoints'}: {actual})"
        for key, (value, asked, actual) in where.items()
        if key in given and asked.resolve() != parent.get(key, actual).resolve()
    )


def _placed(job: JobConfig, run: RunInfo) -> JobConfig:
    """``job`` with its output and checkpoint folders where ``run`` has them."""
    if Path(job.metrics.output_dir).resolve() != run.path.parent.resolve():
        job.metrics.output_dir = str(run.path.parent)
    if run_checkpoint_folder(job.checkpoint.folder, run.path).resolve() != (
        run.checkpoint_folder.resolve()
    ):
        own = run.checkpoint_folder.resolve() == (run.path / "checkpoints").resolve()
        job.checkpoint.folder = "" if own else str(run.checkpoint_folder.parent)
    return job


def _changes(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[tuple]:
    return [
        (f"{section}.{key}", old[section][key], value)
        for section, values in new.items()
        for key, value in values.items()
        if f"{section}.{key}" not in _FLAGS and old[section][key] != value
    ]


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


def _check_fixed(changes: list[tuple], run: RunInfo) -> None:
    for key, old, new in changes:
        if key.startswith("model.") or key == "data.tokenizer":
            raise ValueError(
                f"--resume: {key} {_show(new)} cannot apply to run {run.run_id}, trained with "
                f"{key} {_show(old)}: it changes the model's shape; leave out {key} to "
                "resume, or leave out --resume to start a new run"
            )


def run_config_text(job: JobConfig) -> str:
    """``config.toml`` of a run: ``job`` as TOML, without the one-off resume flags."""
    ck = dataclasses.replace(job.checkpoint, resume=False, resume_if_possible=False)
    return format_config(dataclasses.replace(job, checkpoint=ck))


def this_run(job: JobConfig, resume: Resume | None) -> tuple[str, Path]:
    """``(run id, run folder)`` of the run the launcher starts or continues."""
    if resume is not None:
        return resume.run.run_id, resume.run.path
    run_id = os.environ.get(RUN_ID_ENV) or new_run_id()
    return run_id, run_folder(job.metrics.output_dir, run_id)


def output_folders(job: JobConfig, run_dir: Path) -> dict[str, Path]:
    """``{setting: folder}`` for every folder the run writes (see ``check_output_folders``)."""
    folders = {"metrics.output_dir": run_dir}
    if job.checkpoint.enable:
        folders["checkpoint.folder"] = run_checkpoint_folder(job.checkpoint.folder, run_dir)
    if job.metrics.tensorboard:
        folders["metrics.tensorboard"] = run_dir / "tensorboard"
    return folders


def start_run_files(job: JobConfig, run_id: str, run_dir: Path, *, resumed: bool) -> None:
    """Write the run's ``config.toml`` and ``run.json`` (status ``running``)."""
    write_run_files(
        run_dir,
        run_id=run_id,
        checkpoint_folder=run_checkpoint_folder(job.checkpoint.folder, run_dir),
        config_text=run_config_text(job),
        status="running",
        resumed=resumed,
    )
