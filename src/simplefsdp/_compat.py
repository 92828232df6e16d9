"""Names that differ between the torch versions we support (2.11 to 2.13),
and workarounds for torch bugs (see docs/crashes.md)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# torch >= 2.13 renames the single-tensor collectives and the old names warn
# (FutureWarning); torch 2.11 has only the old names. Same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def root_mesh(mesh):
    """The mesh that ``mesh`` was sliced from (``mesh`` itself if not sliced).

    ``DeviceMesh._get_root_mesh`` where torch has it; older torch keeps the
    relation in ``_mesh_resources``.
    """
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        return getter()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


def slices_of_one_mesh(mesh, other) -> bool:
    """Whether ``other`` is a slice of the mesh ``mesh`` was sliced from: the
    same root, or that root's dims of ``other``'s names over the same ranks.
    torch caches slices by their dims and ranks, so in a process that built an
    equal mesh before, a new slice can report the older mesh as its root."""
    root = root_mesh(mesh)
    if root_mesh(other) == root:
        return True
    names = other.mesh_dim_names
    if not names or not set(names) <= set(root.mesh_dim_names or ()):
        return False
    try:
        return torch.equal(root[names].mesh, other.mesh)
    except (KeyError, ValueError, RuntimeError):
        return False


# Note: [Gloo all-gather workaround]
# ``_c10d_functional.all_gather_into_tensor`` (what DTensor's redistribute and
# every compiled FSDP all-gather call, under aot_eager and Inductor alike)
# goes through the backend's ``allgather_into_tensor_coalesced``; on gloo that
# is ``allgather_coalesced`` (a flat staging buffer, filled and copied out on
# a gloo worker thread). With several small all-gathers in flight we saw it
# corrupt the heap, in a loop of bare functional collectives with no
# simplefsdp code (glibc: "malloc(): unaligned fastbin chunk detected",
# "free(): invalid pointer", SIGSEGV in the main thread's next collective);
# docs/crashes.md has the reproduction and counts. The out variant,
# ``all_gather_into_tensor_out``, takes ``_allgather_base`` (gloo's plain
# allgather into the output) and did not crash in the same loops. So for CPU
# tensors (gloo) the functional op's kernel is replaced by one that allocates
# the output and calls the out variant: same result, same work registration
# (``wait_tensor`` waits on it), a different gloo path. Tracing is unaffected
# (the Meta/fake kernels stay), so compiled graphs are unchanged; only the
# CPU kernel that runs them is. CUDA (NCCL) is not touched.
GLOO_ALL_GATHER_WORKAROUND_ENV_VAR = "SIMPLEFSDP_GLOO_ALLGATHER_WORKAROUND"
_workaround_lib = None


def _all_gather_into_tensor_cpu(
    input: torch.Tensor,  # noqa: A002 - the op's argument name
    group_size: int,
    group_name: str,
) -> torch.Tensor:
    out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]))
    return torch.ops._c10d_functional.all_gather_into_tensor_out.default(
        input, group_size, group_name, out=out
    )


def install_gloo_all_gather_workaround() -> bool:
    """Route CPU functional all-gathers through gloo's ``_allgather_base``.

    See Note: [Gloo all-gather workaround]. Idempotent; ``data_parallel``
    calls it. ``SIMPLEFSDP_GLOO_ALLGATHER_WORKAROUND=0`` (read on the first
    call) leaves torch's kernel in place, to reproduce the crash. Returns
    whether the workaround is installed.
    """
    global _workaround_lib
    if _workaround_lib is not None:
        return True
    if os.environ.get(GLOO_ALL_GATHER_WORKAROUND_ENV_VAR, "1") == "0":
        return False
    ops = torch.ops._c10d_functional
    if not (hasattr(ops, "all_gather_into_tensor") and hasattr(ops, "all_gather_into_tensor_out")):
        return False
    import warnings

    lib = torch.library.Library("_c10d_functional", "IMPL")  # noqa: TOR901
    with warnings.catch_warnings():
        # torch warns that an existing kernel is overridden: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("all_gather_into_tensor", _all_gather_into_tensor_cpu, "CPU")
    _workaround_lib = lib
    return True


# Note: [Stable DeviceMesh pickles for Inductor's cache]
# Inductor's FX graph cache keys a graph by pickling it with its example
# inputs. A DTensor graph's inputs include its DeviceMesh (an opaque object),
# and DeviceMesh pickles its whole ``__dict__``, including ``_hash``: a cache of
# ``hash()`` over a tuple with strings, which Python salts per process. So the
# key of an unchanged graph differs from one process to the next, and every
# start compiles from scratch (torch 2.13; docs/design.md has a reproduction).
# While we compile a graph, ``stable_mesh_pickling()`` makes DeviceMesh pickle
# without ``_hash`` (recomputed on first use after unpickling, as
# ``DeviceMesh.__hash__`` does when it is missing). Everything else of the
# mesh (ranks, layout, device type, dim names, process group names) stays in
# the key, and the pickle still restores the mesh.


def _restore_device_mesh(cls, state):
    mesh = cls.__new__(cls)
    if hasattr(mesh, "__setstate__"):
        mesh.__setstate__(state)
    else:  # pragma: no cover - torch without DeviceMesh.__setstate__
        mesh.__dict__.update(state)
    return mesh


def _reduce_device_mesh(mesh):
    getstate = getattr(mesh, "__getstate__", None)
    state = dict(getstate() if getstate is not None else mesh.__dict__)
    state.pop("_hash", None)
    return _restore_device_mesh, (type(mesh), state)


class stable_mesh_pickling:  # noqa: N801 - used as a context manager
    """Within the ``with`` block, pickling a DeviceMesh leaves out its
    per-process hash cache (Note: [Stable DeviceMesh pickles for Inductor's
    cache]). The previous reducer, if any, is restored on exit."""

    def __enter__(self):
        import copyreg

        from torch.distributed.device_mesh import DeviceMesh

        self._cls = DeviceMesh
        self._previous = copyreg.dispatch_table.get(DeviceMesh)
        copyreg.dispatch_table[DeviceMesh] = _reduce_device_mesh
        return self

    def __exit__(self, *exc):
        import copyreg

        if self._previous is None:
            copyreg.dispatch_table.pop(self._cls, None)
        else:
            copyreg.dispatch_table[self._cls] = self._previous
        return False
