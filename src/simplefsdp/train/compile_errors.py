"""Compile errors with a known fix, explained in one line.

Two kinds are recognised. A damaged file in the Inductor cache: a compile that
is interrupted (killed, out of disk) can leave a truncated artifact there, e.g.
a 0-byte ``.so``; every later run that hits the same cache key loads it and
fails, after the whole (possibly long) compile, with
``ImportError: .../c<hash>.main.so: file too short`` wrapped in Dynamo's
``BackendCompilerFailed``. :func:`describe_compile_error` finds such an error
anywhere in an exception chain and says which file and which cache folder to
delete. And a graph break of a model compiled whole (``fullgraph``): the
line names Dynamo's reason, the model's line that breaks and
``--compile.fullgraph false``::

    try:
        trainer.train()
    except Exception as exc:
        hint = describe_compile_error(exc)
        if hint is not None:
            logger.error(hint)
        raise

It imports nothing of simplefsdp, and torch only inside the function.
"""

from __future__ import annotations

import getpass
import os
import pickle
import re
import shlex
import tempfile
from pathlib import Path
from typing import NamedTuple

#: What the dynamic loader says about a damaged or vanished shared object.
_LOADER_MARKERS = (
    "file too short",
    "invalid ELF header",
    "cannot open shared object file",
    "ELF load command",
)
#: What a truncated pickle says (EOFError / UnpicklingError), also as text in a wrapper.
_PICKLE_MARKERS = (
    "Ran out of input",
    "pickle data was truncated",
    "UnpicklingError",
)
_MAX_CHAIN = 64  # exceptions visited, against pathological chains
_PATH_END = re.compile(r"[\s:'\"()\[\],;]")


class DamagedCacheFile(NamedTuple):
    """A damaged cache file found in an exception chain.

    Attributes:
        path: the file, as named by the error.
        cache_dir: the cache folder that holds it (Inductor's, or Triton's).
        reason: what was wrong with it, e.g. ``"file too short"``.
    """

    path: str
    cache_dir: str
    reason: str


def inductor_cache_dir() -> str:
    """Inductor's cache folder, without creating it or setting any variable.

    ``TORCHINDUCTOR_CACHE_DIR`` when set, else torch's default
    (``<tempdir>/torchinductor_<user>``).
    """
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return os.path.abspath(env)
    try:  # torch >= 2.5; cache_dir() itself would mkdir and set the variable
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except Exception:
        pass
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def _cache_roots() -> list[str]:
    """Folders whose files count as compile-cache artifacts, most specific first."""
    roots = []
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton:
        roots.append(os.path.abspath(triton))
    roots.append(inductor_cache_dir())
    out: list[str] = []
    for root in roots:
        for form in (root, os.path.realpath(root)):
            form = form.rstrip(os.sep)
            if form and form not in out:
                out.append(form)
    return out


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception reachable through cause, context and wrappers."""
    out: list[BaseException] = []
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack and len(out) < _MAX_CHAIN:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        nested = getattr(e, "exceptions", None)  # ExceptionGroup
        if isinstance(nested, (list, tuple)):
            stack.extend(reversed(nested))
        # Dynamo's BackendCompilerFailed keeps the backend's error here as well.
        stack.extend((e.__context__, e.__cause__, getattr(e, "inner_exception", None)))
    return out


def _text(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:
        message = ""
    return f"{type(exc).__name__}: {message}"


def _reason(exc: BaseException, text: str) -> str | None:
    """The marker of a damaged-artifact error in ``exc`` (or its text), else ``None``."""
    for marker in _LOADER_MARKERS:
        if marker in text:
            return marker
    for marker in _PICKLE_MARKERS:
        if marker in text:
            return "EOFError: Ran out of input" if marker == "Ran out of input" else marker
    if isinstance(exc, (EOFError, pickle.UnpicklingError)):
        first_line = text.splitlines()[0] if text else type(exc).__name__
        return first_line.rstrip(": ")
    return None


def _under(path: str, roots: list[str]) -> str | None:
    """The root that holds ``path`` (compared as given and resolved), else ``None``."""
    forms = {os.path.abspath(path)}
    try:
        forms.add(os.path.realpath(path))
    except (OSError, ValueError):
        pass
    for root in roots:
        if any(f.startswith(root + os.sep) for f in forms):
            return root
    return None


def _paths_in_text(text: str, roots: list[str]) -> list[tuple[str, str]]:
    found = []
    for root in roots:
        start = 0
        while (i := text.find(root + os.sep, start)) >= 0:
            end = _PATH_END.search(text, i + len(root) + 1)
            path = text[i : end.start() if end else len(text)].rstrip(".")
            found.append((path, root))
            start = i + len(root) + 1
    return found


def _paths_in_attrs(exc: BaseException, roots: list[str]) -> list[tuple[str, str]]:
    found = []
    for attr in ("filename", "filename2", "path"):  # OSError, ImportError
        value = getattr(exc, attr, None)
        if isinstance(value, (str, os.PathLike)):
            root = _under(os.fspath(value), roots)
            if root is not None:
                found.append((os.fspath(value), root))
    return found


def _paths_in_frames(exc: BaseException, roots: list[str]) -> list[tuple[str, str]]:
    """Cache files held in the locals of the frames ``exc`` was raised through."""
    found = []
    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, (str, Path)) and 0 < len(str(value)) < 4096:
                root = _under(str(value), roots)
                if root is not None and os.path.basename(str(value)):
                    found.append((str(value), root))
        tb = tb.tb_next
    # The innermost frame is the closest to the failed read.
    return list(reversed(found))


def find_damaged_cache_file(exc: BaseException) -> DamagedCacheFile | None:
    """The damaged Inductor/Triton cache file behind ``exc``, if that is what it is.

    Looks at ``exc`` and every exception in its chain (``__cause__``,
    ``__context__``, Dynamo's ``inner_exception``, exception groups), and at
    their messages, since wrappers often carry only the inner error's text.
    An error counts when it is a loader error about a shared object ("file
    too short", "invalid ELF header", "cannot open shared object file") or a
    truncated pickle (``EOFError``, ``UnpicklingError``), and it names a file
    inside the cache folder (in its message, its ``filename``/``path``, or,
    for a pickle error, the locals of the frames it was raised in).
    """
    roots = _cache_roots()
    for e in _chain(exc):
        text = _text(e)
        reason = _reason(e, text)
        if reason is None:
            continue
        candidates = _paths_in_attrs(e, roots) + _paths_in_text(text, roots)
        if reason not in _LOADER_MARKERS:
            candidates += _paths_in_frames(e, roots)
        if candidates:
            path, root = candidates[0]
            return DamagedCacheFile(path=path, cache_dir=root, reason=reason)
    return None


#: What the compiler's note on a graph break under ``fullgraph`` names.
_FULLGRAPH_FLAG = "--compile.fullgraph false"
_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n\s*(\S.*)')


def describe_graph_break(exc: BaseException) -> str | None:
    """One line for a graph break in a model compiled whole: Dynamo's reason,
    the model's line that breaks, and the flag that compiles around it;
    ``None`` when ``exc`` is not one (an error the compiler's wrapper noted
    as a graph break, see ``simplefsdp.compiler.first_inputs``)."""
    for e in _chain(exc):
        notes = [str(n) for n in getattr(e, "__notes__", None) or ()]
        if not any(_FULLGRAPH_FLAG in n for n in notes):
            continue
        text = _text(e)
        reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
        _, marker, user_code = text.partition("from user code:")
        frames = _USER_FRAME.findall(user_code) if marker else []
        where = ""
        if frames:  # the innermost frame of the model's code: the line that breaks
            path, line, code = frames[-1]
            where = f" at {os.path.basename(path)}:{line} ({code.strip()})"
        line = (
            f"the model's code breaks the compiled graph: {reason or type(e).__name__}{where}; "
            f"use {_FULLGRAPH_FLAG} to compile around it (each graph between breaks is "
            "bucketed on its own)"
        )
        if any("differs between ranks" in n for n in notes):
            line += (
                "; where that branch differs between ranks (experts picked per token), "
                "every rank must also read the same parameters: --parallel.engine "
                "simplefsdp_eager"
            )
        return " ".join(line.splitlines())
    return None


def describe_compile_error(exc: BaseException) -> str | None:
    """One line saying how to fix ``exc``, or ``None`` when it is not a known case.

    Known cases: a damaged file in the Inductor cache (see
    :func:`find_damaged_cache_file`); the line names the file, the cache
    folder to delete and ``TORCHINDUCTOR_CACHE_DIR`` as the alternative. A
    graph break of a model compiled whole (:func:`describe_graph_break`).
    """
    found = find_damaged_cache_file(exc)
    if found is None:
        return describe_graph_break(exc)
    line = (
        f"the compile cache holds a damaged file, {found.path} ({found.reason}), most likely "
        f"left by an interrupted compile; delete it, or the whole cache folder "
        f"(rm -rf {shlex.quote(found.cache_dir)}), and run again, or set TORCHINDUCTOR_CACHE_DIR to a new "
        f"empty folder to compile with a fresh cache"
    )
    return " ".join(line.splitlines())
