"""Lexically constrained beam search: every target term a sentence must contain (a glossary's, as subword ids)
appears in its output. Dynamic beam allocation (Post & Vilar 2018) on the same KV cache and phases as search.py's
beam search:

    each row tracks which terms it has written (met) and how far into one it is (the term, the position);
    (2) next-token log-probabilities; EOS is forbidden to a row with terms still to write, and a row that has only
        as many steps left as term tokens to write may take nothing but the next of them;
    (3) candidates: the best 2k continuations of each sentence (as beam search), plus, for every live row, the next
        token of the term it is writing, or the first token of each term it has not begun;
    (4) EOS candidates among the k best finish (only rows with every term written may take EOS);
    (5) the k live hypotheses are taken bank by bank, a bank being the number of term tokens written: the best of
        the fullest bank, then the best of the next, ..., round and round until k are taken. So hypotheses that
        have written more of their terms stay in the beam beside the best unconstrained ones, and the search does
        not end before some of them have written everything;
    (6)-(7) sentences done, cache and history reordered, as in beam search.

A sentence without terms has one bank, so its search is beam search's. With beam 1 the one slot goes to the best
candidate of the fullest bank only when it continues a term begun, when EOS (forbidden) was the model's choice, or
when the length limit forces it; otherwise to the best token: terms are written where the model leaves room.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mtcli.search import (
    NEG_INF,
    Hypothesis,
    ban_repeated_ngrams,
    length_penalty,
    row_topk,
    rows_at_limit,
    sentences_done,
    step_log_probs,
)


@dataclass(frozen=True)
class TermState:
    """Where one hypothesis stands with its sentence's terms."""

    met: frozenset = frozenset()  # indices of the terms written in full
    term: int = -1  # the term being written (-1: none)
    pos: int = 0  # tokens of it written so far

    def advance(self, token: int, terms: list[list[int]]) -> TermState:
        """The state after writing `token`: the term in progress goes on or is abandoned; a token that begins a term
        not yet written starts it (a one-token term is written at once)."""
        if self.term >= 0 and terms[self.term][self.pos] == token:
            if self.pos + 1 == len(terms[self.term]):
                return TermState(self.met | {self.term})
            return TermState(self.met, self.term, self.pos + 1)
        for i, term in enumerate(terms):
            if i not in self.met and term[0] == token:
                return TermState(self.met | {i}) if len(term) == 1 else TermState(self.met, i, 1)
        return TermState(self.met)

    def met_in_text(self, text: str, new_chars: int, term_texts: list[str]) -> TermState:
        """The state with every term not yet written that `text` now holds (within its last piece, `new_chars`
        long, and before it) counted as written."""
        state = self
        for i, term in enumerate(term_texts):
            if i not in state.met and term and term in text[-(len(term) + new_chars) :]:
                state = (
                    TermState(state.met | {i}) if state.term == i else TermState(state.met | {i}, state.term, state.pos)
                )
        return state

    def written(self, terms: list[list[int]]) -> int:
        """Term tokens written: the bank."""
        return sum(len(terms[i]) for i in self.met) + self.pos

    def needed(self, terms: list[list[int]]) -> int:
        """Tokens still to write: the rest of the term in progress and every term not begun."""
        rest = len(terms[self.term]) - self.pos if self.term >= 0 else 0
        return rest + sum(len(t) for i, t in enumerate(terms) if i not in self.met and i != self.term)

    def next_tokens(self, terms: list[list[int]]) -> list[int]:
        """Tokens that write more of the terms: the next of the term in progress, else the first of each not begun."""
        if self.term >= 0:
            return [terms[self.term][self.pos]]
        return list(dict.fromkeys(t[0] for i, t in enumerate(terms) if i not in self.met))

    def done(self, terms: list[list[int]]) -> bool:
        return len(self.met) == len(terms)


@torch.inference_mode()
def constrained_beam_search(
    model,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    max_lens: torch.Tensor,
    terms: list[list[list[int]]],
    beam_size: int,
    lenpen: float = 0.0,
    min_len: int = 1,
    nbest: int = 1,
    no_repeat_ngram: int = 0,
    length_norm: str = "gnmt",
    early_stopping: bool = False,
    piece_text: list[str] | None = None,
    memory: torch.Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Beam search in which each sentence's output contains every term of `terms[i]` (lists of target subword ids)
    that fits its length limit (terms are kept in order while their tokens fit). Returns the `nbest` best
    hypotheses per sentence, best first; see the module's description.

    `piece_text` (each target id's text, for languages written without spaces): a term also counts as written when
    the hypothesis's text holds it, whatever pieces wrote it. In Chinese a term is often inside a longer piece
    (吃新鲜的梨 is one piece of the toy vocabulary), and its own pieces would otherwise be written a second time."""
    B, k, device, eos = src.shape[0], beam_size, src.device, model.specials.eos
    limits = max_lens.tolist()
    terms = [_fitting(sentence, limit) for sentence, limit in zip(terms, limits)]
    # Finished hypotheses a sentence waits for: beam search's k, but a sentence with terms only nbest. Its hypotheses
    # can finish only once every term is written, so waiting for k of them kept it searching ~3x as many steps
    # (docs/benchmarks.md); it still ends only when no live hypothesis can beat them.
    wanted = [nbest if sentence else max(k, nbest) for sentence in terms]
    memory = model.encode(src, src_pad_mask) if memory is None else memory
    max_total = max(limits)
    cache = model.new_cache(B * k, max_total + 1, device, memory.dtype)
    sentences = list(range(B))  # sentence index of each batch entry still searching
    tokens = torch.full((B * k, 1), model.specials.bos, dtype=torch.long, device=device)
    history: list[list[int]] = [[] for _ in range(B * k)]
    states = [TermState() for _ in range(B * k)]
    scores = torch.full((B, k), NEG_INF, device=device)
    scores[:, 0] = 0.0
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    row_limits = np.repeat(np.array(limits), k)  # kept on the host, as beam_search keeps them
    term_texts = (
        [["".join(piece_text[t] for t in term) for term in sentence] for sentence in terms] if piece_text else []
    )
    texts = [""] * (B * k)  # each row's output text, with piece_text
    for step in range(max_total + 1):
        n = len(sentences)
        # (2) Log-probabilities with the terms' rules.
        at_limit = rows_at_limit(row_limits, step, device)
        log_probs = step_log_probs(model, tokens, memory, src_pad_mask, cache, step, at_limit, min_len)
        if no_repeat_ngram > 0 and step >= no_repeat_ngram:
            history_t = torch.tensor(history, device=device)
            ban_repeated_ngrams(log_probs, history_t, no_repeat_ngram, model.specials.pad)
        wants_eos = (log_probs.argmax(dim=1) == eos).tolist() if k == 1 else None
        _apply_term_rules(log_probs, states, [terms[s] for s in sentences for _ in range(k)], row_limits, step, eos)
        # (3) Candidates: the best 2k continuations of each sentence (as beam search) ...
        c = min(2 * k, log_probs.shape[-1])
        row_scores, row_tokens = row_topk(log_probs, c)
        best = (scores.view(n, k, 1) + row_scores.view(n, k, c)).view(n, k * c)
        top_scores, top_ids = best.topk(c, dim=1)
        top_beams = (top_ids // c).tolist()
        top_tokens = row_tokens.view(n, k * c).gather(1, top_ids).tolist()
        top_scores = top_scores.tolist()
        # ... and the term tokens of every live row, read in one gather
        flat_scores = scores.view(-1).tolist()
        term_rows = [
            (row, token)
            for row, state in enumerate(states)
            if flat_scores[row] > NEG_INF and terms[sentences[row // k]]
            for token in state.next_tokens(terms[sentences[row // k]])
        ]
        term_scores = []
        if term_rows:
            rows_t = torch.tensor([r for r, _ in term_rows], device=device)
            toks_t = torch.tensor([t for _, t in term_rows], device=device)
            term_scores = (scores.view(-1)[rows_t] + log_probs[rows_t, toks_t]).tolist()
        extra: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
        for (row, token), score in zip(term_rows, term_scores):
            extra[row // k].append((row % k, token, score))
        penalty = length_penalty(step + 1, lenpen, length_norm)
        picks: list[tuple[int, int, float]] = []  # (row, token, score), k per sentence
        best_live = []
        for i in range(n):
            sentence, sentence_terms = sentences[i], terms[sentences[i]]
            candidates: dict[tuple[int, int], float] = {}
            for score, beam, token in zip(top_scores[i], top_beams[i], top_tokens[i]):
                if score > NEG_INF:
                    candidates[(beam, token)] = score
            for beam, token, score in extra[i]:
                if score > NEG_INF:
                    candidates.setdefault((beam, token), score)
            ranked = sorted(candidates.items(), key=lambda item: -item[1])
            # (4) EOS candidates among the k best finish (only rows with every term written may take EOS).
            for (beam, token), score in ranked[:k]:
                if token == eos:
                    finished[sentence].append(Hypothesis(history[i * k + beam], score / penalty, score))
            live = [(beam, token, score) for (beam, token), score in ranked if token != eos]
            # (5) k live hypotheses, bank by bank.
            row_states = states[i * k : i * k + k]
            chosen = _allocate(live, row_states, k, sentence_terms, bool(wants_eos and wants_eos[i * k]))
            picks += [(i * k + beam, token, score) for beam, token, score in chosen]
            picks += [(i * k, eos, NEG_INF)] * (k - len(chosen))  # fewer live candidates than k: empty slots
            best_live.append(chosen[0][2] if chosen else NEG_INF)
        # (6) Which sentences are done.
        is_done = sentences_done(finished, sentences, best_live, wanted, penalty, early_stopping)
        if all(is_done) or step == max_total:
            for i, sentence in enumerate(sentences):  # never nothing: the best live hypothesis as far as it went
                if not finished[sentence] and best_live[i] > NEG_INF:
                    row, token, score = picks[i * k]
                    finished[sentence].append(Hypothesis(history[row] + [token], score / penalty, score))
            break
        # (7) Reorder cache, history and term states by back-pointers; sentences that are done leave the batch.
        keep = [i for i in range(n) if not is_done[i]]
        kept = [picks[i * k + j] for i in keep for j in range(k)]
        history = [history[row] + [token] for row, token, _ in kept]
        states = [states[row].advance(token, terms[sentences[row // k]]) for row, token, _ in kept]
        if piece_text:
            texts = [texts[row] + piece_text[token] for row, token, _ in kept]
            for j, (row, token, _) in enumerate(kept):
                sentence = sentences[row // k]
                states[j] = states[j].met_in_text(texts[j], len(piece_text[token]), term_texts[sentence])
        scores = torch.tensor([score for _, _, score in kept], device=device).view(-1, k)
        tokens = torch.tensor([token for _, token, _ in kept], device=device).view(-1, 1)
        rows = torch.tensor([row for row, _, _ in kept], device=device)
        if len(keep) < n:
            keep_t = torch.tensor(keep, device=device)
            sentences = [sentences[i] for i in keep]
            memory, src_pad_mask = memory[keep_t], src_pad_mask[keep_t]
            row_limits = row_limits.reshape(n, k)[keep].reshape(-1)
            cache.reorder(rows, keep_t)
        else:
            cache.reorder(rows)
    for hyps in finished:
        hyps.sort(key=lambda h: -h.score)
    return [hyps[:nbest] for hyps in finished]


def _fitting(terms: list[list[int]], limit: int) -> list[list[int]]:
    """The terms, in order, while their tokens together fit the output length limit (the search forces the rest of
    them in when the steps left are just enough, so they must fit)."""
    kept, used = [], 0
    for term in terms:
        if term and used + len(term) <= limit:
            kept.append(term)
            used += len(term)
    return kept


def _apply_term_rules(log_probs, states, row_terms, row_limits: np.ndarray, step: int, eos: int) -> None:
    """Beam phase (2), in place: EOS is forbidden to rows with terms still to write, and a row whose steps left are
    just enough for its term tokens may take only the next of them (with the model's score for it)."""
    no_eos, forced_rows, forced_tokens = [], [], []
    for row, (state, terms) in enumerate(zip(states, row_terms)):
        if not terms or state.done(terms):
            continue
        no_eos.append(row)
        if state.needed(terms) >= row_limits[row] - step:
            forced_rows.append(row)
            forced_tokens.append(state.next_tokens(terms)[0])
    if forced_rows:
        rows, toks = torch.tensor(forced_rows), torch.tensor(forced_tokens)
        kept = log_probs[rows, toks].nan_to_num(neginf=-1e9)  # at the limit only EOS was left finite
        log_probs[rows] = NEG_INF
        log_probs[rows, toks] = kept
    if no_eos:
        log_probs[no_eos, eos] = NEG_INF


def _allocate(live, row_states, k: int, terms, wants_eos: bool) -> list[tuple[int, int, float]]:
    """Beam phase (5): k of the live candidates (beam, token, score; best first), taken from the fullest bank (most
    term tokens written) down, the best of each bank in turn, round and round; returned best first. Beam 1: the best
    of the fullest bank when the row is writing a term or the model wanted to stop, else the best."""
    if not live:
        return []
    if not terms:
        return live[:k]
    banked: dict[int, list[tuple[int, int, float]]] = {}
    # a token in no term abandons the term in progress: its bank is what the row has written in full (the common case,
    # worked out without stepping the state)
    term_tokens = {token for term in terms for token in term}
    in_full = [state.written(terms) - state.pos for state in row_states]
    for beam, token, score in live:
        bank = row_states[beam].advance(token, terms).written(terms) if token in term_tokens else in_full[beam]
        banked.setdefault(bank, []).append((beam, token, score))
    order = sorted(banked, reverse=True)
    if k == 1:
        return [banked[order[0]][0]] if row_states[0].term >= 0 or wants_eos else [live[0]]
    chosen = []
    while len(chosen) < k and any(banked[b] for b in order):
        for bank in order:
            if banked[bank] and len(chosen) < k:
                chosen.append(banked[bank].pop(0))
    return sorted(chosen, key=lambda c: -c[2])
