"""Progress output: a tqdm bar on a terminal only, the same step lines
everywhere; ``simplefsdp bench`` says what each configuration is doing."""

from __future__ import annotations

import io
import subprocess
import sys

from simplefsdp.bench.cli import _wait_reporting
from simplefsdp.train.metrics import ProgressDisplay, format_step_line

RECORD = {
    "loss": 4.1234,
    "lr": 5e-4,
    "grad_norm": 1.5,
    "tokens_per_s_per_rank": 1234.0,
    "peak_memory_bytes": 2**20,
}


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _show(stream, steps=(1, 2, 3)) -> None:
    progress = ProgressDisplay(10, 0, stream=stream)
    for step in steps:
        progress.update(step)
        progress.line(format_step_line(step, 10, RECORD))
    progress.close()


def test_no_bar_off_a_terminal_and_the_step_lines_unchanged():
    stream = io.StringIO()
    _show(stream)
    want = "".join(format_step_line(s, 10, RECORD) + "\n" for s in (1, 2, 3))
    assert stream.getvalue() == want
    assert want.splitlines()[0] == (
        "step  1/10 | loss 4.1234 | lr 5.00e-04 | grad_norm 1.500 | tok/s/rank 1,234 | mem 1.0 MiB"
    )


def test_a_bar_on_a_terminal_with_the_step_lines_above_it():
    stream = FakeTerminal()
    _show(stream)
    text = stream.getvalue()
    for step in (1, 2, 3):
        assert format_step_line(step, 10, RECORD) in text
    assert "| 3/10 [" in text and "30%" in text  # tqdm's bar, redrawn in place
    assert "\rstep  1/10 | loss" in text  # each line written over the bar


def test_disabled_progress_shows_nothing():
    stream = FakeTerminal()
    progress = ProgressDisplay(10, 0, enabled=False, stream=stream)
    progress.update(1)
    progress.line("step 1/10")
    progress.close()
    assert stream.getvalue() == ""


def test_bench_waits_reporting_each_phase_of_a_configuration(tmp_path):
    # A configuration that reports two phases, each waiting for the runner
    # to have seen it (no timing involved).
    phase = tmp_path / "simplefsdp-auto.phase"
    script = (
        "import os, sys, time, pathlib\n"
        "phase, ack = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
        "for i, text in enumerate(['compiling (the first warm-up step)', 'measuring 3 steps']):\n"
        "    phase.with_suffix('.tmp').write_text(text)\n"
        "    os.replace(phase.with_suffix('.tmp'), phase)\n"
        "    while not ack.with_name(f'ack{i}').exists():\n"
        "        time.sleep(0.01)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(phase), str(tmp_path / "ack")])
    seen = []

    def on_phase(text: str) -> None:
        (tmp_path / f"ack{len(seen)}").write_text("")
        seen.append(text)

    assert _wait_reporting(proc, 120.0, phase, on_phase, poll_s=0.05) == 0
    assert seen == ["compiling (the first warm-up step)", "measuring 3 steps"]
    assert not phase.exists()
