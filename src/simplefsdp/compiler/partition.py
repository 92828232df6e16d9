"""Forward/backward partitioning: torch's min-cut partitioner plus two repairs.

Note: [RNG states saved next to opaque objects]
    Under activation checkpointing, AOTAutograd's partitioner makes every
    recomputed random op replay the forward's RNG state: the forward saves the
    state (``run_and_save_rng_state``) as one more output and the backward
    takes it as one more input. Ops tagged ``nondeterministic_seeded`` count as
    random even when they are not used randomly, notably
    ``scaled_dot_product_attention`` (its dropout), so every checkpointed
    attention block has one.

    With torch 2.13 the state is appended right before the saved SymInts, i.e.
    *after* the saved opaque objects. A simplefsdp graph saves one opaque
    object, the ``DeviceMesh`` that the recomputed all-gather of a resharded
    parameter needs. AOTAutograd's runtime, however, slices the forward's
    outputs as ``[user outputs, tensors, opaque objects, SymInts]`` and calls
    the backward with ``[SymInts, tensors, opaque objects, gradients]``: the
    state lands in the opaque slice, the mesh in the tensor slice, and the
    first step fails with "expected all tensors_saved_with_vc_check to be
    Tensors". This is what made full activation checkpointing of Llama blocks
    fail under ``simplefsdp.compile``.

    :func:`repair_rng_state_order` moves the states to where the runtime
    expects saved tensors (after the last version-checked saved tensor, in the
    forward's outputs and the backward's inputs alike) and leaves graphs
    without the problem untouched.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from simplefsdp.compiler.patterns import collective_kind, is_wait

aten = torch.ops.aten

_PLAIN_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_opaque(node: fx.Node) -> bool:
    """A saved value that is neither a tensor nor a scalar (e.g. a DeviceMesh)."""
    if "val" not in node.meta:
        return False
    val = node.meta["val"]
    return not isinstance(val, (torch.Tensor, *_PLAIN_SCALARS)) and val is not None


def _is_scalar(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), _PLAIN_SCALARS)


def _is_no_vc(node: fx.Node) -> bool:
    return bool(node.meta.get("saved_tensor_with_no_vc_check", False))


def _is_rng_state_output(node: Any) -> bool:
    run_and_save = getattr(torch._prims.rng_prims, "run_and_save_rng_state", None)
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is run_and_save
        and node.args[1] == 0
    )


def _is_rng_state_input(node: fx.Node) -> bool:
    run_with = getattr(torch._prims.rng_prims, "run_with_rng_state", None)
    return node.op == "placeholder" and any(
        user.target is run_with and user.args[0] is node for user in node.users
    )


def repair_rng_state_order(fw: fx.GraphModule, bw: fx.GraphModule) -> bool:
    """Put saved RNG states before saved opaque objects (see the Note above).

    Returns whether the graphs were changed (only when an opaque object was
    saved ahead of an RNG state, the layout AOTAutograd's runtime misreads).
    """
    output = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    states = [o for o in outs if _is_rng_state_output(o)]
    if not states:
        return False
    first_state = outs.index(states[0])
    if not any(isinstance(o, fx.Node) and _is_opaque(o) for o in outs[:first_state]):
        return False
    rest = [o for o in outs if not _is_rng_state_output(o)]
    # The trailing block the runtime slices from the end: no-VC-check tensors,
    # opaque objects, SymInts. The states go right before it.
    at = len(rest)
    while at > 0 and isinstance(rest[at - 1], fx.Node):
        node = rest[at - 1]
        if not (_is_scalar(node) or _is_opaque(node) or _is_no_vc(node)):
            break
        at -= 1
    output.args = (tuple(rest[:at] + states + rest[at:]),)

    inputs = list(bw.graph.find_nodes(op="placeholder"))
    state_inputs = [p for p in inputs if _is_rng_state_input(p)]
    if len(state_inputs) != len(states):
        raise RuntimeError(
            f"simplefsdp: forward saves {len(states)} RNG states but backward reads "
            f"{len(state_inputs)}; cannot repair their order"
        )
    others = [p for p in inputs if p not in state_inputs]
    anchor = next(p for p in others if _is_opaque(p) or _is_no_vc(p))
    for node in state_inputs:
        anchor.prepend(node)
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    return True


def merge_duplicate_waits(graph: fx.Graph) -> int:
    """Give every collective one ``wait_tensor``; returns how many were merged.

    Note: [One wait per collective]
        AOTAutograd's partitioner runs common-subexpression elimination on
        the joint graph. Two parameters whose gradients are the same tensor
        (two biases added to one output, as in GPT-NeoX's parallel residual
        block) have identical reduce-scatters, which it merges into one node;
        their two ``wait_tensor`` nodes, each returning one gradient, are
        kept. Our passes pair each collective with one wait (``wait_of``), and
        bucketing replaced that one and erased the collective, leaving the
        other wait without its input. Here every later wait of a collective
        is replaced: by the first wait for an all-gather (its readers only
        compute from it), and by a ``clone`` of the first wait for a
        reduction. Two waits of one collective return the same tensor, so two
        gradients from one would share storage, and an in-place update of one
        (``clip_grad_norm_``'s scaling) would scale the other again; eager
        autograd gives each parameter its own gradient, and so does the clone.
        The reduction then returns two gradients and is attributed to no
        single parameter, so the passes leave it unbucketed (``find_sites``).
    """
    merged = 0
    for node in list(graph.nodes):
        kind = collective_kind(node)
        waits = [user for user in node.users if is_wait(user)] if kind else []
        if len(waits) < 2:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first, *rest = sorted(waits, key=order.__getitem__)
        for wait in rest:
            replacement = first
            if kind != "all_gather":
                with graph.inserting_after(first):
                    replacement = graph.call_function(aten.clone.default, (first,))
                replacement.meta["val"] = first.meta.get("val")
            wait.replace_all_uses_with(replacement)
            graph.erase_node(wait)
            merged += 1
    return merged


def partition(joint: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, Any]:
    """torch's ``min_cut_rematerialization_partition``, then
    :func:`repair_rng_state_order` and :func:`merge_duplicate_waits` on both graphs."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    repair_rng_state_order(fw, bw)
    for gm in (fw, bw):  # Note: [One wait per collective]
        if merge_duplicate_waits(gm.graph):
            gm.recompile()
    return fw, bw


def inductor_partitioner(partition_fn: Any = None) -> Any | None:
    """An Inductor ``custom_partitioner_fn`` running ``partition_fn``
    (default :func:`partition`), or ``None`` where this torch has no such hook."""
    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
    except ImportError:
        return None
    if not hasattr(torch._inductor.config, "custom_partitioner_fn"):
        return None

    class _Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return (partition_fn or partition)(gm, joint_inputs, **kwargs)

        def uuid(self) -> None:  # never serve cached graphs partitioned without us
            return None

    return _Partitioner()
