"""``torchrun -m simplefsdp.train`` across two "nodes": two torchrun launchers on this
machine that meet through a c10d rendezvous, one CPU process each (gloo).

This is the launch of ``examples/slurm/train.sbatch`` (one torchrun per node,
``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID``),
with both nodes sharing one working directory as on a shared file system:

* ``hybrid_shard`` takes the default mesh ``[nodes, processes per node]``
  (``[2, 1]``: replicate across the nodes) and ``fully_shard`` shards over both;
  both finish and their losses fall;
* with ``--max-restarts 1`` a worker SIGKILLed on one node (the test-only hook
  ``SIMPLEFSDP_TEST_KILL_AT_STEP``) makes both nodes restart; the job resumes
  from the step-2 checkpoint and ends with the uninterrupted run's losses.

Runs are tiny and eager (6 steps of the debug model on 300 kB of the stdlib
corpus); the module takes about two minutes on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cli_runs import checkpoints, losses, only_run, small_args, train_env
from simplefsdp._faults import DEFAULT_KILL_MARKER, KILL_AT_STEP_ENV, KILL_RANK_ENV

pytestmark = pytest.mark.slow

STEPS = 6
KILL_AT = 3  # after the checkpoint of step 2: the restart resumes from step 2
SMALL = small_args(STEPS)
TIMEOUT_S = 150  # per two-node run; a hung rendezvous or collective fails the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts its workers in new sessions,
    so killing the launcher's process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher that is still running, and every process it started."""
    if proc.poll() is not None:
        return
    pids = _descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _two_nodes(cwd: Path, name: str, extra: list[str], *, restarts: int = 0, env=None):
    """Train on two one-process "nodes"; returns ``[(returncode, output), ...]`` per node.

    Each node is one ``torchrun --nnodes 2 --nproc-per-node 1`` launcher with the
    same rendezvous, as ``examples/slurm/train.sbatch`` starts them.
    """
    args = [*SMALL, "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck", *extra]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", str(restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--rdzv-id", f"{name}-{uuid.uuid4().hex[:8]}",
        "-m", "simplefsdp.train", *args,
    ]  # fmt: skip
    logs = [cwd / f"{name}.node{i}.log" for i in range(2)]
    procs: list[subprocess.Popen] = []
    try:
        for log in logs:
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=cwd,
                        env=env or train_env(),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            _kill_tree(proc)
    results = [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]
    if any(code != 0 for code, _ in results):
        nodes = (f"--- node {i} (exit {code}):\n{out}" for i, (code, out) in enumerate(results))
        pytest.fail(" ".join(cmd) + "\n" + "\n".join(nodes))
    return results


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One working directory for both nodes (a shared file system)."""
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def fully_shard(workdir):
    """The uninterrupted ``fully_shard`` run, also the reference of the restart test."""
    return _two_nodes(workdir, "fsdp", ["--parallel.mode", "fully_shard"])


def _check_trained(cwd: Path, name: str) -> dict[int, float]:
    run = only_run(cwd / name)
    assert run.name.startswith(f"{name}-")  # a new run's id is the job's --rdzv-id
    records = _records(run / "metrics.jsonl")
    assert records[0]["event"] == "run_started" and records[0]["world_size"] == 2
    trained = losses(run / "metrics.jsonl")
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert trained[1] > 5.5
    assert max(trained[STEPS - 1], trained[STEPS]) < trained[1] - 1.0, trained
    manifest = json.loads((checkpoints(run) / f"step-{STEPS}" / "manifest.json").read_text())
    assert manifest["step"] == STEPS and manifest["world_size"] == 2
    return trained


def test_hybrid_shard_replicates_across_two_nodes(workdir):
    results = _two_nodes(workdir, "hsdp", ["--parallel.mode", "hybrid_shard"])
    output = "".join(out for _, out in results)
    # LOCAL_WORLD_SIZE 1 per node: the default mesh replicates across the 2 nodes
    assert "mesh ('dp_replicate', 'dp_shard') (2, 1)" in output, output
    assert "training finished" in output
    _check_trained(workdir, "hsdp")


def test_fully_shard_trains_on_two_nodes(workdir, fully_shard):
    output = "".join(out for _, out in fully_shard)
    assert "mesh ('dp_shard',) (2,)" in output, output
    _check_trained(workdir, "fsdp")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sigkill_on_one_node_restarts_both_and_resumes(workdir, fully_shard):
    # As examples/slurm/train.sbatch: a fresh TCPStore per rendezvous round, since
    # the agents' restart counts differ (a node restarted for a peer's failure
    # does not count it); LOGLEVEL=INFO shows the agents' restart decisions.
    env = train_env(
        **{KILL_AT_STEP_ENV: str(KILL_AT), KILL_RANK_ENV: "1"},
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        LOGLEVEL="INFO",
    )
    extra = ["--parallel.mode", "fully_shard", "--checkpoint.resume_if_possible", "true"]
    results = _two_nodes(workdir, "killed", extra, restarts=1, env=env)
    assert (workdir / "killed" / DEFAULT_KILL_MARKER).is_file()  # rank 1 was killed ...
    output = "".join(out for _, out in results)
    assert "exitcode: -9" in output, output  # ... its node's agent saw the SIGKILL
    for i, (_, out) in enumerate(results):  # ... and both nodes started a second attempt
        assert "will restart worker group" in out, f"node {i}:\n{out}"
    assert f"steps          2 -> {STEPS}" in output  # the restart resumed at step 2
    run = only_run(workdir / "killed")  # the restart continued the run
    records = _records(run / "metrics.jsonl")
    events = [(r["event"], r["step"], r["world_size"]) for r in records if "event" in r]
    assert events == [("run_started", 0, 2), ("run_resumed", 2, 2)], events
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == list(range(1, STEPS + 1)), steps  # step 3 died before its log
    assert losses(run / "metrics.jsonl") == losses(only_run(workdir / "fsdp") / "metrics.jsonl")
