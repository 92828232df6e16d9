"""The documentation speaks of the product as it is: no development history in
README.md, docs/ or src/, and no broken relative link in README.md or docs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Phrases only a development diary uses: "stop 12", "issue 17", "issues 15",
# "session" (a work session; a process session is ``setsid``), "the
# development machine", "this PR". Legitimate words stay legal: "a clean stop",
# "stop signal", "the run stops after step 12", "issues a wait".
HISTORY = re.compile(
    r"\b(?:stop|issue|PR) #?\d+\b(?! (?:steps?|seconds?|ranks?|times?)\b)"
    r"|\b(?:stops|issues) \d+(?:-\d+| and \d+)"
    r"|\bsessions?\b"
    r"|\bdevelopment (?:machine|process|history|diary)\b"
    r"|\bthis (?:PR|pull request)\b",
    re.IGNORECASE,
)
# Dates of development belong in git and CHANGELOG.md (docs date their
# measurements, so this applies to code only).
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")
SCANNED = (".md", ".py", ".toml", ".c", ".sh", ".yml")


def history_words(paths: list[Path], dates: bool = False) -> list[str]:
    """``file:line: text`` for every development-history phrase in ``paths``
    (files, or folders whose documentation and source files are read)."""
    hits = []
    for path in paths:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            if f.suffix not in SCANNED or not f.is_file():
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if HISTORY.search(line) or (dates and DATE.search(line)):
                    hits.append(f"{f}:{n}: {line.strip()}")
    return hits


def broken_links(files: list[Path]) -> list[str]:
    """``file: target`` for every relative link in the Markdown ``files``
    whose file or folder does not exist (code blocks are skipped)."""
    broken = []
    for f in files:
        text = re.sub(r"```.*?```", "", f.read_text(encoding="utf-8"), flags=re.DOTALL)
        text = re.sub(r"`[^`\n]*`", "", text)
        for match in LINK.finditer(text):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor on the same page
            if not (f.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{f}: {target}")
    return broken


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_development_history_in_docs_or_code():
    hits = history_words([ROOT / "README.md", ROOT / "docs", ROOT / "mkdocs.yml"])
    hits += history_words([ROOT / "src"], dates=True)
    assert not hits, "development history belongs in git and CHANGELOG.md:\n" + "\n".join(hits)


def test_history_words_found_and_legitimate_words_not(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Since stop 12 the planner keeps buckets.\nA clean stop saves.\n")
    assert [h.split(": ", 1)[1] for h in history_words([page])] == [
        "Since stop 12 the planner keeps buckets."
    ]
    for diary in (
        "issue 17's goals",
        "stops 23 and 24",
        "in this session",
        "on the development machine",
    ):
        page.write_text(diary + "\n")
        assert history_words([page]), diary
    for legit in ("stop signal", "the run stops after 12 steps", "setsid", "it issues 3 waits"):
        page.write_text(legit + "\n")
        assert not history_words([page]), legit
    page.write_text("measured 2026-12-04\n")
    assert not history_words([page]) and history_words([page], dates=True)


def test_relative_links_resolve():
    broken = broken_links(doc_files())
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_broken_link_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](page.md) [web](https://pytorch.org) [here](#top) ![img](gone.png)\n"
        "[gone](missing.md#x) `[code](nowhere.md)`\n"
    )
    assert [b.split(": ", 1)[1] for b in broken_links([page])] == ["gone.png", "missing.md#x"]


def test_docs_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: no warning, so no broken link or anchor, no
    page left out of the navigation, no docstring the API reference cannot
    read."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_readme_commands_are_what_ci_runs():
    """The README's set-up, check and test commands are the lines `.ci/run` runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    commands = [line for line in ci if line and not line.startswith(("#", "set ", "cd ", "rm "))]
    commands = [c for c in commands if not c.startswith(("python3 -m venv", "source "))]
    assert commands, "no commands found in .ci/run"
    for command in commands:
        assert command in readme, f"README.md does not show the command CI runs: {command}"


def test_readme_is_an_overview():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_models_page_lists_every_family_and_flavor():
    """docs/models/index.md names every registered family and flavor."""
    from simplefsdp.models.registry import family_names, flavor_names

    page = (ROOT / "docs" / "models" / "index.md").read_text()
    missing = [f"`{name}`" for name in (*family_names(), *flavor_names())]
    missing = [name for name in missing if name not in page]
    assert not missing, f"docs/models/index.md lacks {missing}"
