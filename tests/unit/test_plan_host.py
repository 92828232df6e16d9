"""The host side of an eager MoE step (Note: [Host-bound steps]): kernels
counted on the family's model, and host against device per run of segments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from simplefsdp.models.registry import resolve_flavor
from simplefsdp.plan.analytic import ExpertLayout, predict_analytic
from simplefsdp.plan.hardware import PROFILES
from simplefsdp.plan.host import _KernelCounter, block_ops, host_step, tiny_config

H100 = PROFILES["h100"]
LAYOUT = ExpertLayout(gpus=8, batch=1, seq=4096, ep=2, ac="selective", engine="fsdp2")


@pytest.fixture(scope="module")
def dsv3():
    return resolve_flavor("deepseek_v3_16b")


def test_counter_skips_views():
    x = torch.ones(4, 6)
    with _KernelCounter() as counter:
        y = x.view(6, 4).t().transpose(0, 1).unsqueeze(0).expand(2, 6, 4)  # no kernel
        y = y + 1  # one kernel
        y.detach().reshape(-1)[:3].sum()  # one kernel
    assert sum(counter.counts.values()) == 2, counter.counts


def test_tiny_config_keeps_the_flavor_switches(dsv3):
    spec, config = dsv3
    tiny = tiny_config(spec, config)
    assert spec.num_params(tiny) < 1e8
    # no query compression, one expert group, softmax routing: the 16B's structure
    assert (tiny.q_lora_rank, tiny.num_expert_groups, tiny.score_func) == (0, 1, "softmax")
    assert tiny.route_norm is config.route_norm


def test_block_ops_counted_on_the_model(dsv3):
    spec, config = dsv3
    local = block_ops(spec, config, "selective", 1)
    parallel = block_ops(spec, config, "selective", 2)
    # expert parallelism adds the dispatch and combine, and one sync per pass
    assert (local.syncs_per_pass, parallel.syncs_per_pass) == (0, 1)
    assert parallel.forward > local.forward > 20
    assert parallel.backward >= local.backward > local.forward
    # selective AC recomputes part of the forward (matmuls and attention saved)
    assert 0 < parallel.recompute < parallel.forward
    # the experts run as grouped matmuls: the count does not grow with them
    more = dataclasses.replace(config, num_experts=2 * config.num_experts)
    assert block_ops(spec, more, "selective", 2) == parallel
    forward, backward, recompute = parallel.step_counts(config.n_moe_layers, 1)
    assert forward == parallel.rest_forward + config.n_moe_layers * parallel.forward
    assert recompute > 0 and backward > 0


def test_host_step_runs():
    runs = [(3.0, 1.0), (1.0, 2.0)]
    separate = host_step(runs, syncs=2, sync_s=0.5, overlap=False)
    assert separate.step_s == pytest.approx(3.0 + 2.0 + 1.0)
    assert separate.host_bound and separate.wait_s == pytest.approx(6.0 - 3.0)
    joined = host_step(runs, syncs=0, sync_s=0.5, overlap=True)
    assert joined.step_s == pytest.approx(4.0) and joined.host_bound
    fast = host_step([(0.1, 1.0), (0.2, 2.0)], syncs=0, sync_s=0.0, overlap=False)
    assert fast.wait_s == 0.0 and not fast.host_bound


@pytest.mark.parametrize("ep", [1, 2])
def test_host_bound_switch(dsv3, ep):
    spec, config = dsv3
    layout = dataclasses.replace(LAYOUT, ep=ep)
    tiny_cost = dataclasses.replace(H100, host_forward_op_s=1e-12, host_backward_op_s=1e-12)
    pred = predict_analytic(spec, config, layout, tiny_cost)
    syncs = config.n_moe_layers * 2 if ep > 1 else 0
    sync_s = syncs * (H100.kernel_overhead_s + 1e-12)
    # a negligible host: the device model, plus each sync's latency
    assert pred.time["host_wait"] == pytest.approx(sync_s, abs=1e-9)
    assert "device bound" in "".join(pred.notes)
    slow = dataclasses.replace(H100, host_forward_op_s=1e-3, host_backward_op_s=1e-3)
    slow_pred = predict_analytic(spec, config, layout, slow)
    sync_s = syncs * (H100.kernel_overhead_s + 1e-3)
    # a slow host: the host's sum (the all-to-all hidden under it)
    device = slow_pred.time["compute"] - slow_pred.time["host_wait"]
    assert device == pytest.approx(pred.time["compute"] - pred.time["host_wait"])
    assert slow_pred.time["compute"] + slow_pred.time["ep_comm_total"] == pytest.approx(
        slow_pred.time["host"] + sync_s
    )
    assert "host bound" in "".join(slow_pred.notes)
    # compiled (fused kernels): device bound assumed, whatever the per-op cost
    compiled = predict_analytic(
        spec, config, dataclasses.replace(layout, engine="simplefsdp"), slow
    )
    assert compiled.time["host"] == 0.0
