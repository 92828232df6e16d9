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

__all__ = [
    "FIXED_ON_RESUME",
    "Resume",
    "output_folders",
    "resolve_resume",
    "run_config_text",
    "start_run_files",
    "this_run",
]

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
        return job, Resume(run, step, changes, unused)
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
    return job, Resume(run, step, changes, unused)


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
