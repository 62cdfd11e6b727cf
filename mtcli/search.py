"""Search: greedy, beam and sampling over batches of sentences, all on the model's incremental-decoding cache.

The encoder runs once; each step feeds only the newest token to `Transformer.decode` with a `KVCache` (from
`model.new_cache`); an `Ensemble` offers the same three calls. Sentences whose search is over leave the batch (and
the cache), so long outliers do not keep the whole batch busy.

Lengths count output subwords without EOS. `max_lens[i]` is the most a sentence may produce: at that length EOS is
the only choice. `min_len` (default 1) is the least: EOS is not allowed before it, so a sentence never comes back
empty (CTranslate2's and fairseq's rule; without it a model that likes EOS at step 1 returned "" for ordinary
captions). Empty sources never reach the search: `Translator` answers them with an empty line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mtcli.cache import KVCache
from mtcli.ensemble import EnsembleCache

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    tokens: list[int]  # output subwords, without BOS and EOS
    score: float  # log-probability (with EOS) divided by the length penalty
    log_prob: float  # log-probability (with EOS)


def length_penalty(length: torch.Tensor | int, alpha: float, norm: str = "gnmt"):
    """What a hypothesis' log-probability is divided by (its length counts EOS): GNMT's ((5 + length) / 6) ** alpha,
    or `power`, length ** alpha, as CTranslate2 and Transformers' generate; alpha 0 gives 1 (no normalization)."""
    if norm == "power":
        return float(length) ** alpha if isinstance(length, int) else length**alpha
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src_lens: torch.Tensor, a: float, b: int, max_positions: int) -> torch.Tensor:
    """a * source length + b subwords (source length without EOS), capped so BOS + output fits the positions."""
    # Past the positions a and b change nothing, and beyond them they broke the sum: a = 1e300 is inf in float32,
    # inf * 0 is NaN, and inf or NaN converts to a negative length, which left every output empty.
    a, b = min(a, max_positions), min(b, max_positions)
    lens = (a * src_lens.float() + b).floor().long()
    return lens.clamp(min=0, max=max_positions - 1)


def step_log_probs(
    model,
    tokens: torch.Tensor,
    memory: torch.Tensor,
    src_pad_mask: torch.Tensor,
    cache: KVCache | EnsembleCache,
    step: int,
    at_limit: torch.Tensor | None,
    min_len: int,
) -> torch.Tensor:
    """Log-probabilities of the next token, (N, V) in float32, with the length constraints applied. `at_limit`: the
    rows that must end now (`rows_at_limit`), or None."""
    pad, bos, eos = model.specials.pad, model.specials.bos, model.specials.eos
    logits = model.decode(tokens, memory, src_pad_mask, cache)[:, -1]
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # reads bf16 logits as they are
    log_probs[:, pad] = NEG_INF
    log_probs[:, bos] = NEG_INF
    if step < min_len:
        log_probs[:, eos] = NEG_INF
    if at_limit is not None:
        eos_scores = log_probs[at_limit, eos].clone()
        log_probs[at_limit] = NEG_INF
        log_probs[at_limit, eos] = torch.nan_to_num(eos_scores, neginf=0.0)
    return log_probs


def rows_at_limit(row_limits: np.ndarray, step: int, device) -> torch.Tensor | None:
    """The rows whose length limit (kept on the host, so that no step reads the device to find them) is reached at
    `step`, as an index tensor; None when there are none (most steps)."""
    rows = np.flatnonzero(row_limits <= step)
    return torch.from_numpy(rows).to(device) if rows.size else None


@torch.inference_mode()
def greedy_search(
    model,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    max_lens: torch.Tensor,
    min_len: int = 1,
    memory: torch.Tensor | None = None,
) -> list[Hypothesis]:
    """The most likely next token at every step. Returns one hypothesis per sentence (score = log-probability).
    `memory`: the encoder's output for `src`, when the caller has it already (every search takes it).

    Each step reads the device once (the chosen tokens with their log-probabilities): on a GPU, every read waits for
    the queued kernels."""
    B, device, eos = src.shape[0], src.device, model.specials.eos
    limits = max_lens.tolist()  # kept on the host, as is which sentences still search
    memory = model.encode(src, src_pad_mask) if memory is None else memory
    cache = model.new_cache(B, max(limits) + 1, device, memory.dtype)
    active = list(range(B))  # sentence index of each row
    active_limits = np.array(limits)
    tokens = torch.full((B, 1), model.specials.bos, dtype=torch.long, device=device)
    outputs: list[list[int]] = [[] for _ in range(B)]
    log_prob_sums = [0.0] * B
    done: list[Hypothesis | None] = [None] * B
    for step in range(max(limits) + 1):
        at_limit = rows_at_limit(active_limits, step, device)
        log_probs = step_log_probs(model, tokens, memory, src_pad_mask, cache, step, at_limit, min_len)
        best_lp, best = log_probs.max(dim=-1)
        # the step's one read: float64 holds the token ids and the float32 log-probabilities exactly
        picked = torch.stack([best.double(), best_lp.double()], dim=1).tolist()
        keep = []
        for row, (sentence, (token, lp)) in enumerate(zip(active, picked)):
            log_prob_sums[sentence] += lp
            if token == eos:
                done[sentence] = Hypothesis(outputs[sentence], log_prob_sums[sentence], log_prob_sums[sentence])
            else:
                outputs[sentence].append(int(token))
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(active):  # drop finished sentences from the batch and the cache
            keep_t = torch.tensor(keep, device=device)
            active, active_limits = [active[row] for row in keep], active_limits[keep]
            best, memory, src_pad_mask = best[keep_t], memory[keep_t], src_pad_mask[keep_t]
            cache.reorder(keep_t, keep_t)
        tokens = best[:, None]
    return done  # type: ignore[return-value]


@torch.inference_mode()
def beam_search(
    model,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    max_lens: torch.Tensor,
    beam_size: int,
    lenpen: float = 0.0,
    min_len: int = 1,
    nbest: int = 1,
    no_repeat_ngram: int = 0,
    length_norm: str = "gnmt",
    early_stopping: bool = False,
    memory: torch.Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Beam search; returns the `nbest` best hypotheses per sentence, best first.

    A sentence's search ends when it has k = max(beam_size, nbest) finished hypotheses and no live one scores better
    than the k-th at its current length (Hugging Face's rule; fairseq also waits for k), or at its length limit.
    Stopping at the first finished hypothesis that beats the live ones is cheaper but ends too early under a length
    penalty, which lets a longer hypothesis overtake later: on Multi30k valid (beam 5, length penalty 1.0) it
    gave 0.3 BLEU less, with outputs 1.4% shorter. Beam 1 stays identical to greedy search.

    early_stopping: end a sentence's search as soon as it has k finished hypotheses, whatever the live ones score:
    CTranslate2's rule (its only one) and Transformers' `early_stopping=True`, so that a `power` run searches as
    its exports do. Without a length penalty both rules give the same best hypothesis.
    """
    B, k, device, eos = src.shape[0], beam_size, src.device, model.specials.eos
    wanted = max(k, nbest)  # finished hypotheses a sentence waits for
    limits = max_lens.tolist()  # the host keeps what it decides on: limits, sentences, outputs so far
    # (1) Encode once. Cross-attention keys/values stay one per sentence; self-attention rows are one per beam.
    memory = model.encode(src, src_pad_mask) if memory is None else memory
    max_total = max(limits)
    cache = model.new_cache(B * k, max_total + 1, device, memory.dtype)
    sentences = list(range(B))  # sentence index of each batch entry still searching
    tokens = torch.full((B * k, 1), model.specials.bos, dtype=torch.long, device=device)
    # Each row's output so far, as back-pointers kept on the host: per step, every row's parent row in the step
    # before and the token it added (a finished hypothesis follows them back: output_of).
    parents: list[np.ndarray] = []
    added: list[np.ndarray] = []
    row_limits = np.repeat(np.array(limits), k)
    banned_from = torch.empty((B * k, 0), dtype=torch.long, device=device)  # the same on the device (no_repeat_ngram)
    # Only the first beam is live at the start, so the first step does not pick k copies of the same token.
    scores = torch.full((B, k), NEG_INF, device=device)
    scores[:, 0] = 0.0
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]

    for step in range(max_total + 1):
        n = len(sentences)
        # (2) Next-token log-probabilities for every live row, with constraints.
        at_limit = rows_at_limit(row_limits, step, device)
        log_probs = step_log_probs(model, tokens, memory, src_pad_mask, cache, step, at_limit, min_len)
        if no_repeat_ngram > 0:
            ban_repeated_ngrams(log_probs, banned_from, no_repeat_ngram, model.specials.pad)
        # (3) Add to the running scores; best 2k candidates over beam x vocabulary, so k stay live after EOS ones.
        # The best 2k of a sentence are among the best 2k of each of its beams: two small top-k's instead of one over
        # k x V entries (a tenth of the step's time at beam 5 with an 8k vocabulary on CPU).
        c = min(2 * k, log_probs.shape[-1])
        row_scores, row_tokens = row_topk(log_probs, c)  # (n*k, c)
        candidates = (scores.view(n, k, 1) + row_scores.view(n, k, c)).view(n, k * c)
        top_scores, top_ids = candidates.topk(c, dim=1)  # (n, c)
        top_beams = top_ids // c
        top_tokens = row_tokens.view(n, k * c).gather(1, top_ids)
        is_eos = (top_tokens == eos) & torch.isfinite(top_scores)
        # (4) The best k non-EOS candidates stay live.
        not_live = is_eos | ~torch.isfinite(top_scores)
        live_order = not_live.to(torch.uint8).argsort(dim=1, stable=True)[:, :k]
        live_scores = top_scores.gather(1, live_order).masked_fill(not_live.gather(1, live_order), NEG_INF)  # (n, k)
        live_beams = top_beams.gather(1, live_order)
        live_tokens = top_tokens.gather(1, live_order)
        # The step's one read of the device: what the host decides on, in one float64 block (exact for the ids and
        # the float32 scores); on a GPU every read waits for the queued kernels.
        block = torch.cat([top_scores[:, :k], top_beams[:, :k], is_eos[:, :k], live_scores, live_beams, live_tokens], 1)
        host = block.double().cpu().numpy()
        top_scores_h, top_beams_h, is_eos_h = host[:, :k], host[:, k : 2 * k].astype(np.int64), host[:, 2 * k : 3 * k]
        best_live_h, live_beams_h = host[:, 3 * k], host[:, 4 * k : 5 * k].astype(np.int64)
        live_tokens_h = host[:, 5 * k :].astype(np.int64)
        # (5) EOS candidates ranked within the first k finish: normalized by the length penalty (with EOS).
        penalty = length_penalty(step + 1, lenpen, length_norm)
        for i, j in zip(*np.nonzero(is_eos_h)):
            lp = float(top_scores_h[i, j])
            written = output_of(i * k + top_beams_h[i, j], parents, added)
            finished[sentences[i]].append(Hypothesis(written, lp / penalty, lp))
        # (6) Which sentences are done: `wanted` finished, the worst of which no live hypothesis beats at its present
        # length.
        done = sentences_done(finished, sentences, best_live_h.tolist(), wanted, penalty, early_stopping)
        if all(done) or step == max_total:
            break
        # (7) Reorder the cache and history by back-pointers; sentences that are done leave the batch.
        keep = [i for i in range(n) if not done[i]]
        parents.append((np.array(keep)[:, None] * k + live_beams_h[keep]).reshape(-1))
        added.append(live_tokens_h[keep].reshape(-1))
        if len(keep) < n:
            keep_t = torch.tensor(keep, device=device)
            rows = (keep_t[:, None] * k + live_beams[keep_t]).reshape(-1)
            live_scores, live_tokens = live_scores[keep_t], live_tokens[keep_t]
            sentences = [sentences[i] for i in keep]
            row_limits = row_limits.reshape(n, k)[keep].reshape(-1)
            memory, src_pad_mask = memory[keep_t], src_pad_mask[keep_t]
            cache.reorder(rows, keep_t)
        else:
            rows = (torch.arange(n, device=device)[:, None] * k + live_beams).reshape(-1)
            cache.reorder(rows)
        if no_repeat_ngram > 0:
            banned_from = torch.cat([banned_from[rows], live_tokens.reshape(-1, 1)], dim=1)
        scores = live_scores
        tokens = live_tokens.reshape(-1, 1)
    for hyps in finished:
        hyps.sort(key=lambda h: -h.score)
    return [hyps[:nbest] for hyps in finished]


def output_of(row: int, parents: list[np.ndarray], added: list[np.ndarray]) -> list[int]:
    """The tokens row `row` of the present step has written: its back-pointers followed to the first step."""
    tokens = []
    for step in range(len(parents) - 1, -1, -1):
        tokens.append(int(added[step][row]))
        row = parents[step][row]
    tokens.reverse()
    return tokens


def sentences_done(
    finished, sentences: list[int], best_live: list[float], wanted: int | list[int], penalty, early_stopping=False
) -> list[bool]:
    """Beam phase (6): a sentence is done with `wanted` finished hypotheses (one number, or one per sentence), the
    worst of which its best live one cannot beat at the present length (its score can only fall) or at once with
    early_stopping, or with no live candidate left."""
    is_done = []
    for sentence, live in zip(sentences, best_live):
        hyps = finished[sentence]
        n = wanted[sentence] if isinstance(wanted, list) else wanted
        if len(hyps) >= n:
            hyps.sort(key=lambda h: -h.score)
            del hyps[n:]
            is_done.append(early_stopping or live / penalty <= hyps[n - 1].score)
        else:
            is_done.append(live == NEG_INF)  # e.g. at the length limit
    return is_done


def row_topk(scores: torch.Tensor, c: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores, c, dim=1), in two cheap passes on a CPU: the c blocks of `block` columns with the highest
    maxima hold the c best entries of a row, so one vectorised max over the row and a top-k over c x block entries
    replace a top-k over the whole vocabulary (faster at beam-search shapes such as 320 x 8,000). Ties may come out
    in another order; on GPUs, torch.topk as it is."""
    N, V = scores.shape
    if scores.device.type != "cpu" or V < 16 * block:
        return scores.topk(c, dim=1)
    if V % block:
        scores = torch.nn.functional.pad(scores, (0, block - V % block), value=NEG_INF)
    blocks = scores.view(N, -1, block)  # (N, V / block, block)
    best_blocks = blocks.amax(dim=2).topk(c, dim=1).indices  # (N, c)
    candidates = blocks.gather(1, best_blocks[:, :, None].expand(-1, -1, block)).view(N, c * block)
    values, where = candidates.topk(c, dim=1)
    return values, best_blocks.gather(1, where // block) * block + where % block


def ban_repeated_ngrams(log_probs: torch.Tensor, history: torch.Tensor, n: int, spare_column: int) -> None:
    """Forbid tokens that would repeat an n-gram already in the row's output (in place). `spare_column`: a column
    that is -inf already (padding's): windows that do not match ban it, so nothing is read back from the device."""
    N, L = history.shape
    if L < n:  # no complete n-gram yet
        return
    if n == 1:
        log_probs.scatter_(1, history, NEG_INF)
        return
    windows = history.unfold(1, n, 1)  # (N, L-n+1, n)
    suffix = history[:, L - (n - 1) :]  # (N, n-1) the last n-1 tokens
    matches = (windows[:, :, : n - 1] == suffix[:, None, :]).all(dim=2)  # (N, L-n+1)
    log_probs.scatter_(1, windows[:, :, n - 1].masked_fill(~matches, spare_column), NEG_INF)


@torch.inference_mode()
def sample(
    model,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    max_lens: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_len: int = 1,
    generator: torch.Generator | None = None,
    memory: torch.Tensor | None = None,
) -> list[Hypothesis]:
    """Ancestral sampling with temperature, top-k and nucleus (top-p) truncation. One sample per sentence."""
    B, device, (pad, eos) = src.shape[0], src.device, (model.specials.pad, model.specials.eos)
    limits = max_lens.tolist()
    limits_h = np.array(limits)
    memory = model.encode(src, src_pad_mask) if memory is None else memory
    cache = model.new_cache(B, max(limits) + 1, device, memory.dtype)
    tokens = torch.full((B, 1), model.specials.bos, dtype=torch.long, device=device)
    outputs: list[list[int]] = [[] for _ in range(B)]
    log_prob_sums = torch.zeros(B, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    alive_h = [True] * B  # the same on the host
    for step in range(max(limits) + 1):
        at_limit = rows_at_limit(limits_h, step, device)
        log_probs = step_log_probs(model, tokens, memory, src_pad_mask, cache, step, at_limit, min_len)
        logits = log_probs / temperature
        if top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, NEG_INF)
        if top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, NEG_INF))
        choice = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
        choice = torch.where(alive, choice, torch.full_like(choice, pad))
        log_prob_sums += torch.where(alive, log_probs.gather(1, choice.clamp(min=0)[:, None]).squeeze(1), 0.0)
        for i, token in enumerate(choice.tolist()):  # the step's one read of the device
            if alive_h[i] and token != eos:
                outputs[i].append(token)
            alive_h[i] = alive_h[i] and token != eos
        alive &= choice != eos
        if not any(alive_h):
            break
        tokens = torch.where(alive, choice, torch.full_like(choice, eos))[:, None]
    sums = log_prob_sums.tolist()
    return [Hypothesis(out, s, s) for out, s in zip(outputs, sums)]
