"""Glossaries: the file format and its errors, the matching rules (whole words, case, longest first, scripts without
spaces), marking, and term accuracy."""

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
        (b"apple __done__\tx\n", ":1: a term holds a marker word"),
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


def test_marking_puts_the_target_term_after_the_source_term_between_marker_words():
    g = glossary(("apples", "苹果"))
    assert g.mark("I love apples") == "I love __source__ apples __target__ 苹果 __done__"
    assert g.mark("nothing here") == "nothing here"


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
