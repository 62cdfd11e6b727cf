"""Lexically constrained beam search: every term is written (one-token, multi-token, two in a sentence, under a tight
length limit), a sentence without terms searches as beam search does, scores are the model's own (cached equals a
full recomputation), and the term states count what they should."""

import math

import pytest
import torch
from test_search import MockModel, src_batch

from mtcli.config import ModelConfig
from mtcli.constrained import TermState, constrained_beam_search
from mtcli.model import Transformer
from mtcli.search import beam_search, greedy_search
from mtcli.tokenizer import BOS, EOS

TABLE = {
    (): {4: 0.6, 5: 0.3, 6: 0.1},
    (4,): {EOS: 0.7, 5: 0.2, 7: 0.1},
    (5,): {EOS: 0.9, 4: 0.1},
    (4, 5): {EOS: 0.9, 6: 0.1},
}


def contains(tokens: list[int], term: list[int]) -> bool:
    return any(tokens[i : i + len(term)] == term for i in range(len(tokens) - len(term) + 1))


@pytest.mark.parametrize("beam", [1, 2, 4])
@pytest.mark.parametrize("terms", [[[7]], [[6, 7]], [[7], [5, 6]], [[8, 8, 7]]], ids=str)
def test_every_term_is_written_whatever_the_model_prefers(beam, terms):
    """The mock model wants [4] then EOS; 7 it gives 10% at most and 8 never (the default row ends at once)."""
    model = MockModel(TABLE, vocab=10)
    src, mask = src_batch([3])
    hyps = constrained_beam_search(model, src, mask, torch.tensor([8]), [terms], beam, nbest=1)
    best = hyps[0][0]
    assert all(contains(best.tokens, t) for t in terms), (best.tokens, terms)
    assert math.isfinite(best.score)


def test_terms_are_forced_in_when_the_length_limit_leaves_just_enough_room():
    model = MockModel(TABLE, vocab=10)
    src, mask = src_batch([3])
    for beam in (1, 3):
        best = constrained_beam_search(model, src, mask, torch.tensor([3]), [[[6, 7], [8]]], beam)[0][0]
        assert len(best.tokens) <= 3 and contains(best.tokens, [6, 7]) and contains(best.tokens, [8])
    # terms that cannot fit together: those that fit, in order, are kept
    best = constrained_beam_search(model, src, mask, torch.tensor([2]), [[[6, 7], [8]]], 2)[0][0]
    assert contains(best.tokens, [6, 7]) and len(best.tokens) <= 2


@pytest.mark.parametrize("beam", [1, 2, 3])
def test_a_sentence_without_terms_searches_as_beam_search_does(beam):
    model = MockModel(TABLE, vocab=10)
    src, mask = src_batch([3, 2])
    max_lens = torch.tensor([6, 6])
    plain = beam_search(model, src, mask, max_lens, beam, lenpen=0.6, nbest=beam)
    constrained = constrained_beam_search(model, src, mask, max_lens, [[], []], beam, lenpen=0.6, nbest=beam)
    assert [[h.tokens for h in s] for s in constrained] == [[h.tokens for h in s] for s in plain]
    if beam == 1:
        assert [s[0].tokens for s in constrained] == [h.tokens for h in greedy_search(model, src, mask, max_lens)]


def test_a_batch_mixing_sentences_with_and_without_terms():
    model = MockModel(TABLE, vocab=10)
    src, mask = src_batch([3, 3, 3])
    hyps = constrained_beam_search(model, src, mask, torch.tensor([6, 6, 6]), [[[7]], [], [[6], [8, 9]]], 3)
    assert contains(hyps[0][0].tokens, [7])
    assert hyps[1][0].tokens == beam_search(model, src[:1], mask[:1], torch.tensor([6]), 3)[0][0].tokens
    assert contains(hyps[2][0].tokens, [6]) and contains(hyps[2][0].tokens, [8, 9])


@torch.no_grad()
def test_scores_are_the_models_log_probabilities_of_the_output_computed_without_a_cache():
    """The cached, reordered search must score its output as the model does over the whole sequence at once."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(layers=2, d_model=32, heads=4, d_ff=64, dropout=0.0), 40, 40, True).eval()
    src = torch.randint(4, 40, (3, 7))
    src[:, -1] = EOS
    mask = torch.zeros_like(src, dtype=torch.bool)
    terms = [[[11, 12]], [[13], [14, 15, 16]], []]
    hyps = constrained_beam_search(model, src, mask, torch.tensor([10, 10, 10]), terms, 4, nbest=2)
    for i, sentence in enumerate(hyps):
        for hyp in sentence:
            assert all(contains(hyp.tokens, t) for t in terms[i])
            tgt = torch.tensor([[BOS, *hyp.tokens]])
            log_probs = torch.log_softmax(model(src[i : i + 1], mask[i : i + 1], tgt)[0], dim=-1)
            expected = sum(log_probs[t, tok].item() for t, tok in enumerate([*hyp.tokens, EOS]))
            assert hyp.log_prob == pytest.approx(expected, abs=1e-3)


def test_term_states_track_progress_abandon_and_restart():
    terms = [[5, 6, 7], [5, 8], [9]]
    state = TermState()
    assert state.next_tokens(terms) == [5, 9] and state.needed(terms) == 6
    state = state.advance(5, terms)  # begins the first term starting with 5
    assert (state.term, state.pos, state.written(terms)) == (0, 1, 1)
    state = state.advance(8, terms)  # abandons it; 8 begins nothing
    assert (state.term, state.met, state.written(terms)) == (-1, frozenset(), 0)
    for token in (9, 5, 6, 7):
        state = state.advance(token, terms)
    assert state.met == {0, 2} and not state.done(terms) and state.needed(terms) == 2
    state = state.advance(5, terms).advance(8, terms)
    assert state.done(terms) and state.written(terms) == 6
