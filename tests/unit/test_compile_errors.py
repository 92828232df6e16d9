"""``describe_compile_error``: a damaged Inductor cache file is named in one line.

The errors are real where that is cheap (the dynamic loader on a 0-byte
``.so``, ``pickle`` on an empty file) and wrapped the way Dynamo wraps a
backend's error (``BackendCompilerFailed``, ``raise ... from``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pickle
import shlex
import sys

import pytest

from simplefsdp.train.compile_errors import (
    describe_compile_error,
    find_damaged_cache_file,
    inductor_cache_dir,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF loader text")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An Inductor cache folder with a 0-byte compiled module, as an interrupted compile leaves."""
    root = tmp_path / "inductor cache"  # a space, as in some home folders
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    so = root / "ab" / "cabcdef0123.main.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    return root, so


def _backend_failed(inner: Exception) -> Exception:
    """Dynamo's wrapper of a backend's error, raised from it as Dynamo does."""
    from torch._dynamo.exc import BackendCompilerFailed

    def inductor():
        pass

    try:
        wrapper = BackendCompilerFailed(inductor, inner, None)
    except TypeError:  # another torch's signature
        wrapper = BackendCompilerFailed(inductor, inner)
    try:
        raise wrapper from inner
    except BackendCompilerFailed as exc:
        return exc


def _import_extension(path: str) -> None:
    """Load ``path`` as a Python extension module, as Inductor's code cache does."""
    spec = importlib.util.spec_from_file_location("cabcdef0123", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _caught(fn, *args) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the test wants whatever it raised
        return exc
    raise AssertionError("did not raise")


def _check_line(line: str | None, root, path) -> None:
    assert line is not None
    assert "\n" not in line
    assert str(path) in line
    assert f"rm -rf {shlex.quote(str(root))}" in line
    assert "TORCHINDUCTOR_CACHE_DIR" in line


@linux_only
def test_truncated_so_wrapped_twice_is_named(cache):
    root, so = cache
    inner = _caught(_import_extension, str(so))
    assert isinstance(inner, ImportError) and "file too short" in str(inner)

    def compile_graph():
        raise _backend_failed(inner)

    def train_step():
        try:
            compile_graph()
        except Exception as exc:
            raise RuntimeError("training step 1 failed") from exc

    exc = _caught(train_step)
    found = find_damaged_cache_file(exc)
    assert found is not None
    assert found.path == str(so) and found.cache_dir == str(root)
    assert found.reason == "file too short"
    _check_line(describe_compile_error(exc), root, so)


@linux_only
def test_ctypes_oserror_and_implicit_context(cache):
    root, so = cache

    def load_and_fail():
        try:
            ctypes.CDLL(str(so))
        except OSError:
            raise ValueError("while handling the load")  # noqa: B904

    # __context__ (no explicit cause) is followed too.
    exc = _caught(load_and_fail)
    assert isinstance(exc.__context__, OSError)
    _check_line(describe_compile_error(exc), root, so)


def test_message_text_alone_is_enough(cache):
    """A wrapper that kept only the text (e.g. an error sent from another rank)."""
    root, so = cache
    exc = RuntimeError(
        f"backend='inductor' raised:\nImportError: {so}: file too short\n\n"
        "Set TORCH_LOGS=+dynamo for more information"
    )
    _check_line(describe_compile_error(exc), root, so)
    bad_elf = OSError(f"{root}/cd/ccd.so: invalid ELF header")
    assert find_damaged_cache_file(bad_elf).path == f"{root}/cd/ccd.so"


def test_truncated_pickle_found_through_frame_locals(cache):
    root, _ = cache
    entry = root / "fxgraph" / "ab" / "fabc" / "0"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"")

    def read_cache_entry(path):
        with open(path, "rb") as f:
            return pickle.load(f)  # EOFError: Ran out of input (no path in the message)

    def lookup():
        try:
            read_cache_entry(str(entry))
        except EOFError as exc:
            raise RuntimeError("cache lookup failed") from exc

    exc = _backend_failed(_caught(lookup))  # BackendCompilerFailed <- RuntimeError <- EOFError
    found = find_damaged_cache_file(exc)
    assert found is not None and found.path == str(entry), found
    assert "Ran out of input" in found.reason
    _check_line(describe_compile_error(exc), root, entry)


def test_other_errors_are_not_described(cache, tmp_path):
    root, so = cache
    assert describe_compile_error(ValueError("shapes do not match")) is None
    assert describe_compile_error(_backend_failed(RuntimeError("Triton OOM"))) is None
    # The same loader error, for a file outside the cache.
    outside = tmp_path / "libfoo.so"
    assert describe_compile_error(ImportError(f"{outside}: file too short")) is None
    assert describe_compile_error(OSError("libcuda.so.1: cannot open shared object file")) is None
    # A truncated pickle that has nothing to do with the cache.
    eof = _caught(pickle.loads, b"")
    assert isinstance(eof, EOFError)
    assert describe_compile_error(eof) is None
    # Mentioning the cache folder is not enough without a damaged-file error.
    assert describe_compile_error(RuntimeError(f"compiled {so}")) is None


def test_cyclic_chain_terminates(cache):
    _, so = cache
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert describe_compile_error(a) is None
    b.__cause__ = ImportError(f"{so}: file too short")
    assert describe_compile_error(a) is not None


def test_cache_dir_default_has_no_side_effects(monkeypatch, tmp_path):
    torch_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert inductor_cache_dir() == os.path.abspath(torch_utils.default_cache_dir())
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert not os.path.exists(inductor_cache_dir())
    so = os.path.join(inductor_cache_dir(), "ab", "cab.main.so")
    assert find_damaged_cache_file(ImportError(f"{so}: file too short")).path == so


@linux_only
def test_the_trainer_turns_it_into_a_one_line_training_error(cache):
    from simplefsdp.train.trainer import TrainingError, _compile_errors

    root, so = cache
    inner = _caught(_import_extension, str(so))
    with pytest.raises(TrainingError) as info:
        with _compile_errors():
            raise _backend_failed(inner)
    _check_line(str(info.value), root, so)
    with pytest.raises(ValueError, match="unrelated"):  # anything else passes unchanged
        with _compile_errors():
            raise ValueError("unrelated")


def test_a_graph_break_under_fullgraph_is_one_line_naming_the_code_and_the_flag():
    """Dynamo's error for a data-dependent branch, noted by the compiler's
    wrapper (``fullgraph``), becomes one line: the reason, the user's line
    that breaks, and the flag that compiles around it."""
    import torch

    from simplefsdp.compiler.first_inputs import _fullgraph_note

    def step(x):
        if x[0] > 0:  # the branch Dynamo cannot trace
            return x * 2
        return x

    try:
        torch.compile(step, backend="eager", fullgraph=True)(torch.ones(3))
    except torch._dynamo.exc.Unsupported as exc:
        assert describe_compile_error(exc) is None  # not noted: not ours to explain
        exc.add_note(_fullgraph_note(data_dependent=True))
        try:  # found through a wrapper's chain too
            raise RuntimeError("step 1 failed") from exc
        except RuntimeError as wrapped:
            line = describe_compile_error(wrapped)
    else:
        pytest.fail("no graph break")
    assert "\n" not in line and line.startswith("the model's code breaks the compiled graph: ")
    assert "test_compile_errors.py:" in line and "(if x[0] > 0:" in line
    assert "--compile.fullgraph false" in line and "simplefsdp_eager" in line
