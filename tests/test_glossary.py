"""Glossaries: the file format and its errors, the matching rules (whole words, case, longest first, scripts without
spaces), term accuracy, and a glossary through translate, eval, data synthesize and the server's request checks."""

import json

import pytest

from mtcli.errors import MtcliError
from mtcli.glossary import Glossary, TermCheck, expected_terms, load_glossary, term_accuracy


def glossary(*pairs) -> Glossary:
    g = Glossary()
    for source, target in pairs:
        g.add(source, target)
    return g


def test_a_glossary_file_with_comments_blank_lines_and_a_conflict(tmp_path, log):
    path = tmp_path / "terms.tsv"
    path.write_text("# fruit\napple\t苹果\n\n  New York \t 纽约\napple\t蘋果\nAPPLE\t苹果\n", encoding="utf-8")
    g = load_glossary(path)
    assert len(g) == 2
    assert [(m.source, m.target) for m in g.matches("An Apple in New York")] == [
        ("Apple", "苹果"),
        ("New York", "纽约"),
    ]
    assert g.conflicts == 1  # APPLE -> 苹果 repeats the first entry; 蘋果 conflicts with it
    assert sum("given again with another target term" in line for line in log) == 1


@pytest.mark.parametrize(
    "content, message",
    [
        (b"apple \xe8\x8b\xb9\xe6\x9e\x9c\n", ":1: no tab"),
        (b"ok\tfine\n\t\xe8\x8b\xb9\xe6\x9e\x9c\n", ":2: an empty source term"),
        (b"apple\t \n", ":1: an empty target term"),
        (b"a\tb\tc\n", ":1: more than one tab"),
        (b"ok\tfine\napple\t\xe8\x8b\n", ":2: not valid UTF-8"),
        (b"...\t!\n" + b" ".join([b"w"] * 40) + b"\tx\n", ":2: a source term of 40 words"),
    ],
)
def test_bad_glossary_lines_are_one_error_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_bytes(content)
    with pytest.raises(MtcliError, match=message) as error:
        load_glossary(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert path.read_bytes() == content  # nothing the user owns changes
    with pytest.raises(MtcliError, match="no such file"):
        load_glossary(tmp_path / "missing.tsv")


def test_whole_words_only_and_any_whitespace_between_them():
    g = glossary(("apple", "苹果"), ("ice cream", "冰淇淋"))
    assert [m.source for m in g.matches("pineapple, pine-apple, apples, apple.")] == ["apple"]
    assert [m.source for m in g.matches("ice\tcream and ice  cream, icecream")] == ["ice\tcream", "ice  cream"]


def test_longest_match_wins_then_the_leftmost_and_matches_never_overlap():
    g = glossary(("New", "新"), ("New York", "纽约"), ("York City", "约克城"), ("New York City", "纽约市"))
    assert [m.target for m in g.matches("New York City")] == ["纽约市"]
    g = glossary(("New York", "纽约"), ("York City", "约克城"))
    assert [m.target for m in g.matches("New York City")] == ["纽约"]  # equal length: the leftmost, no overlap
    assert [m.target for m in g.matches("York City")] == ["约克城"]


def test_scripts_without_spaces_match_at_any_character():
    g = glossary(("苹果", "apple"), ("东京", "Tokyo"))
    matches = g.matches("我喜欢苹果树。东京很大")
    assert [(m.start, m.end, m.target) for m in matches] == [(3, 5, "apple"), (7, 9, "Tokyo")]


def test_term_accuracy_against_a_hand_computed_value():
    g = glossary(("apple", "Apfel"), ("car", "Auto"))
    sources = ["an apple and a car", "apple, apple", "no terms"]
    checks = expected_terms(g, sources)
    assert checks == [
        TermCheck(0, "apple", "Apfel"),
        TermCheck(0, "car", "Auto"),
        TermCheck(1, "apple", "Apfel"),
        TermCheck(1, "apple", "Apfel"),
    ]
    hypotheses = ["ein apfel und ein Auto", "Apfel, Birne", ""]
    # case-sensitive: Auto, one of two Apfel in line 1 -> 2 of 4; ignoring case: also apfel in line 0 -> 3 of 4
    assert term_accuracy(checks, hypotheses) == {"terms": 4, "accuracy": 50.0, "accuracy_lc": 75.0}
    assert term_accuracy([], hypotheses)["accuracy"] is None


def test_a_request_glossary_is_checked_with_its_limits_stated():
    from mtcli.serve_requests import HTTPError, ServeLimits, read_glossary

    limits = ServeLimits(max_glossary=3)
    assert read_glossary(None, limits) is None
    assert len(read_glossary([["tea", "咖啡"], [" apple ", "苹果"]], limits)) == 2
    for value, status, words in [
        ("tea", 400, "expected a list"),
        ([["tea"]], 400, "glossary[0]"),
        ([["tea", 5]], 400, "two strings"),
        ([["a", "b"], ["", "x"]], 400, "glossary[1]: an empty source term"),
        ([["a", "b"]] * 4, 413, "the limit is 3 per request (--max-glossary)"),
    ]:
        with pytest.raises(HTTPError) as error:
            read_glossary(value, limits)
        assert error.value.status == status and words in error.value.message, error.value.message


# ---------------------------------------------------------------------------------------------------------------------
# Through the commands, on the toy model


def contains_all(text: str, *terms: str) -> bool:
    return all(term in text for term in terms)


@pytest.mark.model
def test_hard_constraints_write_every_term_through_translate(toy_run, tmp_path):
    """Terms the toy model never writes for these sources (香蕉 is two subwords), one or two in a line, greedy and
    beam; a line without terms is translated as without the glossary."""
    from conftest import invoke

    path = tmp_path / "terms.tsv"
    path.write_text("apples\t香蕉\ntea\t咖啡\n", encoding="utf-8")
    lines = ["I love apples", "she likes tea and apples", "the cat eats fish"]
    plain = invoke("translate", "--run", toy_run, *lines).stdout.splitlines()
    for beam in ("1", "4"):
        out = invoke("translate", "--run", toy_run, "--glossary", path, "--beam", beam, *lines).stdout.splitlines()
        assert contains_all(out[0], "香蕉") and contains_all(out[1], "香蕉", "咖啡"), out
        if beam == "4":
            assert out[2] == plain[2]
    off = invoke("translate", "--run", toy_run, "--glossary", path, "--set", "decode.constraints=off", *lines)
    assert off.stdout.splitlines() == plain


@pytest.mark.model
def test_a_term_the_model_writes_inside_a_longer_piece_is_not_written_again(toy_run):
    """Chinese has no spaces, so the toy vocabulary holds pieces such as 吃新鲜的梨: a glossary asking for the word
    the model writes anyway (pears -> 梨) was written a second time (她晚上总是吃新鲜的梨吗？梨吗？) because the
    search counted only its own pieces. Now a term the text holds counts as written: never twice, and nearly every
    line translates as without the glossary."""
    from mtcli.toy import OBJECTS, toy_pairs
    from mtcli.translate import Translator

    translator = Translator.from_run(toy_run, device="cpu", precision="fp32")
    lines, glossaries = [], []
    for en, zh in toy_pairs()["test"][:200]:
        for word, chinese in (o for objects in OBJECTS.values() for o in objects):
            if f" {word} " in f" {en} " and chinese in zh:
                glossary = Glossary()
                glossary.add(word, chinese)
                lines.append(en)
                glossaries.append(glossary)
                break
    plain = translator.translate(lines, beam=4)
    hard = [h[0].text for h in translator.translate_nbest(lines, glossary=glossaries, constraints="hard", beam=4)]
    terms = [next(iter(g.terms.values())) for g in glossaries]
    usual = [i for i, term in enumerate(terms) if term in plain[i]]
    assert len(usual) >= 50
    assert all(hard[i].count(terms[i]) == plain[i].count(terms[i]) for i in usual)
    # the same translation, but for the few lines where the beam's slots, shared between banks, lost the best path
    assert sum(hard[i] == plain[i] for i in usual) >= 0.9 * len(usual)


@pytest.mark.model
def test_eval_reports_term_accuracy_of_each_system(toy_run, tmp_path):
    from conftest import invoke

    src, ref, terms = tmp_path / "src.en", tmp_path / "ref.zh", tmp_path / "terms.tsv"
    src.write_text("I love apples\nshe likes tea\nthe cat eats fish\n", encoding="utf-8")
    ref.write_text("我喜欢香蕉\n她喜欢咖啡\n猫吃鱼\n", encoding="utf-8")
    terms.write_text("1\tapples\t香蕉\n2\ttea\t咖啡\n3\tfish\t鱼\n", encoding="utf-8")
    args = ["eval", "--run", toy_run, "--src", src, "--ref", ref, "--metrics", "bleu", "--json"]
    hard = json.loads(invoke(*args, "--terms", terms).stdout)
    # lines 1 and 2 are forced; line 3's term is the one the model writes anyway
    assert hard["terms"] == {"terms": 3, "accuracy": 100.0, "accuracy_lc": 100.0}
    off = json.loads(invoke(*args, "--terms", terms, "--set", "decode.constraints=off", "--compare", toy_run).stdout)
    assert off["terms"]["accuracy"] == 33.33  # on its own the toy model writes only 鱼
    assert [s["terms"]["accuracy"] for s in off["comparison"]["systems"]] == [33.33, 33.33]


@pytest.mark.model
def test_data_synthesize_translates_with_the_glossary_and_it_keys_the_output(toy_run, tmp_path):
    from conftest import invoke

    mono, glossary = tmp_path / "mono.en", tmp_path / "g.tsv"
    mono.write_text("I love apples\nshe likes tea\n", encoding="utf-8")
    glossary.write_text("apples\t香蕉\n", encoding="utf-8")
    out = tmp_path / "synth"
    invoke("data", "synthesize", "--teacher", toy_run, "--input", mono, "--out", out, "--glossary", glossary)
    assert "香蕉" in (out / "train.zh").read_text(encoding="utf-8").splitlines()[0]
    glossary.write_text("apples\t梨\n", encoding="utf-8")  # another glossary is another translation, not a reuse
    invoke("data", "synthesize", "--teacher", toy_run, "--input", mono, "--out", out, "--glossary", glossary, "--force")
    assert "梨" in (out / "train.zh").read_text(encoding="utf-8").splitlines()[0]
