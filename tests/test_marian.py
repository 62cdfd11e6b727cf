"""Importing MarianMT (opus-mt) models. No Hub here: tiny MarianMT models are built with transformers (random weights,
swish, a non-zero final_logits_bias, a vocab.json whose ids are a permutation of SentencePiece's), saved with
save_pretrained and imported; mtcli must compute what Transformers computes: logits, greedy and beam search, the
tokenizer; export it back unchanged; fine-tune it with exact resume; refuse what it cannot hold, in one line."""

import json
import pickle
import random
import re
from pathlib import Path

import pytest
import torch
from conftest import WORDS_DE, WORDS_EN, invoke, losses, tiny_pairs
from typer.testing import CliRunner

from mtcli.checkpoint import best_checkpoint, list_checkpoints, load_model
from mtcli.translate import Translator

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers", reason="the export extra (transformers) is not installed")


def _spm(lines, path, size):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(path), vocab_size=size, minloglevel=2, hard_vocab_limit=False
    )
    return spm.SentencePieceProcessor(model_file=f"{path}.model")


def _vocab(pieces, rng, size: int = 0) -> dict[str, int]:
    """MarianMT's layout: </s> 0, <unk> 1, the pieces in an order unlike SentencePiece's, unused entries up to
    `size`, <pad> last (the pad id, which both embeddings take as padding_idx, must fit each vocabulary)."""
    pieces = [p for p in pieces if p not in ("<unk>", "<s>", "</s>")]
    rng.shuffle(pieces)
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    while len(vocab) < size - 1:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def build_marian(folder, separate: bool, seed: int = 0):
    """A tiny MarianMT model and tokenizer saved in `folder`, shaped like opus-mt-en-de (post-norm, swish, scaled
    embeddings, sinusoids, output bias, pad = decoder start = last id, eos 0)."""
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    pairs = tiny_pairs(400, seed)
    src_spm = _spm([s for s, _ in pairs], folder / "src", 60)
    tgt_spm = _spm([t for _, t in pairs], folder / "tgt", 60)
    src_pieces = [src_spm.id_to_piece(i) for i in range(src_spm.get_piece_size())]
    tgt_pieces = [tgt_spm.id_to_piece(i) for i in range(tgt_spm.get_piece_size())]
    (folder / "src.model").rename(folder / "source.spm")
    (folder / "tgt.model").rename(folder / "target.spm")
    if separate:
        size = max(len(src_pieces), len(tgt_pieces)) + 8
        src_vocab, tgt_vocab = _vocab(src_pieces, rng, size), _vocab(tgt_pieces, rng, size)
        (folder / "target_vocab.json").write_text(json.dumps(tgt_vocab))
    else:
        src_vocab = tgt_vocab = _vocab(src_pieces + tgt_pieces, rng)
    (folder / "vocab.json").write_text(json.dumps(src_vocab))
    pad = len(tgt_vocab) - 1
    config = transformers.MarianConfig(
        vocab_size=len(src_vocab),
        decoder_vocab_size=len(tgt_vocab),
        share_encoder_decoder_embeddings=not separate,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=64,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=0,
        init_std=0.3,  # peaked distributions: search decisions are not float ties
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, 0] += 8.0  # EOS likely enough that outputs end before the length limit
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=pad, eos_token_id=0, pad_token_id=pad, bad_words_ids=[[pad]], num_beams=4
    )
    model.save_pretrained(folder)
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(folder / "source.spm"),
        target_spm=str(folder / "target.spm"),
        vocab=str(folder / "vocab.json"),
        target_vocab_file=str(folder / "target_vocab.json") if separate else None,
        separate_vocabs=separate,
        source_lang="en",
        target_lang="de",
    )
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module", params=["joint", "separate"])
def imported(request, tmp_path_factory):
    home = tmp_path_factory.mktemp(f"marian-{request.param}")
    model, tokenizer = build_marian(home / "hf", separate=request.param == "separate")
    invoke("import", "--hf", home / "hf", "--out", home / "run")
    return home, model, tokenizer


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS_EN, k=rng.randint(1, 9))) for _ in range(n)]


def test_logits_equal_transformers_on_a_padded_batch(imported):
    home, hf_model, hf_tokenizer = imported
    model, _, tokenizer = load_model(best_checkpoint(home / "run"))
    lines = sentences(6, 1)
    batch = hf_tokenizer(lines, return_tensors="pt", padding=True)
    targets = hf_tokenizer(text_target=[" ".join(random.Random(i).choices(WORDS_DE, k=i + 1)) for i in range(6)])
    T = max(len(t) for t in targets["input_ids"])
    pad = hf_model.config.pad_token_id
    decoder_in = torch.full((6, T), pad)
    for row, ids in enumerate(targets["input_ids"]):
        decoder_in[row, 1 : len(ids)] = torch.tensor(ids[:-1])  # decoder start, then the target without EOS
    # float64 shows the computation is the same (1e-5 is far above its rounding); float32 differs by the order of
    # its sums (fused q/k/v, the permuted model dimension), a few 1e-5 at logits of size ~10
    for dtype, tolerance in ((torch.float64, 1e-5), (torch.float32, 1e-4)):
        with torch.inference_mode():
            theirs = hf_model.to(dtype)(**batch, decoder_input_ids=decoder_in).logits
            ours = model.to(dtype)(batch["input_ids"], batch["attention_mask"] == 0, decoder_in)
        for row, ids in enumerate(targets["input_ids"]):  # the real positions: after them, padding inputs differ
            torch.testing.assert_close(ours[row, : len(ids)], theirs[row, : len(ids)], atol=tolerance, rtol=0)
    assert model.cfg.activation == "swish" and model.output_bias.abs().sum() > 0
    assert model.specials.pad == model.specials.bos == pad and model.specials.eos == 0


def test_tokenizer_round_trips_as_marian_tokenizer(imported):
    home, _, hf_tokenizer = imported
    tokenizer = Translator.from_run(home / "run", device="cpu", precision="fp32").tokenizer
    lines = sentences(20, 2) + ["Katze zzz?", ""]
    assert [ids + [0] for ids in tokenizer.encode_src(lines)] == hf_tokenizer(lines)["input_ids"]
    targets = [" ".join(random.Random(i).choices(WORDS_DE, k=5)) for i in range(10)]
    target_ids = hf_tokenizer(text_target=targets)["input_ids"]
    assert [ids + [0] for ids in tokenizer.encode_tgt(targets)] == target_ids
    assert tokenizer.decode_tgt(target_ids) == hf_tokenizer.batch_decode(target_ids, skip_special_tokens=True)


def test_greedy_and_beam_equal_transformers_generate(imported):
    """Every sentence whose search ends with EOS. One that reaches the length limit is left out of the beam check:
    there mtcli ends hypotheses with a scored EOS and Transformers cuts them without one, so their ranks differ."""
    home, hf_model, hf_tokenizer = imported
    translator = Translator.from_run(home / "run", device="cpu", precision="fp32")
    lines = sentences(30, 3)
    limits = dict(max_len_a=0.0, max_len_b=20)  # Transformers has no limit relative to the source length
    pad = hf_model.config.pad_token_id
    with torch.inference_mode():
        batch = hf_tokenizer(lines, return_tensors="pt", padding=True)
        for beam in (1, 4):
            generated = hf_model.generate(
                **batch, num_beams=beam, do_sample=False, max_new_tokens=20, min_new_tokens=1, length_penalty=0.0
            )
            ended = [0 in row[1:].tolist() for row in generated]
            theirs = [[t for t in row[1:].tolist() if t not in (0, pad)] for row in generated]
            texts = hf_tokenizer.batch_decode(generated, skip_special_tokens=True)
            ours = translator.translate_nbest(lines, beam=beam, lenpen=0.0, **limits)
            assert sum(ended) >= 20, f"beam {beam}: only {sum(ended)} of 30 outputs end before the limit"
            for i in range(len(lines)):
                if ended[i] or beam == 1:  # greedy decides token by token: equal even at the limit
                    assert ours[i][0].tokens == theirs[i], f"beam {beam}, sentence {i}"
                    assert ours[i][0].text == texts[i]


def test_the_import_searches_as_generate_with_its_generation_config_and_reports_parity(imported):
    """The run's own decode settings are the model's generation config (num_beams 4, Transformers' default
    length_penalty 1.0 as decode.length_norm power, early_stopping false): `generate` without search arguments and
    `mtcli translate` with none give the same outputs (at one length limit); the import wrote its parity report."""
    home, hf_model, hf_tokenizer = imported
    translator = Translator.from_run(home / "run", device="cpu", precision="fp32")
    decode = translator.config.decode
    assert (decode.beam, decode.lenpen, decode.length_norm, decode.early_stopping) == (4, 1.0, "power", False)
    lines = sentences(30, 5)
    with torch.inference_mode():
        batch = hf_tokenizer(lines, return_tensors="pt", padding=True)
        generated = hf_model.generate(**batch, max_new_tokens=20, min_new_tokens=1)
    texts = hf_tokenizer.batch_decode(generated, skip_special_tokens=True)
    ours = translator.translate(lines, max_len_a=0.0, max_len_b=20)
    ended = [0 in row[1:].tolist() for row in generated]
    assert sum(ended) >= 20 and [a for a, e in zip(ours, ended) if e] == [b for b, e in zip(texts, ended) if e]
    report = json.loads((home / "run" / "parity.json").read_text())
    assert report["engine"] == "hf" and report["failures"] == [] and report["probe"].startswith("no valid split")
    assert [r["identical_rate"] for r in report["rows"]] == [1.0, 1.0]


def test_eval_takes_a_checkpoint_with_another_run_of_its_vocabulary_and_refuses_another(imported, tmp_path):
    """`eval --run A --checkpoint B` compares the tokenizers themselves: an imported run (vocab.json, one
    SentencePiece model per side) of the same vocabulary is taken, one whose vocabulary differs is refused."""
    import shutil

    from mtcli.cli import app
    from mtcli.errors import MtcliError

    home, _, _ = imported
    checkpoint = best_checkpoint(home / "run")
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(home / "run", same)
    shutil.copytree(home / "run", other)
    vocab = json.loads((other / "vocab.json").read_text(encoding="utf-8"))
    pieces = sorted(vocab, key=vocab.get)
    vocab[pieces[-1]], vocab[pieces[-2]] = vocab[pieces[-2]], vocab[pieces[-1]]  # two ids swapped
    (other / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    text = tmp_path / "text.en"
    text.write_text("the cat sees a dog\na man runs\n", encoding="utf-8")
    files = ["--src", text, "--ref", text, "--metrics", "bleu", "--json"]
    result = json.loads(invoke("eval", "--run", same, "--checkpoint", checkpoint, *files).stdout)
    assert result["checkpoint"] == str(checkpoint)
    with pytest.raises(MtcliError, match="another vocabulary"):
        CliRunner().invoke(app, ["eval", "--run", str(other), "--checkpoint", str(checkpoint), *map(str, files)],
                           catch_exceptions=False)  # fmt: skip


def test_export_back_to_transformers_and_ctranslate2(imported, tmp_path, monkeypatch):
    home, hf_model, hf_tokenizer = imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    invoke("export", "--run", home / "run", "--format", "hf", "--out", tmp_path / "hf")
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    original = hf_model.state_dict()
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, original[name], atol=1e-6, rtol=0, msg=name)
    lines = sentences(10, 4)
    assert (
        transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(lines)["input_ids"]
        == hf_tokenizer(lines)["input_ids"]
    )
    ctranslate2 = pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    invoke("export", "--run", home / "run", "--format", "ctranslate2", "--out", tmp_path / "ct2")
    translator = Translator.from_run(home / "run", device="cpu", precision="fp32")
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    pieces = [translator.tokenizer.src_pieces(ids) for ids in translator.tokenizer.encode_src(lines)]
    found = engine.translate_batch(
        pieces, beam_size=4, length_penalty=0.0, max_decoding_length=20, min_decoding_length=1
    )
    ours = translator.translate_nbest(lines, beam=4, lenpen=0.0, max_len_a=0.0, max_len_b=20)
    assert [r.hypotheses[0] for r in found] == [translator.tokenizer.tgt_pieces(h[0].tokens) for h in ours]


def test_fine_tuning_keeps_the_vocabulary_improves_and_resumes_exactly(tmp_path, tiny_corpus):
    build_marian(tmp_path / "hf", separate=False, seed=5)
    invoke("import", "--hf", tmp_path / "hf", "--out", tmp_path / "opus")
    sets = {
        "train.init_from": tmp_path / "opus",
        "data.path": tiny_corpus,
        "data.splits.valid": "valid",
        "data.cache_dir": tmp_path / "cache",
        "train.max_updates": 120,
        "train.valid_every": 60,
        "train.lr": 1e-3,
        "train.warmup": 20,
        "train.max_tokens": 1024,
        "train.precision": "fp32",
    }

    def run(where, **extra):
        options = [x for k, v in {**sets, **extra}.items() for x in ("--set", f"{k}={v}")]
        invoke("train", "--config", "finetune.yaml", "--run-dir", where, *options)

    run(tmp_path / "full")
    log = (tmp_path / "full" / "train.log").read_text()
    valid = [(int(u), float(loss)) for u, loss in re.findall(r"valid update +(\d+) \| loss ([\d.]+)", log)]
    assert [u for u, _ in valid] == [0, 60, 120]  # the starting model is scored before the first update
    assert valid[-1][1] < valid[0][1] - 1.0
    assert (tmp_path / "full" / "vocab.json").read_bytes() == (tmp_path / "opus" / "vocab.json").read_bytes()
    run(tmp_path / "part", **{"train.max_updates": 70})
    invoke("train", "--config", tmp_path / "part" / "config.yaml", "--run-dir", tmp_path / "part", "--resume",
           "--set", "train.max_updates=120")  # fmt: skip
    assert losses(tmp_path / "part") == losses(tmp_path / "full")


def test_bad_inputs_are_refused_in_one_line(tmp_path, monkeypatch):
    import subprocess
    import sys

    good = tmp_path / "good"
    build_marian(good, separate=False, seed=7)

    def refused(folder, expected):
        out = tmp_path / f"out-{folder.name}"
        result = subprocess.run(
            [sys.executable, "-m", "mtcli", "import", "--hf", str(folder), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
        assert not list_checkpoints(out)

    def variant(name):
        import shutil

        folder = tmp_path / name
        shutil.copytree(good, folder)
        return folder

    no_vocab = variant("no-vocab")
    (no_vocab / "vocab.json").unlink()
    refused(no_vocab, "vocab.json")
    bart = variant("bart")
    config = json.loads((bart / "config.json").read_text())
    (bart / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    refused(bart, "model_type")
    sizes = variant("sizes")
    (sizes / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 3}))
    refused(sizes, "vocab_size")
    pickled = variant("pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload()))
    refused(pickled, "refused")
    assert not (tmp_path / "pwned").exists()
    refused_in_process(good, tmp_path, monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a closed port: the Hub is out of reach
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from mtcli.errors import MtcliError
    from mtcli.marian import resolve_source

    with pytest.raises(MtcliError, match="cannot reach the Hugging Face Hub.*local folder"):
        resolve_source("Helsinki-NLP/opus-mt-en-de")


def test_a_vocabulary_that_is_not_an_object_is_refused_naming_the_file(tmp_path):
    """vocab.json (or target_vocab.json) as a list, or with ids that are not whole numbers: one line naming the
    model's own file, and nothing written."""
    from mtcli.errors import MtcliError
    from mtcli.marian import import_marian

    folder = tmp_path / "hf"
    build_marian(folder, separate=True, seed=3)
    vocab = json.loads((folder / "vocab.json").read_text())
    for name, bad, expected in (
        ("vocab.json", sorted(vocab, key=vocab.get), "found an array"),
        ("target_vocab.json", ["</s>", "<unk>"], "found an array"),
        ("vocab.json", {**vocab, "<unk>": "1"}, "'<unk>' is not a whole number"),
    ):
        original = (folder / name).read_text()
        (folder / name).write_text(json.dumps(bad))
        with pytest.raises(MtcliError) as error:
            import_marian(str(folder), tmp_path / "out")
        assert str(error.value).startswith(f"{folder / name}: expected a JSON object") and expected in str(error.value)
        assert not (tmp_path / "out").exists()
        (folder / name).write_text(original)


def refused_in_process(good: Path, tmp_path: Path, monkeypatch) -> None:
    """Hostile or damaged model folders, each refused with one line before a model of the size they claim is built
    and before anything is written; and a Hub that accepts connections but never answers."""
    import shutil
    import socket

    from mtcli.errors import MtcliError
    from mtcli.marian import import_marian

    config = json.loads((good / "config.json").read_text())
    cases = {
        "a million layers": ({"encoder_layers": 1_000_000}, "encoder_layers"),
        "a billion positions": ({"max_position_embeddings": 10**9}, "max_position_embeddings"),
        "positions as a float": ({"max_position_embeddings": 1e9}, "max_position_embeddings"),
        "d_model as a word": ({"d_model": "big"}, "d_model"),
        "a missing size": ({"encoder_ffn_dim": None}, "encoder_ffn_dim"),
        "a d_model the weights do not have": ({"d_model": config["d_model"] * 2}, "d_model"),
        "fewer layers than the weights": ({"decoder_layers": 1}, "decoder_layers"),
        "heads that do not divide d_model": ({"encoder_attention_heads": 7, "decoder_attention_heads": 7}, "heads"),
    }
    for name, (change, expected) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, folder)
        edited = {k: v for k, v in {**config, **change}.items() if v is not None}
        (folder / "config.json").write_text(json.dumps(edited))
        with pytest.raises(MtcliError, match=expected):
            import_marian(str(folder), tmp_path / "out")
        assert not (tmp_path / "out").exists(), name
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0\n")
    linked = tmp_path / "linked"
    shutil.copytree(good, linked)
    (linked / "source.spm").unlink()
    (linked / "source.spm").symlink_to(secret)
    with pytest.raises(MtcliError, match="outside the model folder"):
        import_marian(str(linked), tmp_path / "out")
    garbage = tmp_path / "garbage-spm"
    shutil.copytree(good, garbage)
    (garbage / "source.spm").write_bytes(b"not a sentencepiece model")
    with pytest.raises(MtcliError, match="source.spm"):
        import_marian(str(garbage), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(MtcliError, match="also an input"):
        import_marian(str(good), good)
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("mtcli.hub.PROBE_TIMEOUT_S", 1.0)
    try:
        with pytest.raises(MtcliError, match="no answer within"):
            import_marian("Helsinki-NLP/opus-mt-en-de", tmp_path / "out")
    finally:
        silent.close()


class _Payload:
    """A pickle that would run code when loaded without weights_only."""

    def __reduce__(self):
        return (open, ("pwned", "w"))
