"""Word alignments from the model itself, and HTML tags placed by them, on a real corpus: a model trained with guided
alignment (train.guided_alignment) against the same recipe without it.

    python benchmarks/align_quality.py --base runs/multi30k --guided runs/multi30k-guided [--split valid]

For each model, on the split (at most --lines lines, the run's beam):
- BLEU of its translations, and the time of translating with --alignments against without (paired rounds);
- its word alignments against eflomal's alignments of (source, that model's own output), which eflomal aligns
  together with the training corpus (its statistics need more than a test set): precision, recall, F1 and AER
  (eflomal's links as the sure ones). The guided model reads its trained head; the base model falls back to the
  averaged heads of the same layer (what `translate --alignments` does for a model trained without it);
- tag placement: each source line gets 1-2 spans of 1-3 words wrapped in <b>, <i>, <a href="...">, or a nested pair
  (<b> around the span, <i> around one of its words), translated as HTML, by word alignment and by the Argos-style
  method (each element's text translated alone and looked for). A tag is correct when it wraps exactly the words
  of the covering span of the target words eflomal aligns to its source words in (source, output) (a tag must be
  contiguous); tags whose source words eflomal leaves unaligned are not scored. Output parsed back: well-formed;
  its text without tags equal to the untagged translation (tags change no words).

Prints a table and writes benchmarks/align_quality.json (--json elsewhere). Judge on a split nothing was tuned on.
"""

from __future__ import annotations

import argparse
import html
import json
import random
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtcli.align import align_chunk  # noqa: E402
from mtcli.checkpoint import resolve_checkpoint  # noqa: E402
from mtcli.clean import clean_line  # noqa: E402
from mtcli.corpus import open_splits  # noqa: E402
from mtcli.data import eval_texts  # noqa: E402
from mtcli.device import cpu_name  # noqa: E402
from mtcli.glossary import words  # noqa: E402
from mtcli.outputs import new_file  # noqa: E402
from mtcli.scoring import score  # noqa: E402
from mtcli.translate import Translator, translate_html  # noqa: E402

OWN_JSON = ROOT / "benchmarks" / "align_quality.json"  # replaced by each run; another existing file is refused


def training_pairs(translator: Translator) -> tuple[list[str], list[str]]:
    train = open_splits(translator.config.data, Path(translator.config.data.cache_dir))["train"]
    sources, targets = [], []
    for s, t in train.batches():
        sources += [clean_line(x) for x in s]
        targets += [clean_line(x) for x in t]
    return sources, targets


def link_scores(found: list[list], sure: list[list]) -> dict:
    """Precision, recall, F1 and AER (Och & Ney 2003, sure = possible = `sure`) of `found` links, in percent."""
    hits = sum(len(set(a) & set(s)) for a, s in zip(found, sure))
    n_found, n_sure = sum(len(set(a)) for a in found), sum(len(set(s)) for s in sure)
    precision, recall = hits / max(n_found, 1), hits / max(n_sure, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-9)
    aer = 1 - 2 * hits / max(n_found + n_sure, 1)
    return {k: round(100 * v, 2) for k, v in (("precision", precision), ("recall", recall), ("f1", f1), ("aer", aer))}


def tagged(sources: list[str], seed: int = 0) -> tuple[list[str], list[list[tuple[str, int, int]]]]:
    """Each line as HTML with 1-2 word spans wrapped (see the module docstring), and its tags: (id, first source
    word, last source word + 1)."""
    rng = random.Random(seed)
    documents, tags = [], []
    for line in sources:
        spans = words(line)
        taken: list[tuple[int, int]] = []
        wanted = 2 if len(spans) >= 6 and rng.random() < 0.5 else 1
        for _ in range(10 * wanted):
            if len(taken) == wanted or not spans:
                break
            length = rng.randint(1, min(3, len(spans)))
            start = rng.randrange(len(spans) - length + 1)
            if all(start + length <= a or b <= start for a, b in taken) and any(
                ch.isalpha() for ch in line[spans[start][0] : spans[start + length - 1][1]]
            ):
                taken.append((start, start + length))
        taken.sort()
        line_tags, pieces, pos = [], [], 0
        for k, (a, b) in enumerate(taken):
            begin, end = spans[a][0], spans[b - 1][1]
            pieces.append(html.escape(line[pos:begin], quote=False))
            kind = rng.choice(["b", "i", "a", "nested"])
            inner = html.escape(line[begin:end], quote=False)
            if kind == "nested" and b - a >= 2:
                w = rng.randrange(a, b)
                wb, we = spans[w][0], spans[w][1]
                inner = (
                    html.escape(line[begin:wb], quote=False)
                    + f'<i id="t{k}n">{html.escape(line[wb:we], quote=False)}</i>'
                    + html.escape(line[we:end], quote=False)
                )
                line_tags.append((f"t{k}n", w, w + 1))
                kind = "b"
            elif kind == "nested":
                kind = "b"
            attrs = f' id="t{k}"' + (' href="/w?a=1&amp;b=&quot;2&quot;"' if kind == "a" else "")
            pieces.append(f"<{kind}{attrs}>{inner}</{kind}>")
            line_tags.append((f"t{k}", a, b))
            pos = end
        pieces.append(html.escape(line[pos:], quote=False))
        documents.append("<p>" + "".join(pieces) + "</p>")
        tags.append(line_tags)
    return documents, tags


class TagSpans(HTMLParser):
    """The text of an HTML fragment without its tags, each tag's id with its character span in that text, and
    whether the tags pair up."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.text, self.spans, self.stack, self.well_formed = "", {}, [], True

    def handle_starttag(self, tag, attrs):
        self.stack.append((tag, dict(attrs).get("id"), len(self.text)))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1][0] != tag:
            self.well_formed = False
            return
        _, tag_id, start = self.stack.pop()
        if tag_id:
            self.spans.setdefault(tag_id, []).append((start, len(self.text)))

    def handle_data(self, data):
        self.text += data


def placement(outputs: list[str], plain: list[str], tags, links) -> dict:
    """Share of scorable tags placed exactly, well-formed outputs, outputs whose text equals the plain translation."""
    correct = scored = unscorable = well_formed = same_text = 0
    for output, translation, line_tags, pair_links in zip(outputs, plain, tags, links):
        parsed = TagSpans()
        parsed.feed(output)
        parsed.close()
        well_formed += parsed.well_formed and not parsed.stack
        same_text += parsed.text.strip() == translation.strip()
        target_words = words(parsed.text)
        for tag_id, a, b in line_tags:
            aligned = sorted({j for i, j in pair_links if a <= i < b})
            if not aligned:
                unscorable += 1
                continue
            scored += 1
            expected = set(range(aligned[0], aligned[-1] + 1))
            spans = parsed.spans.get(tag_id, [])
            if len(spans) != 1:
                continue
            start, end = spans[0]
            covered = {k for k, (s, e, _) in enumerate(target_words) if start <= s and e <= end}
            correct += covered == expected
    return {
        "tags_scored": scored,
        "tags_unaligned": unscorable,
        "correct": round(100 * correct / max(scored, 1), 2),
        "well_formed": round(100 * well_formed / max(len(outputs), 1), 2),
        "text_unchanged": round(100 * same_text / max(len(outputs), 1), 2),
    }


def timed(function, *args):
    began = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - began


def measure(name: str, translator: Translator, sources, references, train, rounds: int) -> dict:
    decode = translator.config.decode
    print(f"{name}: translating {len(sources):,} lines (beam {decode.beam}) ...", flush=True)
    plain_times, aligned_times = [], []
    for _ in range(rounds):  # paired and alternating: the machine's speed drifts
        plain, seconds = timed(translator.translate_nbest, sources, decode)
        plain_times.append(seconds)
        aligned, seconds = timed(lambda: translator.translate_nbest(sources, decode, alignments=True))
        aligned_times.append(seconds)
    outputs = [h[0].text for h in aligned]
    assert outputs == [h[0].text for h in plain], "alignments changed a translation"
    bleu = score(outputs, references, translator.config.data.tgt_lang)
    print(f"{name}: aligning (source, output) with eflomal ...", flush=True)
    sure = align_chunk(sources + train[0], outputs + train[1])[: len(sources)]
    found = [h[0].alignment for h in aligned]
    documents, tags = tagged(sources)
    result = {
        "bleu": round(bleu["bleu"], 2),
        "chrf": round(bleu["chrf"], 2),
        "seconds": [round(min(plain_times), 2), round(min(aligned_times), 2)],
        "alignments_time_ratio": round(min(aligned_times) / min(plain_times), 3),
        "alignment_vs_eflomal": link_scores(found, sure),
        "heads": "guided head" if translator.guided_alignment else "averaged heads (no guided alignment)",
    }
    for method, by_links in (("by_alignment", True), ("argos_style", False)):
        print(f"{name}: {len(documents):,} tagged lines, tags placed {method} ...", flush=True)
        outputs_html = translate_html(translator, documents, decode, by_links)
        result[f"tags_{method}"] = placement(outputs_html, outputs, tags, sure)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the recipe's run (or checkpoint)")
    parser.add_argument("--guided", type=Path, required=True, help="the same recipe with train.guided_alignment")
    parser.add_argument("--split", default="valid", choices=["valid", "test"])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="paired timing rounds")
    parser.add_argument("--json", type=Path, default=OWN_JSON)
    args = parser.parse_args()
    if args.json.resolve() != OWN_JSON and args.json.exists():
        sys.exit(f"{args.json} exists: give a new file")
    results: dict = {"cpu": cpu_name(), "split": args.split, "models": {}}
    train = None
    for name, path in (("guided", args.guided), ("base", args.base)):
        checkpoint = path if (path / "model.safetensors").is_file() else resolve_checkpoint(path)
        translator = Translator.from_checkpoint(checkpoint, "cpu")
        sources, references = eval_texts(translator.config, args.split)
        sources, references = sources[: args.lines], references[: args.lines]
        train = train or training_pairs(translator)
        results["models"][name] = {"checkpoint": str(checkpoint), "precision": translator.precision}
        results["models"][name] |= measure(name, translator, sources, references, train, args.rounds)
        results["lines"] = len(sources)
    print(json.dumps(results, indent=1))
    with new_file(args.json, force=True) as out:
        out.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
