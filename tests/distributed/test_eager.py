"""simplefsdp.eager on 2-4 CPU processes: parity with data_parallel without the
executor and with torch FSDP2, the schedule (orders, prefetch, rate limiter),
gradient accumulation, and API errors.

Each test spawns one group of processes and checks several configurations in
it, to keep the suite fast on small machines.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import simplefsdp
from simplefsdp import get_eager_executor, remove_eager
from simplefsdp.frontend.parametrization import has_param_views
from simplefsdp.testing import record_collectives, run_distributed
from toy_models import build, loss_fn, make_batch

LOCAL_BATCH = 2
STEPS = 10


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Stack(nn.Module):
    """Blocks in a ModuleList with uneven sizes (9, 13), a 1-row head and a
    1-element scale (ranks > 0 hold empty shards), and an optional block call
    order. (FSDP2 rejects 0-d parameters; the tied toy model covers them.)"""

    def __init__(self, n_blocks: int = 3, order: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.1]))
        self.inp = nn.Linear(5, 9)
        self.blocks = nn.ModuleList(Block(9, 13) for _ in range(n_blocks))
        self.head = nn.Linear(9, 1)
        self.order = tuple(order) if order is not None else tuple(range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (B, 9)
        for i in self.order:
            h = self.blocks[i](h)
        return self.head(h) * self.scale  # (B, 1)


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _build(n_blocks: int = 3, order: tuple[int, ...] | None = None) -> Stack:
    torch.manual_seed(0)
    return Stack(n_blocks, order)


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a deterministic global batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + 17 * step + micro)
    x = torch.randn(LOCAL_BATCH * world, 5, generator=gen)
    y = torch.randn(LOCAL_BATCH * world, 1, generator=gen)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[rows], y[rows]


def _global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _mesh(mode: str):
    world = dist.get_world_size()
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _wrap(mode: str = "fully_shard", *, eager: dict | None = None, **dp_kwargs) -> nn.Module:
    model = simplefsdp.data_parallel(_build(), _mesh(mode), mode=mode, **dp_kwargs)
    if eager is not None:
        simplefsdp.eager(model, **eager)
    return model


def _fsdp2(mode: str, mp_policy=None) -> nn.Module:
    """torch FSDP2 per block + root; replicate is HSDP with shard size 1."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if mode == "replicate":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = _mesh(mode)
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype
        )
    model = _build()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _set_sync(model: nn.Module, sync: bool) -> None:
    """Turn gradient sync on/off (data_parallel alone reduces every micro-batch)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    elif "_simplefsdp_eager_executor" in model.__dict__:
        get_eager_executor(model).set_requires_gradient_sync(sync)


def _train(model: nn.Module, steps: int = STEPS, micro_batches: int = 1) -> list[torch.Tensor]:
    """Train with AdamW; returns the rank-averaged loss of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(micro_batches):
            x, y = _batch(step, micro)
            _set_sync(model, micro == micro_batches - 1)
            loss = nn.functional.mse_loss(model(x).float(), y) / micro_batches
            loss.backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(total))
    return losses


def _assert_same(losses, ref_losses, *, bitwise: bool, label: str, tol: float = 1e-5) -> None:
    assert len(losses) == len(ref_losses) > 0, label
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if bitwise:
            assert torch.equal(a, b), (label, step, a.item(), b.item())
        else:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{label} step {step}")


def _assert_same_params(model: nn.Module, ref: nn.Module, label: str) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.placements == q.placements, (label, name)
        assert torch.equal(p.to_local(), q.to_local()), (label, name)


# --------------------------------------------------------------------------- #
# Parity
# --------------------------------------------------------------------------- #

_SCHEDULES = {
    "reshard+prefetch": ({}, {}),
    "reshard,no-prefetch": ({}, {"forward_prefetch": False, "backward_prefetch": False}),
    "zero2+prefetch": ({"reshard_after_forward": False}, {}),
    "zero2,no-prefetch": (
        {"reshard_after_forward": False},
        {"forward_prefetch": False, "backward_prefetch": False},
    ),
    "limit1,class-plan": ({}, {"limit_all_gathers": 1, "bucketing": Block}),
}


def _fp32_parity_body(mode: str) -> None:
    """Every schedule is bitwise equal to data_parallel without the executor;
    sharded modes are also bitwise equal to FSDP2 (2 ranks, fp32)."""
    base = _wrap(mode)
    base_losses = _train(base)
    fsdp2_losses = _train(_fsdp2(mode))
    _assert_same(fsdp2_losses, base_losses, bitwise=True, label=f"fsdp2 {mode}")
    for label, (dp_kwargs, eager_kwargs) in _SCHEDULES.items():
        model = _wrap(mode, eager=eager_kwargs, **dp_kwargs)
        _assert_same(_train(model), base_losses, bitwise=True, label=f"{mode} {label}")
        _assert_same_params(model, base, label)
    # Sharding along dim 1 goes through the movedim path of the views.
    wide_base = _wrap(mode, shard_dim=1)
    wide = _wrap(mode, eager={}, shard_dim=1)
    _assert_same(_train(wide), _train(wide_base), bitwise=True, label=f"{mode} shard_dim=1")


def _hybrid_body() -> None:
    base_losses = _train(_wrap("hybrid_shard"))
    fsdp2_losses = _train(_fsdp2("hybrid_shard"))
    for label in ("reshard+prefetch", "reshard,no-prefetch", "zero2+prefetch"):
        dp_kwargs, eager_kwargs = _SCHEDULES[label]
        losses = _train(_wrap("hybrid_shard", eager=eager_kwargs, **dp_kwargs))
        _assert_same(losses, base_losses, bitwise=False, label=f"hybrid {label} vs data_parallel")
        _assert_same(losses, fsdp2_losses, bitwise=False, label=f"hybrid {label} vs fsdp2")
    model = _wrap("hybrid_shard", eager={})
    _train(model, steps=1)
    executor = get_eager_executor(model)
    events = {(e.kind, e.phase) for e in executor.trace}
    assert ("reduce", "backward") in events and ("unshard", "backward") in events


def test_hybrid_shard_4_ranks() -> None:
    run_distributed(_hybrid_body, 4)


def _mixed_precision_body() -> None:
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mode in ("fully_shard", "replicate"):
        base_losses = _train(_wrap(mode, mp_policy=policy))
        fsdp2_losses = _train(_fsdp2(mode, policy))
        for label in ("reshard+prefetch", "zero2,no-prefetch"):
            dp_kwargs, eager_kwargs = _SCHEDULES[label]
            model = _wrap(mode, eager=eager_kwargs, mp_policy=policy, **dp_kwargs)
            losses = _train(model)
            name = f"bf16 {mode} {label}"
            _assert_same(losses, base_losses, bitwise=False, label=name, tol=1e-2)
            _assert_same(losses, fsdp2_losses, bitwise=False, label=name + " fsdp2", tol=1e-2)
            executor = get_eager_executor(model)
            assert {b.compute_dtype for b in executor.buckets} == {torch.bfloat16}
            assert {b.reduce_dtype for b in executor.buckets} == {torch.float32}
            for param in model.parameters():
                assert param.dtype == torch.float32
    # Gradients arrive in the parameters' dtype, reduced in fp32.
    model = _wrap("fully_shard", eager={}, mp_policy=policy)
    x, y = _batch(0)
    out = model(x)
    assert out.dtype == torch.bfloat16
    nn.functional.mse_loss(out.float(), y).backward()
    for param in model.parameters():
        assert isinstance(param.grad, DTensor) and param.grad.dtype == torch.float32


def _accumulation_body() -> None:
    micro = 4
    base_losses = _train(_wrap("fully_shard"), micro_batches=micro)
    fsdp2_losses = _train(_fsdp2("fully_shard"), micro_batches=micro)
    for label in ("reshard+prefetch", "zero2,no-prefetch"):
        dp_kwargs, eager_kwargs = _SCHEDULES[label]
        losses = _train(_wrap(eager=eager_kwargs, **dp_kwargs), micro_batches=micro)
        _assert_same(losses, base_losses, bitwise=False, label=f"accumulate {label}")
        _assert_same(losses, fsdp2_losses, bitwise=False, label=f"accumulate {label} fsdp2")
    # No communication and no .grad on intermediate micro-batches; one
    # reduction per bucket on the last, giving the sum of the micro-batches'
    # gradients (data_parallel alone reduces each and accumulates).
    model, ref = _wrap(eager={}), _wrap()
    executor = get_eager_executor(model)
    n_buckets = len(executor.buckets)
    for micro_index in range(micro):
        x, y = _batch(0, micro_index)
        nn.functional.mse_loss(ref(x), y).backward()
        last = micro_index == micro - 1
        with contextlib.nullcontext() if last else executor.no_sync():
            nn.functional.mse_loss(model(x), y).backward()
        kinds = [e.kind for e in executor.trace if e.phase == "backward"]
        if not last:
            assert kinds.count("reduce") == 0 and kinds.count("accumulate") == n_buckets
            assert all(p.grad is None for p in model.parameters())
    assert kinds.count("reduce") == n_buckets and kinds.count("accumulate") == 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="must be a bool"):
        executor.set_requires_gradient_sync(1)


# --------------------------------------------------------------------------- #
# Schedule: recorded orders, prefetch, rate limiter
# --------------------------------------------------------------------------- #


class _CountingCollectives:
    """Wraps the executor's collectives; counts all-gathers issued but not yet waited."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.in_flight = 0
        self.max_in_flight = 0

    def all_gather(self, *args):
        work = self.inner.all_gather(*args)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        counter = self

        class _Counted:
            def wait(self):
                counter.in_flight -= 1
                return work.wait()

        return _Counted()

    def reduce_scatter(self, *args):
        return self.inner.reduce_scatter(*args)

    def all_reduce(self, *args):
        return self.inner.all_reduce(*args)


def names_of(executor) -> list[str]:
    return [b.name for b in executor.buckets]


def _schedule_body() -> None:
    order = (3, 0, 5, 1, 4, 2)  # blocks run in this order, not registration order
    results = {}
    for limit in (1, 2, 3):
        torch.manual_seed(0)
        model = simplefsdp.data_parallel(Stack(6, order), _mesh("fully_shard"))
        simplefsdp.eager(model, "per_block", limit_all_gathers=limit)
        executor = get_eager_executor(model)
        names = [b.name for b in executor.buckets]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counting = _CountingCollectives(executor.comm)
        executor.comm = counting
        for step in range(3):
            executor.reset_stats()
            x, y = _batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        results[limit] = (executor.stats, counting.max_in_flight)

        # Recorded orders: the blocks' call order; backward is its reverse.
        block_buckets = [names.index(f"blocks.{i}") for i in order]
        forward_blocks = [i for i in executor.forward_order if i in block_buckets]
        assert forward_blocks == block_buckets, (executor.forward_order, names)
        backward_blocks = [i for i in executor.backward_order if i in block_buckets]
        assert backward_blocks == block_buckets[::-1]
        # The last step's backward prefetched in that recorded order (every
        # block: the head's pre-backward prefetches the first), and each
        # bucket's prefetch was issued before the reduction of the bucket
        # before it in backward order.
        backward = [e for e in executor.trace if e.phase == "backward"]
        prefetched = [e.bucket for e in backward if e.kind == "unshard" and e.prefetch]
        assert [i for i in prefetched if i in block_buckets] == block_buckets[::-1]
        assert not any(e.kind == "unshard" and not e.prefetch for e in backward)
        position = {(e.kind, e.bucket): k for k, e in enumerate(backward)}
        for earlier, later in zip(block_buckets[::-1], block_buckets[::-1][1:]):
            assert position[("unshard", later)] < position[("reduce", earlier)]
        # Forward prefetch also follows the recorded (permuted) forward order.
        forward = [e for e in executor.trace if e.phase == "forward"]
        gathered = [e.bucket for e in forward if e.kind == "unshard"]
        assert [i for i in gathered if i in block_buckets] == block_buckets

    for limit, (stats, max_in_flight) in results.items():
        # Rate limiter: never more than `limit` gathered-but-unused buckets, and
        # prefetching does reach the limit; in-flight all-gathers (issued, not
        # yet waited, counted independently) are the prefetched ones plus the
        # one needed now.
        assert stats.max_unused_gathers == limit, (limit, stats)
        assert max_in_flight <= limit + 1, (limit, max_in_flight)
        assert stats.max_unsharded_buckets <= limit + 3, (limit, stats)
    assert results[1][0].max_unsharded_buckets < results[3][0].max_unsharded_buckets

    # Without prefetch nothing is gathered ahead: one bucket at a time in
    # forward (plus the root bucket, kept from its first use to backward).
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(Stack(6, order), _mesh("fully_shard"))
    simplefsdp.eager(model, forward_prefetch=False, backward_prefetch=False)
    executor = get_eager_executor(model)
    for step in range(2):
        executor.reset_stats()
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
    assert executor.stats.max_unused_gathers == 0
    assert not any(e.prefetch for e in executor.trace)

    # Between forward and backward: with resharding only the root bucket (the
    # last to finish forward) stays gathered; ZeRO-2 keeps every bucket.
    # After backward nothing is gathered.
    for reshard in (True, False):
        torch.manual_seed(0)
        model = simplefsdp.data_parallel(Stack(6, order), reshard_after_forward=reshard)
        simplefsdp.eager(model)
        executor = get_eager_executor(model)
        for step in range(3):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            allocated = {b.index for b in executor.buckets if b.is_allocated}
            if step > 0:  # the first iteration does not know the root bucket yet
                everything = set(range(len(executor.buckets)))
                assert allocated == ({executor.root_bucket} if reshard else everything)
            loss.backward()
            assert not any(b.is_allocated for b in executor.buckets)
        assert names_of(executor)[executor.root_bucket].startswith("rest:scale")


# --------------------------------------------------------------------------- #
# API, edge cases, errors
# --------------------------------------------------------------------------- #


def _api_body() -> None:
    mesh = _mesh("fully_shard")
    with pytest.raises(ValueError, match="not wrapped by simplefsdp.data_parallel"):
        simplefsdp.eager(_build())
    with pytest.raises(ValueError, match="limit_all_gathers=0"):
        simplefsdp.eager(_wrap(), limit_all_gathers=0)
    with pytest.raises(TypeError, match="forward_prefetch must be a bool"):
        simplefsdp.eager(_wrap(), forward_prefetch="yes")
    with pytest.raises(ValueError, match="names no module or parameter"):
        simplefsdp.eager(_wrap(), [["blocks.9"]])
    model = _wrap(eager={})
    with pytest.raises(ValueError, match="already runs with simplefsdp.eager"):
        simplefsdp.eager(model)
    with pytest.raises(ValueError, match="does not run with simplefsdp.eager"):
        get_eager_executor(_wrap())

    # cpu_offload on a CPU mesh: a logged note, not an error.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    api_logger = logging.getLogger("simplefsdp.eager_executor.api")
    api_logger.addHandler(handler)
    api_logger.setLevel(logging.INFO)
    offloaded = _wrap(eager={"cpu_offload": True})
    api_logger.removeHandler(handler)
    assert any("cpu_offload=True has no effect" in r.getMessage() for r in records)
    assert not get_eager_executor(offloaded).options.cpu_offload

    # Same parameters and checkpoint as without the executor; no collectives.
    plain = _wrap()
    with record_collectives() as record:
        state = model.state_dict()
    assert record.calls == [] and list(state) == list(plain.state_dict())
    assert all(isinstance(v, DTensor) for k, v in state.items())
    # Outside forward, reads still gather through DTensor.
    assert model.inp.weight.shape == (9, 5) and not isinstance(model.inp.weight, DTensor)

    # An eval forward under no_grad leaves nothing gathered.
    executor = get_eager_executor(model)
    with torch.no_grad():
        model(_batch(0)[0])
    assert not any(b.is_allocated for b in executor.buckets)

    # Two forwards before one backward (a siamese or contrastive loss): every
    # bucket is gathered again for the second forward, and its gradient
    # reduced once, for both reads (data_parallel alone reduces each read's:
    # the same sum in another order, so parameters match to rounding).
    for dp_kwargs in ({}, {"reshard_after_forward": False}):
        results = []
        for use_eager in (True, False):
            model = _wrap(eager={} if use_eager else None, **dp_kwargs)
            executor = get_eager_executor(model) if use_eager else None
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
            losses = []
            for step in range(2):
                (x, y), (x2, _) = _batch(step), _batch(step, micro=1)
                out = model(x).float() + model(x2).float()
                loss = nn.functional.mse_loss(out, y)
                if executor is not None:
                    executor.reset_stats()
                loss.backward()
                if executor is not None:  # one reduction per bucket, not per read
                    assert executor.stats.reductions == len(executor.buckets), executor.stats
                opt.step()
                opt.zero_grad()
                losses.append(_global_mean(loss))
            results.append((losses, model))
        (twice, eager_model), (ref_losses, ref_model) = results
        _assert_same(twice, ref_losses, bitwise=False, label=f"two forwards {dp_kwargs}")
        for (name, p), (_, q) in zip(eager_model.named_parameters(), ref_model.named_parameters()):
            torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-5, atol=1e-6, msg=name)

    # Frozen parameters are gathered but get no gradient; remove_eager
    # restores data_parallel's own execution, continuing identically.
    frozen = _wrap(eager={})
    frozen.blocks[1].requires_grad_(False)
    ref = _wrap()
    ref.blocks[1].requires_grad_(False)
    _assert_same(_train(frozen, steps=2), _train(ref, steps=2), bitwise=True, label="frozen")
    assert all(p.grad is None for p in frozen.blocks[1].parameters())
    remove_eager(frozen)
    assert not has_param_views(frozen.inp)
    _assert_same(_train(frozen), _train(ref), bitwise=True, label="after remove_eager")

    # Activation checkpointing: recomputation in backward reads the views again.
    runs = []
    for use_eager in (True, False):
        model = _build()
        for i, block in enumerate(model.blocks):
            model.blocks[i] = _Checkpointed(block)
        simplefsdp.data_parallel(model, mesh)
        if use_eager:
            simplefsdp.eager(model, [[f"blocks.{i}"] for i in range(len(model.blocks))])
        runs.append(_train(model, steps=3))
    _assert_same(runs[0], runs[1], bitwise=True, label="activation checkpointing")

    # A tied embedding (owned by the embedding and the head), a 0-d parameter
    # (a replicated slot in a sharded bucket) and 19 rows over 2 ranks.
    tied_losses = []
    for use_eager in (True, False):
        tied = simplefsdp.data_parallel(build("tied"), mesh)
        if use_eager:
            simplefsdp.eager(tied, [["embed"], ["hidden"], ["norm"]])
            executor, tied_eager = get_eager_executor(tied), tied
        opt = torch.optim.AdamW(tied.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            tokens, targets = make_batch("tied", step, 2 * dist.get_world_size())
            rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
            loss = loss_fn("tied", tied(tokens[rows]), targets[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_global_mean(loss))
        tied_losses.append(losses)
    _assert_same(tied_losses[0], tied_losses[1], bitwise=False, label="tied")
    embed_bucket = next(b for b in executor.buckets if b.name == "embed")
    owners = [m for m in tied_eager.modules() if id(m) in executor._owner_ids[embed_bucket.index]]
    assert {type(m).__name__ for m in owners} == {"Embedding", "Linear"}


def _llama_body() -> None:
    from simplefsdp.models.llama3 import ModelArgs, Transformer, TransformerBlock

    args = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=37, multiple_of=16, max_seq_len=8)
    world, rank = dist.get_world_size(), dist.get_rank()

    def run(model: nn.Module) -> list[torch.Tensor]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 37, (2 * world, 8), generator=gen)[2 * rank : 2 * rank + 2]
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_global_mean(loss))
        return losses

    torch.manual_seed(0)
    ref = Transformer(args)
    base = simplefsdp.data_parallel(copy.deepcopy(ref))
    ours = simplefsdp.eager(simplefsdp.data_parallel(copy.deepcopy(ref)), TransformerBlock)
    _assert_same(run(ours), run(base), bitwise=True, label="llama3 per block")


# --------------------------------------------------------------------------- #
# Test functions. Spawning processes dominates the run time on small machines,
# so every 2-rank check runs in one spawned group (a module-scoped fixture);
# each check reports its own traceback and pytest shows one test per check.
# --------------------------------------------------------------------------- #

_TWO_RANK_CHECKS = {
    "fp32_fully_shard": (_fp32_parity_body, ("fully_shard",)),
    "fp32_replicate": (_fp32_parity_body, ("replicate",)),
    "mixed_precision": (_mixed_precision_body, ()),
    "accumulation": (_accumulation_body, ()),
    "schedule": (_schedule_body, ()),
    "api": (_api_body, ()),
    "llama3": (_llama_body, ()),
}


def _run_checks() -> dict[str, str | None]:
    """Run every 2-rank check; a failure's traceback is kept, the rest still run."""
    import traceback

    outcomes: dict[str, str | None] = {}
    for name, (body, args) in _TWO_RANK_CHECKS.items():
        try:
            body(*args)
            outcomes[name] = None
        except Exception:
            outcomes[name] = traceback.format_exc()
    return outcomes


@pytest.fixture(scope="module")
def two_rank_outcomes() -> list[dict[str, str | None]]:
    return run_distributed(_run_checks, 2, timeout_s=600)


def _check(outcomes: list[dict[str, str | None]], name: str) -> None:
    failures = {rank: o[name] for rank, o in enumerate(outcomes) if o[name] is not None}
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())


@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
def test_fp32_bitwise_parity_2_ranks(two_rank_outcomes, mode: str) -> None:
    """Every schedule == data_parallel == FSDP2, bitwise, over 10 steps."""
    _check(two_rank_outcomes, f"fp32_{mode}")


def test_mixed_precision_bf16_params_fp32_reduce(two_rank_outcomes) -> None:
    _check(two_rank_outcomes, "mixed_precision")


def test_gradient_accumulation_4_micro_batches(two_rank_outcomes) -> None:
    _check(two_rank_outcomes, "accumulation")


def test_recorded_order_prefetch_and_rate_limiter(two_rank_outcomes) -> None:
    _check(two_rank_outcomes, "schedule")


def test_api_errors_offload_state_dict_frozen_tied_and_remove(two_rank_outcomes) -> None:
    _check(two_rank_outcomes, "api")


def test_llama3_transformer_block_plan_bitwise(two_rank_outcomes) -> None:
    _check(two_rank_outcomes, "llama3")


def _one_block_body() -> dict:
    """A one-block ModuleList: the block itself owns its bucket (the list has no
    forward, so its hooks would never run and the block's parameters would be
    gathered one by one through DTensor)."""
    from simplefsdp.bench.measure import count_collectives

    model = simplefsdp.data_parallel(_build(n_blocks=1), _mesh("fully_shard"))
    simplefsdp.eager(model, bucketing="per_block")
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()  # records the order
    model.zero_grad(set_to_none=True)
    owners = get_eager_executor(model)._owner_ids
    counts = count_collectives(lambda: nn.functional.mse_loss(model(x), y).backward())
    return {"counts": counts, "block_owned": any(id(model.blocks[0]) in o for o in owners)}


def test_one_block_list_is_gathered_as_one_bucket():
    result = run_distributed(_one_block_body, 2)[0]
    # Buckets: rest:scale+inp, blocks.0, rest:head (the root bucket, kept after
    # forward): 3 gathers in forward, 2 again in backward; one reduction each.
    assert result["block_owned"], result
    assert result["counts"]["all_gather"] == 5 and result["counts"]["reduce_scatter"] == 3
