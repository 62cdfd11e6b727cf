"""`mtcli serve`: cutting text and joining translations, then a real server (a subprocess on 127.0.0.1) on the toy
model: LibreTranslate's request and response shapes, the native route, equality with `mtcli translate`, long
inputs, hostile bodies, metrics; and the faults: 256 clients against a small queue, API keys, SIGTERM under load."""

from __future__ import annotations

import html
import http.client
import json
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import invoke
from faults_serve import Server

from mtcli.segment import join, split_html, split_text
from mtcli.tokenizer import Tokenizer
from mtcli.toy import toy_pairs
from mtcli.translate import split_long

LIBRE = {"source": "en", "target": "zh", "format": "text"}
SENTENCES = [en for en, _ in toy_pairs()["test"][:40]]


# ---------------------------------------------------------------------------------------------------------------------
# Cutting and joining (no model)


@pytest.mark.parametrize(
    "text",
    [
        "I love apples. Do you like tea?  She does!\n\nTom eats fish.\r\n",
        "  leading and trailing spaces  ",
        "😀 42. I love apples 😀",
        "no punctuation at all",
        "",
    ],
)
def test_text_is_cut_into_sentences_and_joins_back_to_itself(text):
    segments = split_text(text, "en")
    assert join(segments, segments.pieces, "en") == text
    assert all(p == p.strip() and p for p in segments.pieces)


def test_sentences_lines_and_letterless_runs():
    segments = split_text("I love apples. Do you like tea?\nTom eats fish. 😀", "en")
    assert segments.pieces == ["I love apples.", "Do you like tea?", "Tom eats fish."]
    assert join(segments, ["A", "B", "C"], "en") == "A B\nC 😀"
    assert join(segments, ["甲", "乙", "丙"], "zh") == "甲乙\n丙 😀"  # no spaces between Chinese sentences


def test_html_keeps_markup_and_escapes_translations():
    source = '<p class="x">I love apples. Tom &amp; me.</p><pre>a < b</pre><script>if (a < b) {}</script><br/>Hi'
    segments = split_html(source, "en")
    assert segments.pieces == ["I love apples.", "Tom & me.", "Hi"]
    assert join(segments, segments.pieces, "en") == source.replace("a < b</pre>", "a &lt; b</pre>")
    out = join(segments, ["<1>", "2 & 3", "4"], "en")
    assert out.startswith('<p class="x">&lt;1&gt; 2 &amp; 3</p><pre>') and out.endswith("<br/>4")


def test_html_inline_elements_stay_in_their_sentence_and_round_trip_exactly():
    """Inline elements (nested, links with entities in their attributes) no longer cut the sentence: the model gets
    `I love apples and green pears.` whole, and each element's own text besides; translated as themselves, the
    texts give back the source byte for byte. Tags that do not pair up inside a block keep the old cut (each text
    run alone), also exactly."""
    source = (
        '<p>I love <b>apples</b> and <a href="/x?a=1&amp;b=2">green <i>pears</i></a>.</p>'
        "<p>Tom &amp; <em>Jerry</em> &lt;3 <span><b>cats</b></span>.</p><ul><li>Hi <u>there</u></li></ul>"
        "<p>I love <b>apples</p>"
    )
    segments = split_html(source, "en")
    assert segments.pieces == ["I love apples and green pears.", "Tom & Jerry <3 cats.", "Hi there", "I love", "apples"]
    assert segments.mark_texts() == ["apples", "green pears", "pears", "Jerry", "cats", "cats", "there"]
    assert join(segments, segments.pieces, "en") == source
    deep = "<p>" + "<b>" * 3000 + "I love apples" + "</b>" * 3000 + "</p>"  # no recursion limit reached
    assert join(split_html(deep, "en"), ["I love apples"], "en") == deep


def test_html_inline_elements_go_around_the_words_that_translate_them():
    segments = split_html('<p>I love <b>apples</b> and <a href="x">green <i>pears</i></a>.</p>', "en")
    zh = join(segments, ["我喜欢苹果和绿色的梨。"], "zh", ["苹果", "绿色的梨", "梨"])
    assert zh == '<p>我喜欢<b>苹果</b>和<a href="x">绿色的<i>梨</i></a>。</p>'
    fr = join(segments, ["J'aime les pommes et les poires vertes."], "fr", ["pommes", "poires vertes", "poires"])
    assert fr == '<p>J\'aime les <b>pommes</b> et les <a href="x"><i>poires</i> vertes</a>.</p>'  # order changed
    # inflected alone and in the sentence: the shared characters find them, whole words only
    de = join(segments, ["Ich liebe Äpfel und grüne Birnen."], "de", ["Apfel", "grünen Birnen", "Birne"])
    assert de == '<p>Ich liebe <b>Äpfel</b> und <a href="x">grüne <i>Birnen</i></a>.</p>'
    # nothing in common: the same relative place, still nested, siblings apart, every tag kept and escaped text
    odd = join(segments, ["Ich mag <Obst> sehr."], "de", ["xyz", "qqq", "zzz"])
    assert odd.count("<b>") == odd.count("</b>") == 1 and odd.count("<i>") == 1
    assert html.unescape(re.sub(r"<[^>]+>", "", odd)) == "Ich mag <Obst> sehr."  # the text is the translation
    assert re.search(r'<a href="x">[^<]*<i>[^<]*</i>[^<]*</a>', odd), odd
    # an element across two sentences is closed and reopened at the sentence end, never across the space
    segments = split_html("<p><b>First one. Second</b> one.</p>", "en")
    assert join(segments, ["Erstens.", "Zweitens eins."], "de", ["Zweitens"]) == (
        "<p><b>Erstens.</b> <b>Zweitens</b> eins.</p>"
    )


def test_html_inline_placement_never_breaks_the_markup_whatever_the_translations():
    """Random nested inline elements and random translations (of any length, sharing words or not): the output's
    tags always pair up and nest as in the source, and its text is exactly the translations and the glue."""
    rng = random.Random(0)
    words = ["I", "love", "apples", "Tom", "eats", "green", "fish", "tea", "x", "Äpfel", "猫", "&", "<3", "2"]

    def fragment(depth):
        out = []
        for _ in range(rng.randint(1, 4)):
            if depth < 3 and rng.random() < 0.4:
                tag = rng.choice(["b", "i", "a", "span"])
                out.append(f"<{tag}>{fragment(depth + 1)}</{tag}>")
            else:
                out.append(html.escape(" ".join(rng.choices(words, k=rng.randint(0, 3))), quote=False))
            out.append(rng.choice(["", " ", ". ", "? "]))
        return "".join(out)

    for _ in range(200):
        source = f"<p>{fragment(0)}</p>"
        segments = split_html(source, "en")
        translations = [" ".join(rng.choices(words, k=rng.randint(0, 6))) for _ in segments.pieces]
        marks = [" ".join(rng.choices(words, k=rng.randint(0, 2))) for _ in segments.mark_texts()]
        out = join(segments, translations, rng.choice(["de", "zh"]), marks)
        for tag in ("b", "i", "a", "span"):
            assert source.count(f"<{tag}>") <= out.count(f"<{tag}>") == out.count(f"</{tag}>"), (source, out)
        depth = 0
        for match in re.finditer(r"<(/?)[a-z]+>", out):
            depth += -1 if match[1] else 1
            assert depth >= 0, (source, out)
        text = html.unescape(re.sub(r"<[^>]+>", "", out))
        assert all(t in text for t in translations), (source, translations, out)


@pytest.mark.parametrize(
    "markup",
    [
        "<![CDATA[x < y && z]]>",  # HTMLParser hands over "CDATA[x < y && z"; the end was written back as ]>
        "<![CDATA[]]>",
        "<![CDATA[a]b]]>",
        "<![if !IE]>",  # MS Office's conditionals end with ]>
        "<![endif]>",
        "<!--[if IE]><p>old</p><![endif]-->",
        "<!DOCTYPE html>",
        "<?xml version='1.0'?>",
    ],
)
def test_html_declarations_and_marked_sections_are_kept_exactly(markup):
    source = f"<p>I love apples.</p>{markup}<p>Tom eats fish.</p>"
    segments = split_html(source, "en")
    assert segments.pieces == ["I love apples.", "Tom eats fish."]
    assert join(segments, segments.pieces, "en") == source


@pytest.mark.parametrize("text", ["<![ CDATA[a]]> b", "a <![[b]]> c", "<![style x]]>Hi", "<![CDATA[never closed"])
def test_html_a_marked_section_the_parser_cannot_read_is_text(text):
    segments = split_html(text, "en")  # HTMLParser raised AssertionError on these (a 500)
    assert html.unescape(join(segments, segments.pieces, "en")) == text


# ---------------------------------------------------------------------------------------------------------------------
# A server in a subprocess


def assert_error(answer, status: int, *words: str):
    code, headers, body = answer
    assert code == status, (code, body)
    assert isinstance(body, dict) and set(body) == {"error"} and "\n" not in body["error"], body
    assert "Traceback" not in body["error"]
    for word in words:
        assert word in body["error"], body
    return headers


@pytest.fixture(scope="module")
def server(toy_run, tmp_path_factory):
    limits = ["--max-body-bytes", "65536", "--max-sentences", "64", "--max-chars", "3000", "--max-beam", "8"]
    glossary = tmp_path_factory.mktemp("glossary") / "server.tsv"  # a term no other test's sentences hold
    glossary.write_text("xylophone\t香蕉\n", encoding="utf-8")
    srv = Server(toy_run, *limits, "--glossary", str(glossary))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def cli_translations(toy_run, tmp_path_factory):
    """`mtcli translate --input` on SENTENCES, at beam 4 (the run's) and beam 1."""
    source = tmp_path_factory.mktemp("cli") / "test.en"
    source.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    beam4 = invoke("translate", "--run", toy_run, "--input", source).stdout.splitlines()
    beam1 = invoke("translate", "--run", toy_run, "--input", source, "--beam", "1").stdout.splitlines()
    return beam4, beam1


@pytest.mark.system
def test_translations_equal_mtcli_translate(server, cli_translations):
    beam4, beam1 = cli_translations
    assert server.post("/translate", {"q": SENTENCES, **LIBRE})[2]["translatedText"] == beam4
    native = server.post("/v1/translate", {"texts": SENTENCES, "beam": 1, "split_sentences": False})[2]
    assert [t["text"] for t in native["translations"]] == beam1
    sentences = [s if s.endswith(("?", ".")) else s + "." for s in SENTENCES[:6]]
    one_by_one = server.post("/translate", {"q": sentences, **LIBRE})[2]["translatedText"]
    paragraph = server.post("/translate", {"q": " ".join(sentences), **LIBRE})[2]["translatedText"]
    assert paragraph == "".join(one_by_one)  # cut into the same sentences; Chinese joins them without spaces


@pytest.mark.system
def test_libretranslate_request_and_response_shapes(server):
    """The shapes of LibreTranslate's published API and its tests; Mastodon sends lists, format html and auto."""
    one = server.post("/translate", {"q": "I love apples", **LIBRE})
    assert one[0] == 200 and one[2] == {"translatedText": "我喜欢苹果"}
    form = server.post(
        "/translate",
        b"q=I+love+apples&source=en&target=zh",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form[2] == {"translatedText": "我喜欢苹果"}
    mastodon = {"q": ["<p>I love apples</p>", "<p>😀</p>"], "source": "auto", "target": "zh", "format": "html"}
    answer = server.post("/translate", {**mastodon, "api_key": None})[2]
    assert answer["translatedText"] == ["<p>我喜欢苹果</p>", "<p>😀</p>"]
    assert answer["detectedLanguage"] == [{"confidence": 100.0, "language": "en"}] * 2
    alternatives = server.post("/translate", {"q": "I love apples", **LIBRE, "alternatives": 2})[2]
    assert alternatives["translatedText"] == "我喜欢苹果" and len(alternatives["alternatives"]) == 2
    batch = server.post("/translate", {"q": ["I love apples", "Do you like tea?"], **LIBRE, "alternatives": 2})[2]
    assert len(batch["alternatives"]) == 2 and all(len(a) == 2 for a in batch["alternatives"])
    assert server.request("GET", "/languages")[2] == [{"code": "en", "name": "English", "targets": ["zh"]}]
    assert_error(server.post("/translate", {"q": "Hello", "source": "en", "target": "zz"}), 400, "zz is not supported")
    assert_error(server.post("/translate", {"q": "Hello", "source": "de", "target": "zh"}), 400, "de is not supported")
    assert_error(server.post("/translate", {"source": "en", "target": "zh"}), 400, "missing q")
    assert_error(server.post("/translate", {"q": [], **LIBRE}), 400, "missing q")
    assert_error(
        server.post("/translate", {"q": "Hello", **LIBRE, "format": "xml"}), 400, "xml format is not supported"
    )
    assert_error(server.post("/translate", {"q": "Hi", **LIBRE, "alternatives": "abc"}), 400, "not a number")
    assert_error(server.post("/translate", ["not", "a", "dict"]), 400, "must be an object")
    assert_error(server.post("/translate", {"q": "Hi", **LIBRE, "alternatives": 8}), 422, "limit of 7")
    assert_error(server.request("POST", "/health"), 405)
    assert_error(server.request("GET", "/nowhere"), 404, "/nowhere")


@pytest.mark.system
def test_native_route_takes_decode_settings_and_returns_scores(server):
    body = {"texts": ["I love apples", "Do you like tea? Tom eats fish."], "beam": 5, "nbest": 3, "lenpen": 1.0}
    status, _, answer = server.post("/v1/translate", body)
    assert status == 200 and answer["decode"]["beam"] == 5 and answer["decode"]["lenpen"] == 1.0
    first = answer["translations"][0]
    assert first["text"] == "我喜欢苹果" and len(first["nbest"]) == 3 and first["nbest"][0]["text"] == first["text"]
    scores = [h["score"] for h in first["nbest"]]
    assert scores == sorted(scores, reverse=True) and all(h["log_prob"] < 0 for h in first["nbest"])
    sampled = server.post("/v1/translate", {"texts": ["I love apples"] * 3, "sampling": True, "top_k": 5})
    assert sampled[0] == 200 and len(sampled[2]["translations"]) == 3
    assert_error(server.post("/v1/translate", {"texts": ["x"], "beem": 5}), 422, "unknown field(s) beem")
    assert_error(server.post("/v1/translate", {"texts": ["x"], "beam": 9}), 422, "limit of 8")
    assert_error(server.post("/v1/translate", {"texts": ["x"], "beam": "5"}), 400, "beam: expected an integer")
    assert_error(server.post("/v1/translate", {"texts": ["x"], "beam": True}), 400, "beam: expected an integer")
    assert_error(server.post("/v1/translate", {"texts": ["x"], "beam": 2, "nbest": 3}), 422, "nbest")
    assert_error(server.post("/v1/translate", {"texts": ["x"], "lenpen": -1}), 422, "lenpen")
    power = server.post("/v1/translate", {"texts": ["I love apples"], "length_norm": "power", "lenpen": 1.0})
    assert power[0] == 200 and power[2]["decode"]["length_norm"] == "power", power
    assert_error(server.post("/v1/translate", {"texts": ["x"], "length_norm": "gmnt"}), 422, "gnmt or power")
    assert_error(server.post("/v1/translate", {"texts": ["x"], "length_norm": 1}), 400, "expected a string")
    assert_error(server.post("/v1/translate", {"texts": "x", "format": "html", "split_sentences": False}), 422)


@pytest.mark.system
def test_long_input_is_split_not_truncated(server, toy_run):
    long_line = " ".join(["I love apples and she likes tea"] * 30)  # over the 127 subwords the toy model takes
    pieces = split_long(Tokenizer.from_folder(toy_run), long_line, 127)
    assert len(pieces) > 1 and " ".join(pieces) == long_line  # cut between words
    assert all(len(Tokenizer.from_folder(toy_run).encode_src([p])[0]) <= 127 for p in pieces)
    served = server.post("/v1/translate", {"texts": [long_line], "split_sentences": False})[2]
    each = server.post("/v1/translate", {"texts": pieces, "split_sentences": False})[2]
    assert served["translations"][0]["text"] == "".join(t["text"] for t in each["translations"])
    split = invoke("translate", "--run", toy_run, "--split-long", long_line)
    assert split.stdout.strip() == served["translations"][0]["text"] and "truncated" not in split.stderr
    assert "truncated" in invoke("translate", "--run", toy_run, long_line).stderr


@pytest.mark.system
def test_hostile_bodies_get_a_4xx_and_the_server_carries_on(server):
    ten_mb = b'{"q": "' + b"a" * (10 << 20) + b'"}'
    assert_error(server.post("/translate", ten_mb), 413, "65,536 bytes", "--max-body-bytes")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # chunked, no Content-Length
    connection.request("POST", "/translate", iter([b'{"q": "', b"a" * 100_000, b'"}']), encode_chunked=True)
    assert connection.getresponse().status == 413
    connection.close()
    assert_error(server.post("/translate", b"[" * 30_000 + b"]" * 30_000), 400, "nested too deeply")
    assert_error(server.post("/translate", b'{"q": "a\x00b"}'), 400, "not valid JSON")
    assert_error(server.post("/translate", {"q": "a\x00b", **LIBRE}), 400, "NUL")
    assert_error(server.post("/translate", b'{"q": "\xff\xfe"}'), 400, "not UTF-8", "0xff")
    assert_error(server.post("/translate", b""), 400, "empty")
    assert_error(server.post("/translate", b"{'q': 1}"), 400, "not valid JSON")
    for q in (5, [1, 2], {"a": 1}, True):
        assert_error(server.post("/translate", {"q": q, **LIBRE}), 400, "expected a string or a list of strings")
    assert_error(server.post("/translate", {"q": "x" * 3001, **LIBRE}), 413, "3,000", "--max-chars")
    assert_error(server.post("/translate", {"q": ["Hi."] * 65, **LIBRE}), 413, "65 texts", "--max-sentences")
    assert_error(server.post("/translate", {"q": "Hi. " * 65, **LIBRE}), 413, "65 sentences", "--max-sentences")
    multipart = {"Content-Type": "multipart/form-data; boundary=x"}
    assert_error(server.post("/translate", b"--x--", headers=multipart), 400, "multipart")
    disconnecting = http.client.HTTPConnection("127.0.0.1", server.port)  # a client that leaves mid-request
    disconnecting.request("POST", "/translate", json.dumps({"q": SENTENCES, **LIBRE}).encode())
    disconnecting.close()
    assert server.post("/translate", {"q": "I love apples", **LIBRE})[2] == {"translatedText": "我喜欢苹果"}


@pytest.mark.system
def test_glossaries_reach_the_translation_server_wide_and_per_request(server):
    """The server's --glossary applies to every request; a request's own `glossary` replaces it; bad glossaries get a
    one-line 400 or 413 and the server carries on."""
    assert "香蕉" in server.post("/translate", {"q": "I love the xylophone", **LIBRE})[2]["translatedText"]
    own = {"q": ["she likes tea", "I love the xylophone"], **LIBRE, "glossary": [["tea", "咖啡"]]}
    tea, xylophone = server.post("/translate", own)[2]["translatedText"]
    assert "咖啡" in tea and "香蕉" not in xylophone
    native = server.post("/v1/translate", {"texts": ["she likes tea"], "glossary": [["tea", "咖啡"]], "beam": 1})
    assert "咖啡" in native[2]["translations"][0]["text"] and native[2]["decode"]["constraints"] == "hard"
    off = server.post(
        "/v1/translate", {"texts": ["she likes tea"], "glossary": [["tea", "咖啡"]], "constraints": "off"}
    )
    assert "咖啡" not in off[2]["translations"][0]["text"]
    assert_error(server.post("/translate", {"q": "tea", **LIBRE, "glossary": {"tea": "x"}}), 400, "glossary")
    assert_error(server.post("/translate", {"q": "tea", **LIBRE, "glossary": [["tea", ""]]}), 400, "glossary[0]")
    assert_error(
        server.post("/v1/translate", {"texts": ["tea"], "glossary": [["a", "b"]] * 1001}), 413, "--max-glossary"
    )
    long_term = [["tea", "茶" * 200]]  # longer than any output of the toy model (128 positions)
    assert_error(server.post("/v1/translate", {"texts": ["tea"], "glossary": long_term}), 400, "subwords")
    sampled = server.post("/v1/translate", {"texts": ["I love the xylophone"], "sampling": True})
    assert_error(sampled, 422, "constraints off")
    soft = server.post(
        "/v1/translate", {"texts": ["she likes tea"], "glossary": [["tea", "咖啡"]], "constraints": "soft"}
    )
    assert_error(soft, 422, "constraints soft needs a model trained with data.terminology")
    assert server.post("/translate", {"q": "I love apples", **LIBRE})[2] == {"translatedText": "我喜欢苹果"}


@pytest.mark.system
def test_html_inline_elements_come_back_around_their_translation(server):
    """`I love <b>apples</b>` was translated as two sentences (我喜欢狗 <b>吗？</b>); now as one, with the element
    around the words that translate its text, in the plain API and the native one."""
    html_text = '<p>I love <b>apples</b></p><p>Do you like <a href="/t?x=1&amp;y=2">tea</a>?</p>'
    plain = server.post("/translate", {"q": "I love apples", **LIBRE})[2]["translatedText"]
    answer = server.post("/translate", {"q": html_text, **LIBRE, "format": "html"})[2]["translatedText"]
    assert answer.startswith(f"<p>{plain[:-2]}<b>{plain[-2:]}</b></p>"), answer  # 我喜欢<b>苹果</b>
    assert answer.count('<a href="/t?x=1&amp;y=2">') == 1 and answer.endswith("</p>"), answer
    native = server.post("/v1/translate", {"texts": [html_text], "format": "html"})[2]["translations"][0]["text"]
    assert native == answer


@pytest.mark.system
def test_health_metrics_and_page(server, toy_run):
    server.post("/translate", {"q": ["I love apples", "Do you like tea?"], **LIBRE})
    health = server.request("GET", "/health")[2]
    assert health["status"] == "ok" and health["model"]["source"] == "en" and health["queue"]["limit"] == 4096
    assert Path(health["model"]["checkpoint"]).parents[1] == Path(toy_run)  # the run folder, as it was given
    status, headers, metrics = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert re.search(r'^mtcli_requests_total\{route="/translate",status="200"\} \d+$', metrics, re.M)
    assert re.search(r'^mtcli_request_seconds_bucket\{route="/translate",le="\+Inf"\} \d+$', metrics, re.M)
    assert int(re.search(r"^mtcli_sentences_total (\d+)$", metrics, re.M)[1]) >= 2
    assert re.search(r"^mtcli_queue_sentences 0$", metrics, re.M)
    status, headers, page = server.request("GET", "/")
    assert status == 200 and "<textarea" in page and not re.search(r"(src|href)=\"(https?:)?//", page)


# ---------------------------------------------------------------------------------------------------------------------
# Faults: a timeout, a small queue, API keys, SIGTERM under load


@pytest.mark.system
def test_a_request_over_its_time_gets_503_and_retry_after(toy_run):
    srv = Server(toy_run, "--timeout", "0.001")  # no translation is that fast
    try:
        headers = assert_error(srv.post("/translate", {"q": SENTENCES, **LIBRE}), 503, "0.001 s (--timeout)")
        assert int(headers["retry-after"]) >= 1 and srv.request("GET", "/health")[0] == 200
    finally:
        assert srv.stop() == 0


def burst(srv: Server, count: int, body_of) -> list:
    """`count` requests at once, each from its own thread: [(status, headers, body) or the exception]."""
    results: list = [None] * count
    start = threading.Barrier(count)

    def client(i: int) -> None:
        start.wait()
        try:
            results[i] = srv.post("/translate", body_of(i), timeout=120)
        except (OSError, http.client.HTTPException) as e:
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


def metric(srv: Server, name: str) -> int:
    return int(re.search(rf"^{name} (\d+)$", srv.request("GET", "/metrics")[2], re.M)[1])


@pytest.mark.system
def test_requests_that_time_out_are_not_translated_and_the_next_is_answered(server, toy_run):
    """Issue 59: after a burst of requests answered 503 by --timeout, the worker went on translating them and the
    next requests got 503 too, while /health showed an empty queue. Now the rest of the burst is skipped: a small
    request sent just after is answered, at most the model batch in progress is translated after the answers, and
    /health names the batch that keeps the model busy. Times are scaled to this machine's speed: one sentence's
    time, measured on the module's server, sets --timeout (20 of them, 3 to 15 s); the burst is 1,024 of them."""
    server.post("/translate", {"q": "I love apples", **LIBRE})  # warm
    one = 0.0
    for _ in range(3):
        start = time.monotonic()
        assert server.post("/translate", {"q": "I love apples", **LIBRE})[0] == 200
        one = max(one, time.monotonic() - start)
    timeout = min(max(20 * one, 3.0), 15.0)
    # one sentence a model batch: the worker can skip what is left after any sentence
    srv = Server(toy_run, "--timeout", f"{timeout:.2f}", "--set", "decode.batch_sentences=1")
    try:
        for _ in range(5):  # the first translations warm the model up, which may take more than --timeout
            if srv.post("/translate", {"q": "I love apples", **LIBRE})[0] == 200:
                break
        texts = (SENTENCES * 2)[:64]
        start = time.monotonic()  # one sentence's model time, one a batch as in the burst
        assert srv.post("/translate", {"q": texts[:16], **LIBRE})[0] == 200
        sentence = (time.monotonic() - start) / 16
        answers: list = []
        thread = threading.Thread(target=lambda: answers.extend(burst(srv, 16, lambda i: {"q": texts, **LIBRE})))
        thread.start()
        deadline, batch = time.monotonic() + timeout, None
        while (batch is None or batch["sentences"] < 64) and time.monotonic() < deadline:  # the burst's, not one
            time.sleep(0.01)
            batch = srv.request("GET", "/health")[2]["batch"]
        assert batch is not None and batch["sentences"] >= 64 and batch["requests"] >= 1 and batch["seconds"] >= 0
        thread.join(timeout=3 * timeout + 30)
        # the requests served first may finish within --timeout (on a fast machine one took 1.3 s of the 3): at most
        # twice as many as the measured speed allows; the rest are 503 and their sentences skipped
        statuses = [a[0] if isinstance(a, tuple) else a for a in answers]
        assert set(statuses) <= {200, 503} and statuses.count(503) >= 1, answers[:1]
        assert statuses.count(200) <= 2 * timeout / (64 * sentence) + 1, (statuses, sentence, timeout)
        assert all(len(body["translatedText"]) == 64 for status, _, body in answers if status == 200)
        assert all("--timeout" in body["error"] for status, _, body in answers if status == 503)
        translated = metric(srv, "mtcli_sentences_total")

        assert srv.post("/translate", {"q": "I love apples", **LIBRE})[2] == {"translatedText": "我喜欢苹果"}
        deadline, health = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            health = srv.request("GET", "/health")[2]
            if health["batch"] is None:
                break
            time.sleep(0.01)
        assert health["batch"] is None and health["queue"]["sentences"] == health["queue"]["requests"] == 0
        # after the answers: the sentence in progress then, and the new request's
        assert metric(srv, "mtcli_sentences_total") - translated <= 2
        assert metric(srv, "mtcli_skipped_sentences_total") > 0
        assert srv.stop() == 0
    finally:
        if srv.proc.poll() is None:  # a failed check above: the server may be busy for minutes
            srv.proc.kill()
            srv.proc.wait()


@pytest.mark.system
def test_overload_keys_and_sigterm_drain(toy_run, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# one per line\nsecret-1\nsecret-2\n")
    srv = Server(toy_run, "--queue-size", "8", "--max-sentences", "8", "--api-keys", str(keys), "--precision", "fp32")
    try:
        assert_error(srv.post("/translate", {"q": "I love apples", **LIBRE}), 401, "API key")
        assert_error(srv.post("/translate", {"q": "Hi", **LIBRE, "api_key": "secret-3"}), 401, "API key")
        bearer = {"Authorization": "Bearer secret-2"}
        assert srv.post("/v1/translate", {"texts": ["I love apples"]}, headers=bearer)[0] == 200
        expected = []  # in requests of 8 sentences, the most this server takes at once
        for start in range(0, len(SENTENCES), 8):
            body = {"q": SENTENCES[start : start + 8], **LIBRE, "api_key": "secret-1"}
            expected += srv.post("/translate", body)[2]["translatedText"]

        # 256 clients at once against a queue of 8 sentences: some are turned away, none is answered wrong
        before = rss_mb(srv.proc.pid)
        results = burst(srv, 256, lambda i: {"q": SENTENCES[i % 40], **LIBRE, "api_key": "secret-1"})
        statuses = [r[0] for r in results if isinstance(r, tuple)]
        assert len(statuses) == 256, [r for r in results if not isinstance(r, tuple)][:3]
        assert statuses.count(503) > 0 and statuses.count(200) > 0 and set(statuses) == {200, 503}
        for i, (status, headers, body) in enumerate(results):
            if status == 200:
                assert body["translatedText"] == expected[i % 40], i
            else:
                assert int(headers["retry-after"]) >= 1 and "--queue-size 8" in body["error"]
        assert srv.proc.poll() is None and rss_mb(srv.proc.pid) - before < 200

        # SIGTERM while 16 clients keep sending: every request the server took is answered, then it exits 0
        answers: list = []  # (client, answer, whether SIGTERM had been sent when it came)
        stop_sent = threading.Event()

        def client(i: int) -> None:
            while True:
                try:
                    answer = srv.post("/translate", {"q": SENTENCES[i], **LIBRE, "api_key": "secret-1"}, timeout=60)
                except (OSError, http.client.HTTPException):  # refused or reset: the server stopped accepting
                    assert stop_sent.is_set()
                    return
                answers.append((i, answer, stop_sent.is_set()))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        while len(answers) < 40:
            time.sleep(0.01)
        stop_sent.set()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=90)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
    for i, (status, _, body), _ in answers:
        assert status == 503 or body["translatedText"] == expected[i], (status, body)
    assert any(status == 200 and after for _, (status, _, _), after in answers)  # in flight at SIGTERM, answered
    answered, accepted = srv.answered()
    assert answered == accepted == srv.responses, (answered, accepted, srv.responses)
