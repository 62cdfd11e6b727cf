"""Continuous batching (mtcli.stream): a sentence that joins a running search at any step, beside sentences of other
ages that come and go, gets what search.py gives it alone: the same subwords and scores, for greedy and beam search
with every stopping and length setting."""

import random
from dataclasses import replace

import pytest
import torch
from test_search import VOCAB, reverse_model  # noqa: F401 - the fixture

from mtcli.config import DecodeConfig
from mtcli.search import beam_search, greedy_search, max_output_lengths
from mtcli.stream import Stream
from mtcli.tokenizer import EOS, PAD

pytestmark = pytest.mark.slow  # trains the fixture's model (a few seconds)

SETTINGS = {
    "greedy": dict(beam=1),
    "beam4": dict(beam=4, lenpen=0.6),
    "beam3 nbest 3, power, early stopping": dict(beam=3, nbest=3, lenpen=1.0, length_norm="power", early_stopping=True),
    "beam4 no-repeat 2, min_len 3": dict(beam=4, no_repeat_ngram=2, min_len=3),
    "beam1 no-repeat 1": dict(beam=1, no_repeat_ngram=1),
    "beam2 short limit": dict(beam=2, max_len_a=0.5, max_len_b=1),
}


def alone(model, ids: list[int], d: DecodeConfig):
    """search.py on one sentence, as Translator._search calls it."""
    src = torch.tensor([ids + [EOS]])
    max_lens = max_output_lengths(torch.tensor([len(ids)]), d.max_len_a, d.max_len_b, model.cfg.max_positions)
    args = (model, src, src == PAD, max_lens)
    if d.beam == 1 and not d.no_repeat_ngram:
        return greedy_search(*args, d.min_len)
    return beam_search(*args, d.beam, d.lenpen, d.min_len, d.nbest, d.no_repeat_ngram, d.length_norm, d.early_stopping)[
        0
    ]


@pytest.mark.parametrize("name", SETTINGS)
def test_a_sentence_joining_a_running_batch_gets_what_it_gets_alone(name, reverse_model):  # noqa: F811 - the fixture
    model, d = reverse_model, replace(DecodeConfig(), **SETTINGS[name])
    rng = random.Random(7)
    sentences = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(40)]
    stream = Stream(model, d, model.cfg.max_positions)
    results, todo = {}, list(range(len(sentences)))
    while todo or len(stream):
        if todo and rng.random() < 0.5:  # 0-3 newcomers at a random step, while others are half-way
            n = rng.randint(1, 3)
            joining, todo = todo[:n], todo[n:]
            stream.add([sentences[i] for i in joining], joining)
        for tag, hyps in stream.step():
            results[tag] = hyps
    assert sorted(results) == list(range(len(sentences)))
    for i, ids in enumerate(sentences):
        expected = alone(model, ids, d)
        assert [h.tokens for h in results[i]] == [h.tokens for h in expected], i
        assert [h.score for h in results[i]] == pytest.approx([h.score for h in expected], abs=1e-4)
    assert any(len(h[0].tokens) > 3 for h in results.values())  # real outputs, not all cut at once
    assert stream.cache.length == 0 and not stream.history.numel()  # all left: nothing kept


def test_the_cache_keeps_only_the_columns_live_sentences_read(reverse_model):  # noqa: F811 - the fixture
    model, d = reverse_model, replace(DecodeConfig(), beam=2)
    stream = Stream(model, d, model.cfg.max_positions)
    rng = random.Random(3)
    longest = 0
    for step in range(300):  # a server's lifetime: a newcomer every other step, for far more steps than positions
        if step % 2 == 0:
            stream.add([[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 10))]], [step])
        stream.step()
        longest = max(longest, stream.cache.length)
        assert stream.history.shape == (len(stream) * 2, stream.cache.length + 1)
    assert longest <= model.cfg.max_positions  # not the 300 steps the stream has run
