"""The caching-allocator simulation of ``simplefsdp plan`` (Notes: [Caching
allocator simulation], [Events of a training step])."""

from __future__ import annotations

import dataclasses

import pytest

from plan_profiles import FIXED
from simplefsdp.compiler.planning import collective_kind, estimate_memory
from simplefsdp.models.llama3 import get_config
from simplefsdp.models.registry import get_spec
from simplefsdp.plan.allocator import (
    Alloc,
    CachingAllocator,
    Free,
    Previous,
    cached_bytes,
    fsdp2_stream,
    fused_loss_skips,
    graph_events,
    round_size,
    segment_size,
    simulate_traced,
)
from simplefsdp.plan.predict import Layout, predict, traced
from simplefsdp.plan.trace import TraceKey

MiB = 1 << 20


def _run(events, **kw):
    return CachingAllocator(**kw).run(events)


def test_requests_round_up_to_512_bytes_and_segments_by_size() -> None:
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # small pool
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(11 * MiB) == 12 * MiB  # rounded up to 2 MiB
    stats = _run([Alloc("a", 1)])
    assert (stats.requested_peak_bytes, stats.allocated_peak_bytes) == (1, 512)
    assert stats.reserved_peak_bytes == 2 * MiB


def test_a_freed_block_is_reused_whole_when_the_rest_is_too_small_to_split() -> None:
    stats = _run([Alloc("a", 12 * MiB), Free("a"), Alloc("b", 11 * MiB)])
    assert stats.reserved_peak_bytes == 12 * MiB  # no second segment
    assert stats.allocated_peak_bytes == 12 * MiB  # 1 MiB left is not split off


def test_a_freed_block_splits_and_its_rest_serves_the_next_request() -> None:
    events = [Alloc("a", 12 * MiB), Free("a"), Alloc("b", 4 * MiB), Alloc("c", 8 * MiB)]
    stats = _run(events)
    assert stats.reserved_peak_bytes == 12 * MiB
    assert stats.allocated_peak_bytes == 12 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_holds_the_request() -> None:
    events = [Alloc("a", 14 * MiB), Alloc("b", 12 * MiB), Free("a"), Free("b")]
    events += [Alloc("c", 11 * MiB), Alloc("d", 13 * MiB)]
    assert _run(events).reserved_peak_bytes == 26 * MiB  # first fit would need a third
    events[-2:] = [Alloc("c", 13 * MiB), Alloc("d", 11 * MiB)]
    assert _run(events).reserved_peak_bytes == 26 * MiB


def test_freed_neighbours_merge_into_one_block() -> None:
    events = [Alloc("a", 4 * MiB), Alloc("b", 4 * MiB), Free("a"), Free("b")]
    assert _run(events).reserved_peak_bytes == 20 * MiB  # one segment for both
    assert _run([*events, Alloc("c", 18 * MiB)]).reserved_peak_bytes == 20 * MiB
    unmerged = [Alloc("a", 4 * MiB), Alloc("b", 4 * MiB), Free("a"), Alloc("c", 18 * MiB)]
    assert _run(unmerged).reserved_peak_bytes == 38 * MiB


def test_a_stream_reuses_only_its_own_cached_blocks() -> None:
    same = [Alloc("a", 12 * MiB), Free("a"), Alloc("b", 12 * MiB, stream=0)]
    other = [Alloc("a", 12 * MiB), Free("a"), Alloc("b", 12 * MiB, stream=1)]
    assert _run(same).reserved_peak_bytes == 12 * MiB
    assert _run(other).reserved_peak_bytes == 24 * MiB


def test_at_capacity_the_cache_is_released_and_the_allocation_retried() -> None:
    events = [Alloc("a", 12 * MiB), Free("a"), Alloc("b", 20 * MiB)]
    assert _run(events).reserved_peak_bytes == 32 * MiB
    stats = _run(events, capacity_bytes=30 * MiB)
    assert (stats.reserved_peak_bytes, stats.retries, stats.ooms) == (20 * MiB, 1, 0)
    # A split segment is not released: the request cannot fit.
    split = [Alloc("a", 12 * MiB), Alloc("k", 4 * MiB), Free("a"), Alloc("b", 20 * MiB)]
    stats = _run(split, capacity_bytes=35 * MiB)
    assert (stats.retries, stats.ooms) == (1, 1)
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        CachingAllocator(0)


def test_expandable_segments_grow_by_pages_from_their_free_end() -> None:
    events = [Alloc("a", 12 * MiB), Alloc("b", 12 * MiB)]
    stats = _run(events, expandable_segments=True)
    # [a 12 | free 8] + one 20 MiB page: b takes the free 8 and 4 of it.
    assert stats.reserved_peak_bytes == 40 * MiB
    assert _run(events).reserved_peak_bytes == 24 * MiB  # two 12 MiB segments
    stats = _run([*events, Free("a"), Alloc("c", 11 * MiB)], expandable_segments=True)
    assert stats.reserved_peak_bytes == 40 * MiB  # a's block, split (large pool too)
    assert stats.allocated_peak_bytes == 24 * MiB
    # At capacity the whole pages of free blocks are unmapped (here another
    # stream's) and the allocation retried.
    events = [Alloc("a", 12 * MiB, stream=1), Free("a"), Alloc("b", 12 * MiB)]
    stats = _run(events, capacity_bytes=30 * MiB, expandable_segments=True)
    assert (stats.reserved_peak_bytes, stats.retries, stats.ooms) == (20 * MiB, 1, 0)


def _key(n_layers: int) -> TraceKey:
    return TraceKey("llama3", get_config("debug", n_layers=n_layers), 2, 1, 2, 64, "selective")


def test_a_graphs_events_peak_at_its_estimated_memory() -> None:
    t = traced(_key(2))
    for gm in (t.forward, t.backward):
        events, _ = graph_events(gm, "g", {})
        stats = _run(events)
        assert stats.requested_peak_bytes == estimate_memory(gm).peak_bytes
        assert stats.reserved_peak_bytes >= stats.allocated_peak_bytes
    # Eager FSDP2's streams: every all-gather and its copy-in on stream 1,
    # every reduce-scatter and its copy-in on stream 2.
    gathers = [n for n in t.forward.graph.nodes if collective_kind(n) == "all_gather"]
    scatters = [n for n in t.backward.graph.nodes if collective_kind(n) == "reduce_scatter"]
    assert gathers and scatters
    assert all(fsdp2_stream(n) == fsdp2_stream(n.args[0]) == 1 for n in gathers)
    assert all(fsdp2_stream(n) == fsdp2_stream(n.args[0]) == 2 for n in scatters)
    assert sum(fsdp2_stream(n) > 0 for n in t.forward.graph.nodes) == 2 * len(gathers)
    # A fused loss materialises none of the eager loss's fp32 tensors of the
    # vocabulary's width.
    skip = fused_loss_skips(t.key.config.vocab_size)
    nodes = {n.name: n for n in t.forward.graph.nodes}
    eager, _ = graph_events(t.forward, "g", {})
    fused, _ = graph_events(t.forward, "g", {}, skip=skip)
    allocated = [{e.key[1] for e in ev if isinstance(e, Alloc)} for ev in (eager, fused)]
    wide = {name for name in allocated[0] if skip(nodes[name])}
    assert wide  # the upcast logits and their log-probabilities
    assert allocated[1] == allocated[0] - wide
    # The step: parameters, two steps of both graphs, AdamW; steady by the second.
    two, three = simulate_traced(t), simulate_traced(t, steps=3)
    assert two == three
    assert two.requested_peak_bytes >= 4 * t.local_param_bytes  # parameters, moments, grads
    streams = simulate_traced(t, collective_streams=True)
    assert streams.requested_peak_bytes == two.requested_peak_bytes
    assert streams.reserved_peak_bytes > two.reserved_peak_bytes  # pools apart


def test_the_plans_peak_is_the_reserved_one_on_a_caching_allocator() -> None:
    spec, args = get_spec("llama3"), get_config("debug")
    layout = Layout(gpus=2, batch=2, seq=64)
    pred = predict(spec, args, layout, FIXED)
    assert pred.memory["cached"] > 0
    assert pred.peak_bytes == pytest.approx(sum(pred.memory.values()))
    assert any("reserved memory" in n for n in pred.notes)
    cpu = predict(spec, args, layout, dataclasses.replace(FIXED, caching_allocator=False))
    assert "cached" not in cpu.memory
    assert cpu.peak_bytes == pytest.approx(pred.peak_bytes - pred.memory["cached"])


def test_fsdp2s_collective_streams_stay_with_compiled_blocks() -> None:
    # torchtitan's FSDP + torch.compile compiles the blocks; FSDP2's hooks,
    # and the buffers they allocate on the collectives' streams, stay eager
    spec, args = get_spec("llama3"), get_config("debug")
    layout = Layout(gpus=2, batch=2, seq=64, engine="fsdp2", compile=True)
    pred = predict(spec, args, layout, FIXED)
    key = TraceKey("llama3", dataclasses.replace(args, n_layers=2), 2, 1, 2, 64, "selective")
    t2 = traced(key)
    streams, plain = (simulate_traced(t2, collective_streams=s).cached_bytes for s in (True, False))
    assert streams != plain
    assert pred.memory["cached"] == streams


def test_expandable_segments_are_simulated_where_the_layout_asks() -> None:
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's
    # run_train.sh): one growing segment per pool and stream
    spec, args = get_spec("llama3"), get_config("debug")
    layout = Layout(gpus=2, batch=2, seq=256, expandable_segments=True)
    pred = predict(spec, args, layout, FIXED)
    key = TraceKey("llama3", dataclasses.replace(args, n_layers=2), 2, 1, 2, 256, "selective")
    t2 = traced(key)
    grown, fixed = (simulate_traced(t2, expandable_segments=e).cached_bytes for e in (True, False))
    assert grown < fixed  # the activations' freed blocks merge into the growing segment
    assert pred.memory["cached"] == grown
    assert "expandable" in pred.layout.describe()


def test_at_capacity_the_plans_reserved_peak_stays_within_the_usable_memory() -> None:
    # A device just above the tensors: the allocator releases its cache and
    # retries, so the reserved peak stays within the usable memory (FSDP2:
    # per-block groups whatever the memory, so the tensors are the same).
    spec, args = get_spec("llama3"), get_config("debug")
    layout = Layout(gpus=2, batch=2, seq=64, engine="fsdp2")
    free = predict(spec, args, layout, FIXED)
    tensors = free.peak_bytes - free.memory["cached"]
    usable = tensors + free.memory["cached"] / 4
    tight = dataclasses.replace(FIXED, memory_bytes=usable / FIXED.usable_memory_fraction)
    pred = predict(spec, args, layout, tight)
    assert pred.peak_bytes - pred.memory["cached"] == pytest.approx(tensors)
    assert pred.peak_bytes <= usable
    assert any("retries" in n for n in pred.notes)


@pytest.mark.heavy
@pytest.mark.parametrize("ac", ["selective", "full"])
def test_the_two_block_cache_matches_a_full_trace(ac: str) -> None:
    # Larger tensors than the debug model's (meta: no memory is used), so that
    # the large pool's segments matter; the cached bytes of 2 blocks stand for 4.
    def key(n: int) -> TraceKey:
        config = get_config(
            "debug", dim=1024, n_layers=n, n_heads=8, n_kv_heads=4, vocab_size=32000,
            max_seq_len=4096,
        )  # fmt: skip
        return TraceKey("llama3", config, 8, 1, 2, 4096, ac)

    for streams in (False, True):
        two, four = (simulate_traced(traced(key(n)), collective_streams=streams) for n in (2, 4))
        assert four.allocated_peak_bytes > two.allocated_peak_bytes
        assert two.cached_bytes == pytest.approx(four.cached_bytes, rel=0.1), streams


def test_a_repeated_steps_cache_and_its_release_at_capacity() -> None:
    # one step: a 12 MiB tensor freed, then a 20 MiB one (a new segment)
    step = [Alloc("a", 12 * MiB), Free("a"), Alloc("b", 20 * MiB), Free("b")]
    cached, retries = cached_bytes(step, allocated=20 * MiB, usable=1 << 40)
    assert (cached, retries) == (12 * MiB, 0)  # the second step reuses both
    # the device holds 30 MiB: the 12 MiB segment is released, retried once
    cached, retries = cached_bytes(step, allocated=20 * MiB, usable=30 * MiB)
    assert (cached, retries) == (0, 1)


def test_a_tensor_of_the_previous_step_is_freed_in_the_next() -> None:
    # a gradient shard of 4 MiB kept until the next step frees it: two live
    # at most (8 MiB of the 20 MiB segment), none freed on the first step
    step = [Alloc("g", 4 * MiB), Free(Previous("g"))]
    cached, _ = cached_bytes(step, allocated=0, usable=1 << 40, steps=3)
    assert cached == 12 * MiB  # three live (never freed) would leave 8


def test_eager_fsdp2s_collective_buffers_sit_on_streams_of_their_own() -> None:
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan.host import EagerStep, Fsdp2Buffers, eager_step_events

    spec, config = resolve_flavor("deepseek_v3_16b")
    step = EagerStep(spec, config, "selective", 2, 1, 1024)
    GiB = 1 << 30
    buffers = Fsdp2Buffers(
        dense=((GiB // 4, GiB // 32),),
        moe=((GiB // 16, GiB // 128), (GiB // 2, GiB // 8)),
        root=((GiB // 2, GiB // 16),),
    )
    plain = eager_step_events(step)
    fsdp2 = eager_step_events(dataclasses.replace(step, buffers=buffers))
    streams = {e.stream for e in fsdp2 if isinstance(e, Alloc)}
    assert streams == {0, 1, 2} and {e.stream for e in plain if isinstance(e, Alloc)} == {0}
    # the reduce-scatter inputs are the fp32 gradients: twice the gathered bytes
    rs = [e.size for e in fsdp2 if isinstance(e, Alloc) and e.stream == 2]
    assert max(rs) == GiB
    # every allocation is freed, the gradient shards by the next step
    allocs = {e.key for e in fsdp2 if isinstance(e, Alloc)}
    frees = {e.key.key if isinstance(e.key, Previous) else e.key for e in fsdp2
             if isinstance(e, Free)}  # fmt: skip
    assert allocs == frees
    shards = [e.key for e in fsdp2 if isinstance(e, Free) and isinstance(e.key, Previous)]
    assert len(shards) == 1 + 2 * 2 + 1  # a dense block, two MoE blocks of two groups, root
    # their pools hold blocks the compute stream cannot use
    with_streams, _ = cached_bytes(fsdp2, allocated=0, usable=1 << 50)
    without, _ = cached_bytes(plain, allocated=0, usable=1 << 50)
    assert with_streams > without + GiB


def test_an_eager_moe_plan_holds_the_allocators_cache_and_a_compiled_one_not() -> None:
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan.analytic import ExpertLayout, predict_analytic
    from simplefsdp.plan.hardware import PROFILES
    from simplefsdp.plan.host import EagerStep, eager_step_events

    spec, config = resolve_flavor("deepseek_v3_16b")
    layout = ExpertLayout(gpus=8, batch=1, seq=1024, ep=2, engine="fsdp2")
    eager = predict_analytic(spec, config, layout, PROFILES["h100"])
    events = eager_step_events(EagerStep(spec, config, "selective", 2, 1, 1024))
    # every storage the step allocates is freed by its end
    allocs = [e.key for e in events if isinstance(e, Alloc)]
    assert len(allocs) == len({e.key for e in events if isinstance(e, Free)}) > 100
    assert eager.memory["cached"] > 0
    assert eager.peak_bytes == pytest.approx(sum(eager.memory.values()))
    compiled = dataclasses.replace(layout, engine="simplefsdp")
    assert "cached" not in predict_analytic(spec, config, compiled, PROFILES["h100"]).memory
