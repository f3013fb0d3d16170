"""Batched token sampling on the device.

One step, for logits ``[B, V]`` (fp32) of B requests:

0. ``logit_bias`` (only when a row has one): each (token, bias) pair added to the row's logits;
1. penalties (only when a row asks for one):
   - repetition (Hugging Face): a token seen in prompt + output has its logit divided by ``r`` if
     positive, multiplied by ``r`` if not;
   - frequency / presence (OpenAI): ``logit -= frequency * count + presence * (count > 0)``, counts
     over output tokens only;
2. greedy rows (temperature 0) take the argmax of the penalised logits;
3. other rows: divide by temperature, keep the top-k, then the top-p nucleus (smallest prefix of the
   sorted distribution whose mass reaches p), then drop tokens with ``p < min_p * p_max``, and draw
   from what is left with the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` (equivalent to
   sampling from ``p``, and free of a cumulative sum).

Seeded requests draw their ``E`` row from a generator seeded with ``mix(seed, output position)``:
the token depends only on the seed, the position and the logits, never on batch mates, and a
retracted request resumes with the same stream. Unseeded rows share one vectorised draw.

Logprobs follow vLLM's default: the log-softmax of the *raw* model logits (before biases, penalties,
temperature and filters), natural log. The sampled token's logprob is reported even when the
filters would make its raw probability look different from the one it was drawn with.

Everything is vectorised over the batch; the only per-row Python loop is the seeded draws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import TypeVar

import torch

from radixrelay.attention.metadata import to_device
from radixrelay.kernels.host_staging import tensor_to_device
from radixrelay.protocol.step import TokenLogprobs
from radixrelay.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
T = TypeVar("T")


def step_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for ``position`` (number of output tokens so far) of a seeded request:
    SplitMix64 of the pair, so nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class PenaltyTensors:
    repetition: torch.Tensor   # [B, 1] fp32, 1.0 = off
    frequency: torch.Tensor    # [B, 1] fp32
    presence: torch.Tensor     # [B, 1] fp32
    seen: torch.Tensor         # [B, V] bool: token occurs in prompt + output
    output_counts: torch.Tensor  # [B, V] fp32: occurrences in the output


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters of one batch, built once per step by ``build``. Optional fields are None
    when no row of the batch needs them, so the matching work is skipped."""

    greedy: torch.Tensor               # [B] bool
    all_greedy: bool                   # every row is greedy: skip the draw entirely
    temperatures: torch.Tensor         # [B, 1] fp32, 1.0 on greedy rows (never divides by 0)
    top_k: torch.Tensor | None         # [B, 1] int64, V where disabled
    top_p: torch.Tensor | None         # [B, 1] fp32, 1.0 where disabled
    min_p: torch.Tensor | None         # [B, 1] fp32, 0.0 where disabled
    penalties: PenaltyTensors | None
    step_seeds: tuple[int | None, ...]  # per row: generator seed for this step, None = unseeded
    num_logprobs: tuple[int | None, ...]  # per row: SamplingParams.logprobs
    # ``logit_bias`` of every row, flattened: (rows int64 [N], ids int64 [N], biases fp32 [N]); None if none
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        *,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """``token_ids[i]`` is row i's prompt + output so far, ``[0, num_prompt_tokens[i])`` its prompt;
        ``vocab_size`` is the logits' width (it may exceed the tokenizer's). Cost: O(batch) plus, for
        rows with penalties only, O(their tokens)."""
        if not len(params) == len(token_ids) == len(num_prompt_tokens):
            raise ValueError("build: params, token_ids and num_prompt_tokens differ in length")
        return cls.from_rows(
            params, [len(ids) - n for ids, n in zip(token_ids, num_prompt_tokens)],
            _build_penalties(params, token_ids, num_prompt_tokens, vocab_size, device),
            vocab_size=vocab_size, device=device)

    @classmethod
    def from_rows(
        cls,
        params: Sequence[SamplingParams],
        num_outputs: Sequence[int] | Callable[[int], int],
        penalties: PenaltyTensors | None,
        *,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """``num_outputs[i]`` (or ``num_outputs(i)``, read for seeded rows only): tokens row i has sampled
        before this step (its seeded stream's position); ``penalties``: the rows' penalty state, kept on
        the device by the caller. O(batch), no device sync; an all-greedy batch copies nothing to the
        device (the draw's parameters are not read)."""
        if not callable(num_outputs) and len(params) != len(num_outputs):
            raise ValueError("from_rows: params and num_outputs differ in length")
        outputs = num_outputs if callable(num_outputs) else num_outputs.__getitem__
        num_logprobs = tuple(map(_LOGPROBS, params))                      # C-level maps: O(batch), small constant
        temperatures = list(map(_TEMPERATURE, params))
        bias = _bias_tensors(params, device) if any(map(_LOGIT_BIAS, params)) else None
        if not any(temperatures):                                         # every row greedy
            ones, column = _constant_rows(len(params), device)
            return cls(greedy=ones, all_greedy=True, temperatures=column, top_k=None, top_p=None, min_p=None,
                       penalties=penalties, step_seeds=(None,) * len(params), num_logprobs=num_logprobs,
                       bias=bias)
        greedy = [t == 0 for t in temperatures]

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device).unsqueeze(1)

        seeded = any(p.seed is not None for p in params)
        return cls(
            greedy=to_device(greedy, torch.bool, device),
            all_greedy=False,
            temperatures=column([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_k=(column([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64)
                   if any(0 < p.top_k < vocab_size for p in params) else None),
            top_p=column([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None,
            min_p=column([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
            penalties=penalties,
            step_seeds=(tuple(None if p.seed is None or g else step_seed(p.seed, outputs(i))
                              for i, (p, g) in enumerate(zip(params, greedy)))
                        if seeded else (None,) * len(params)),
            num_logprobs=num_logprobs,
            bias=bias,
        )


def _bias_tensors(params: Sequence[SamplingParams], device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    ids = [t for p in params for t, _ in p.logit_bias]
    biases = [b for p in params for _, b in p.logit_bias]
    return (to_device(rows, torch.int64, device), to_device(ids, torch.int64, device),
            to_device(biases, torch.float32, device))


def apply_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """logits: [B, V] fp32 -> a new tensor with each (row, id) pair's bias added (repeated ids add up)."""
    rows, ids, biases = bias
    return logits.index_put((rows, ids), biases, accumulate=True)


_CONSTANT_ROWS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_LOGPROBS, _TEMPERATURE, _LOGIT_BIAS = attrgetter("logprobs"), attrgetter("temperature"), attrgetter("logit_bias")


def _constant_rows(n: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [n] all True, fp32 [n, 1] all 1.0) on ``device``: views of tensors made once per device
    (grown by doubling), never written to."""
    device = torch.device(device)
    have = _CONSTANT_ROWS.get(device)
    if have is None or have[0].shape[0] < n:
        size = max(n, 2 * have[0].shape[0] if have is not None else 256)
        have = _CONSTANT_ROWS[device] = (torch.ones(size, dtype=torch.bool, device=device),
                                         torch.ones(size, 1, dtype=torch.float32, device=device))
    return have[0][:n], have[1][:n]


class SamplingTensorsCache:
    """``SamplingTensors.from_rows`` for batches whose rows repeat (steady decode). The per-row parameter
    tensors are kept while the batch has the same rows, compared by identity: ``owners`` holds one
    object per row whose sampling parameters never change (the worker's request-table entries; a
    request admitted again gets a new one). A repeated batch then costs the seeded rows' seeds and the
    penalty state passed in, not O(batch) host lists and copies."""

    def __init__(self) -> None:
        self._owners: list[object] = []
        self._vocab_size = -1
        self._base: SamplingTensors | None = None
        self._seeded: list[tuple[int, int]] = []        # (row, seed) of the seeded sampling rows

    def get(self, owners: Sequence[T], params_of: Callable[[T], SamplingParams], outputs_of: Callable[[T], int],
            penalties: PenaltyTensors | None, *, vocab_size: int, device: torch.device | str) -> SamplingTensors:
        """``params_of(owner)``: the row's parameters (read when the rows changed); ``outputs_of(owner)``:
        tokens the row sampled before this step (read for seeded rows)."""
        base = self._base
        if (base is None or vocab_size != self._vocab_size or len(owners) != len(self._owners)
                or not all(map(is_, owners, self._owners))):
            params = list(map(params_of, owners))
            base = self._base = SamplingTensors.from_rows(params, lambda i: outputs_of(owners[i]), penalties,
                                                          vocab_size=vocab_size, device=device)
            self._owners, self._vocab_size = list(owners), vocab_size
            self._seeded = ([] if base.all_greedy else
                            [(i, p.seed) for i, p in enumerate(params) if p.seed is not None and not p.greedy])
            return base
        if not self._seeded and penalties is base.penalties:
            return base
        seeds = base.step_seeds
        if self._seeded:
            row_seeds = list(seeds)
            for i, seed in self._seeded:
                row_seeds[i] = step_seed(seed, outputs_of(owners[i]))
            seeds = tuple(row_seeds)
        return dataclasses.replace(base, penalties=penalties, step_seeds=seeds)


def _build_penalties(
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
) -> PenaltyTensors | None:
    used = [p.has_penalties for p in params]
    if not any(used):
        return None
    rows = len(params)
    token_ids = [ids if u else () for ids, u in zip(token_ids, used)]  # other rows: nothing to count
    width = max(len(ids) for ids in token_ids)
    # Padding id = vocab_size: an extra column that is sliced away after the scatter.
    padded = torch.full((rows, max(width, 1)), vocab_size, dtype=torch.int64)
    is_output = torch.zeros((rows, max(width, 1)), dtype=torch.float32)
    for i, (ids, n) in enumerate(zip(token_ids, num_prompt_tokens)):
        padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        is_output[i, n : len(ids)] = 1.0
    padded, is_output = tensor_to_device(padded, device), tensor_to_device(is_output, device)
    counts = torch.zeros((rows, vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, is_output)
    seen = torch.zeros((rows, vocab_size + 1), dtype=torch.bool, device=device)
    seen.scatter_(1, padded, True)

    def column(values: list[float]) -> torch.Tensor:
        return tensor_to_device(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)

    return PenaltyTensors(
        repetition=column([p.repetition_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        seen=seen[:, :vocab_size],
        output_counts=counts[:, :vocab_size],
    )


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    """logits: [B, V] fp32 -> a new penalised tensor."""
    repeated = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
    logits = torch.where(pen.seen, repeated, logits)
    return logits - pen.frequency * pen.output_counts - pen.presence * (pen.output_counts > 0)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """logits: [B, V]; excluded tokens become -inf. One descending sort serves both filters."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)  # [1, V]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V]: mass of strictly better tokens
        # p == 1 rows keep everything (rounding could otherwise push mass_before to 1.0).
        drop = (mass_before >= top_p) & (top_p < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max (a ratio, so the order relative to top-k/top-p is moot)."""
    probs = logits.softmax(dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` for the host, queued without waiting for the device (read it once the step is done): on CUDA
    written into pinned memory by a kernel (``kernels.host_copy``: never queued behind a KV tier save's
    copies), elsewhere ``x`` itself."""
    if x.device.type != "cuda":
        return x
    from radixrelay.kernels.host_copy import write_to_host  # imports triton: CUDA only

    return write_to_host(x)


@dataclass(frozen=True)
class LogprobsTensors:
    sampled: torch.Tensor       # [B] fp32: raw log-softmax of the sampled token
    top_ids: torch.Tensor       # [B, K] int64, best first; K = the batch's largest request
    top_logprobs: torch.Tensor  # [B, K] fp32

    def to_host(self) -> LogprobsTensors:
        """Copies on the host, started without waiting for the device (read them once it is done); written
        by a kernel on CUDA (``kernels.host_copy``: never behind a tier save's copies)."""
        return LogprobsTensors(*(to_host(t) for t in (self.sampled, self.top_ids, self.top_logprobs)))

    def to_protocol(self, num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Per row: None where logprobs were not requested, else the row's k alternatives."""
        sampled = self.sampled.tolist()
        ids, values = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            None if k is None else TokenLogprobs(sampled[i], list(zip(ids[i][:k], values[i][:k])))
            for i, k in enumerate(num_logprobs)
        ]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor            # [B] int64
    logprobs: LogprobsTensors | None   # None when no row asked for logprobs


class Sampler:
    """Stateless apart from the generator used by unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator

    def __call__(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"Sampler: expected fp32 logits [B, V], got {logits.dtype} {tuple(logits.shape)}")
        if logits.shape[0] != tensors.greedy.shape[0]:
            raise ValueError(f"Sampler: {logits.shape[0]} logit rows for {tensors.greedy.shape[0]} requests")
        biased = apply_bias(logits, tensors.bias) if tensors.bias is not None else logits
        penalised = apply_penalties(biased, tensors.penalties) if tensors.penalties is not None else biased
        if tensors.all_greedy:
            token_ids = penalised.argmax(dim=-1)
        else:
            token_ids = self._draw(penalised, tensors)
        return SamplerOutput(token_ids, _logprobs(logits, token_ids, tensors.num_logprobs))

    def _draw(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        scaled = apply_top_k_top_p(logits / t.temperatures, t.top_k, t.top_p)
        if t.min_p is not None:
            scaled = apply_min_p(scaled, t.min_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        seeded = [(row, seed) for row, seed in enumerate(t.step_seeds) if seed is not None]
        if len(seeded) < len(t.step_seeds):       # unseeded rows draw from the sampler's generator, all at once
            noise.exponential_(generator=self._generator)
        for row, seed in seeded:                  # a seeded row's noise is its own (overwritten if drawn above)
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
        noise.clamp_(min=1e-20)  # an exact 0 would make 0/0 = NaN on excluded tokens
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(t.greedy, logits.argmax(dim=-1), sampled)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
) -> LogprobsTensors | None:
    wanted = [k for k in num_logprobs if k is not None]
    if not wanted:
        return None
    logprobs = logits.log_softmax(dim=-1)  # raw model distribution, natural log
    top = logprobs.topk(max(wanted), dim=-1)
    return LogprobsTensors(
        sampled=logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1),
        top_ids=top.indices,
        top_logprobs=top.values,
    )
