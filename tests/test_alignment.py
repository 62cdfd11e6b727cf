"""Word alignments from the model itself: links carried from words to pieces and back, guided alignment's targets and
loss, the alignment heads' weights (cached decoding equal to the full pass), alignments of greedy and beam outputs
of a toy model trained with guided alignment, and HTML inline tags put back by them."""

from __future__ import annotations

import html
import json
import time
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from conftest import invoke, losses, train_toy, training_fixture

from mtcli.align import attention_links, piece_links, piece_words, source_piece_words, word_links
from mtcli.batching import collate
from mtcli.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from mtcli.loss import LossModel, guided_alignment_loss
from mtcli.model import Transformer
from mtcli.segment import join, split_html

# ---------------------------------------------------------------------------------------------------------------------
# Words and pieces


def test_pieces_are_mapped_to_the_words_they_spell():
    text = "A man's  blue shirt, 好吗?"
    pieces = ["▁A", "▁man", "'", "s", "▁bl", "ue", "▁shirt", ",", "▁", "好吗", "?"]
    expected = [[0], [1], [1], [1], [2], [2], [3], [4], [], [5, 6], [7]]
    assert piece_words(pieces, text) == expected
    # byte-fallback pieces count one character per UTF-8 character, at its first byte
    assert piece_words(["▁a", "<0xE4>", "<0xBD>", "<0xA0>", "b"], "a 你b") == [[0], [1], [1], [1], [2]]
    # more pieces than the text holds (a normalization that grew the text) never index past it
    assert piece_words(["▁fi", "x", "▁y"], "ﬁ") == [[0], [], []]
    assert source_piece_words(["▁>>", "de", "<<", "▁Hi"], "Hi", ">>de<<") == [[], [], [], [0]]


def test_word_links_become_piece_links_and_back():
    src_words, tgt_words = [[0], [1], [1], [2]], [[0], [0], [1, 2], []]
    pairs = piece_links([(0, 1), (1, 0), (1, 2)], src_words, tgt_words)
    assert pairs == [(0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert word_links(pairs + [(3, 3)], src_words, tgt_words) == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_links_are_read_from_attention_in_both_directions():
    attention = np.array(
        [  # target pieces x source pieces
            [0.8, 0.1, 0.1],
            [0.1, 0.6, 0.3],  # source piece 1 is attended most by target piece 2, not by this one
            [0.0, 0.7, 0.3],
            [0.2, 0.5, 0.3],
        ]
    )
    assert attention_links(attention) == [(0, 0), (1, 2)]  # each the other's best
    assert attention_links(attention, one_to_many=True) == [(0, 0), (1, 1), (1, 2), (1, 3)]
    assert attention_links(np.zeros((0, 3))) == []


def test_guided_alignment_targets_sum_to_one_per_aligned_target_and_link_eos():
    srcs, tgts = [[5, 6, 7], [5]], [[8, 9], [8, 9, 10]]
    links = [np.array([[0, 0], [1, 0], [2, 1]], np.uint16), np.array([[0, 2], [3, 0]], np.uint16)]  # (3, 0): gone
    batch = collate(srcs, tgts, links=links)
    B, T = batch.tgt_in.shape
    S = batch.src.shape[1]
    dense = torch.zeros(B * T * S).index_add_(0, batch.align_index, batch.align_weight).view(B, T, S)
    expected = torch.zeros(B, T, S)
    expected[0, 0, 0] = expected[0, 0, 1] = 0.5
    expected[0, 1, 2] = 1.0
    expected[0, 2, 3] = 1.0  # EOS -> EOS
    expected[1, 2, 0] = 1.0
    expected[1, 3, 1] = 1.0
    torch.testing.assert_close(dense, expected)


def test_guided_alignment_needs_the_alignments_in_the_data():
    with pytest.raises(ConfigError, match="data.alignments"):
        Config(train=TrainConfig(guided_alignment=0.1))
    with pytest.raises(ConfigError, match="sampling_alpha"):
        Config(data=DataConfig(alignments=True, sampling_alpha=0.1), train=TrainConfig(guided_alignment=0.1))
    with pytest.raises(ConfigError, match="model.alignment_layer"):
        ModelConfig(layers=2, alignment_layer=2)
    assert ModelConfig(layers=3).alignment_layer_index == 1  # the penultimate
    assert ModelConfig(layers=1).alignment_layer_index == 0  # the only one
    assert ModelConfig(layers=3, alignment_layer=-1).alignment_layer_index == 2


# ---------------------------------------------------------------------------------------------------------------------
# The alignment heads


def tiny_model(**model) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(layers=2, d_model=32, heads=4, d_ff=64, dropout=0.0, max_positions=64, **model)
    return Transformer(cfg, 40, 40, joint_vocab=True).eval()


def explicit_weights(model: Transformer, src, mask, tgt_in, heads: int) -> torch.Tensor:
    """softmax(QK^T / sqrt(D)) of the alignment layer's first heads, averaged, from a forward pre-hook's inputs."""
    layer = model.decoder[model.cfg.alignment_layer_index].cross_attn
    seen = {}
    hook = layer.register_forward_pre_hook(lambda mod, args: seen.setdefault("args", args))
    try:
        model.decode(tgt_in, model.encode(src, mask), mask)
    finally:
        hook.remove()
    x, memory = seen["args"][:2]
    d, H = x.shape[-1], model.cfg.heads
    q = layer.q(x).view(*x.shape[:2], H, d // H).transpose(1, 2)
    k = layer.kv(memory)[..., :d].view(*memory.shape[:2], H, d // H).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / (d // H) ** 0.5
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1)[:, :heads].mean(1)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_alignment_weights_are_the_layers_attention_and_cached_decoding_gives_the_same(norm):
    model = tiny_model(norm=norm, alignment_heads=2)
    batch = collate([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]])
    memory = model.encode(batch.src, batch.src_pad_mask)
    with torch.no_grad():
        full = model.decode_aligned(batch.tgt_in, memory, batch.src_pad_mask, None, 2)[1]
        alone = model.decode_aligned(batch.tgt_in, memory, batch.src_pad_mask, None, 2, stop_at_alignment=True)
        expected = explicit_weights(model, batch.src, batch.src_pad_mask, batch.tgt_in, 2)
        torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-4)
        assert alone[0] is None
        torch.testing.assert_close(alone[1], full)
        assert (full[1, :, 3:] == 0).all()  # padding gets no weight
        # one step at a time with the KV cache, two beams per sentence: each beam row equals the full pass
        beams = 2
        cache = model.new_cache(2 * beams, batch.tgt_in.shape[1], "cpu")
        steps = []
        tgt = batch.tgt_in.repeat_interleave(beams, 0)
        for t in range(tgt.shape[1]):
            steps.append(model.decode_aligned(tgt[:, t : t + 1], memory, batch.src_pad_mask, cache, 2)[1])
        cached = torch.cat(steps, dim=1).view(2, beams, *full.shape[1:])
        for beam in range(beams):
            torch.testing.assert_close(cached[:, beam], full, atol=1e-5, rtol=1e-4)


def test_the_guided_loss_is_added_with_its_weight_and_trains_the_heads():
    model = tiny_model()
    model.train()
    links = [np.array([[0, 1], [1, 0], [2, 2]], np.uint16), np.array([[0, 0]], np.uint16)]
    b = collate([[5, 6, 7], [9, 10]], [[11, 12, 13], [14]], links=links)
    args = (b.src, b.src_pad_mask, b.tgt_in, b.tgt_index, b.labels, b.align_index, b.align_weight)
    plain = LossModel(model, 0.1)(*args)
    guided = LossModel(model, 0.1, guided_alignment=0.5)(*args)
    memory = model.encode(b.src, b.src_pad_mask)
    weights = model.decode_aligned(b.tgt_in, memory, b.src_pad_mask, None, 1)[1]
    expected = guided_alignment_loss(weights, b.align_index, b.align_weight)
    assert float((guided - plain).detach()) == pytest.approx(0.5 * float(expected.detach()), rel=1e-4)
    # minimizing the guided loss alone moves the head's attention onto the linked source pieces
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        weights = model.decode_aligned(b.tgt_in, model.encode(b.src, b.src_pad_mask), b.src_pad_mask, None, 1)[1]
        loss = guided_alignment_loss(weights, b.align_index, b.align_weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    picked = weights[0, :3, :3].argmax(-1).tolist()
    assert picked == [1, 0, 2]


# ---------------------------------------------------------------------------------------------------------------------
# HTML: inline elements put back by word alignment


class WellFormed(HTMLParser):
    """Opened and closed inline tags must pair up in order."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ("br", "img", "wbr"):
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):  # <img/>: opens and closes nothing
        pass

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"


def well_formed(text: str) -> str:
    parser = WellFormed()
    parser.feed(text)
    parser.close()
    assert not parser.stack, f"unclosed: {parser.stack}"
    return text


def placed(document: str, translation: str, links: list[tuple[int, int]], lang: str = "de") -> str:
    """`document` (one sentence) put back around `translation` by `links`."""
    segments = split_html(document, "en")
    assert len(segments.pieces) == 1
    return well_formed(join(segments, [translation], lang, alignments=[links]))


def test_an_element_goes_around_the_words_aligned_to_its_own():
    assert placed("<p>I love <b>apples</b></p>", "Ich liebe Äpfel", [(0, 0), (1, 1), (2, 2)]) == (
        "<p>Ich liebe <b>Äpfel</b></p>"
    )
    # reordered: the element moves with its words; Chinese characters are words of their own
    out = placed(
        "<p>I <i>really</i> like <b>green tea</b></p>",
        "Ich mag grünen Tee wirklich",
        [(0, 0), (1, 4), (2, 1), (3, 2), (4, 3)],
    )
    assert out == "<p>Ich mag <b>grünen Tee</b> <i>wirklich</i></p>"
    assert placed("<p>I love <b>apples</b></p>", "我喜欢苹果", [(0, 0), (1, 1), (1, 2), (2, 3), (2, 4)], "zh") == (
        "<p>我喜欢<b>苹果</b></p>"
    )


def test_split_projections_widen_and_nesting_attributes_and_other_markup_survive():
    document = (
        '<!DOCTYPE html><!-- a comment --><p><img src="a.png" alt="&quot;"/>The <a href="/x?a=1&amp;b=&quot;2&quot;">'
        "<b>old</b> man</a> sleeps now</p><![CDATA[ raw ]]><script>if (a < b) {}</script>"
    )
    segments = split_html(document, "en")
    assert len(segments.pieces) == 1
    # The old man sleeps now -> Der Mann , der alt ist , schläft jetzt: "old man" -> words 1-4 (widened)
    links = [(0, 0), (1, 4), (2, 1), (3, 7), (4, 8)]
    out = join(segments, ["Der Mann, der alt ist, schläft jetzt"], "de", alignments=[links])
    well_formed(out)
    assert out.startswith('<!DOCTYPE html><!-- a comment --><p><img src="a.png" alt="&quot;"/>Der')
    assert out.endswith("</p><![CDATA[ raw ]]><script>if (a < b) {}</script>")
    assert '<a href="/x?a=1&amp;b=&quot;2&quot;">Mann, der <b>alt</b></a>' in out


def test_an_element_whose_words_vanish_keeps_its_relative_place():
    out = placed("<p>I love <b>apples</b> a lot</p>", "Ich liebe Äpfel sehr", [(0, 0), (1, 1), (3, 3), (4, 3)])
    assert "<b>" in out and "</b>" in out  # kept, not dropped
    assert html.unescape(out.replace("<b>", "").replace("</b>", "")) == "<p>Ich liebe Äpfel sehr</p>"


def test_escaping_and_hostile_markup_stay_bounded():
    out = placed("<p>Fish &amp; <b>chips</b></p>", "Fisch & Pommes", [(0, 0), (1, 1), (2, 2)])
    assert out == "<p>Fisch &amp; <b>Pommes</b></p>"
    started = time.monotonic()
    deep = "<p>" + "<b>" * 100_000 + "word" + "</b>" * 100_000 + "</p>"
    segments = split_html(deep, "en")
    out = join(segments, ["Wort"] * len(segments.pieces), "de", alignments=[[(0, 0)]] * len(segments.pieces))
    assert "Wort" in out and time.monotonic() - started < 30
    wide = '<p>I love <b title="' + "x" * 10_000_000 + '">apples</b></p>'
    out = placed(wide, "Ich liebe Äpfel", [(0, 0), (1, 1), (2, 2)])
    assert out.endswith(">Äpfel</b></p>") and len(out) > 10_000_000
    # thousands of sibling elements in one sentence: placing each looks only at the free stretches near it (the
    # stretch search was cubic in the siblings: 3,000 took 8 minutes)
    started = time.monotonic()
    many = split_html("<p>" + " ".join(f"<b>w{i}</b>" for i in range(3000)) + "</p>", "en")
    out = join(many, ["x " * 3000], "de", alignments=[[(i, i) for i in range(3000)]])
    assert out.count("<b>x</b>") == 3000 and time.monotonic() - started < 30
    unbalanced = split_html("<p>I <b>love apples</p>", "en")
    out = join(unbalanced, ["Ich liebe Äpfel"] * len(unbalanced.pieces), "de", alignments=[[(0, 0)]] * 9)
    assert "Ich liebe Äpfel" in out


# ---------------------------------------------------------------------------------------------------------------------
# A toy model trained with guided alignment


@training_fixture(scope="module")
def aligned_run(tmp_path_factory, toy_cache):
    """The toy config with guided alignment (the toy_run fixture's length)."""
    home = tmp_path_factory.mktemp("aligned")
    settings = {
        "train.max_updates": 300,
        "train.valid_every": 150,
        "train.keep_last": 1,
        "data.alignments": "true",
        "train.guided_alignment": 0.1,
    }
    return train_toy(home / "runs" / "toy", toy_cache, settings)


@pytest.mark.model
def test_guided_alignment_reaches_the_training_loss(aligned_run, toy_run):
    """The same recipe, data order and seed: the guided run's first update adds 0.1 x the alignment loss (at
    initialisation about log(source length), over 0.1 per token)."""
    guided, plain = losses(aligned_run), losses(toy_run)
    assert guided[0] > plain[0] + 0.1, (guided[0], plain[0])


@pytest.mark.model
def test_a_guided_model_aligns_its_own_greedy_and_beam_outputs(aligned_run):
    from mtcli.translate import Translator

    translator = Translator.from_run(aligned_run, device="cpu", precision="fp32")
    assert translator.guided_alignment
    lines = ["I love apples", "we eat fresh pears", "Do you like green tea?"]
    for beam in (1, 4):
        hyps = translator.translate_nbest(lines, beam=beam, nbest=min(beam, 2), alignments=True)
        for sentence in hyps:
            for h in sentence:
                target_words = len([w for w in h.text if not w.isspace()])  # Chinese: a word per character
                assert h.alignment and all(i < h.source_words and j < target_words for i, j in h.alignment)
        assert hyps[0][0].text == "我喜欢苹果"
        assert hyps[0][0].alignment == [(0, 0), (1, 1), (1, 2), (2, 3), (2, 4)]  # I-我 love-喜欢 apples-苹果
    plain = translator.translate_nbest(lines, beam=4)
    assert [h[0].text for h in plain] == [h[0].text for h in translator.translate_nbest(lines, beam=4, alignments=True)]


@pytest.mark.model
def test_translate_prints_alignments_and_puts_html_tags_back(aligned_run, tmp_path):
    out = invoke("translate", "--run", aligned_run, "--alignments", "I love apples").stdout
    assert out.splitlines()[-1] == "我喜欢苹果 ||| 0-0 1-1 1-2 2-3 2-4"
    out = invoke("translate", "--run", aligned_run, "--html", "<p>I love <b>apples</b></p>").stdout
    assert out.splitlines()[-1] == "<p>我喜欢<b>苹果</b></p>"
    document = tmp_path / "page.html"
    document.write_text('<!DOCTYPE html>\n<p>I <i>love</i> <a href="a?b=1&amp;c=2">apples</a></p>\n')
    invoke("translate", "--run", aligned_run, "--html", "--input", document, "--output", tmp_path / "out.html")
    out = (tmp_path / "out.html").read_text()
    assert out == '<!DOCTYPE html>\n<p>我<i>喜欢</i><a href="a?b=1&amp;c=2">苹果</a></p>\n'


@pytest.mark.model
def test_a_model_without_guided_alignment_falls_back_to_its_averaged_heads(toy_run, log):
    from mtcli.translate import Translator

    translator = Translator.from_run(toy_run, device="cpu", precision="fp32")
    assert not translator.guided_alignment
    hyps = translator.translate_nbest(["I love apples"], beam=1, alignments=True)
    assert hyps[0][0].alignment  # links, however rough
    translator.note_alignment_source()
    assert any("averaged cross-attention heads" in line for line in log)


@pytest.mark.system
def test_the_server_returns_alignments_and_places_html_tags_by_them(aligned_run):
    from faults_serve import Server

    srv = Server(aligned_run)
    try:
        code, _, body = srv.post("/v1/translate", {"texts": ["I love apples", "we eat pears"], "alignments": True})
        assert code == 200, body
        first = body["translations"][0]
        assert first["text"] == "我喜欢苹果" and first["alignment"] == "0-0 1-1 1-2 2-3 2-4"
        assert all(isinstance(t["alignment"], str) for t in body["translations"])
        code, _, body = srv.post(
            "/v1/translate", {"texts": ["I love apples"], "nbest": 2, "beam": 2, "alignments": True}
        )
        assert code == 200 and all("alignment" in h for h in body["translations"][0]["nbest"]), body
        code, _, body = srv.post("/v1/translate", {"texts": ["I love apples"]})
        assert code == 200 and "alignment" not in body["translations"][0]
        code, _, body = srv.post("/v1/translate", {"texts": ["<b>I</b>"], "format": "html", "alignments": True})
        assert code == 422 and "format text" in body["error"]
        code, _, body = srv.post("/v1/translate", {"texts": ["I love apples"], "alignments": "yes"})
        assert code == 400, body
        code, _, body = srv.post(
            "/translate", {"q": "<p>I love <b>apples</b></p>", "source": "en", "target": "zh", "format": "html"}
        )
        assert code == 200 and body["translatedText"] == "<p>我喜欢<b>苹果</b></p>", body
    finally:
        assert srv.stop() == 0


@pytest.mark.model
def test_the_ctranslate2_export_aligns_as_mtcli_does(aligned_run, tmp_path):
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    from mtcli.parity import CTranslate2Engine, EngineSettings
    from mtcli.translate import Translator

    out = tmp_path / "ct2"
    invoke("export", "--run", aligned_run, "--format", "ctranslate2", "--out", out, "--probe-lines", "40")
    row = json.loads((out / "parity.json").read_text())["alignments"]
    assert row["guided"] and row["heads"] == 1 and row["lines"] >= 40
    assert row["identical_links"] == row["links"] > 100  # float32: every link the same
    engine = CTranslate2Engine(out)
    settings = EngineSettings(beam=1, lenpen=0.0, min_len=1, max_len=100, no_repeat_ngram=0, early_stopping=False)
    lines = ["I love apples", "Do you like green tea?"]
    translator = Translator.from_run(aligned_run, device="cpu", precision="fp32")
    ours = [(h[0].text, h[0].alignment) for h in translator.translate_nbest(lines, beam=1, alignments=True)]
    assert engine.translate_aligned(lines, settings, 1) == ours
