"""Attention over a sequence split by position: document masks and context parallelism.

:class:`SequenceContext` is what reaches
:func:`simplefsdp.models.common.attention.attend` (through the decoder) when a
batch is packed with documents or split over context-parallel ranks. It
holds the split (which global positions each rank holds), the batch's
document numbers and the context-parallel group, and computes attention
with one of three backends:

* ``allgather``: all-gather the keys and values over the group (their
  gradients are reduce-scattered in backward by the collective's autograd)
  and attend the local queries to the whole sequence;
* ``ring``: pass key/value blocks around the ring (``cp - 1`` rotations),
  attend to each block, and merge the partial results by their
  log-sum-exp;
* ``ulysses``: all-to-all from sequence shards to head shards, attend over
  the whole sequence on ``H / cp`` heads, and all-to-all back.

Masks are built from positions (query position ``p`` sees key position
``s`` when ``s <= p``, ``s > p - sliding_window`` and both are in the same
document), so every split, and every order in which a backend assembles the
keys, is exact. A mask goes to one SDPA call (:func:`masked_attention`),
learned sinks as one more key (Note: [Sinks as one more key]); a sliding
window runs in chunks of the keys it reaches (:func:`windowed_attention`,
:func:`chunked_attention`), in one process and under the ``allgather`` and
``ulysses`` backends (Note: [Sliding windows across ranks]). The ``ring``
backend computes each block's scores itself (softmax in at least float32),
merged by their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

BACKENDS = ("allgather", "ring", "ulysses")

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@dataclass
class SequenceContext:
    """A batch's split over positions, its documents and its context-parallel group.

    Attributes:
        index: ``(cp, T / cp)`` global positions each rank holds (``cp = 1``:
            ``(1, T)``, the whole sequence).
        rank: this rank's row of ``index``.
        group: the context-parallel process group's name (``None`` when
            ``cp = 1``).
        backend: one of :data:`BACKENDS`.
        document_ids: ``(B, T)`` document numbers over the global sequence
            (``None``: one document per row, plain causal attention).
        rope_positions: ``(B, T / cp)`` rotary positions of this rank's
            tokens when they restart per document (``None``: the global
            positions ``index[rank]``).
        run: every row of ``index`` is runs of this many consecutive
            positions (the load balance's chunks; ``0``: not known), which
            lets a sliding window run in chunks across ranks.
        slots: ``(T,)`` where each global position sits in the gathered
            order ``index.flatten()`` (its argsort, taken once per batch
            rather than per layer; computed when not given).
    """

    index: torch.Tensor
    rank: int = 0
    group: str | None = None
    backend: str = "allgather"
    document_ids: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None
    run: int = 0
    slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = torch.argsort(self.index.flatten())

    @property
    def cp(self) -> int:
        """The context-parallel degree."""
        return self.index.shape[0]

    def rotary(self, freqs_cis: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the rotary table ``(max_seq_len, hd/2, 2)``.

        Returns:
            ``(T / cp, hd/2, 2)``, or ``(B, T / cp, hd/2, 2)`` when positions
            restart per document.
        """
        if self.rope_positions is not None:
            return freqs_cis[self.rope_positions]
        return freqs_cis[self.index[self.rank]]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries ``(B, H, T/cp, d_qk)`` to the whole sequence.

        Arguments as :func:`simplefsdp.models.common.attention.attend`; ``k``
        and ``v`` are this rank's shards ``(B, H_kv, T/cp, d)``.

        Returns:
            ``(B, H, T/cp, d_v)``.
        """
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.cp == 1:
            pos = self.index[0]  # 0 .. T - 1
            if runs_in_chunks(sliding_window, q.shape[2]):
                n_rep = q.shape[1] // k.shape[1]
                k, v = _repeat(k, n_rep), _repeat(v, n_rep)
                return windowed_attention(q, k, v, sliding_window, scale, sinks, self.document_ids)
            return _attention(
                q, k, v, pos, pos, self._docs(pos), self._docs(pos), scale, sliding_window, sinks
            )
        if self.backend == "ring":
            return self._ring(q, k, v, scale, sliding_window, sinks)
        if self.backend == "ulysses":
            return self._ulysses(q, k, v, scale, sliding_window, sinks)
        q_pos = self.index[self.rank]
        kv_pos = self.index.flatten()
        k, v = _gather_seq(k, self.group), _gather_seq(v, self.group)
        chunk = window_chunk(sliding_window, kv_pos.numel(), self.run)
        if chunk:
            return self._windowed_runs(q, k, v, sliding_window, chunk, scale, sinks)
        return _attention(
            q,
            k,
            v,
            q_pos,
            kv_pos,
            self._docs(q_pos),
            self._docs(kv_pos),
            scale,
            sliding_window,
            sinks,
        )

    def _docs(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None if self.document_ids is None else self.document_ids[:, positions]

    def _windowed_runs(self, q, k, v, window, chunk, scale, sinks) -> torch.Tensor:
        """A sliding window over the gathered keys (in the order ``index.flatten()``),
        in chunks: each run of this rank's consecutive queries meets the keys
        its window reaches, gathered from the whole sequence (Note: [Sliding
        windows across ranks])."""
        b, h, local, d = q.shape
        runs, length = local // self.run, self.run
        reach = window_reach(window, chunk)
        dev = q.device
        slot = self.slots  # where each position sits in the gathered keys
        starts = self.index[self.rank].view(runs, length)[:, 0]
        k_pos = starts[:, None] + torch.arange(-reach, length, device=dev)  # (R, r + L)
        k_at = k_pos.clamp(min=0)
        n_rep = h // k.shape[1]

        def of_runs(x: torch.Tensor) -> torch.Tensor:  # (B, H', T, e) -> (B * R, H, r + L, e)
            x = x[:, :, slot[k_at].flatten()].view(b, x.shape[1], runs, reach + length, -1)
            return _repeat(
                x.transpose(1, 2).reshape(b * runs, -1, reach + length, x.shape[-1]), n_rep
            )

        q = q.view(b, h, runs, length, d).transpose(1, 2).reshape(b * runs, h, length, d)
        q_doc = k_doc = None
        if self.document_ids is not None:
            q_doc = self.document_ids[:, self.index[self.rank]].reshape(b * runs, length)
            k_doc = self.document_ids[:, k_at].reshape(b * runs, reach + length)
        valid = (k_pos >= 0).repeat(b, 1)
        out = chunked_attention(
            q, of_runs(k), of_runs(v), window, chunk, scale, sinks, q_doc, k_doc, valid
        )
        return out.view(b, runs, h, length, -1).transpose(1, 2).reshape(b, h, local, -1)

    def _ring(self, q, k, v, scale, sliding_window, sinks) -> torch.Tensor:
        cp, rank = self.cp, self.rank
        q_pos = self.index[rank]
        q_doc = self._docs(q_pos)
        outs, lses = [], []
        for step in range(cp):
            if step:
                k, v = _rotate(k, cp, rank, self.group), _rotate(v, cp, rank, self.group)
            kv_pos = self.index[(rank - step) % cp]
            # Recomputed in backward: a block keeps its inputs (this rank's
            # queries, one block of H_kv keys and values), not its scores.
            out, lse = checkpoint(
                _ring_block,
                q,
                k,
                v,
                (q_pos, kv_pos, q_doc, self._docs(kv_pos)),
                sliding_window,
                scale,
                use_reentrant=False,
            )
            outs.append(out)
            lses.append(lse)
        return _merge(outs, lses, sinks, q.shape[1]).to(q.dtype)

    def _ulysses(self, q, k, v, scale, sliding_window, sinks) -> torch.Tensor:
        cp = self.cp
        heads = q.shape[1]
        if heads % cp:
            raise ValueError(
                f"the ulysses backend needs the {heads} attention heads of a rank to divide "
                f"by cp={cp}; use cp_backend allgather or ring"
            )
        if k.shape[1] % cp:
            k, v = _repeat(k, heads // k.shape[1]), _repeat(v, heads // v.shape[1])
        pos = self.index.flatten()
        docs = self._docs(pos)
        if sinks is not None:
            sinks = sinks.view(cp, -1)[self.rank]
        q, k, v = (_seq_to_heads(t, cp, self.group) for t in (q, k, v))
        if runs_in_chunks(sliding_window, pos.numel()):
            # the whole sequence on this rank's heads: in position order, in
            # chunks of the window, and back to the gathered order
            order = self.slots
            n_rep = q.shape[1] // k.shape[1]
            k, v = _repeat(k[:, :, order], n_rep), _repeat(v[:, :, order], n_rep)
            out = windowed_attention(
                q[:, :, order], k, v, sliding_window, scale, sinks, self.document_ids
            )[:, :, pos]
        else:
            out = _attention(q, k, v, pos, pos, docs, docs, scale, sliding_window, sinks)
        return _heads_to_seq(out, cp, self.group)


def _repeat(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def allowed_keys(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``(B or 1, 1, Tq, Tk)`` boolean: which keys each query sees (causal
    by position, within ``sliding_window`` and the same document)."""
    allowed = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk)
    if sliding_window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    allowed = allowed[None, None]
    if q_doc is not None:
        allowed = allowed & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return allowed


# Note: [Sinks as one more key]
# A learned sink is one more logit per head in each query's softmax, with
# no value. Computing it beside explicit scores materializes a (B, H, Tq, Tk)
# float32 tensor per attention (16 GiB for 64 heads at 8,192 tokens, several
# of them saved for backward); instead the sink becomes one more key that
# every query sees, so that SDPA's fused kernels (the memory-efficient one on
# a GPU, the flash one on a CPU, both with a boolean mask) compute it
# without scores in memory. Queries get SINK_COLUMNS more head-dim columns,
# [1, 1, 0, ...]; keys zeros there; the sink key is zero in the head dims
# and holds (sink / scale) split into a high and a low part in the extra two,
# so that its logit is exact to about 16 bits in bfloat16 (one part would
# round it to 8). The sink's value row is zero, and values are padded to the
# queries' width (the CPU kernel takes one head dim), the output cut back.
# Keys are padded to a multiple of 16 with keys no query sees (the GPU
# kernel's mask alignment). The extra columns cost 8 / head_dim more
# attention FLOPs.
SINK_COLUMNS = 8
_KEY_ALIGNMENT = 16


def masked_keys(keys: int, sinks: bool) -> int:
    """The keys :func:`masked_attention` passes SDPA for ``keys`` keys: with
    sinks, one more and padding to a multiple of 16."""
    return -(-(keys + 1) // _KEY_ALIGNMENT) * _KEY_ALIGNMENT if sinks else keys


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of ``q`` ``(B, H, Tq, d)`` to ``k``/``v`` ``(B, H, Tk, d / d_v)``
    (key heads already repeated to the queries') over the boolean mask
    ``allowed`` ``(B or 1, 1, Tq, Tk)``; with ``sinks`` ``(H,)``, a learned
    sink logit per head joins each query's softmax (Note: [Sinks as one more
    key]). Every query must see at least one key or the sink.

    Returns:
        ``(B, H, Tq, d_v)`` in ``q``'s dtype.
    """
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    b, h, tq, d = q.shape
    tk, dv = k.shape[2], v.shape[-1]
    width = -(-max(d + SINK_COLUMNS, dv) // 8) * 8
    keys = masked_keys(tk, True)
    target = sinks.to(torch.promote_types(q.dtype, torch.float32)) / scale
    high = target.to(q.dtype)
    low = (target - high.to(target.dtype)).to(q.dtype)
    ones = q.new_ones(b, h, tq, 2)
    q = torch.cat([q, ones, q.new_zeros(b, h, tq, width - d - 2)], dim=-1)
    sink_key = torch.cat(
        [k.new_zeros(h, d), high[:, None], low[:, None], k.new_zeros(h, width - d - 2)], dim=-1
    )  # (H, width)
    k = torch.cat(
        [
            torch.cat([k, k.new_zeros(b, h, tk, width - d)], dim=-1),
            sink_key[None, :, None, :].expand(b, h, 1, width),
            k.new_zeros(b, h, keys - tk - 1, width),
        ],
        dim=2,
    )
    v = F.pad(v, (0, width - dv, 0, keys - tk))  # zero values for the sink and padding
    mb = allowed.shape[0]
    allowed = torch.cat(
        [
            allowed.expand(mb, 1, tq, tk),
            allowed.new_ones(mb, 1, tq, 1),
            allowed.new_zeros(mb, 1, tq, keys - tk - 1),
        ],
        dim=-1,
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out[..., :dv]


def runs_in_chunks(sliding_window: int | None, seq: int) -> bool:
    """A window of this size over ``seq`` tokens runs in chunks
    (:func:`windowed_attention`): it is under half the sequence."""
    return sliding_window is not None and 0 < 2 * sliding_window < seq


# Note: [Sliding windows across ranks]
# A rank's queries are runs of consecutive positions (head-tail: two runs
# of T / 2cp; the document balance: its chunks of T / (cp m)). Under the
# ``allgather`` backend a window layer does not attend the rank's
# (T/cp x T) mask: each run takes the keys its window reaches from the
# gathered sequence (the run and ``window_reach`` positions before it, by
# index, so autograd reduce-scatters their gradients as for the whole
# sequence) and runs in chunks of the window, or of the run where that is
# shorter, each chunk against the chunks its window reaches: about
# (T/cp) x (W + chunk) pairs instead of (T/cp) x T, and no (T/cp x T) mask.
# Keys before position 0 are masked out. Under ``ulysses`` a rank holds the
# whole sequence on its heads: it is put in position order, run as in one
# process, and put back.


def window_chunk(sliding_window: int | None, seq: int, run: int) -> int:
    """The chunk of queries a window runs in across context-parallel ranks
    whose rows of positions are runs of ``run`` consecutive ones: the
    window or a shorter run; ``0`` where the chunks would meet no fewer keys
    than the whole ``seq`` (or there is no window, or ``run`` is not known)."""
    if sliding_window is None or sliding_window <= 0 or run <= 0:
        return 0
    chunk = min(sliding_window, run)
    return chunk if window_reach(sliding_window, chunk) + chunk < seq else 0


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sliding_window: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``(B, H, T, d)`` to ``k``/``v`` (key heads
    repeated to the queries') within ``sliding_window`` (and within each
    row's documents, ``documents`` ``(B, T)``), in chunks: the queries in
    chunks of ``sliding_window``, each chunk against its own keys and the
    chunk's before (all a window can reach), as a batch of
    :func:`masked_attention` calls. The work is ``T x 2 * sliding_window``
    query-key pairs instead of ``T x T``.

    Returns:
        ``(B, H, T, d_v)`` in ``q``'s dtype.
    """
    t = q.shape[2]
    c = sliding_window
    # keys and values front-padded by the reach before the first chunk (one
    # chunk; none for a window of 1), which no query sees
    r = window_reach(sliding_window, c)
    k, v = (F.pad(x, (0, 0, r, 0)) for x in (k, v))
    positions = torch.arange(-r, t, device=q.device)
    k_doc = None
    if documents is not None:
        k_doc = F.pad(documents, (r, 0), value=-1)
    return chunked_attention(
        q, k, v, sliding_window, c, scale, sinks, documents, k_doc, (positions >= 0)[None]
    )


def window_reach(sliding_window: int, chunk: int) -> int:
    """The keys before a chunk of ``chunk`` queries that a window reaches,
    in whole chunks: ``chunk * ceil((sliding_window - 1) / chunk)``."""
    return chunk * -(-(sliding_window - 1) // chunk)


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sliding_window: int,
    chunk: int,
    scale: float,
    sinks: torch.Tensor | None,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    k_valid: torch.Tensor,
) -> torch.Tensor:
    """Windowed causal attention of ``t`` consecutive queries in chunks.

    ``q`` ``(B, H, t, d)`` are at positions ``0 .. t - 1``; ``k``/``v``
    ``(B, H, r + t, e)`` (heads repeated to the queries') at positions
    ``-r .. t - 1``, ``r = window_reach(sliding_window, chunk)``; keys where
    ``k_valid`` ``(B or 1, r + t)`` is false are seen by no query. Each
    chunk of ``chunk`` queries meets its own keys and the ``r`` before, one
    batched :func:`masked_attention` call; ``q_doc`` ``(B, t)`` and
    ``k_doc`` ``(B, r + t)`` keep attention inside documents.

    Returns:
        ``(B, H, t, d_v)`` in ``q``'s dtype.
    """
    b, h, t, d = q.shape
    c = chunk
    p = window_reach(sliding_window, c) // c
    n = -(-t // c)
    tail = n * c - t
    # end-padded to whole chunks (padded queries see padded keys; cut off below)
    q = F.pad(q, (0, 0, 0, tail))
    k, v = (F.pad(x, (0, 0, 0, tail)) for x in (k, v))

    def per_chunk(x: torch.Tensor) -> torch.Tensor:  # (B, H, n, L, e) -> (B * n, H, L, e)
        return x.transpose(1, 2).reshape(b * n, h, *x.shape[3:])

    def key_chunks(x: torch.Tensor) -> torch.Tensor:  # chunk i's keys: chunks i .. i + p
        e = x.shape[-1]
        parts = [x[:, :, j * c : (j + n) * c].reshape(b, h, n, c, e) for j in range(p + 1)]
        return per_chunk(torch.cat(parts, dim=3))

    def row_chunks(x: torch.Tensor) -> torch.Tensor:  # (B', (n + p) c) -> (B', n, (p + 1) c)
        parts = [x[:, j * c : (j + n) * c].reshape(x.shape[0], n, c) for j in range(p + 1)]
        return torch.cat(parts, dim=2)

    qc = per_chunk(q.view(b, h, n, c, d))
    kc, vc = key_chunks(k), key_chunks(v)
    starts = c * torch.arange(n, device=q.device)[:, None]
    q_pos = starts + torch.arange(c, device=q.device)  # (n, c)
    k_pos = starts + torch.arange(-p * c, c, device=q.device)  # (n, (p + 1) c)
    allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & (
        k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    )  # (n, c, (p + 1) c)
    valid = row_chunks(F.pad(k_valid, (0, tail), value=True))  # (B or 1, n, (p + 1) c)
    allowed = allowed[None] & valid[:, :, None, :]
    if q_doc is not None:  # padded positions: a document of their own
        qd = F.pad(q_doc, (0, tail), value=-1).view(b, n, c)
        kd = row_chunks(F.pad(k_doc, (0, tail), value=-1))
        allowed = allowed & (qd[..., :, None] == kd[..., None, :])
    allowed = allowed.expand(b, n, c, (p + 1) * c).reshape(b * n, 1, c, (p + 1) * c)
    out = masked_attention(qc, kc, vc, allowed, scale, sinks)  # (B * n, H, c, d_v)
    out = out.reshape(b, n, h, c, -1).permute(0, 2, 1, 3, 4).reshape(b, h, n * c, -1)
    return out[:, :, :t]


def _attention(q, k, v, q_pos, k_pos, q_doc, k_doc, scale, sliding_window, sinks) -> torch.Tensor:
    """Masked attention of ``q`` to all of ``k``/``v`` (every query sees at least itself)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat(k, n_rep), _repeat(v, n_rep)
    allowed = allowed_keys(q_pos, k_pos, q_doc, k_doc, sliding_window)
    return masked_attention(q, k, v, allowed, scale, sinks)


def _block(q, k, v, allowed, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention to one block of keys: the normalised output and its log-sum-exp.

    A query that sees no key of the block gets a finite, hugely negative
    log-sum-exp, so that its weight in :func:`_merge` is exactly zero and its
    gradient finite.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-2, -1)).to(acc) * scale  # (B, H, Tq, Tk)
    scores = scores.masked_fill(~allowed, torch.finfo(acc).min)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Tq)
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs.to(v.dtype), v).to(acc), lse


def _ring_block(q, k, v, where, sliding_window, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block` of one ring step; ``where``: query and key positions and documents."""
    n_rep = q.shape[1] // k.shape[1]
    allowed = allowed_keys(*where, sliding_window)
    return _block(q, _repeat(k, n_rep), _repeat(v, n_rep), allowed, scale)


def _merge(outs, lses, sinks, heads) -> torch.Tensor:
    """Combine blocks' outputs by their log-sum-exp (and a sink logit per head)."""
    stacked = torch.stack(lses)  # (n, B, H, Tq)
    if sinks is not None:
        sink = sinks.to(stacked.dtype).view(1, 1, heads, 1).expand(1, *stacked.shape[1:])
        total = torch.logsumexp(torch.cat([stacked, sink]), dim=0)
    else:
        total = torch.logsumexp(stacked, dim=0)
    weights = torch.exp(stacked - total)  # (n, B, H, Tq)
    return sum(w[..., None] * o for w, o in zip(weights, outs, strict=True))


def _gather_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """All-gather ``(B, H, T_l, d)`` over the group along the sequence: ``(B, H, cp T_l, d)``."""
    front = x.permute(2, 0, 1, 3).contiguous()  # (T_l, B, H, d)
    gathered = _gather(front, 0, group)  # (cp T_l, B, H, d)
    return gathered.permute(1, 2, 0, 3)


def _rotate(x: torch.Tensor, cp: int, rank: int, group: str) -> torch.Tensor:
    """Send ``x`` to rank ``rank + 1`` and receive rank ``rank - 1``'s (autograd: the reverse)."""
    flat = x.contiguous().view(-1)
    send = [0] * cp
    recv = [0] * cp
    send[(rank + 1) % cp] = flat.numel()
    recv[(rank - 1) % cp] = flat.numel()
    return funcol.all_to_all_single_autograd(flat, recv, send, group).view(x.shape)


def _seq_to_heads(x: torch.Tensor, cp: int, group: str) -> torch.Tensor:
    """``(B, H, T_l, d)`` sequence shard -> ``(B, H / cp, cp T_l, d)`` head shard."""
    b, h, t, d = x.shape
    parts = (
        x.reshape(b, cp, h // cp, t, d).permute(1, 0, 2, 3, 4).contiguous()
    )  # (cp, B, H/cp, T_l, d)
    got = funcol.all_to_all_single_autograd(parts.view(cp, -1), None, None, group)
    got = got.view(cp, b, h // cp, t, d)  # source rank's sequence chunk
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, cp: int, group: str) -> torch.Tensor:
    """``(B, H / cp, cp T_l, d)`` head shard -> ``(B, H, T_l, d)`` sequence shard."""
    b, hl, tt, d = x.shape
    t = tt // cp
    parts = x.reshape(b, hl, cp, t, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, T_l, d)
    got = funcol.all_to_all_single_autograd(parts.view(cp, -1), None, None, group)
    got = got.view(cp, b, hl, t, d)  # source rank's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * hl, t, d)
