"""The host side of an eager MoE step (Note: [Host-bound steps]): the
family's kernels recorded at their real shapes, issued by the host against
one device stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from simplefsdp.models.registry import resolve_flavor
from simplefsdp.plan.analytic import ExpertLayout, predict_analytic
from simplefsdp.plan.hardware import PROFILES
from simplefsdp.plan.host import (
    EagerStep,
    KernelOp,
    _KernelRecorder,
    _record_step,
    device_bound,
    simulate,
    timeline_step,
)
from simplefsdp.plan.kernels import kernel_model

H100 = PROFILES["h100"]
LAYOUT = ExpertLayout(gpus=8, batch=1, seq=4096, ep=2, ac="selective", engine="fsdp2")


@pytest.fixture(scope="module")
def dsv3():
    return resolve_flavor("deepseek_v3_16b")


def test_recorder_skips_views():
    x = torch.ones(4, 6)
    with _KernelRecorder(lambda *_: 1.0, saves_attention=False) as recorder:
        y = x.view(6, 4).t().transpose(0, 1).unsqueeze(0).expand(2, 6, 4)  # no kernel
        y = y + 1  # one kernel
        y.detach().reshape(-1)[:3].sum()  # one kernel
    assert [op[0] for op in recorder.ops] == ["forward", "forward"]


def test_simulate_by_hand():
    host = {"forward": 1.0, "backward": 0.5, "recompute": 1.0, "hook": 0.25, "prefetch": 0.0}
    # the device waits for the host's issue, then for its own predecessor
    ops = [KernelOp("forward", 3.0), KernelOp("forward", 0.5), KernelOp("backward", 2.0)]
    step, device, issued = simulate(ops, host, sync_s=0.0)
    assert (step, device, issued) == (1.0 + 3.0 + 0.5 + 2.0, 5.5, 2.5)
    # a sync before the second op: the host waits for the first to finish
    synced = [ops[0], KernelOp("forward", 0.5, sync=True), ops[2]]
    assert simulate(synced, host, sync_s=0.25)[0] == 4.0 + 0.25 + 1.0 + 0.5 + 2.0
    # a slow host: the host's sum, plus the last kernel
    slow = {k: 10.0 for k in host}
    assert simulate(ops, slow, sync_s=0.0)[0] == 30.0 + 2.0
    # a block's gather issued by its hooks (0.25 s of host, at 1.25) and
    # waited for at once: hidden behind the kernel queued before it, or not
    gathered = [ops[0], KernelOp("hook", 0.0, gather="moe", wait=True), *ops[1:]]
    assert simulate(gathered, host, 0.0, {"moe": 2.0})[0] == 4.0 + 0.5 + 2.0
    assert simulate(gathered, host, 0.0, {"moe": 5.0})[0] == 1.25 + 5.0 + 0.5 + 2.0
    # prefetched: issued one block ahead, before the first kernel, the
    # second block's hook waits for it
    ahead = [KernelOp("prefetch", 0.0, gather="moe"), ops[0], KernelOp("hook", 0.0, wait=True)]
    assert simulate(ahead + ops[1:], host, 0.0, {"moe": 5.0})[0] == 5.0 + 0.5 + 2.0
    # the hooks after a sync: the device idles while the host runs them
    after_sync = [ops[0], KernelOp("hook", 0.0, sync=True), *ops[1:]]
    assert simulate(after_sync, host, 0.0)[0] == 4.0 + 0.25 + 1.0 + 0.5 + 2.0


def test_fsdp2s_buffers_leave_the_recorded_kernels_alone(dsv3):
    from simplefsdp.plan.host import Fsdp2Buffers

    spec, config = dsv3
    small = dataclasses.replace(config, n_layers=config.n_dense_layers + 2)
    ops = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6)
    group = ((1 << 20, 1 << 17),)
    buffers = Fsdp2Buffers(dense=group, moe=group * 2, root=group)
    recorder = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6, True, buffers)
    assert recorder.ops == ops
    # each group's all-gather: the blocks' (a dense one, two MoE ones of two
    # groups) in forward and again in backward, the root's once (kept
    # gathered to the end of backward)
    gathers = [e for e in recorder.events if getattr(e, "stream", 0) == 1]
    assert len(gathers) == 2 * (1 + 2 * 2) + 1
    # not resharded after forward: each block's gathered once, its
    # parameters freed only after its backward
    kept = dataclasses.replace(buffers, reshard_after_forward=False)
    recorder = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6, True, kept)
    assert recorder.ops == ops
    gathers = [e for e in recorder.events if getattr(e, "stream", 0) == 1]
    assert len(gathers) == (1 + 2 * 2) + 1
    keys = [e.key for e in recorder.events]
    first_param = ("fsdp2-param", "forward", 0, 0)
    freed = keys.index(first_param, keys.index(first_param) + 1)  # its Free, same key
    assert freed > keys.index(("fsdp2-grad", 0, 0))  # after its backward's gradients
    # torchtitan's split root: the embedding gathered in forward and again
    # for its backward, the step's last; the final norm and output once,
    # reduced before the last block's backward gathers it
    split = dataclasses.replace(buffers, embedding=group)
    recorder = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6, True, split)
    assert recorder.ops == ops
    keys = [e.key for e in recorder.events]
    gathers = [e.key for e in recorder.events if getattr(e, "stream", 0) == 1]
    assert len(gathers) == 2 * (1 + 2 * 2) + 1 + 2
    assert [k for k in gathers if k[2] == "embedding"] == [
        ("fsdp2-ag", "forward", "embedding", 0),
        ("fsdp2-ag", "backward", "embedding", 0),
    ]
    last = config.n_dense_layers + 1
    assert keys.index(("fsdp2-rs", "root", 0)) < keys.index(("fsdp2-ag", "backward", last, 0))
    assert keys.index(("fsdp2-rs", "embedding", 0)) > keys.index(("fsdp2-rs", 0, 0))


def test_steps_kernels_recorded_on_the_model(dsv3):
    spec, config = dsv3
    small = dataclasses.replace(config, n_layers=config.n_dense_layers + 1)
    ops = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6)
    phases = [op[0] for op in ops]
    forward, recompute = phases.count("forward"), phases.count("recompute")
    # selective AC recomputes part of the forward (matmuls and attention saved)
    assert 0 < recompute < forward < phases.count("backward")
    # expert parallelism: the token counts read before each experts call in
    # forward (then the experts' own FSDP group's hooks run); selective AC
    # saves the copy, full AC's recomputation reads them again
    syncs = [op[0] for op in ops if op[2]]
    assert syncs == ["hook"]
    full = _record_step(spec, small, "full", 2, 1, 256, lambda *_: 1e-6)
    assert [op[0] for op in full if op[2]] == ["hook", "recompute"]
    # recomputing the experts: their three grouped matmuls once more
    lean = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6,
                        recompute_experts=True)  # fmt: skip
    assert [op[0] for op in lean].count("recompute") == recompute + 3
    # FSDP's groups: the root, the blocks and the experts, each hooked
    # before its forward and its backward; the blocks' gathers issued one
    # block ahead, the first by the root
    blocks = config.n_dense_layers + 1
    assert phases.count("hook") == 2 * (1 + blocks + 1)
    # FSDP2's split root: the embedding's group and the final norm's with
    # the output hooked too, the embedding's hooked before the step's last
    # kernel (its gradient)
    split = _record_step(spec, small, "selective", 2, 1, 256, lambda *_: 1e-6, split_root=True)
    assert [op[0] for op in split].count("hook") == 2 * (3 + blocks + 1)
    last_hook = max(i for i, op in enumerate(split) if op[0] == "hook")
    assert [op[0] for op in split[last_hook + 1 :]] == ["backward"]
    assert [op.gather for op in ops if op.gather] == ["dense", "moe"]
    assert sum(op.wait for op in ops) == blocks
    assert not any(op[2] for op in _record_step(spec, small, "selective", 1, 1, 256,
                                                       lambda *_: 1e-6))  # fmt: skip
    # the experts run as grouped matmuls: the count does not grow with them
    more = dataclasses.replace(small, num_experts=2 * small.num_experts)
    assert len(_record_step(spec, more, "selective", 2, 1, 256, lambda *_: 1e-6)) == len(ops)


def test_a_device_bound_step_is_its_device_time_and_its_syncs():
    step = device_bound(3.0, syncs=2, sync_s=0.5)
    assert (step.step_s, step.wait_s, step.host_s) == (4.0, 1.0, 0.0)
    assert not step.host_bound


@pytest.mark.parametrize("ep", [1, 2])
def test_host_bound_switch(dsv3, ep):
    spec, config = dsv3
    layout = dataclasses.replace(LAYOUT, ep=ep)
    free = dict(host_forward_op_s=1e-12, host_backward_op_s=1e-12, host_selective_ac_op_s=0.0)
    free_hw = dataclasses.replace(H100, **free)
    kernels = kernel_model(free_hw, free_hw.memory_bandwidth * free_hw.memory_efficiency)
    step = EagerStep(spec, config, "selective", ep, 1, 4096, kernels)
    alone = timeline_step(step, free_hw)
    syncs = config.n_moe_layers if ep > 1 else 0  # forward's only: selective AC saves the copy
    sync_s = syncs * (H100.kernel_overhead_s + 1e-12)
    # a negligible host: the eager kernels' own time, plus each sync's latency
    assert alone.wait_s == pytest.approx(sync_s, rel=1e-3, abs=1e-9)
    # the blocks' forward gathers: the first one waited for (but for the
    # embedding's kernel before it), the rest hidden behind the kernels
    # queued before them
    gathered = timeline_step(step, free_hw, gather_s={"dense": 1e-3})
    assert sync_s + 0.5e-3 < gathered.wait_s <= sync_s + 1e-3
    # FSDP2's hooks, 1 ms per group and step: hidden where the host runs
    # ahead, but the experts' forward half runs after the token sync, when
    # the device has drained
    hooked_hw = dataclasses.replace(free_hw, host_fsdp2_group_s=1e-3)
    hooked = timeline_step(step, hooked_hw, fsdp2=True)
    exposed = hooked.wait_s - alone.wait_s
    if ep > 1:
        assert exposed >= config.n_moe_layers * 0.5e-3 * 0.99
    assert exposed < 0.5e-3 * (2 * config.n_layers + 1)  # not all of it
    pred = predict_analytic(spec, config, layout, free_hw)
    assert "device bound" in "".join(pred.notes)
    slow = dict(host_forward_op_s=1e-3, host_backward_op_s=1e-3, host_selective_ac_op_s=0.0)
    slow_pred = predict_analytic(spec, config, layout, dataclasses.replace(H100, **slow))
    # a slow host: about the host's sum (the device's last kernels after it)
    assert slow_pred.time["compute"] == pytest.approx(slow_pred.time["host"], rel=0.05)
    assert slow_pred.time["compute"] > 10 * pred.time["compute"]
    assert "host bound" in "".join(slow_pred.notes)
    # selective AC's dispatch mode adds to each forward and recomputed op
    sac = predict_analytic(spec, config, layout, H100)
    plain = dataclasses.replace(H100, host_selective_ac_op_s=0.0)
    assert sac.time["host"] > predict_analytic(spec, config, layout, plain).time["host"]
    # compiled (fused kernels): device bound assumed, whatever the per-op cost
    compiled = predict_analytic(
        spec, config, dataclasses.replace(layout, engine="simplefsdp"),
        dataclasses.replace(H100, **slow),
    )  # fmt: skip
    assert compiled.time["host"] == 0.0


@pytest.mark.parametrize("recompute_experts", [False, True])
def test_selective_activations_are_what_the_model_saves(dsv3, recompute_experts):
    """The analytic selective AC's activations of an MoE block (without
    EP: no all-to-all) against what the family's own model, recorded on the
    meta device under the engines' policy, still holds as backward starts."""
    from simplefsdp.plan.allocator import Alloc, Free
    from simplefsdp.plan.analytic import activation_elements

    spec, config = dsv3
    seq = 512

    def held(moe_blocks: int) -> tuple[int, float]:
        model = dataclasses.replace(config, n_layers=config.n_dense_layers + moe_blocks)
        recorder = _record_step(spec, model, "selective", 1, 1, seq, lambda *_: 0.0, True,
                                recompute_experts=recompute_experts)  # fmt: skip
        live = {}
        for event in recorder.events[: recorder.forward_end]:
            if isinstance(event, Alloc):
                live[event.key] = event.size
            elif isinstance(event, Free):
                live.pop(event.key, None)
        saved = activation_elements(model, "selective", recompute_experts=recompute_experts)
        return sum(live.values()), 2 * saved["saved"] * seq

    (one, planned_one), (two, planned_two) = held(1), held(2)
    assert planned_two - planned_one == pytest.approx(two - one, rel=0.05)
