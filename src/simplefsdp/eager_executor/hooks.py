"""Which modules drive each bucket, and installing the executor's hooks on them.

Note: [Bucket owner modules]
    A bucket is gathered when the first of its *owner modules* starts forward
    and may be freed when all of them have finished. The owners are found from
    where the bucket's parameters are registered: start at each module that
    holds one of them directly (every alias of a tied parameter counts, since
    each holder reads it in its own forward) and climb to the parent while the
    parent's whole subtree holds only this bucket's parameters and the parent
    runs a forward of its own (not a ``ModuleList``/``ModuleDict``). For a
    ``"per_block"`` plan that yields one owner per block (the block itself,
    not its linears); for ``[["norm", "output"]]`` the two modules; for a tied
    embedding both the embedding and the output projection. Nested owners are
    dropped (the outer one covers them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch.nn as nn

from simplefsdp.bucket_plan import BucketPlan
from simplefsdp.eager_executor.runtime import EagerExecutor, ViewTarget
from simplefsdp.frontend.parametrization import register_param_views, remove_param_views


def _subtree_param_ids(root: nn.Module) -> dict[int, set[int]]:
    """id(module) -> ids of every parameter in its subtree (aliases included)."""
    result: dict[int, set[int]] = {}

    def visit(module: nn.Module) -> set[int]:
        if id(module) in result:
            return result[id(module)]
        ids = {id(p) for p in module._parameters.values() if p is not None}
        for child in module.children():
            ids |= visit(child)
        result[id(module)] = ids
        return ids

    visit(root)
    return result


def find_owner_modules(root: nn.Module, plan: BucketPlan) -> list[list[nn.Module]]:
    """The owner modules of each bucket (see Note: [Bucket owner modules])."""
    canonical = dict(root.named_parameters())
    bucket_of_param = {id(canonical[f]): i for i, f in _bucket_items(plan)}
    subtree = _subtree_param_ids(root)
    parent: dict[int, nn.Module | None] = {id(root): None}
    for module in root.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    bucket_ids = [{id(canonical[f]) for f in b.param_fqns} for b in plan.buckets]

    owners: list[list[nn.Module]] = [[] for _ in plan.buckets]
    for module in root.modules():
        for param in module._parameters.values():
            if param is None or id(param) not in bucket_of_param:
                continue
            index = bucket_of_param[id(param)]
            owner = module
            up = parent[id(owner)]
            while up is not None and _runs_forward(up) and subtree[id(up)] <= bucket_ids[index]:
                owner, up = up, parent[id(up)]
            if all(owner is not m for m in owners[index]):
                owners[index].append(owner)
    return [_outermost(found) for found in owners]


def _runs_forward(module: nn.Module) -> bool:
    """Containers without a forward (``ModuleList``, ``ModuleDict``) never run
    their hooks, so they cannot own a bucket (a one-block ``ModuleList``
    holds exactly its block's parameters)."""
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _bucket_items(plan: BucketPlan) -> list[tuple[int, str]]:
    return [(i, fqn) for i, bucket in enumerate(plan.buckets) for fqn in bucket.param_fqns]


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    nested = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in nested]


def view_targets(root: nn.Module, plan: BucketPlan) -> list[list[ViewTarget]]:
    """Per bucket, where its parameter views are published (installs the dicts).

    Every module holding a bucket parameter (each alias) gets a views dict
    registered with the frontend (Note: [Parameter view providers] in
    ``frontend/parametrization.py``) that its parameter reads consult.
    """
    canonical_fqn = {id(p): fqn for fqn, p in root.named_parameters()}
    index_of = plan.bucket_index()
    targets: list[list[ViewTarget]] = [[] for _ in plan.buckets]
    for module in root.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        views = register_param_views(module)
        for name in names:
            fqn = canonical_fqn[id(module._parameters[name])]
            targets[index_of[fqn]].append((views, name, fqn))
    return targets


def remove_view_dicts(root: nn.Module) -> None:
    for module in root.modules():
        remove_param_views(module)


def install_hooks(
    root: nn.Module, executor: EagerExecutor, owners: Sequence[Sequence[nn.Module]]
) -> None:
    """Register the root, owner and post-accumulate-grad hooks; handles go to
    ``executor.handles``. Order matters: the root's pre-hook runs first and its
    post-hook last, so a bucket owned by the root itself nests inside them."""
    handles = executor.handles
    handles.append(root.register_forward_pre_hook(executor.root_pre_forward, prepend=True))
    for index, modules in enumerate(owners):
        for module in modules:
            handles.append(
                module.register_forward_pre_hook(functools.partial(executor.pre_forward, index))
            )
            handles.append(
                module.register_forward_hook(functools.partial(executor.post_forward, index))
            )
    handles.append(root.register_forward_hook(executor.root_post_forward))
    for index, bucket in enumerate(executor.buckets):
        if bucket.requires_grad:
            hook = functools.partial(executor.post_accumulate_grad, index)
            handles.append(bucket.flat.register_post_accumulate_grad_hook(hook))
