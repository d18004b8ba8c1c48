"""Turns the last-position logits of each sequence into its next token.

Order as in vLLM: grammar masks (structured outputs, only on the rows that have
one), raw logprobs, the per-request logit controls (allowed_token_ids, bad_words,
logit_bias), penalties, min_tokens masking, then greedy rows take the argmax and
the others go through temperature, top-k, top-p and min-p before a draw.
Everything is batched tensor work on the logits' device; the only host
synchronisation is reading back the sampled ids (and logprobs if asked), which
`SampledBatch.to_host` may put off until after the next step is launched. A
request with a seed draws from its own generator, so its tokens do not depend on
what else is in the batch.

The logit controls touch only the rows of the requests that ask for them: those
rows are gathered (in fp32), changed, and put back (or, in an all-greedy batch of
half-precision logits, argmaxed on their own), so the other rows of the batch cost
nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraserve.sampling_params import SamplingParams
from loraserve.structured_output.bitmask import TokenMask, apply_token_masks


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    generator: torch.Generator | None
    # Tokens sampled for this request but not yet in output_token_ids (async
    # scheduling); they count towards min_tokens.
    num_pending: int = 0
    # Structured outputs: the tokens its grammar allows next.
    token_mask: TokenMask | None = None
    # Structured outputs: the mask depends on the token still in flight, so the step
    # samples this row later (ModelRunner.sample_deferred), once the mask is known.
    deferred: bool = False


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: [(sampled id, logprob), (top-1 id, logprob), ...] or None.
    logprobs: list[list[tuple[int, float]] | None]


@dataclass
class SampledBatch:
    """One step's sampled ids (and logprobs) on their way to the host: the copies
    are queued behind the step on the device, so the host can prepare and launch
    the next step before it reads them with `to_host`."""

    token_ids: torch.Tensor  # [B], on the device; the next step may read it there
    host_ids: torch.Tensor
    num_logprobs: list[int | None]
    chosen: torch.Tensor | None = None  # [B] logprob of each sampled id
    top_ids: torch.Tensor | None = None  # [B, n]
    top_vals: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    # Rows sampled after the step (deferred rows): their own batch replaces them.
    patches: list[tuple[list[int], SampledBatch]] = field(default_factory=list)

    def to_host(self) -> SamplerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        sampled = self.host_ids.tolist()
        logprobs: list[list[tuple[int, float]] | None] = [None] * len(sampled)
        if self.chosen is not None:
            chosen = self.chosen.tolist()
            top_ids = self.top_ids.tolist() if self.top_ids is not None else None
            top_vals = self.top_vals.tolist() if self.top_vals is not None else None
            for i, n in enumerate(self.num_logprobs):
                if n is None:
                    continue
                entry = [(sampled[i], chosen[i])]
                if n:
                    entry += list(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
                logprobs[i] = entry
        for rows, patch in self.patches:
            patched = patch.to_host()
            for j, i in enumerate(rows):
                sampled[i], logprobs[i] = patched.token_ids[j], patched.logprobs[j]
        return SamplerOutput(sampled, logprobs)


# A deferred row's stand-in when its step samples: the cheapest draw (an argmax),
# overwritten once the row is sampled with its mask.
DEFERRED_PLACEHOLDER = SamplingRow(SamplingParams(temperature=0.0), [], [], None, None)


def _queued(batch: SampledBatch) -> SampledBatch:
    if batch.token_ids.is_cuda:
        batch.ready = torch.cuda.Event()
        batch.ready.record()
    return batch


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class Sampler:
    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``argmax``: the backend's row argmax (the first of equal maxima); torch's
        by default."""
        self.device = device
        self._argmax = argmax or (lambda logits: torch.argmax(logits, dim=-1))
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampledBatch:
        num_logprobs = [r.params.logprobs for r in rows]
        all_greedy = all(r.params.greedy for r in rows)
        wants_logprobs = any(n is not None for n in num_logprobs)
        penalties = any(r.params.uses_penalties for r in rows)
        if wants_logprobs or penalties or not all_greedy:
            # Greedy rows alone need only the argmax, the same in the model's dtype.
            logits = logits.float()
        apply_token_masks(logits, [r.token_mask for r in rows])
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        controlled = _controlled_rows(logits, rows)
        if controlled is not None and logits.dtype == torch.float32:
            index, changed, _ = controlled
            # In place: the logits are this step's own (a fresh tensor, or the graph's
            # output, which the next replay overwrites only after this step).
            logits.index_put_((index,), changed)
            controlled = None
        logits = _apply_penalties(logits, rows)
        logits = _mask_stop_tokens(logits, rows)

        greedy_ids = self._argmax(logits)
        if controlled is not None:
            # All greedy, in half precision: the controlled rows take their own
            # argmax, from their fp32 logits.
            index, changed, controlled_rows = controlled
            greedy_ids.index_put_((index,), self._argmax(
                _mask_stop_tokens(changed, controlled_rows)))
        if all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(
                torch.tensor([r.params.greedy for r in rows], device=logits.device),
                greedy_ids, self._draw(logits, rows),
            )
        batch = SampledBatch(token_ids, _to_host_async(token_ids), num_logprobs)
        if raw_logprobs is not None:
            top_n = max(n or 0 for n in num_logprobs)
            batch.chosen = _to_host_async(raw_logprobs.gather(1, token_ids[:, None]).squeeze(1))
            if top_n:
                top = torch.topk(raw_logprobs, top_n)
                batch.top_ids = _to_host_async(top.indices)
                batch.top_vals = _to_host_async(top.values)
        return _queued(batch)

    @staticmethod
    def argmax_suffices(rows: list[SamplingRow]) -> bool:
        """Whether ``sample`` would return ``argmax(logits)`` of the raw logits: greedy
        rows that ask for no logprobs, no penalties, no min_tokens masking and have no
        grammar mask."""
        return all(
            r.params.greedy and r.params.logprobs is None and not r.params.uses_penalties
            and not r.params.has_logit_controls and not _stop_ids_masked(r)
            and r.token_mask is None
            for r in rows
        )

    @staticmethod
    def from_argmax(token_ids: torch.Tensor) -> SampledBatch:
        """The batch ``sample`` gives for rows where ``argmax_suffices``, from ids
        already taken (a decode graph takes them)."""
        return _queued(SampledBatch(token_ids, _to_host_async(token_ids), [None] * len(token_ids)))

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[-1]
        temps = torch.tensor([max(r.params.temperature, 1e-5) for r in rows], device=dev)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev)[None, :]
            drop = ranks >= torch.tensor(top_k, device=dev)[:, None]
            probs = sorted_logits.softmax(-1)
            # Drop a token once the tokens before it already reach top_p; keep the first.
            drop |= (probs.cumsum(-1) - probs) > torch.tensor(top_p, device=dev)[:, None]
            drop[:, 0] = False
            logits = torch.full_like(logits, float("-inf")).scatter(
                1, order, sorted_logits.masked_fill(drop, float("-inf"))
            )
        probs = logits.softmax(-1)
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            threshold = torch.tensor(min_p, device=dev)[:, None] * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        # argmax(p / q) with q ~ Exp(1) is a draw from p (the exponential race).
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                q[i].exponential_(generator=row.generator)
        return (probs / q).argmax(dim=-1)


def _device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for the device: through pinned
    memory, as a copy from pageable memory may wait for the work already queued."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


def _controlled_rows(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[torch.Tensor, torch.Tensor, list[SamplingRow]] | None:
    """The rows whose requests ask for logit controls: their indices in the batch
    (on the device), their logits in fp32 with allowed_token_ids, bad_words and
    logit_bias applied (in vLLM's order), and their SamplingRows. None when no row
    asks, the common case, which costs nothing."""
    picked = [i for i, r in enumerate(rows) if r.params.has_logit_controls]
    if not picked:
        return None
    dev = logits.device
    index = _device_tensor(picked, torch.long, dev)
    sub_rows = [rows[i] for i in picked]
    sub = logits[index].float()  # a copy: the batch's logits are untouched here
    vocab = sub.shape[-1]

    allowed = [(j, r.params.allowed_token_ids) for j, r in enumerate(sub_rows)
               if r.params.allowed_token_ids is not None]
    if allowed:
        width = max(len(ids) for _, ids in allowed)
        # Pad each row's ids with its own first id: scattering it twice is harmless.
        padded = [ids + [ids[0]] * (width - len(ids)) for _, ids in allowed]
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=dev)
        keep.scatter_(1, _device_tensor(padded, torch.long, dev), True)
        which = _device_tensor([j for j, _ in allowed], torch.long, dev)
        sub[which] = sub[which].masked_fill(~keep, float("-inf"))

    banned_rows, banned_ids = [], []
    for j, row in enumerate(sub_rows):
        for token_id in _banned_by_bad_words(row):
            banned_rows.append(j)
            banned_ids.append(token_id)
    if banned_rows:
        sub.index_put_((_device_tensor(banned_rows, torch.long, dev),
                        _device_tensor(banned_ids, torch.long, dev)),
                       torch.full((len(banned_rows),), float("-inf"), device=dev))

    bias_rows, bias_ids, biases = [], [], []
    for j, row in enumerate(sub_rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            bias_rows.append(j)
            bias_ids.append(token_id)
            biases.append(bias)
    if bias_rows:
        sub.index_put_((_device_tensor(bias_rows, torch.long, dev),
                        _device_tensor(bias_ids, torch.long, dev)),
                       _device_tensor(biases, torch.float32, dev), accumulate=True)
    return index, sub, sub_rows


def _banned_by_bad_words(row: SamplingRow) -> list[int]:
    """The token ids a request's bad words forbid now: the last token of every bad
    word whose other tokens were just generated (a one-token word, always). Only
    the generated tokens count, not the prompt, as in vLLM. A request with a longer
    word has its last token on the host here: the engine waits for it
    (SamplingParams.reads_output_tokens)."""
    words = row.params.bad_words_token_ids
    if not words:
        return []
    output = row.output_token_ids
    banned = []
    for word in words:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= len(output) and output[len(output) - prefix:] == word[:-1]):
            banned.append(word[-1])
    return banned


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    use_rep = any(p != 1.0 for p in rep)
    use_out = any(freq) or any(pres)
    if not (use_rep or use_out):
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    output_counts = _token_counts([r.output_token_ids for r in rows], vocab, dev)
    if use_rep:
        seen = output_counts > 0
        seen |= _token_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0
        penalty = torch.tensor(rep, device=dev)[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if use_out:
        counts = output_counts.to(logits.dtype)
        logits = logits - torch.tensor(freq, device=dev)[:, None] * counts
        logits = logits - torch.tensor(pres, device=dev)[:, None] * (counts > 0).to(logits.dtype)
    return logits


def _token_counts(seqs: list[list[int]], vocab: int, device) -> torch.Tensor:
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.int32, device=device)
    width = max((len(s) for s in seqs), default=0)
    if width == 0:
        return counts[:, :vocab]
    # Pad with the extra column `vocab`, then count every row at once.
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    rows_idx, cols = [], []
    for i, row in enumerate(rows):
        p = row.params
        if not _stop_ids_masked(row):
            continue
        stop_ids = list(p.stop_token_ids or [])
        if row.eos_token_id is not None and not p.ignore_eos:
            stop_ids.append(row.eos_token_id)
        rows_idx += [i] * len(stop_ids)
        cols += stop_ids
    if rows_idx:
        logits = logits.clone()
        logits[torch.tensor(rows_idx, device=logits.device),
               torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def _stop_ids_masked(row: SamplingRow) -> bool:
    """min_tokens not reached yet: the stop ids and EOS cannot be sampled."""
    return len(row.output_token_ids) + row.num_pending < row.params.min_tokens


# Rows of prompt logits turned into logprobs at a time: bounds the fp32 copy of
# the logits that log_softmax needs (rows x vocabulary).
_PROMPT_LOGPROBS_ROWS = 512


@dataclass
class PromptLogprobsBatch:
    """One step's prompt logprobs on their way to the host, like SampledBatch:
    per computed position the logprob and rank of the next prompt token and the
    top-k alternatives, for the sequences that asked (`counts` positions each, in
    step order, with their own k)."""

    counts: list[int]
    num_top: list[int]
    chosen_ids: list[int]
    chosen: torch.Tensor  # [P]
    ranks: torch.Tensor  # [P]
    top_ids: torch.Tensor | None  # [P, max k]
    top_vals: torch.Tensor | None
    ready: torch.cuda.Event | None = None

    def to_host(self) -> list[list[list[tuple[int, float, int]]]]:
        """Per sequence, per position: [(prompt token, logprob, rank), (top-1 id,
        logprob, 1), ...]."""
        if self.ready is not None:
            self.ready.synchronize()
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_vals = self.top_vals.tolist() if self.top_vals is not None else None
        result, row = [], 0
        for count, k in zip(self.counts, self.num_top, strict=True):
            seq = []
            for _ in range(count):
                entry = [(self.chosen_ids[row], chosen[row], ranks[row])]
                if k:
                    entry += [(t, v, r + 1) for r, (t, v) in
                              enumerate(zip(top_ids[row][:k], top_vals[row][:k], strict=True))]
                seq.append(entry)
                row += 1
            result.append(seq)
        return result


@torch.no_grad()
def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor, slice], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    counts: list[int],
    num_top: list[int],
) -> PromptLogprobsBatch:
    """Logprobs of `targets` (the next prompt token at each row of `hidden`) from
    the fp32 log-softmax of the logits, their ranks (the number of tokens at least
    as likely, itself included, as vLLM counts them) and the top max(num_top)
    alternatives, queued for the host. ``compute_logits(chunk, rows)`` gets each
    chunk of `hidden` and its slice of the rows (for the rows' adapters)."""
    dev = hidden.device
    k = max(num_top, default=0)
    target_t = torch.tensor(targets, dtype=torch.long).to(dev, non_blocking=True)
    chosen, ranks, top_ids, top_vals = [], [], [], []
    for start in range(0, len(targets), _PROMPT_LOGPROBS_ROWS):
        end = start + _PROMPT_LOGPROBS_ROWS
        rows = slice(start, end)
        logprobs = torch.log_softmax(compute_logits(hidden[rows], rows).float(), dim=-1)
        picked = logprobs.gather(1, target_t[start:end, None])
        chosen.append(picked.squeeze(1))
        ranks.append((logprobs >= picked).sum(dim=-1))
        if k:
            top = torch.topk(logprobs, k)
            top_ids.append(top.indices)
            top_vals.append(top.values)
    batch = PromptLogprobsBatch(
        counts, num_top, list(targets),
        _to_host_async(torch.cat(chosen)), _to_host_async(torch.cat(ranks)),
        _to_host_async(torch.cat(top_ids)) if k else None,
        _to_host_async(torch.cat(top_vals)) if k else None,
    )
    if dev.type == "cuda":
        batch.ready = torch.cuda.Event()
        batch.ready.record()
    return batch
