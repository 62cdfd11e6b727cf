"""Continuous batching, for the server: sentences join a running search at its next step and leave it as soon as
their own search ends, so the model works on a full batch at every step and nobody waits for the longest sentence of
a batch (`mtcli serve`'s model worker, serve_worker.py, drives it).

`Stream(model, decode, max_positions)`: `add(ids, tags)` encodes newcomers and gives them rows; `step()` runs one
decoder step for every row and returns `(tag, hypotheses)` for each sentence whose search ended. A sentence's search
is search.py's for the same settings, step for step (greedy_search with beam 1, else beam_search): the same
candidates, length limits, stopping rule and scores. Only the batch around it differs, which can change the last
bits of its floating-point sums (docs/serve.md says when that changed a translation).

Rows of different ages share one decoder call because the self-attention cache is aligned by step, not by
position: every row writes its newest key/value into the same column. A sentence that joined at column c has its BOS
there, its positions count from c (KVCache.first), and a key mask hides the columns before c. Whatever those columns
hold gets a weight of exactly 0, so it must only be finite (0 x NaN is NaN): the buffers start as zeros and only ever
receive keys and values. Every step reorders the cache by the beams' back-pointers, a copy anyway; the copy also
drops the columns no live row reads, so the cache is as long as the oldest live sentence's output, however long the
server runs. Rows are in order of age (sentences join at the end), so the copy takes each group of rows from its
oldest sentence's first column only: a young sentence's rows do not copy the old ones' columns.
"""

from __future__ import annotations

import torch

from mtcli.batching import collate
from mtcli.cache import KVCache, cache_dtype
from mtcli.config import DecodeConfig
from mtcli.search import NEG_INF, Hypothesis, length_penalty, max_output_lengths, row_topk, sentence_done

COPY_GROUPS = 4  # row groups of the cache reorder (see above): 4 copied ~60% of the columns one copy would


class Stream:
    def __init__(self, model, decode: DecodeConfig, max_positions: int):
        self.model, self.decode, self.max_positions = model, decode, max_positions
        self.greedy = decode.beam == 1 and not decode.no_repeat_ngram  # as Translator._search chooses
        self.k = decode.beam
        self.device = next(model.parameters()).device
        cfg = model.cfg
        self.heads, self.head_dim = cfg.heads, cfg.d_model // cfg.heads
        self.dtype = cache_dtype(model, self.device)
        self.cache = KVCache(len(model.decoder), 0, self.heads, self.head_dim, 0, self.device, self.dtype)
        self.buffers: list[list[torch.Tensor]] = []  # per layer: k, v, and the spares the reorder writes into
        self._reset()

    def _reset(self) -> None:
        """No sentence left: empty state, the buffers kept for the next ones."""
        long = dict(dtype=torch.long, device=self.device)
        self.tags: list = []  # per live sentence, in row order
        self.first = torch.empty(0, **long)  # per sentence: the cache column of its BOS
        self.max_lens = torch.empty(0, **long)  # per sentence: the most subwords it may produce
        self.src_pad_mask = torch.empty(0, 1, dtype=torch.bool, device=self.device)
        self.scores = torch.empty(0, self.k, device=self.device)  # beam: running log-probabilities of the live beams
        self.log_prob_sums: list[float] = []  # greedy: summed in Python floats, as greedy_search does
        self.finished: list[list[Hypothesis]] = []  # beam: finished hypotheses per sentence
        self.tokens = torch.empty(0, 1, **long)  # each row's next input
        self.history = torch.empty(0, 1, **long)  # each row's inputs by cache column (-1 before its BOS)
        self.cache.length = 0
        for layer in self.cache.layers:
            layer.cross_k = layer.cross_v = None

    def __len__(self) -> int:
        return len(self.tags)

    @property
    def source_tokens(self) -> int:
        """Source subwords (with EOS) of the live sentences: what the batch budget (decode.batch_tokens) counts."""
        return int((~self.src_pad_mask).sum()) if len(self) else 0

    # -----------------------------------------------------------------------------------------------------------------
    # Joining

    @torch.inference_mode()
    def add(self, ids: list[list[int]], tags: list) -> None:
        """Sentences (source ids without EOS, none empty, each within the positions) join at the next step."""
        model, k, m = self.model, self.k, len(ids)
        # First what can fail (the model on these sentences), then the changes: a failed add changes nothing.
        batch = collate(ids, specials=model.specials).to(self.device)
        memory = model.encode(batch.src, batch.src_pad_mask)
        new_keys = [layer.cross_attn.memory_keys(memory, self.dtype) for layer in model.decoder]
        lengths = torch.tensor([len(x) for x in ids])
        d = self.decode
        max_lens = max_output_lengths(lengths, d.max_len_a, d.max_len_b, self.max_positions).to(self.device)
        n, column = len(self), self.cache.length
        # Cross-attention keys/values, one entry per sentence, padded to a common source length (masked).
        S = max(self.src_pad_mask.shape[1] if n else 0, batch.src.shape[1])
        for (new_k, new_v), cache in zip(new_keys, self.cache.layers):
            new_k, new_v = _pad_dim(new_k, 2, S, 0.0), _pad_dim(new_v, 2, S, 0.0)
            if n:
                cache.cross_k = torch.cat([_pad_dim(cache.cross_k, 2, S, 0.0), new_k])
                cache.cross_v = torch.cat([_pad_dim(cache.cross_v, 2, S, 0.0), new_v])
            else:
                cache.cross_k, cache.cross_v = new_k, new_v
        self.src_pad_mask = torch.cat(
            [_pad_dim(self.src_pad_mask, 1, S, True), _pad_dim(batch.src_pad_mask, 1, S, True)]
        )
        self._make_room(rows=(n + m) * k, columns=column + 1)  # their columns before `column` stay masked
        bos = model.specials.bos
        new_history = torch.full((m * k, column + 1), -1, dtype=torch.long, device=self.device)
        new_history[:, column] = bos
        self.history = torch.cat([self.history, new_history])
        self.tokens = torch.cat([self.tokens, torch.full((m * k, 1), bos, dtype=torch.long, device=self.device)])
        self.first = torch.cat([self.first, torch.full((m,), column, dtype=torch.long, device=self.device)])
        self.max_lens = torch.cat([self.max_lens, max_lens])
        scores = torch.full((m, k), NEG_INF, device=self.device)
        scores[:, 0] = 0.0  # only the first beam is live at the start (as beam_search)
        self.scores = torch.cat([self.scores, scores])
        self.log_prob_sums += [0.0] * m
        self.finished += [[] for _ in range(m)]
        self.tags += list(tags)

    def _make_room(self, rows: int, columns: int) -> None:
        """Buffers of at least `rows` x `columns` (grown by doubling, the written part copied over), zeros at first."""
        have_rows, have_columns = (self.buffers[0][0].shape[0], self.buffers[0][0].shape[2]) if self.buffers else (0, 0)
        if rows <= have_rows and columns <= have_columns:
            return
        new_rows, new_columns = max(rows, 2 * have_rows, 8 * self.k), max(columns, 2 * have_columns, 32)
        shape = (new_rows, self.heads, new_columns, self.head_dim)
        used_rows, used_columns = len(self) * self.k, self.cache.length
        grown = []
        for i in range(len(self.model.decoder)):
            new = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(4)]
            if self.buffers:
                for old, fresh in zip(self.buffers[i][:2], new[:2]):
                    fresh[:used_rows, :, :used_columns] = old[:used_rows, :, :used_columns]
            grown.append(new)
        self.buffers = grown

    # -----------------------------------------------------------------------------------------------------------------
    # One step

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[Hypothesis]]]:
        """One decoder step for every live row. Returns (tag, hypotheses: the nbest best first; one with beam 1) for
        the sentences whose search ended at it, which leave the batch."""
        if not len(self):
            return []
        model, k, n, column = self.model, self.k, len(self), self.cache.length
        rows = n * k
        self._make_room(rows, column + 1)
        for layer, buffer in zip(self.cache.layers, self.buffers):
            layer.k, layer.v = buffer[0][:rows], buffer[1][:rows]
        first_rows = self.first.repeat_interleave(k)
        self.cache.first = first_rows
        logits = model.decode(self.tokens, None, self.src_pad_mask, self.cache)[:, -1]  # writes column `column`
        steps = column - self.first  # per sentence: subwords produced before this one
        log_probs = self._log_probs(logits, steps.repeat_interleave(k), self.max_lens.repeat_interleave(k))
        if self.greedy:
            done, keep_rows, next_tokens = self._greedy(log_probs, column)
        else:
            done, keep_rows, next_tokens = self._beam(log_probs, steps.tolist(), column)
        ended = [(self.tags[i], self.finished[i]) for i in range(n) if done[i]]
        keep = [i for i in range(n) if not done[i]]
        if not keep:
            self._reset()
            return ended
        self._keep(keep, keep_rows, next_tokens, column + 1)
        return ended

    def _log_probs(self, logits: torch.Tensor, steps: torch.Tensor, max_lens: torch.Tensor) -> torch.Tensor:
        """search._step_log_probs with each row at its own step."""
        specials = self.model.specials
        log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        log_probs[:, specials.pad] = NEG_INF
        log_probs[:, specials.bos] = NEG_INF
        log_probs[steps < self.decode.min_len, specials.eos] = NEG_INF
        at_limit = max_lens <= steps  # these rows must end now
        if at_limit.any():
            eos_scores = log_probs[at_limit, specials.eos].clone()
            log_probs[at_limit] = NEG_INF
            log_probs[at_limit, specials.eos] = torch.nan_to_num(eos_scores, neginf=0.0)
        return log_probs

    def _outputs(self, row: int, sentence: int, column: int) -> list[int]:
        """The subwords row `row` (of `sentence`) has produced, from its history."""
        return self.history[row, int(self.first[sentence]) + 1 : column + 1].tolist()

    def _greedy(self, log_probs: torch.Tensor, column: int):
        """greedy_search's step: the most likely token; a sentence ends at EOS."""
        eos = self.model.specials.eos
        best_lp, best = log_probs.max(dim=-1)
        ended = best == eos
        done = ended.tolist()
        for i, lp in enumerate(best_lp.tolist()):
            self.log_prob_sums[i] += lp
            if done[i]:
                total = self.log_prob_sums[i]
                self.finished[i] = [Hypothesis(self._outputs(i, i, column), total, total)]
        keep = (~ended).nonzero().squeeze(1)
        self.scores = self.scores[keep]
        return done, keep, best[keep]

    def _beam(self, log_probs: torch.Tensor, steps: list[int], column: int):
        """beam_search's phases (2)-(6) with each sentence at its own step and length penalty."""
        d, k, n, eos = self.decode, self.k, len(self), self.model.specials.eos
        if d.no_repeat_ngram > 0:
            self._ban_repeated_ngrams(log_probs, d.no_repeat_ngram)
        c = min(2 * k, log_probs.shape[-1])
        row_scores, row_tokens = row_topk(log_probs, c)  # (n*k, c)
        candidates = (self.scores.view(n, k, 1) + row_scores.view(n, k, c)).view(n, k * c)
        top_scores, top_ids = candidates.topk(c, dim=1)  # (n, c)
        top_beams = top_ids // c
        top_tokens = row_tokens.view(n, k * c).gather(1, top_ids)
        is_eos = (top_tokens == eos) & torch.isfinite(top_scores)
        penalties = [length_penalty(step + 1, d.lenpen, d.length_norm) for step in steps]
        eos_rank_ok = torch.zeros_like(is_eos)
        eos_rank_ok[:, :k] = True
        new_finished = (is_eos & eos_rank_ok).nonzero().tolist()
        if new_finished:
            flat_scores, flat_beams = top_scores.tolist(), top_beams.tolist()
            for i, j in new_finished:
                lp = flat_scores[i][j]
                tokens = self._outputs(i * k + flat_beams[i][j], i, column)
                self.finished[i].append(Hypothesis(tokens, lp / penalties[i], lp))
        not_live = is_eos | ~torch.isfinite(top_scores)
        live_order = not_live.to(torch.uint8).argsort(dim=1, stable=True)[:, :k]
        live_scores = top_scores.gather(1, live_order).masked_fill(not_live.gather(1, live_order), NEG_INF)
        live_beams = top_beams.gather(1, live_order)
        live_tokens = top_tokens.gather(1, live_order)
        wanted, max_lens = max(k, d.nbest), self.max_lens.tolist()
        done = [
            sentence_done(self.finished[i], live, wanted, penalties[i], d.early_stopping) or steps[i] >= max_lens[i]
            for i, live in enumerate(live_scores[:, 0].tolist())
        ]
        for i in range(n):
            if done[i]:
                self.finished[i].sort(key=lambda h: -h.score)
                self.finished[i] = self.finished[i][: d.nbest]
        keep = torch.tensor([i for i in range(n) if not done[i]], dtype=torch.long, device=self.device)
        rows = (keep[:, None] * k + live_beams[keep]).reshape(-1)
        self.scores = live_scores[keep]
        return done, rows, live_tokens[keep].reshape(-1)

    def _ban_repeated_ngrams(self, log_probs: torch.Tensor, n: int) -> None:
        """search._ban_repeated_ngrams on each row's own outputs (the columns after its BOS)."""
        history = self.history
        N, L = history.shape
        starts = self.first.repeat_interleave(self.k) + 1  # each row's first output column
        if L < n:
            return
        windows = history.unfold(1, n, 1)  # (N, L-n+1, n)
        suffix = history[:, L - (n - 1) :] if n > 1 else history[:, :0]
        matches = (windows[:, :, : n - 1] == suffix[:, None, :]).all(dim=2)
        matches &= torch.arange(L - n + 1, device=history.device)[None, :] >= starts[:, None]  # whole outputs only
        matches &= (L - starts >= n)[:, None]  # a complete n-gram exists (search.py: output length >= n)
        rows, window_starts = matches.nonzero(as_tuple=True)
        log_probs[rows, windows[rows, window_starts, n - 1]] = NEG_INF

    def _keep(self, keep: list[int], rows: torch.Tensor, next_tokens: torch.Tensor, columns: int) -> None:
        """Sentences `keep` stay, their rows in the order `rows` (back-pointers); columns before the oldest one's
        BOS are dropped from the cache and the history."""
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        first = self.first[keep_t]
        drop = int(first[0])  # the oldest sentence's first column: no row reads the columns before it
        first = first - drop
        k, starts = self.k, first.tolist()
        bounds = sorted({round(len(keep) * g / COPY_GROUPS) for g in range(COPY_GROUPS + 1)})
        for buffer in self.buffers:
            for i in (0, 1):  # keys, values: gathered into the spare, which then takes their place
                source, target = buffer[i], buffer[i + 2]
                for a, b in zip(bounds, bounds[1:]):  # sentences a..b-1, the oldest first
                    c = starts[a]
                    out = target[a * k : b * k, :, c : columns - drop]
                    torch.index_select(source[:, :, drop + c : columns], 0, rows[a * k : b * k], out=out)
                buffer[i], buffer[i + 2] = target, source
        self.cache.length = columns - drop
        self.history = torch.cat([self.history[rows, drop:], next_tokens[:, None]], dim=1)
        self.tokens = next_tokens[:, None]
        self.first = first
        if len(keep) < len(self):
            self.max_lens = self.max_lens[keep_t]
            self.src_pad_mask = self.src_pad_mask[keep_t]
            for layer in self.cache.layers:
                layer.cross_k, layer.cross_v = layer.cross_k[keep_t], layer.cross_v[keep_t]
            self.tags = [self.tags[i] for i in keep]
            self.finished = [self.finished[i] for i in keep]
            self.log_prob_sums = [self.log_prob_sums[i] for i in keep]


def _pad_dim(x: torch.Tensor, dim: int, size: int, value) -> torch.Tensor:
    """x padded with `value` at the end of dimension `dim` to `size`."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
    return torch.nn.functional.pad(x, pad, value=value)
