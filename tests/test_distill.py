"""Synthetic corpora and `mtcli distill`: a toy teacher distilled into a smaller toy student end to end, synthesis
killed and resumed, a real `mtcli serve` as the teacher, back-translation with tags and weights, and bad input."""

from __future__ import annotations

import contextlib
import errno
import functools
import http.server
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
from conftest import invoke
from faults_serve import Server
from typer.testing import CliRunner

from mtcli import synthetic
from mtcli.cli import app
from mtcli.config_loader import load_config
from mtcli.data import eval_texts, prepare
from mtcli.distill import synthesis_filters
from mtcli.errors import MtcliError
from mtcli.mixture import epoch_examples
from mtcli.parity import CTranslate2Engine, EngineSettings
from mtcli.synthetic import Filters, file_lines, synthesize
from mtcli.teachers import ModelTeacher, open_teacher
from mtcli.tokenizer import Tokenizer
from mtcli.toy import _all_pairs, toy_pairs

ROOT = Path(__file__).resolve().parents[1]


def error_of(*args) -> str:
    """The one-line message of the MtcliError a command raises (the CLI prints it as `error: ...`, exit 2)."""
    with pytest.raises(MtcliError) as info:
        CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def english_lines(path: Path, n: int, seed: int) -> Path:
    """`n` toy English sentences (the toy corpus's generator, another seed), with an empty line among them."""
    lines = [en for en, _ in toy_pairs(n, 0, 0, seed)["train"]]
    lines[3] = ""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "synthesis.json"}


# A student much smaller than the toy teacher (2+2 layers, d_model 128): 2 encoder layers, 1 decoder layer, d_model 64
STUDENT = {
    "model.encoder_layers": 2,
    "model.decoder_layers": 1,
    "model.d_model": 64,
    "model.heads": 2,
    "model.d_ff": 128,
    "train.max_updates": 40,
    "train.valid_every": 20,
    "train.keep_last": 2,
    "train.log_every": 20,
    "distill.average_last": 2,
    "distill.max_ratio": 0,  # the toy's templates differ in length across languages by design
    "distill.chunk_lines": 1500,
}


def sets(settings: dict) -> list[str]:
    return [x for key, value in settings.items() for x in ("--set", f"{key}={value}")]


@pytest.mark.model
def test_toy_teacher_distils_into_a_smaller_student(toy_run, toy_cache, tmp_path):
    mono = english_lines(tmp_path / "mono.en", 50, seed=11)
    run = tmp_path / "student"
    args = ["distill", "--teacher", toy_run, "--config", "toy.yaml", "--run-dir", run, "--mono", mono]
    args += sets({"data.cache_dir": toy_cache, **STUDENT})
    printed = invoke(*args).stdout.strip()
    assert printed == str(run / "MODEL_CARD.md")
    card = json.loads((run / "model_card.json").read_text(encoding="utf-8"))
    assert (run / "MODEL_CARD.md").read_text(encoding="utf-8").startswith("# toy: a distilled en->zh model")

    # The student learnt from the distilled corpus, the distilled --mono text and the original data, as configured
    corpora = load_config(run / "config.yaml").data.train_corpora
    assert [c.path for c in corpora] == [str(run / "distill" / "train"), str(run / "distill" / "mono"), None]
    assert corpora[2].dataset == "toy"
    assert card["data"]["train"]["lines"] == 4000 and card["data"]["mono"]["lines"] == 50
    assert card["data"]["mono"]["dropped"]["empty"] == 1
    assert card["student"]["parameters"] < card["teacher"]["parameters"] / 3

    # Every figure comes from the files the card names
    refs = (run / "distill" / "eval" / "test.ref.zh").read_text(encoding="utf-8").splitlines()
    assert card["eval"]["references"] == "distill/eval/test.ref.zh"  # relative to the run: the card is shareable
    names = [row["system"] for row in card["systems"]]
    assert names == ["teacher", "student greedy int8", "student beam 4", "student greedy, CTranslate2 int8"]
    for row in card["systems"]:
        hyps = (run / row["hypotheses"]).read_text(encoding="utf-8").splitlines()
        bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh")
        assert row["bleu"] == round(bleu.score, 2)
        assert row["sentences_per_second"] > 0
    assert card["systems"][0]["bleu"] > 90  # the toy teacher; the student had 40 updates
    assert card["systems"][1]["paired"]["bleu"]["p_bs"] <= 1
    assert (run / card["student"]["export"]["folder"] / "model.bin").is_file()
    assert set(card["steps"]) == {"synthesize", "synthesize_mono", "train", "average", "score", "export"}
    # The export's row is CTranslate2's greedy search through parity's engine, which leaves an empty line empty
    student = load_config(run / "config.yaml")
    sources = eval_texts(student, "test")[0][:20]
    engine = CTranslate2Engine(run / card["student"]["export"]["folder"], threads=torch.get_num_threads())
    limit = student.model.max_positions - 1
    greedy = EngineSettings(beam=1, lenpen=0.0, early_stopping=True, min_len=0, max_len=limit, no_repeat_ngram=0)
    hyps = (run / card["systems"][3]["hypotheses"]).read_text(encoding="utf-8").splitlines()
    assert engine.translate(["", *sources, " "], greedy, 1) == ["", *hyps[:20], ""]

    # A second call finds every step done and changes nothing; another config is refused, naming the key
    before = (run / "model_card.json").read_bytes()
    again = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert again.exit_code == 0 and (run / "model_card.json").read_bytes() == before
    message = error_of(*args, "--set", "train.max_updates=50")
    assert "was started with another config (train.max_updates: 40 -> 50)" in message


def synthesize_command(teacher, source: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "mtcli", "data", "synthesize", "--teacher", str(teacher), "--input", str(source),
            "--out", str(out), *map(str, extra)]  # fmt: skip


@pytest.mark.system
def test_synthesis_killed_and_rerun_equals_an_uninterrupted_run(toy_run, tmp_path):
    source = english_lines(tmp_path / "mono.en", 600, seed=5)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    subprocess.run(synthesize_command(toy_run, source, whole, "--chunk-lines", 40), env=env, check=True)
    killed = tmp_path / "killed"
    child = subprocess.Popen(synthesize_command(toy_run, source, killed, "--chunk-lines", 40), env=env)
    deadline = time.monotonic() + 120
    while not len(list(tmp_path.glob(".killed.synthesis-*/chunk-*.jsonl"))) >= 3:
        assert child.poll() is None and time.monotonic() < deadline, "synthesis ended before it could be killed"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not killed.exists()  # nothing under the final name
    rerun = subprocess.run(synthesize_command(toy_run, source, killed, "--chunk-lines", 40), env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert "resuming after" in rerun.stderr
    assert files_of(killed) == files_of(whole)
    assert not list(tmp_path.glob(".killed.synthesis-*"))  # the work folder is gone once the corpus is complete
    # The same teacher, input and settings again: reused, not translated
    again = subprocess.run(synthesize_command(toy_run, source, killed, "--chunk-lines", 40), env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert "reusing it" in again.stderr


@pytest.mark.model
def test_sampled_synthesis_interrupted_resumes_with_the_same_samples(toy_run, tmp_path, monkeypatch):
    """Back-translation samples; each chunk's stream is seeded by its number, so a resumed run samples the same."""
    source = file_lines(english_lines(tmp_path / "mono.en", 120, seed=6))
    teacher = ModelTeacher([toy_run], [], "cpu", sampling=True, top_k=5, precision="fp32")
    whole = synthesize(teacher, source, tmp_path / "whole", chunk_lines=20, filters=Filters(max_ratio=0))
    assert whole["lines"] == 120 and whole["dropped"]["empty"] == 1

    original, calls = ModelTeacher.translate, []

    def dies_on_the_fourth_chunk(self, lines, chunk):
        calls.append(chunk)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(self, lines, chunk)

    monkeypatch.setattr(ModelTeacher, "translate", dies_on_the_fourth_chunk)
    teacher = ModelTeacher([toy_run], [], "cpu", sampling=True, top_k=5, precision="fp32")
    with pytest.raises(KeyboardInterrupt):
        synthesize(teacher, source, tmp_path / "resumed", chunk_lines=20, filters=Filters(max_ratio=0))
    monkeypatch.setattr(ModelTeacher, "translate", original)
    synthesize(teacher, source, tmp_path / "resumed", chunk_lines=20, filters=Filters(max_ratio=0))
    assert files_of(tmp_path / "resumed") == files_of(tmp_path / "whole")
    greedy = ModelTeacher([toy_run], [], "cpu", beam=1, precision="fp32")
    plain = synthesize(greedy, source, tmp_path / "greedy", chunk_lines=20, filters=Filters(max_ratio=0))
    assert plain["key"] != whole["key"]
    assert files_of(tmp_path / "greedy") != files_of(tmp_path / "whole")  # sampling did sample


@pytest.mark.system
def test_an_http_teacher_gives_the_same_corpus_as_the_run(toy_run, tmp_path):
    source = english_lines(tmp_path / "mono.en", 100, seed=7)
    invoke(*synthesize_command(toy_run, source, tmp_path / "local", "--max-ratio", 0)[3:])
    server = Server(toy_run)
    try:
        url = f"http://127.0.0.1:{server.port}"
        langs = ["--src-lang", "en", "--tgt-lang", "zh", "--max-ratio", 0]
        invoke(*synthesize_command(url, source, tmp_path / "http", *langs)[3:])
    finally:
        assert server.stop() == 0
    local, remote = files_of(tmp_path / "local"), files_of(tmp_path / "http")
    assert remote["train.zh"] == local["train.zh"] and remote["train.en"] == local["train.en"]
    assert set(remote["train.scores"].decode().split()) == {"nan"}  # LibreTranslate's API gives no scores
    report = json.loads((tmp_path / "http" / "synthesis.json").read_text())
    assert report["teacher"] == url and report["kept"] == 99


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.model
def test_bad_teachers_and_inputs_fail_in_one_line_and_write_nothing(toy_run, toy_cache, tmp_path):
    mono = english_lines(tmp_path / "mono.en", 10, seed=8)
    run = tmp_path / "student"
    base = ["distill", "--teacher", toy_run, "--config", "toy.yaml", "--run-dir", run, *sets(STUDENT)]
    base += sets({"data.cache_dir": toy_cache})
    # a teacher whose source language is not the student's
    message = error_of(*base, "--set", "data.src_lang=de", "--set", "data.tgt_lang=zh")
    assert "translates en->zh, the student de->zh" in message
    # a missing monolingual file
    assert error_of(*base, "--mono", tmp_path / "missing.en") == f"--mono {tmp_path / 'missing.en'}: no such file"
    # a teacher that is not there
    assert "no such run directory" in error_of("distill", "--teacher", tmp_path / "nope", "--config", "toy.yaml")
    assert not run.exists()
    # an endpoint that is down: retried, then one line naming the address
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "synthetic"
    started = time.monotonic()
    message = error_of("data", "synthesize", "--teacher", url, "--input", mono, "--out", out, "--src-lang", "en",
                       "--tgt-lang", "zh", "--retries", 2)  # fmt: skip
    assert message.startswith(f"teacher {url}/languages: unreachable after 3 tries") and time.monotonic() - started < 10
    assert not out.exists() and not list(tmp_path.glob(".synthetic*"))
    # a distill run directory is not a folder of the user's
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    mine = ["distill", "--teacher", toy_run, "--config", "toy.yaml", "--run-dir", tmp_path / "mine"]
    assert "not a distill run directory" in error_of(*mine, *sets({"data.cache_dir": toy_cache, **STUDENT}))
    # a foreign non-empty --out is refused before anything is translated
    assert "the folder is not empty" in error_of("data", "synthesize", "--teacher", toy_run, "--input", mono,
                                                 "--out", tmp_path / "mine")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "mono.en"]
    # --out may not hold the input
    assert "it is also an input" in error_of("data", "synthesize", "--teacher", toy_run, "--input", mono,
                                             "--out", tmp_path)  # fmt: skip


@pytest.mark.model
def test_back_translation_flips_pairs_tags_synthetic_sources_and_honours_weights(toy_run, tmp_path):
    """The en->zh toy run back-translates English text for a zh->en student: its synthetic source is the Chinese."""
    english = english_lines(tmp_path / "mono.en", 60, seed=9)
    teacher = ModelTeacher([toy_run], [], "cpu", sampling=True, top_k=3, precision="fp32")
    report = synthesize(teacher, file_lines(english), tmp_path / "bt", chunk_lines=30, filters=Filters(max_ratio=0))
    bt_en = (tmp_path / "bt" / "train.en").read_text(encoding="utf-8").splitlines()
    assert bt_en == [line for line in english.read_text(encoding="utf-8").splitlines() if line]
    assert report["languages"] == {"source": "en", "target": "zh"}

    cache = tmp_path / "cache"
    corpora = [
        {"path": str(tmp_path / "bt"), "tag": "<BT>", "weight": 2},
        {"dataset": "toy", "split": "train", "weight": 1},
    ]
    cfg = load_config("toy.yaml", [f"data.cache_dir={cache}", "data.src_lang=zh", "data.tgt_lang=en"])
    from mtcli.config_loader import replaced

    cfg = replaced(cfg, **{"data.train_corpora": corpora})
    data = prepare(cfg)
    tokenizer = Tokenizer.from_folder(data.folder)
    assert tokenizer.src.piece_to_id("<BT>") != tokenizer.src.unk_id()  # one piece of its own
    split = data.split("train")
    which = np.load(data.folder / "train.corpus.npy")
    kept_bt = int((which == 0).sum())
    assert kept_bt == report["kept"]
    for i in range(len(split)):
        pieces = tokenizer.src.id_to_piece(split.src(i).tolist())
        assert (pieces[0] == "<BT>") == (which[i] == 0)
        assert "<BT>" not in tokenizer.tgt.id_to_piece(split.tgt(i).tolist())
    examples = epoch_examples(split, np.arange(len(split)), cfg, epoch=1)
    assert (which[examples] == 0).sum() == 2 * kept_bt and (which[examples] == 1).sum() == (which == 1).sum()
    # The tag is refused where it could not be one piece
    with pytest.raises(MtcliError, match="data.train_corpora.tag: must be one word"):
        replaced(cfg, **{"data.train_corpora": [{"path": "x", "tag": "<B T>"}]})


def test_the_shipped_student_configs_are_smaller_where_it_counts():
    """Deep encoder, shallow decoder: the decoder runs once per output word."""
    for name, teacher in (("multi30k-student.yaml", "multi30k.yaml"), ("base-student.yaml", "base.yaml")):
        student, big = load_config(name).model, load_config(teacher).model
        assert student.decoder_layers < (big.decoder_layers or big.layers)
        assert student.d_model <= big.d_model
        assert load_config(name).distill.quantization == "int8"


# ---------------------------------------------------------------------------------------------------------------------
# A fake LibreTranslate teacher on 127.0.0.1, friendly or hostile


@functools.lru_cache(maxsize=1)
def toy_translations() -> dict[str, str]:
    """Every toy English sentence with its Chinese: what a perfect teacher of the toy corpus answers."""
    return dict(_all_pairs())


def toy_answer(texts: list[str]) -> bytes:
    return json.dumps({"translatedText": [toy_translations().get(t, t) for t in texts]}).encode()


EN_ZH = json.dumps([{"code": "en", "name": "English", "targets": ["zh"]}]).encode()


class FakeTeacher:
    """LibreTranslate's API in a thread: GET /languages answers `languages`, POST /translate `answer(texts)`. An
    answer is bytes (sent with its length) or an iterator of bytes (streamed until the client hangs up)."""

    def __init__(self, answer=toy_answer, languages=EN_ZH):
        self.answer, self.languages, self.translate_requests = answer, languages, 0
        teacher = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send(teacher.languages)

            def do_POST(self):
                texts = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["q"]
                teacher.translate_requests += 1
                self.send(teacher.answer(texts))

            def send(self, body):
                if callable(body):  # writes the raw response itself
                    return body(self.wfile)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if isinstance(body, bytes):
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.end_headers()
                with contextlib.suppress(OSError):  # the client hung up: what a capped read does
                    for piece in body:
                        self.wfile.write(piece)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def synthesize_http(url: str, source: Path, out: Path, *extra) -> list[str]:
    return ["data", "synthesize", "--teacher", url, "--input", source, "--out", out, "--src-lang", "en",
            "--tgt-lang", "zh", "--retries", 0, *extra]  # fmt: skip


@pytest.mark.model
def test_an_http_teacher_distils_to_a_shareable_card_that_states_a_failed_parity(toy_cache, tmp_path, monkeypatch):
    # An export that diverges from mtcli (as a broken converter would): distill keeps it, and its card must say so
    divergence = "greedy: 9 repeating outputs (mtcli 0)"
    monkeypatch.setattr("mtcli.parity.failures", lambda rows, precision: [divergence])
    run = tmp_path / "student"
    student = {k: v for k, v in STUDENT.items() if k != "distill.max_ratio"}  # the toy's data.max_ratio 0 applies
    student["distill.average_last"] = 0  # the best checkpoint, measured on valid all the same
    with FakeTeacher() as teacher:
        args = ["distill", "--teacher", teacher.url, "--config", "toy.yaml", "--run-dir", run]
        args += sets({"data.cache_dir": toy_cache, **student})
        assert invoke(*args).stdout.strip() == str(run / "MODEL_CARD.md")
    card = json.loads((run / "model_card.json").read_text(encoding="utf-8"))
    markdown = (run / "MODEL_CARD.md").read_text(encoding="utf-8")

    # The teacher's perfect translations all kept: the ratio filter follows data.max_ratio (0 in the toy)
    assert card["data"]["train"]["kept"] == 4000 and card["data"]["train"]["dropped"]["ratio"] == 0
    assert card["teacher"]["models"] == [teacher.url] and card["systems"][0]["bleu"] == 100
    # The failed parity check, the student's shape, budget and valid BLEU, the command and how to use the export
    assert card["student"]["export"]["parity"]["failures"] == [divergence]
    assert "FAILED its parity check" in markdown and divergence in markdown
    assert card["student"]["shape"] == {
        "encoder_layers": 2, "decoder_layers": 1, "d_model": 64, "heads": 2, "d_ff": 128,
        "parameters": card["student"]["parameters"],
    }  # fmt: skip
    assert card["student"]["training"]["updates"] == 40 and card["student"]["training"]["target_tokens"] > 0
    assert 0 <= card["student"]["valid_bleu"] <= 100
    assert all(isinstance(row["repeating"], int) for row in card["systems"])
    assert card["command"] == f"mtcli distill --teacher {teacher.url} --config distill/config.yaml --run-dir ."
    assert "mtcli translate --checkpoint checkpoints/" in markdown and 'ctranslate2.Translator("' in markdown
    # Shareable: no path of this machine; every path is relative to the run directory
    for text in (markdown, (run / "model_card.json").read_text(encoding="utf-8")):
        assert str(tmp_path) not in text and str(toy_cache) not in text
    assert (run / card["eval"]["references"]).is_file() and (run / card["student"]["checkpoint"]).is_dir()
    assert all((run / row["hypotheses"]).is_file() for row in card["systems"])
    assert (run / card["student"]["export"]["folder"] / "model.bin").is_file()

    # A run that crashed at the card step (the teacher's row and the config as the old code wrote them, when
    # distill.max_ratio was 3.0) completes on a rerun, without the teacher: the card is recomputed from distill.json
    state = json.loads((run / "distill.json").read_text(encoding="utf-8"))
    del state["steps"]["card"]
    state["inputs"]["config"]["distill"]["max_ratio"] = 3.0
    for key in ("engine", "beam", "precision", "lenpen", "device", "threads"):
        state["steps"]["score"]["systems"][0].pop(key, None)
    (run / "distill.json").write_text(json.dumps(state), encoding="utf-8")
    (run / "MODEL_CARD.md").unlink()
    assert invoke(*args).stdout.strip() == str(run / "MODEL_CARD.md")
    assert "card" in json.loads((run / "distill.json").read_text(encoding="utf-8"))["steps"]


def test_an_oversized_answer_ends_in_one_line_without_being_read_whole():
    piece = b"x" * (1 << 18)

    def huge(texts):  # a JSON string that never ends, 64 MiB at most
        yield b'{"translatedText": ["'
        yield from itertools.repeat(piece, 256)

    with FakeTeacher(huge) as teacher:
        http = open_teacher([teacher.url], ("en", "zh"), retries=0)
        tracemalloc.start()
        try:
            with pytest.raises(MtcliError) as info:
                http.translate(["I love apples", "she likes tea"], 0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert str(info.value).startswith(f"teacher {teacher.url}/translate: the answer is larger than")
    assert peak < 8 << 20, f"{peak:,} bytes held for a capped answer"


def trickle(route: str):
    """A response whose status line (/languages) or body (/translate) comes one byte every 0.2 s, 30 at most."""

    def write(wfile):
        head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        if route == "/translate":
            wfile.write(head)
        with contextlib.suppress(OSError):
            for byte in (head if route == "/languages" else b"[" * 1000)[:30]:
                wfile.write(bytes([byte]))
                wfile.flush()
                time.sleep(0.2)

    return write


@pytest.mark.parametrize("route", ["/languages", "/translate"])
def test_a_trickling_teacher_ends_at_the_deadline_in_one_line(route):
    languages = trickle(route) if route == "/languages" else EN_ZH
    with FakeTeacher(lambda texts: trickle(route), languages) as teacher:
        started = time.monotonic()
        with pytest.raises(MtcliError) as info:
            open_teacher([teacher.url], ("en", "zh"), retries=0, timeout=0.3).translate(["I love apples"], 0)
        took = time.monotonic() - started
    message = str(info.value)
    expected = f"teacher {teacher.url}{route}: unreachable after 1 try (no complete answer within 0.3 s)"
    assert message.startswith(expected)
    assert took < 2, f"a 0.3 s deadline took {took:.1f} s"


def test_the_timeout_option_bounds_a_trickling_teacher_through_the_command(tmp_path):
    """`mtcli data synthesize --timeout 0.3 --retries 0`: the one-line error, within the deadline's bound."""
    from mtcli.cli import app

    source = tmp_path / "in.en"
    source.write_text("I love apples\n", encoding="utf-8")
    with FakeTeacher(lambda texts: trickle("/translate"), EN_ZH) as teacher:
        started = time.monotonic()
        args = ["data", "synthesize", "--teacher", teacher.url, "--src-lang", "en", "--tgt-lang", "zh"]
        args += ["--input", str(source), "--out", str(tmp_path / "out"), "--timeout", "0.3", "--retries", "0"]
        result = CliRunner().invoke(app, args)
        took = time.monotonic() - started
    assert isinstance(result.exception, MtcliError), result.output  # the CLI's main prints it on one line, exit 2
    assert "no complete answer within 0.3 s" in str(result.exception)
    assert took < 4 and not (tmp_path / "out").exists()


HOSTILE = {
    "targets a number": ({"languages": b'[{"code": "en", "targets": 5}]'}, "/languages: answered"),
    "code a list": ({"languages": b'[{"code": ["en"], "targets": ["zh"]}]'}, "/languages: answered"),
    "not a list": ({"languages": b'{"en": "zh"}'}, "/languages: answered"),
    "nested 100,000 deep": (
        {"answer": lambda texts: b'{"translatedText": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
        "/translate: the answer is nested too deep",
    ),
    "a lone surrogate": (
        {"answer": lambda texts: json.dumps({"translatedText": ["\ud800" + t for t in texts]}).encode()},
        "/translate: its translation of 'the",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_teacher_answers_fail_in_one_line_and_write_nothing(case, tmp_path):
    server, expected = HOSTILE[case]
    source = tmp_path / "mono.en"
    source.write_text("the children love apples\n", encoding="utf-8")
    with FakeTeacher(**server) as teacher:
        message = error_of(*synthesize_http(teacher.url, source, tmp_path / "out"))
    assert message.startswith(f"teacher {teacher.url}{expected}"), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mono.en"]


def test_a_full_disk_during_synthesis_ends_in_one_line_and_keeps_the_finished_chunks(tmp_path, monkeypatch):
    source = english_lines(tmp_path / "mono.en", 100, seed=13)
    out = tmp_path / "synthetic"
    args = synthesize_http("", source, out, "--chunk-lines", 20)
    real_write = synthetic.write_file_atomic
    writes = []

    def fills_up_at_the_third_chunk(path, data):
        writes.append(path)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data)

    def fails_to_create_files(file, mode="r", *rest, **options):
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return open(file, mode, *rest, **options)

    with FakeTeacher() as teacher:
        args[3] = teacher.url
        with monkeypatch.context() as patch:
            patch.setattr(synthetic, "write_file_atomic", fills_up_at_the_third_chunk)
            message = error_of(*args)
        assert message.startswith(f"--out {out}: cannot write in {tmp_path} (No space left on device)")
        work = next(tmp_path.glob(".synthetic.synthesis-*"))
        assert sorted(p.name for p in work.glob("chunk-*")) == ["chunk-0000000.jsonl", "chunk-0000001.jsonl"]
        assert "2 finished chunks kept" in message and not out.exists()

        # Every chunk translated, then the corpus files cannot be created: the chunks stay for the rerun
        with monkeypatch.context() as patch:
            patch.setattr(synthetic, "open", fails_to_create_files, raising=False)
            message = error_of(*args)
        assert message.startswith(f"--out {out}: cannot write in {tmp_path} (No space left on device)")
        assert len(list(work.glob("chunk-*"))) == 5 and not out.exists()
        requests = teacher.translate_requests
        invoke(*args)
        assert teacher.translate_requests == requests  # nothing translated twice
    assert json.loads((out / "synthesis.json").read_text(encoding="utf-8"))["lines"] == 100


def test_a_filter_that_drops_many_pairs_is_said_so_and_distill_follows_the_datas_ratio(tmp_path, log):
    # The toy's templates differ in length by design (data.max_ratio 0): a student of it keeps them
    assert synthesis_filters(load_config("toy.yaml")).max_ratio == 0
    assert synthesis_filters(load_config("toy.yaml", ["distill.max_ratio=4"])).max_ratio == 4
    source = english_lines(tmp_path / "mono.en", 40, seed=14)
    with FakeTeacher() as teacher:
        http = open_teacher([teacher.url], ("en", "zh"))
        synthesize(http, file_lines(source), tmp_path / "out", filters=Filters(max_ratio=3), progress=False)
    report = json.loads((tmp_path / "out" / "synthesis.json").read_text(encoding="utf-8"))
    assert report["dropped"]["ratio"] > 2  # English against Chinese characters: perfect translations dropped
    assert len(report["warnings"]) == 1 and report["warnings"][0].startswith("the ratio filter dropped")
    assert report["warnings"][0] in [line.removeprefix("synthesis: ") for line in log]
