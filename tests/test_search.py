"""Search properties: beam 1 equals greedy, beam never scores worse than greedy, batch independence, length limits,
n-best order, no-repeat-ngram, sampling; on a mock model with known scores and on a random Transformer."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import training_fixture
from torch import nn

from mtcli.cache import KVCache
from mtcli.config import ModelConfig
from mtcli.cpu_kernels import pack_linears
from mtcli.ensemble import Ensemble
from mtcli.model import Transformer
from mtcli.search import beam_search, greedy_search, length_penalty, max_output_lengths, sample
from mtcli.tokenizer import BOS, EOS, MTCLI_SPECIALS, PAD

VOCAB = 30


class MockModel(nn.Module):
    """Next-token log-probabilities are a fixed function of the prefix (a dict), so search results are known.

    The prefix is read back from the KV cache, where each step stores its input token: this also checks that the
    search reorders the cache with the right back-pointers."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], vocab: int = 8, default=None):
        super().__init__()
        self.table, self.vocab, self.default = table, vocab, default or {EOS: 1.0}
        self.cfg = SimpleNamespace(d_model=2, heads=1)
        self.specials = MTCLI_SPECIALS
        self.decoder = [None]
        self.dummy = nn.Parameter(torch.zeros(1))

    def encode(self, src, src_pad_mask):
        return torch.zeros(src.shape[0], src.shape[1], 2)

    def new_cache(self, rows, max_len, device, dtype=None):
        return KVCache.for_model(self, rows, max_len, device, dtype)

    def decode(self, tgt, memory, src_pad_mask, cache):
        pos = cache.length
        cache.layers[0].k[:, 0, pos, 0] = tgt[:, 0].float()
        cache.length += 1
        prefixes = cache.layers[0].k[:, 0, 1 : pos + 1, 0].long().tolist()
        logits = torch.full((tgt.shape[0], 1, self.vocab), -30.0)
        for row, prefix in enumerate(prefixes):
            for token, prob in self.table.get(tuple(prefix), self.default).items():
                logits[row, 0, token] = math.log(prob)
        return logits


def src_batch(lengths):
    S = max(lengths) + 1
    src = torch.full((len(lengths), S), PAD)
    for row, n in enumerate(lengths):
        src[row, :n] = 5
        src[row, n] = EOS
    return src, src == PAD


def test_length_penalty_values():
    assert length_penalty(1, 0.0) == 1.0
    assert length_penalty(1, 1.0) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx((12 / 6) ** 0.6)


def test_power_length_norm_is_length_to_the_penalty_and_favours_longer_outputs():
    """decode.length_norm power divides by length ** lenpen (CTranslate2, Transformers), GNMT by ((5 + length) / 6)
    ** lenpen. At lenpen 1.0: the empty output (log 0.4, length 1) beats [4] (log 0.31 * 0.99, length 2) under GNMT
    (-0.92 against -1.01), and loses under power (-0.92 against -0.59)."""
    assert length_penalty(3, 1.0, "power") == 3.0 and length_penalty(3, 0.0, "power") == 1.0
    assert length_penalty(torch.tensor([2.0, 4.0]), 0.5, "power").tolist() == pytest.approx([2**0.5, 2.0])
    model = MockModel({(): {EOS: 0.4, 4: 0.31, 5: 0.29}, (4,): {EOS: 0.99, 6: 0.01}})
    src, mask = src_batch([3])

    def best(norm):
        hyp = beam_search(model, src, mask, torch.tensor([5]), beam_size=3, lenpen=1.0, min_len=0, length_norm=norm)
        return hyp[0][0]

    assert best("gnmt").tokens == []
    power = best("power")
    assert power.tokens == [4] and power.score == pytest.approx(math.log(0.31 * 0.99) / 2, abs=1e-4)


def test_beam_finds_what_greedy_misses_on_known_scores():
    # Greedy takes 4 (0.6) and then faces a flat distribution; beam 2 also keeps 5 (0.4), which ends with 0.99.
    table = {
        (): {4: 0.6, 5: 0.4},
        (4,): {6: 0.2, 7: 0.2, EOS: 0.2, 4: 0.2, 5: 0.2},
        (5,): {EOS: 0.99, 6: 0.01},
        (4, 6): {EOS: 1.0},
        (4, 7): {EOS: 1.0},
        (4, 4): {EOS: 1.0},
        (4, 5): {EOS: 1.0},
    }
    model = MockModel(table)
    src, mask = src_batch([3])
    max_lens = torch.tensor([5])
    greedy = greedy_search(model, src, mask, max_lens)[0]
    beam = beam_search(model, src, mask, max_lens, beam_size=2, lenpen=0.0)[0][0]
    assert greedy.tokens in ([4, 6], [4, 7], [4], [4, 4], [4, 5])
    assert beam.tokens == [5]
    assert beam.score == pytest.approx(math.log(0.4 * 0.99), abs=1e-4)
    assert beam.score > greedy.score


def test_beam_search_reorders_the_cache_when_the_second_best_beam_overtakes():
    """After step 1 both surviving beams descend from the second-best first token (5), so the cache rows must be
    reordered by back-pointers: the model reads each row's prefix from its cache, and a search that left the rows in
    place would continue (4, 6), which the table ends at once, instead of (5, 6), which goes on to 8."""
    table = {
        (): {4: 0.5, 5: 0.4},
        (4,): {6: 0.01, 7: 0.01},
        (5,): {6: 0.9, 7: 0.09},
        (5, 6): {8: 0.9, EOS: 0.1},
        (5, 7): {8: 0.5, EOS: 0.5},
        (5, 6, 8): {EOS: 1.0},
        (5, 7, 8): {EOS: 1.0},
    }
    model = MockModel(table, vocab=10, default={EOS: 1.0})
    src, mask = src_batch([3])
    best = beam_search(model, src, mask, torch.tensor([6]), beam_size=2, lenpen=0.0)[0][0]
    assert best.tokens == [5, 6, 8]
    assert best.score == pytest.approx(math.log(0.4 / 0.9 * 0.9 / 0.99 * 0.9), abs=1e-4)  # log-softmax of the table


def test_beam_one_equals_greedy_on_known_scores():
    table = {(): {4: 0.6, 5: 0.4}, (4,): {EOS: 0.45, 6: 0.55}, (4, 6): {EOS: 0.3, 7: 0.7}, (4, 6, 7): {EOS: 1.0}}
    model = MockModel(table)
    src, mask = src_batch([3])
    greedy = greedy_search(model, src, mask, torch.tensor([6]))[0]
    for lenpen in (0.0, 0.6, 1.0):
        beam = beam_search(model, src, mask, torch.tensor([6]), beam_size=1, lenpen=lenpen)[0][0]
        assert beam.tokens == greedy.tokens


def test_nbest_is_sorted_and_distinct():
    table = {(): {4: 0.5, 5: 0.3, 6: 0.2}}
    model = MockModel(table)
    src, mask = src_batch([2])
    hyps = beam_search(model, src, mask, torch.tensor([4]), beam_size=3, nbest=3)[0]
    assert [h.tokens for h in hyps] == [[4], [5], [6]]
    assert hyps[0].score >= hyps[1].score >= hyps[2].score


def test_beam_waits_for_k_finished_hypotheses_so_a_length_penalty_can_prefer_a_longer_one():
    """Ending at the first finished hypothesis that beats the live ones (here: the empty output, log 0.5 against
    log 0.48) is too early under a length penalty: [4] then ends with log(0.48 * 0.99), which the penalty of its
    extra token lifts above the empty output."""
    table = {(): {EOS: 0.5, 4: 0.48, 5: 0.02}, (4,): {EOS: 0.99, 6: 0.01}}
    model = MockModel(table)
    src, mask = src_batch([3])
    best = beam_search(model, src, mask, torch.tensor([5]), beam_size=2, lenpen=2.0)[0][0]
    assert best.tokens == [4]
    assert best.score == pytest.approx(math.log(0.48 * 0.99) / length_penalty(2, 2.0), abs=1e-4)
    assert best.score > math.log(0.5) / length_penalty(1, 2.0)


def test_early_stopping_ends_at_k_finished_hypotheses_as_ctranslate2_does():
    """Beam 2, power, lenpen 2.0. Step 1 finishes the empty output (log 0.5); step 2 finishes [5] (log 0.3 * 0.9):
    two finished, so early stopping (CTranslate2's rule) ends there with [5], although the live [4, 6] (log 0.2 * 0.9,
    length 3 with EOS next) can still beat it: the patient rule waits and takes [4, 6] (log 0.2 * 0.9 * 0.99 / 9)."""
    table = {
        (): {EOS: 0.5, 5: 0.3, 4: 0.2},
        (5,): {EOS: 0.9, 7: 0.1},
        (4,): {6: 0.9, EOS: 0.1},
        (4, 6): {EOS: 0.99, 7: 0.01},
        (5, 7): {EOS: 1.0},
    }
    model = MockModel(table)
    src, mask = src_batch([3])

    def best(early, lenpen=2.0):
        hyps = beam_search(
            model, src, mask, torch.tensor([5]), 2, lenpen, min_len=0, length_norm="power", early_stopping=early
        )
        return hyps[0][0].tokens

    assert best(True) == [5] and best(False) == [4, 6]
    assert best(True, 0.0) == best(False, 0.0) == []  # without a length penalty both rules agree


def test_max_length_is_respected_and_forces_eos():
    # The model never wants to stop; the limit makes it.
    never_stop = {4: 0.7, 5: 0.2999, EOS: 0.0001}
    model = MockModel({}, default=never_stop)
    src, mask = src_batch([3, 3])
    max_lens = torch.tensor([2, 4])
    assert [h.tokens for h in greedy_search(model, src, mask, max_lens)] == [[4, 4], [4, 4, 4, 4]]
    beams = beam_search(model, src, mask, max_lens, beam_size=2, nbest=2)
    assert [hyps[0].tokens for hyps in beams] == [[4, 4], [4, 4, 4, 4]]
    assert all(len(h.tokens) <= int(m) for hyps, m in zip(beams, max_lens) for h in hyps)


def test_max_output_lengths():
    lens = max_output_lengths(torch.tensor([0, 10, 500]), a=1.5, b=5, max_positions=256)
    assert lens.tolist() == [5, 20, 255]


@training_fixture(scope="module")
def reverse_model():
    """A tiny Transformer trained for a few seconds to reverse digit strings: it ends its outputs with EOS at
    varied lengths, and is unsure enough that beam search and greedy search can differ (a random model collapses
    into repeating one token until the length limit)."""
    torch.manual_seed(0)
    cfg = ModelConfig(layers=1, d_model=32, heads=4, d_ff=64, norm="pre", max_positions=64, dropout=0.0)
    model = Transformer(cfg, VOCAB, VOCAB, joint_vocab=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(150):
        lengths = torch.randint(1, 9, (32,), generator=g).tolist()
        src, mask = random_sources(lengths, generator=g)
        tgt_in = torch.full((32, 10), PAD)
        tgt_out = torch.full((32, 10), PAD)
        for row, n in enumerate(lengths):
            rev = src[row, :n].flip(0)
            tgt_in[row, 0], tgt_in[row, 1 : n + 1] = BOS, rev
            tgt_out[row, :n], tgt_out[row, n] = rev, EOS
        logits = model(src, mask, tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def random_sources(lengths, seed=3, generator=None):
    g = generator or torch.Generator().manual_seed(seed)
    S = max(lengths) + 1
    src = torch.full((len(lengths), S), PAD)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(4, VOCAB, (n,), generator=g)
        src[row, n] = EOS
    return src, src == PAD


@pytest.mark.model
@pytest.mark.parametrize("lenpen", [0.0, 0.6])
def test_beam_one_equals_greedy_on_a_transformer(lenpen, reverse_model):
    model = reverse_model
    src, mask = random_sources([5, 9, 2, 7])
    max_lens = max_output_lengths(torch.tensor([5, 9, 2, 7]), 2.0, 5, 64)
    greedy = greedy_search(model, src, mask, max_lens)
    beam = beam_search(model, src, mask, max_lens, beam_size=1, lenpen=lenpen)
    assert [g.tokens for g in greedy] == [b[0].tokens for b in beam]
    assert any(len(g.tokens) < int(m) for g, m in zip(greedy, max_lens))  # some end by EOS, not only the limit


@pytest.mark.model
def test_beam_is_never_worse_than_greedy_under_the_same_scoring(reverse_model):
    model = reverse_model
    lengths = [3, 6, 8, 4, 5, 7, 8, 8, 2, 6, 7, 5]
    src, mask = random_sources(lengths, seed=9)
    max_lens = max_output_lengths(torch.tensor(lengths), 2.0, 5, 64)
    lenpen = 0.6
    greedy = greedy_search(model, src, mask, max_lens)
    beam = beam_search(model, src, mask, max_lens, beam_size=5, lenpen=lenpen)
    for g, b in zip(greedy, beam):
        greedy_score = g.log_prob / length_penalty(len(g.tokens) + 1, lenpen)
        assert b[0].score >= greedy_score - 1e-4


@pytest.mark.system
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_a_sentence_result_does_not_depend_on_its_batch(search, reverse_model):
    """What the README says of fp32 translation (and so of the server's batches): the same subwords alone and in a
    batch, scores equal to float rounding; with the linear layers packed for oneDNN, as translation runs them."""
    model = pack_linears(copy.deepcopy(reverse_model))
    lengths = [4, 11, 2, 7, 9]
    src, mask = random_sources(lengths, seed=5)
    max_lens = max_output_lengths(torch.tensor(lengths), 2.0, 5, 64)

    def run(rows):
        s = src[rows][:, : int((~mask[rows]).sum(1).max())]
        if search == "greedy":
            return [(h.tokens, h.score) for h in greedy_search(model, s, s == PAD, max_lens[rows])]
        found = beam_search(model, s, s == PAD, max_lens[rows], beam_size=4, lenpen=0.6)
        return [(hyps[0].tokens, hyps[0].score) for hyps in found]

    together = run(list(range(5)))
    alone = [run([i])[0] for i in range(5)]
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
    assert [score for _, score in together] == pytest.approx([score for _, score in alone], abs=1e-4)


def full_log_prob(members, src, mask, tokens: list[int]) -> float:
    """log P(tokens + EOS) under the mean of the members' probabilities, each member decoding the whole prefix at
    once without a cache (the reference an ensemble's cached, step-by-step search must agree with)."""
    tgt_in = torch.tensor([[BOS, *tokens]])
    probs = torch.stack([m(src, mask, tgt_in)[0].float().softmax(-1) for m in members]).mean(0)  # (T, V)
    return sum(math.log(probs[t, token]) for t, token in enumerate([*tokens, EOS]))


@pytest.mark.model
def test_an_ensemble_scores_with_the_mean_probability_of_members_of_different_sizes(reverse_model):
    """Greedy and beam search over an ensemble of two Transformers of different width and depth: each hypothesis's
    log-probability is that of the members' averaged probabilities recomputed without a cache, for sentences of
    several lengths (they leave the batch at different steps, so the members' memories and caches are cut down)."""
    torch.manual_seed(5)
    cfg = ModelConfig(layers=2, d_model=48, heads=2, d_ff=96, norm="post", max_positions=64, dropout=0.0)
    other = Transformer(cfg, VOCAB, VOCAB, joint_vocab=True).eval()
    members = [reverse_model, other]
    ensemble = Ensemble(members)
    lengths = [4, 9, 2, 6]
    src, mask = random_sources(lengths, seed=7)
    max_lens = max_output_lengths(torch.tensor(lengths), 1.5, 3, 64)
    greedy = greedy_search(ensemble, src, mask, max_lens)
    beams = beam_search(ensemble, src, mask, max_lens, beam_size=3, nbest=3)
    with torch.no_grad():
        for i, n in enumerate(lengths):
            s, m = src[i : i + 1, : n + 1], mask[i : i + 1, : n + 1]
            for h in [greedy[i], *beams[i]]:
                assert h.log_prob == pytest.approx(full_log_prob(members, s, m, h.tokens), abs=1e-4)
            assert beams[i][0].log_prob >= greedy[i].log_prob - 1e-4  # lenpen 0: beam scores are log-probabilities
    assert len({len(h.tokens) for h in greedy}) > 1


@pytest.mark.model
def test_an_ensemble_of_one_model_translates_as_the_model(reverse_model):
    lengths = [5, 8, 3]
    src, mask = random_sources(lengths, seed=11)
    max_lens = max_output_lengths(torch.tensor(lengths), 2.0, 5, 64)

    def best(model):
        return [hyps[0] for hyps in beam_search(model, src, mask, max_lens, beam_size=4, lenpen=0.6)]

    alone = best(reverse_model)
    for ensemble in (Ensemble([reverse_model]), Ensemble([reverse_model, reverse_model])):
        found = best(ensemble)
        assert [h.tokens for h in found] == [h.tokens for h in alone]
        assert [h.score for h in found] == pytest.approx([h.score for h in alone], abs=1e-5)


def test_min_len_blocks_early_eos():
    table = {(): {EOS: 0.9, 4: 0.1}, (4,): {EOS: 0.9, 5: 0.1}, (4, 5): {EOS: 1.0}}
    model = MockModel(table)
    src, mask = src_batch([3])
    assert greedy_search(model, src, mask, torch.tensor([5]), min_len=2)[0].tokens == [4, 5]
    assert beam_search(model, src, mask, torch.tensor([5]), beam_size=2, min_len=2)[0][0].tokens == [4, 5]


def test_search_never_returns_an_empty_output_by_default():
    # A model that puts 0.99 on EOS at the first step: every search still produces a token first, as CTranslate2 and
    # fairseq do (an implicit minimum length of 1), unless min_len=0 is asked for.
    table = {(): {EOS: 0.99, 4: 0.006, 5: 0.004}, (4,): {EOS: 1.0}, (5,): {EOS: 1.0}}
    model = MockModel(table)
    src, mask = src_batch([3, 2])
    max_lens = torch.tensor([5, 5])
    assert [h.tokens for h in greedy_search(model, src, mask, max_lens)] == [[4], [4]]
    for lenpen in (0.0, 1.0):
        found = beam_search(model, src, mask, max_lens, beam_size=3, lenpen=lenpen, nbest=2)
        assert [[h.tokens for h in hyps] for hyps in found] == [[[4], [5]]] * 2
    drawn = sample(model, src, mask, max_lens, generator=torch.Generator().manual_seed(0))
    assert all(len(h.tokens) >= 1 for h in drawn)
    # min_len=0 lets the model's preference through
    assert [h.tokens for h in greedy_search(model, src, mask, max_lens, min_len=0)] == [[], []]
    assert beam_search(model, src, mask, max_lens, beam_size=3, min_len=0)[0][0].tokens == []


def test_old_checkpoints_read_as_they_behaved():
    # Checkpoints written before decode.min_len defaulted to 1 stored min_len 0 (the old default): read as 1. Before
    # data.clean existed no filter ran: read as all off, so such a run resumes on the data it was trained on.
    import json

    from mtcli.checkpoint import checkpoint_config

    config = json.dumps({"data": {"dataset": "toy"}, "decode": {"min_len": 0}})
    old = checkpoint_config({"config": config})
    assert old.decode.min_len == 1
    assert not (old.data.clean.duplicates or old.data.clean.copies or old.data.clean.max_repeat)
    new = checkpoint_config({"config": config, "config_version": "3"})
    assert new.decode.min_len == 0 and new.data.clean.duplicates


def test_no_repeat_ngram_blocks_repeats():
    # The model wants to repeat "4 5" forever.
    table = {(): {4: 0.9, 6: 0.1}}
    prefix = ()
    for i in range(10):
        token = 4 if i % 2 == 0 else 5
        table[prefix] = {token: 0.8, 6: 0.1, EOS: 0.1}
        prefix = prefix + (token,)
    table[prefix] = {EOS: 1.0}
    model = MockModel(table)
    src, mask = src_batch([3])
    free = beam_search(model, src, mask, torch.tensor([12]), beam_size=2)[0][0].tokens
    blocked = beam_search(model, src, mask, torch.tensor([12]), beam_size=2, no_repeat_ngram=2)[0][0].tokens
    assert free == [4, 5] * 5
    bigrams = list(zip(blocked, blocked[1:]))
    assert len(bigrams) == len(set(bigrams))
    assert free != blocked


@pytest.mark.model
def test_sampling_top_k_one_is_greedy_and_respects_max_length(reverse_model):
    model = reverse_model
    lengths = [5, 3, 8]
    src, mask = random_sources(lengths, seed=2)
    max_lens = max_output_lengths(torch.tensor(lengths), 1.0, 2, 64)
    greedy = greedy_search(model, src, mask, max_lens)
    one = sample(model, src, mask, max_lens, top_k=1, generator=torch.Generator().manual_seed(0))
    assert [h.tokens for h in one] == [h.tokens for h in greedy]
    free = sample(model, src, mask, max_lens, temperature=1.5, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert all(len(h.tokens) <= int(m) for h, m in zip(free, max_lens))
    assert all(BOS not in h.tokens and PAD not in h.tokens and EOS not in h.tokens for h in free)


@pytest.mark.parametrize(("rows", "vocab", "c"), [(7, 8000, 10), (320, 8003, 10), (5, 2000, 2), (3, 100, 4)])
def test_row_topk_equals_torch_topk(rows, vocab, c):
    from mtcli.search import row_topk

    g = torch.Generator().manual_seed(rows)
    scores = torch.randn(rows, vocab, generator=g)  # continuous values: no ties, so the order is unique
    scores[0, :] = float("-inf")  # a row at its length limit: only EOS is finite
    scores[0, EOS] = -0.5
    values, tokens = row_topk(scores, c)
    expected_values, expected_tokens = scores.topk(c, dim=1)
    assert torch.equal(values, expected_values)
    assert torch.equal(tokens[1:], expected_tokens[1:]) and tokens[0, 0] == EOS
    assert torch.equal(scores.gather(1, tokens), values)
