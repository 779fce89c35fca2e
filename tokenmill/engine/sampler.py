"""Token selection over a batch of logits, vectorized across rows.

Fixed order: grammar masks (structured outputs) -> stop-token masking (min_tokens) -> logit_bias -> penalties ->
temperature (fp32) -> top-k / top-p / min-p -> draw. Greedy rows are taken by argmax
(after masking, bias and penalties) and merged with `torch.where`; a batch that is all
greedy skips the rest.

The draw (`draw`): inverse CDF over softmax(logits / temperature) with one uniform per
(request seed, output position) (`position_seed`; a request without a client seed gets
a random one), computed by the native csrc/sampling.h that the decode bursts also run,
so a sampled request's tokens depend on neither its batch nor whether a step ran alone,
in a burst or as a speculative row. Logprobs
(the sampled token's and the top ones) are of the model's distribution before stop
masking, bias, penalties, temperature and truncation; for a row under a grammar, of
that distribution restricted to the tokens the grammar allows (renormalized).

Truncation is part of the draw (csrc/sampling.h, so the bursts truncate too), in the
tempered distribution: top-k keeps every token tied with the k-th largest logit (so
ties can keep more than k); top-p keeps the smallest set of most likely tokens whose
mass reaches p (and any token as likely as the last of them); min-p keeps tokens whose
probability is at least min_p times the largest.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tokenmill.model.kernels import native_ops

_MASK64 = 2 ** 64 - 1
# a masked token's logit for the draw (the native code assumes finite math): weighs 0
_MASKED = -1e30


def position_seed(seed: int, index: int) -> int:
    """The random bits of output position `index` of a request seeded with `seed`
    (splitmix64: neighbouring positions and seeds get unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def as_int64(seed: int) -> int:
    """A 64-bit seed as the int64 with the same bits (for tensors)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def draw(logits: torch.Tensor, temps: torch.Tensor, seeds: list[int], indices: list[int],
         top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
         min_p: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [B, V] float32 (masked tokens at -inf or _MASKED), at
    temps [B] float32 (> 0), after truncation by top_k [B] int64, top_p and min_p [B]
    float32 (None: off for every row), from the uniform of (seeds[b], indices[b]): int64
    [B]."""
    logits = logits.float().clamp(min=_MASKED)
    B, V = logits.shape
    ops = native_ops()
    seeds_t = torch.tensor([as_int64(s) for s in seeds], dtype=torch.int64)
    indices_t = torch.tensor(indices, dtype=torch.int64)
    if ops is not None:
        # the same call the decode bursts make per row (csrc/sampling.h)
        return ops.sample_rows(logits, temps.float(), seeds_t, indices_t,
                               top_k if top_k is not None else torch.zeros(B, dtype=torch.int64),
                               top_p.float() if top_p is not None else torch.ones(B),
                               min_p.float() if min_p is not None else torch.zeros(B))
    # Without the native code: the same definitions in torch (the float sums may round
    # differently, so a seeded token can differ from a native machine's in rare cases).
    if top_k is not None or top_p is not None or min_p is not None:
        kept = _apply_top_k_top_p_min_p(logits / temps.float().unsqueeze(1), top_k, top_p, min_p)
        logits = logits.masked_fill(kept == float("-inf"), _MASKED)
    m = logits.max(dim=-1, keepdim=True).values
    x = (logits - m) * (1.0 / temps.float()).unsqueeze(1)
    e = torch.where(x > -87.0, torch.exp(x), torch.zeros_like(x)).double()
    cum = e.cumsum(dim=-1)
    u = torch.tensor([(position_seed(s, i) >> 11) / 2.0 ** 53 for s, i in zip(seeds, indices)],
                     dtype=torch.float64)
    idx = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return idx.clamp(max=V - 1)


@dataclass
class LogitBias:
    """Every row's logit_bias as flat, parallel [N] tensors: logits[rows, token_ids] +=
    values. Each (row, token id) pair occurs at most once."""
    rows: torch.Tensor  # int64
    token_ids: torch.Tensor  # int64
    values: torch.Tensor  # fp32

    @classmethod
    def from_maps(cls, maps: list[dict[int, float] | None]) -> LogitBias:
        """One map (token id -> bias) or None per row of the batch."""
        sizes = np.fromiter((len(m) if m else 0 for m in maps), dtype=np.int64, count=len(maps))
        n = int(sizes.sum())
        rows = np.repeat(np.arange(len(maps), dtype=np.int64), sizes)
        ids = np.fromiter(chain.from_iterable(m for m in maps if m), dtype=np.int64, count=n)
        values = np.fromiter(chain.from_iterable(m.values() for m in maps if m), dtype=np.float32, count=n)
        return cls(torch.from_numpy(rows), torch.from_numpy(ids), torch.from_numpy(values))


@dataclass
class TokenMask:
    """Grammar masks of some rows: no `blocked` token may be sampled in `rows`. numpy,
    applied in place with numpy: torch's indexed fill took ~100 ms for 16 rows on the
    loaded two-core machine, numpy's under a millisecond a row."""
    rows: list[int]
    blocked: np.ndarray  # [R, V] bool

    @classmethod
    def from_bitmask(cls, rows: list[int], bitmask: np.ndarray, vocab_size: int) -> TokenMask:
        """bitmask: [R, ceil(V / 32)] int32, token t allowed iff bit t % 32 of word t // 32."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return cls(rows, bits == 0)

    @classmethod
    def only(cls, rows: list[int], token_ids: list[int], vocab_size: int) -> TokenMask:
        """Each row may sample its one token alone (a forced token)."""
        blocked = np.ones((len(rows), vocab_size), dtype=bool)
        blocked[np.arange(len(rows)), token_ids] = False
        return cls(rows, blocked)

    def join(self, other: TokenMask) -> TokenMask:
        """Both masks' rows (no row in both)."""
        return TokenMask(self.rows + other.rows, np.concatenate([self.blocked, other.blocked]))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of logits [B, V] fp32 with the blocked tokens at -inf."""
        arr = logits.detach().to("cpu", torch.float32).numpy().copy()
        arr[self.rows] = np.where(self.blocked, np.float32(-np.inf), arr[self.rows])
        return torch.from_numpy(arr).to(logits.device)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] fp32; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64; 0 = off
    top_p: torch.Tensor | None = None  # [B] fp32; 1 = off
    min_p: torch.Tensor | None = None  # [B] fp32; 0 = off
    seeds: list[int] | None = None  # per row (Request.seed); set unless all greedy
    indices: list[int] | None = None  # per row: the output position being sampled
    # penalties (all None when no row has any)
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_ids: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None
    # rows that may not stop yet: (row, stop token ids)
    banned: list[tuple[int, list[int]]] | None = None
    logit_bias: LogitBias | None = None  # None when no row has one
    token_mask: TokenMask | None = None  # None when no row is under a grammar
    num_logprobs: int | None = None  # max top-k over rows that want logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # of each sampled token
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def _apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    B, V = logits.shape
    counts = torch.zeros(B, V, dtype=torch.float32)
    max_out = max((len(x) for x in b.output_ids), default=0)
    if max_out:
        ids = torch.full((B, max_out), V, dtype=torch.int64)  # V = a padding column
        for i, x in enumerate(b.output_ids):
            if x:
                ids[i, :len(x)] = torch.tensor(x, dtype=torch.int64)
        padded = torch.zeros(B, V + 1, dtype=torch.float32)
        padded.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        counts = padded[:, :V]
    if b.repetition is not None and bool((b.repetition != 1.0).any()):
        seen = counts > 0
        for i, x in enumerate(b.prompt_ids):
            if x:
                seen[i, torch.tensor(x, dtype=torch.int64)] = True
        rp = b.repetition.clamp(min=1e-6).unsqueeze(1)  # a finite quotient for any allowed penalty
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if b.frequency is not None:
        logits = logits - b.frequency.unsqueeze(1) * counts
    if b.presence is not None:
        logits = logits - b.presence.unsqueeze(1) * (counts > 0).float()
    return logits


def _apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                             min_p: torch.Tensor | None) -> torch.Tensor:
    """Truncation in torch (machines without the native build): logits [B, V] already
    divided by the temperature, with the dropped tokens at -inf."""
    neg_inf = torch.tensor(float("-inf"))
    if top_k is not None and bool((top_k > 0).any()):
        k = top_k.clamp(max=logits.shape[1])
        max_k = int(k.max())
        kth = torch.topk(logits, max_k, dim=-1).values  # [B, max_k]
        idx = (k.clamp(min=1) - 1).unsqueeze(1)
        thresh = kth.gather(1, idx)
        thresh = torch.where((k > 0).unsqueeze(1), thresh, neg_inf)
        logits = torch.where(logits < thresh, neg_inf, logits)
    if top_p is not None:
        logits = _apply_top_p(logits, top_p)
    if min_p is not None:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


TOP_P_CANDIDATES = 512  # tokens sorted first for top-p; the rest only when they hold the nucleus's edge


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: its most likely tokens until their mass reaches top_p (a
    token is dropped when the mass before it already does; the top one always stays;
    rows with top_p = 1 keep everything). A 151,936-token vocabulary is not sorted every
    step: each row's TOP_P_CANDIDATES best are, and a row whose nucleus they do not
    contain (a flat distribution, top_p near 1) is sorted whole. Either way the row's
    own logits decide, so the result does not depend on the batch."""
    V = logits.shape[1]
    active = top_p < 1.0
    k = min(V, TOP_P_CANDIDATES)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    vals, order = torch.topk(logits, k, dim=-1)  # sorted, best first
    probs = (vals - lse).exp()
    before = probs.cumsum(-1) - probs  # the mass of the tokens ahead of each
    reach = top_p.unsqueeze(1)
    drop = (before >= reach) & active.unsqueeze(1)
    drop[:, 0] = False  # the most likely token stays, even for a top_p that is 0 in fp32
    # the candidates decide a row when the mass of all of them reaches top_p: every token
    # after them has at least that much ahead of it, so it is dropped
    inside = (before[:, -1] + probs[:, -1] >= top_p) | ~active
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, order, vals.masked_fill(drop, float("-inf")))
    out = torch.where(active.unsqueeze(1), out, logits)
    rows = (~inside).nonzero().squeeze(1)
    if len(rows) and k < V:  # (with k == V the candidates were the whole row)
        sl, so = torch.sort(logits[rows], dim=-1, descending=True)
        p = (sl - lse[rows]).exp()
        d = ((p.cumsum(-1) - p) >= reach[rows]) & active[rows].unsqueeze(1)
        d[:, 0] = False
        out[rows] = torch.empty_like(sl).scatter_(1, so, sl.masked_fill(d, float("-inf")))
    return out


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax (the first maximum, NaN counting as largest, as torch.argmax). numpy's
    is ~12x faster on CPU here: torch's took 85 us on one 49152-wide row, 0.7 ms on 16."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(x.contiguous().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, b: SamplingBatch, argmax: torch.Tensor | None = None) -> SamplerOutput:
    """logits [B, V] float32 -> one token per row (and logprobs when asked). argmax: the
    rows' argmax if the caller has it already (used unless masking, bias or penalties
    change the logits first)."""
    if b.token_mask is not None:
        logits = b.token_mask.apply(logits)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if b.num_logprobs is not None else None
    if b.banned or b.logit_bias is not None:
        logits = logits.clone()
    if b.banned:
        for row, ids in b.banned:
            logits[row, ids] = float("-inf")
    if b.logit_bias is not None:
        lb = b.logit_bias
        logits.index_put_((lb.rows, lb.token_ids), lb.values, accumulate=True)
    if b.output_ids is not None:
        logits = _apply_penalties(logits, b)
    unchanged = not b.banned and b.logit_bias is None and b.output_ids is None and b.token_mask is None
    greedy_tokens = argmax if argmax is not None and unchanged else _argmax(logits)
    if b.all_greedy:
        tokens = greedy_tokens
    else:
        temp = b.temperature
        is_greedy = temp == 0.0  # (RequestLimits.resolve sets a greedy row's temperature to 0)
        safe_temp = torch.where(is_greedy, torch.ones_like(temp), temp)
        sampled_rows = (~is_greedy).nonzero().squeeze(1)
        tokens = greedy_tokens.clone()
        if len(sampled_rows):
            rows = sampled_rows.tolist()
            # (a batch built without seeds draws at random)
            seeds = [b.seeds[r] for r in rows] if b.seeds is not None else [secrets.randbits(64) for _ in rows]
            indices = [b.indices[r] for r in rows] if b.indices is not None else [0] * len(rows)
            tokens[sampled_rows] = draw(logits[sampled_rows], safe_temp[sampled_rows], seeds, indices,
                                        *(t[sampled_rows] if t is not None else None
                                          for t in (b.top_k, b.top_p, b.min_p)))
    out = SamplerOutput(token_ids=tokens.tolist())
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        if b.num_logprobs > 0:
            top = torch.topk(raw_logprobs, b.num_logprobs, dim=-1)
            out.top_ids = top.indices.tolist()
            out.top_logprobs = top.values.tolist()
    return out
