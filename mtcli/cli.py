"""The `mtcli` command: parses options, loads the config and calls one library function per command.

Set up once here, for every command: the `mtcli` logger (stderr), glibc's allocator (keep freed memory), and the
exit status of errors (one line, status 2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
import typer.core

from mtcli import __version__
from mtcli.config import CT2_QUANTIZATIONS
from mtcli.config_loader import shipped_config_names
from mtcli.errors import MtcliError
from mtcli.log import logger


class _PlainTypes:
    """Help without typer's `<bool>` beside on/off flags, and with an element's type (`<path>`, not `<list[path]>`)
    beside repeatable options and arguments."""

    def get_params(self, ctx: typer.Context) -> list:
        params = super().get_params(ctx)
        for param in params:
            if param.metavar is not None:
                continue
            if getattr(param, "is_flag", False):
                param.display_type_rich = lambda ctx: None
            elif (param.multiple or param.nargs == -1) and hasattr(
                param, "display_type"
            ):  # typer >= 0.25; older ones print click's types
                label = param.display_type(ctx).replace("list[", "").replace("]", "").lower()
                param.display_type_rich = lambda ctx, label=label: label
        return params


class _Command(_PlainTypes, typer.core.TyperCommand):
    pass


class _Group(_PlainTypes, typer.core.TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    invoke_without_command=True,  # bare `mtcli` prints the help and exits 0, as git and pip do
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Train, run and score Transformer machine-translation models from one config file.",
)
data_app = typer.Typer(
    cls=_Group, invoke_without_command=True, help="Prepare corpora: download, SentencePiece, encode, cache."
)
app.add_typer(data_app, name="data", help="Prepare a corpus: fetch, fit SentencePiece, encode, cache.")

ConfigOpt = typer.Option(
    ...,
    "--config",
    "-c",
    help=f"YAML config: a path, or the name of a shipped config ({', '.join(shipped_config_names())}).",
)
SetOpt = typer.Option(None, "--set", help="Override a config key, e.g. --set train.lr=5e-4 (repeatable).")
DecodeSetOpt = typer.Option(
    None, "--set", help="Override a decode setting, e.g. --set decode.no_repeat_ngram=3 (repeatable)."
)
RunOpt = typer.Option(None, "--run", help="Run directory (default: the latest run under ./runs).")
CheckpointOpt = typer.Option(None, "--checkpoint", help="A checkpoint folder (default: the run's best).")
EnsembleOpt = typer.Option(
    None,
    "--ensemble",
    help="Another run (its best checkpoint) or checkpoint folder to translate with, averaging next-token "
    "probabilities; same SentencePiece model needed (repeatable).",
)
DeviceOpt = typer.Option("auto", help="auto, cpu, cuda or cuda:N.")
ForceOpt = typer.Option(False, "--force", help="Replace this command's own earlier output there (never other files).")
ProbeOpt = typer.Option(None, "--probe", help="Source lines for the parity report (default: the run's valid split).")
ProbeRefOpt = typer.Option(None, "--probe-ref", help="References of --probe's lines (reference BLEU in the report).")
ProbeLinesOpt = typer.Option(500, "--probe-lines", help="At most this many probe lines (plus 7 stress lines).")
NoCheckOpt = typer.Option(False, "--no-check", help="Write the export even where the parity report diverges.")
GlossaryOpt = typer.Option(
    None,
    "--glossary",
    help="A glossary: `source term<TAB>target term` lines (UTF-8, # comments). The target term of every source term "
    "found in a line is written in its translation (decode.constraints: hard, the default; soft: the term is marked "
    "in the source for a model trained with data.terminology; off: not applied).",
)
ImportNoCheckOpt = typer.Option(False, "--no-check", help="Write the run even where the parity report diverges.")
FORMATS = {"hf": "hf", "transformers": "hf", "huggingface": "hf", "ctranslate2": "ctranslate2", "ct2": "ctranslate2"}
FORMATS |= {"argos": "argos", "argostranslate": "argos"}
PrecisionOpt = typer.Option(
    None,
    help="auto (bf16 where the device has fast bf16, else fp32), fp32, bf16 or int8 (CPU); default decode.precision.",
)


def _version(value: bool) -> None:
    if value:
        print(f"mtcli {__version__}")
        raise typer.Exit()


def _help_when_bare(ctx: typer.Context) -> None:
    """A group called without a command prints its help and exits 0 (click's no_args_is_help exits 2)."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    _help_when_bare(ctx)
    from mtcli.device import keep_freed_memory, keep_onednn_kernels
    from mtcli.log import setup_logging

    setup_logging()  # messages to stderr, once for every command
    keep_freed_memory()  # process-wide, so chosen here rather than by library code
    keep_onednn_kernels()


@data_app.callback()
def _data(ctx: typer.Context):
    _help_when_bare(ctx)


@data_app.command("prepare", cls=_Command, short_help="Fetch, clean, fit SentencePiece, encode and cache every split.")
def data_prepare(
    config: str = ConfigOpt,
    overrides: list[str] = SetOpt,
    force: bool = typer.Option(False, help="Rebuild the cache even if it exists."),
):
    """Download (or read) the corpus, fit SentencePiece, clean, encode and cache every split.

    Example: mtcli data prepare --config multi30k.yaml --set data.path=../shared/data/multi30k
    """
    from mtcli.batching import describe_batches
    from mtcli.config_loader import load_config
    from mtcli.data import prepare

    cfg = load_config(config, overrides or [])
    logger.info(describe_batches(prepare(cfg, force=force).split("train"), cfg.train.max_tokens, cfg.train.seed))


@data_app.command(
    "synthesize",
    cls=_Command,
    short_help="Translate text with a teacher into a corpus (distillation, back-translation).",
)
def data_synthesize(
    teachers: list[str] = typer.Option(
        ...,
        "--teacher",
        help="A run, a checkpoint folder, or the URL of a LibreTranslate server (e.g. http://127.0.0.1:5000); "
        "several runs: an ensemble (repeatable).",
    ),
    out: Path = typer.Option(..., "--out", help="Corpus folder to write: new or empty (an earlier one: --force)."),
    input_file: Path = typer.Option(None, "--input", "-i", help="A text file to translate, one sentence per line."),
    config: str = typer.Option(
        None, "--config", "-c", help="Translate a split of this config's data instead (the side the teacher reads)."
    ),
    overrides: list[str] = typer.Option(None, "--set", help="Override a key of --config's data (repeatable)."),
    split: str = typer.Option("train", help="With --config: train, valid or test."),
    beam: int = typer.Option(None, help="Beam size (default: the teacher's config)."),
    lenpen: float = typer.Option(None, help="Length penalty (default: the teacher's config)."),
    sampling: bool = typer.Option(
        None, "--sampling/--no-sampling", help="Sample (back-translation) instead of search."
    ),
    temperature: float = typer.Option(None, help="Sampling temperature."),
    top_k: int = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0: all)."),
    top_p: float = typer.Option(None, "--top-p", help="Sample from the smallest set with this probability."),
    precision: str = PrecisionOpt,
    chunk_lines: int = typer.Option(2000, "--chunk-lines", help="Lines per resumable chunk."),
    max_ratio: float = typer.Option(
        None,
        "--max-ratio",
        help="Drop pairs whose longer side is this many times the shorter, in the teacher's subwords (characters for "
        "an HTTP teacher; 0: off). Default: --config's data.max_ratio, else 3.",
    ),
    min_score: float = typer.Option(
        None, "--min-score", help="Drop pairs under this teacher log-probability per subword."
    ),
    drop_worst: float = typer.Option(
        0.0, "--drop-worst", help="Drop this share of pairs, those with the lowest teacher score per subword."
    ),
    src_lang: str = typer.Option(None, "--src-lang", help="An HTTP teacher's source language (default: --config's)."),
    tgt_lang: str = typer.Option(None, "--tgt-lang", help="An HTTP teacher's target language (default: --config's)."),
    api_key: str = typer.Option(None, "--api-key", help="An HTTP teacher's API key."),
    retries: int = typer.Option(5, help="Retries of a failed HTTP request, with exponential backoff."),
    timeout: float = typer.Option(
        120.0,
        "--timeout",
        help="Seconds one HTTP request may take as a whole (connecting, the server's work, reading the answer). A "
        "request gives up after at most timeout x (retries + 1) plus the waits between tries (0.5, 1, 2, ... s with "
        "up to 25% jitter, at most 30 s each; a server's Retry-After up to 60 s instead): 12 to 17 min at the "
        "defaults.",
    ),
    glossary: Path = GlossaryOpt,
    device: str = DeviceOpt,
    force: bool = ForceOpt,
):
    """Translate a text file, or a split of a config's data, with a teacher (a run, an ensemble, or a LibreTranslate
    server) into a corpus folder that data.path and data.train_corpora read: train.<lang> files named by language,
    the teacher's score per subword in train.scores, dropped pairs in dropped.tsv. Killed, it resumes where it
    stopped; run again with the same teacher, input and settings, it reuses its output.

    Example: mtcli data synthesize --teacher runs/multi30k --config multi30k.yaml --out synth/m30k-distilled
    (back-translation: --teacher runs/de-en --input mono.de --sampling --top-k 10 --out synth/bt)
    """
    from mtcli.config_loader import load_config
    from mtcli.outputs import refuse_input_overlap
    from mtcli.synthetic import Filters, file_lines, split_lines, synthesize
    from mtcli.teachers import is_url, open_teacher

    if (input_file is None) == (config is None):
        raise MtcliError("give --input FILE or --config CONFIG (one of them): the text the teacher translates")
    if chunk_lines < 1:
        raise MtcliError(f"--chunk-lines {chunk_lines}: must be positive")
    if not (max_ratio is None or max_ratio == 0 or max_ratio >= 1) or not 0 <= drop_worst < 1:
        raise MtcliError("--max-ratio must be 0 (off) or at least 1, --drop-worst at least 0 and under 1")
    refuse_input_overlap(out, [input_file, glossary, *(t for t in teachers if not is_url(t))], "--out")
    cfg = load_config(config, overrides or []) if config else None
    langs = (src_lang or (cfg.data.src_lang if cfg else None), tgt_lang or (cfg.data.tgt_lang if cfg else None))
    if cfg and not is_url(teachers[0]):
        langs = (None, None)  # a run knows its languages; split_lines checks they fit the config's data
    options = dict(beam=beam, lenpen=lenpen, sampling=sampling, temperature=temperature, top_k=top_k, top_p=top_p)
    options |= dict(precision=precision)
    teacher = open_teacher(teachers, langs, [], device, api_key, retries, timeout, glossary, **options)
    lines = split_lines(cfg, split, teacher.src_lang) if cfg else file_lines(input_file)
    ratio = max_ratio if max_ratio is not None else (cfg.data.max_ratio if cfg else 3.0)
    synthesize(teacher, lines, out, chunk_lines, Filters(ratio, min_score, drop_worst), force)
    print(out)


@app.command(cls=_Command, short_help="Train a model from a config (prepares the data first).")
def train(
    config: str = ConfigOpt,
    overrides: list[str] = SetOpt,
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default: runs/<config name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its last checkpoint."),
):
    """Train a Transformer (prepares the data first if its cache is missing).

    Example: mtcli train --config toy.yaml   (multi-GPU: torchrun --nproc_per_node 8 -m mtcli train --config base.yaml)
    """
    from mtcli.config_loader import load_config
    from mtcli.train import train as run_training

    cfg = load_config(config, overrides or [])
    result = run_training(cfg, run_dir, resume)
    if result.stopped_by in ("SIGINT", "SIGTERM"):
        logger.warning(
            f"interrupted: resume with: mtcli train --config {result.run_dir / 'config.yaml'} "
            f"--run-dir {result.run_dir} --resume"
        )
        raise typer.Exit(130 if result.stopped_by == "SIGINT" else 143)


@app.command(cls=_Command, short_help="Distil a teacher into a smaller student: data, training, scores, int8, card.")
def distill(
    teachers: list[str] = typer.Option(
        ...,
        "--teacher",
        help="The teacher: a run or checkpoint folder (repeat for an ensemble), or a LibreTranslate server's URL.",
    ),
    config: str = ConfigOpt,
    overrides: list[str] = SetOpt,
    mono: Path = typer.Option(None, "--mono", help="Monolingual source text to distil as well, one sentence a line."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default: runs/<config name>)."),
    device: str = DeviceOpt,
    timeout: float = typer.Option(
        120.0,
        "--timeout",
        help="An HTTP teacher: seconds one request may take as a whole. With its 5 retries a request gives up after "
        "at most timeout x 6 plus the waits between tries (at most 30 s each, or a Retry-After up to 60 s): 12 to "
        "17 min at the default.",
    ),
):
    """The student's config (its model, its data and a distill section) trained on the teacher's translations of
    its training sources: synthesize, train, average, score teacher and student with paired tests, export to
    CTranslate2 int8, write MODEL_CARD.md. Each step is skipped when done: after a kill, run the same command.

    Example: mtcli distill --teacher runs/multi30k --config multi30k-student.yaml
    --set data.path=../shared/data/multi30k
    """
    from mtcli.config_loader import load_config
    from mtcli.distill import distill as run_distill

    cfg = load_config(config, overrides or [])
    card = run_distill(cfg, teachers, run_dir, mono, device, timeout)
    if card is None:
        logger.warning("interrupted: run the same command again to continue")
        raise typer.Exit(130)
    print(Path(card["run_dir"]) / "MODEL_CARD.md")


@app.command(cls=_Command, short_help="Translate sentences, a file or stdin.")
def translate(
    text: list[str] = typer.Argument(None, help="Sentences to translate; `-` or none with a pipe reads stdin."),
    run: Path = RunOpt,
    checkpoint: Path = CheckpointOpt,
    input_file: Path = typer.Option(None, "--input", "-i", help="Translate this file, one sentence per line."),
    output_file: Path = typer.Option(
        None, "--output", "-o", help="Write translations here (default: stdout); an existing file needs --force."
    ),
    beam: int = typer.Option(None, help="Beam size (1: greedy); default from the run's config."),
    nbest: int = typer.Option(
        None, help="Print the n best as Moses n-best lines (`i ||| text ||| features ||| score`)."
    ),
    lenpen: float = typer.Option(None, help="Length penalty alpha (0 disables)."),
    max_len_a: float = typer.Option(None, "--max-len-a", help="Output limit: a * source length + b."),
    max_len_b: int = typer.Option(None, "--max-len-b", help="Output limit: a * source length + b."),
    sampling: bool = typer.Option(None, "--sampling/--no-sampling", help="Sample instead of searching."),
    temperature: float = typer.Option(None, help="Sampling temperature."),
    top_k: int = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0: all)."),
    top_p: float = typer.Option(None, "--top-p", help="Sample from the smallest set with this probability."),
    batch_tokens: int = typer.Option(None, "--batch-tokens", help="Source subwords per batch."),
    split_long: bool = typer.Option(
        False, "--split-long", help="Translate lines longer than the model's positions in pieces, not truncated."
    ),
    precision: str = PrecisionOpt,
    ensemble: list[Path] = EnsembleOpt,
    glossary: Path = GlossaryOpt,
    alignments: bool = typer.Option(
        False,
        "--alignments",
        help="Print each translation's word alignment after ` ||| ` (Pharaoh `i-j`: source word i, target word j).",
    ),
    html: bool = typer.Option(
        False,
        "--html",
        help="Each sentence given, or all of --input or stdin, is one HTML document: markup kept, inline tags "
        "put back around the words they hold.",
    ),
    overrides: list[str] = DecodeSetOpt,
    device: str = DeviceOpt,
    force: bool = typer.Option(False, "--force", help="Replace an existing --output file."),
):
    """Translate sentences, a file or stdin with a trained run.

    Example: mtcli translate "I love apples"   |   mtcli translate --input news.en --output news.zh --beam 5
    """
    from mtcli.checkpoint import read_config, resolve_checkpoint
    from mtcli.line_io import open_source, translate_source
    from mtcli.translate import load_translator, translate_html_source

    source = open_source(text, input_file, output_file, force, [run, checkpoint, *(ensemble or [])])
    ckpt = resolve_checkpoint(run, checkpoint)
    options = dict(beam=beam, nbest=nbest, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b)
    options |= dict(sampling=sampling, temperature=temperature, top_k=top_k, top_p=top_p)
    options |= dict(batch_tokens=batch_tokens, precision=precision)
    translator, decode = load_translator(
        ckpt, read_config(ckpt), overrides or [], device, ensemble or [], split_long, glossary, **options
    )
    if html:
        if alignments:
            raise MtcliError("--alignments with --html: alignments count words of plain text; translate without --html")
        translate_html_source(translator, decode, source, input_file, output_file, force)
        return
    if alignments:
        translator.note_alignment_source()
    translate_source(translator, decode, source, output_file, force, alignments)


@app.command("mark-terms", cls=_Command, short_help="Mark a glossary's terms in text, for any engine of a terms model.")
def mark_terms(
    text: list[str] = typer.Argument(None, help="Sentences to mark; `-` or none with a pipe reads stdin."),
    glossary: Path = typer.Option(..., "--glossary", help=GlossaryOpt.help.split(".")[0] + "."),
    input_file: Path = typer.Option(None, "--input", "-i", help="Mark this file, one sentence per line."),
    output_file: Path = typer.Option(
        None, "--output", "-o", help="Write the marked lines here (default: stdout); an existing file needs --force."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing --output file."),
):
    """Write each line with the glossary's terms marked as a model trained with data.terminology reads them
    (`__source__ __target__ <target term> __done__` in place of each source term): what decode.constraints soft
    does inside mtcli, for the CTranslate2, Transformers and Argos exports of such a model, or LibreTranslate.

    Example: mtcli mark-terms --glossary terms.tsv --input news.en --output news.marked.en
    """
    from mtcli.glossary import load_glossary, soft_marked
    from mtcli.line_io import open_source, rewrite_source

    source = open_source(text, input_file, output_file, force, [glossary])
    terms = load_glossary(glossary)
    rewrite_source(source, output_file, force, lambda line: soft_marked(line, terms.matches(line)))


@app.command(
    "eval", cls=_Command, short_help="Score a split or files: BLEU, chrF, chrF++, TER; confidence, paired tests."
)
def evaluate(
    run: Path = RunOpt,
    checkpoint: Path = CheckpointOpt,
    split: str = typer.Option(None, help="A role from data.splits: test (default) or valid."),
    src: Path = typer.Option(None, "--src", help="Source file to translate instead of a split."),
    refs: list[Path] = typer.Option(None, "--ref", help="Reference file for --src (repeatable: several references)."),
    metrics: str = typer.Option("bleu,chrf,chrf++,ter", help="Comma-separated: bleu, chrf, chrf++, ter."),
    confidence: bool = typer.Option(False, "--confidence", help="95% confidence intervals (bootstrap resampling)."),
    compare: list[str] = typer.Option(
        None, "--compare", help="A run, checkpoint folder or file of hypotheses to test against this one (repeatable)."
    ),
    sentence_scores: Path = typer.Option(
        None, "--sentence-scores", help="Write per-segment scores (JSON lines); an existing file needs --force."
    ),
    beam: int = typer.Option(None, help="Beam size (1: greedy); default from the run's config."),
    lenpen: float = typer.Option(None, help="Length penalty alpha."),
    batch_tokens: int = typer.Option(None, "--batch-tokens", help="Source subwords per batch."),
    lowercase: bool = typer.Option(False, "--lowercase", help="Case-insensitive BLEU and chrF (sacreBLEU -lc)."),
    precision: str = PrecisionOpt,
    ensemble: list[Path] = EnsembleOpt,
    glossary: Path = typer.Option(
        None,
        "--glossary",
        help="A glossary (`source term<TAB>target term` lines): its terms are asked of the translation as "
        "decode.constraints says, and term accuracy is reported beside the scores.",
    ),
    terms: Path = typer.Option(
        None,
        "--terms",
        help="Terms per source line, as the WMT 2021 terminology task gives them: `line<TAB>source term<TAB>target "
        "term` (lines from 1): asked of that line's translation, and term accuracy reported.",
    ),
    overrides: list[str] = DecodeSetOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --sentence-scores file."),
):
    """Translate a split (or --src/--ref files) and report sacreBLEU's BLEU, chrF, chrF++ and TER with their
    signatures; --compare tests other systems against this one (paired bootstrap and approximate randomization).

    Example: mtcli eval --run runs/multi30k --split test --confidence --compare runs/multi30k-seed2
    """
    from mtcli.checkpoint import resolve_checkpoint, run_of
    from mtcli.evaluate import eval_config, evaluation_set, format_report
    from mtcli.evaluate import evaluate as run_eval
    from mtcli.glossary import expected_terms, load_line_terms
    from mtcli.outputs import check_file_target
    from mtcli.scoring import ScoreOptions, parse_metrics
    from mtcli.translate import load_translator

    scoring = ScoreOptions(parse_metrics(metrics), lowercase, confidence)
    if sentence_scores is not None:  # before translating: --sentence-scores may be an input, or someone's file
        check_file_target(sentence_scores, force, [src, *(refs or [])], "--sentence-scores")
    ckpt = resolve_checkpoint(run, checkpoint)
    config = eval_config(ckpt, run if checkpoint is not None else None)
    sources, references, stem = evaluation_set(config, split, src, refs or [])  # before the model loads
    if glossary is not None and terms is not None:
        raise MtcliError("give --glossary or --terms, not both")
    line_terms, term_checks = load_line_terms(terms, len(sources)) if terms is not None else (None, None)
    options = dict(beam=beam, lenpen=lenpen, batch_tokens=batch_tokens, precision=precision)
    translator, decode = load_translator(
        ckpt, config, overrides or [], device, ensemble or [], False, glossary, nbest=1, sampling=False, **options
    )
    if line_terms is not None:
        translator.glossary = line_terms
    elif translator.glossary is not None:
        term_checks = expected_terms(translator.glossary, sources)
    out_dir = run_of(ckpt) / "eval"
    name = f"{stem}.{ckpt.name}" + (f".ensemble{len(translator.ensemble) + 1}" if translator.ensemble else "")
    compare = compare or []
    result = run_eval(
        translator, sources, references, decode, out_dir, name, scoring, compare, sentence_scores, True, term_checks
    )
    result["checkpoint"] = str(ckpt)
    result["ensemble"] = [str(p) for p in translator.ensemble]
    print(json.dumps(result, indent=1, ensure_ascii=False) if as_json else format_report(result))


@app.command(cls=_Command, short_help="Average a run's last N checkpoints into a new one.")
def average(
    run: Path = typer.Option(..., "--run", help="Run directory."),
    last: int = typer.Option(5, "--last", help="Average the last N numbered checkpoints."),
    out: Path = typer.Option(
        None, "--out", help="Checkpoint folder to write (default: <run>/checkpoints/average_last<N>)."
    ),
    output: Path = typer.Option(None, "--output", hidden=True, help="The old name of --out (deprecated)."),
    force: bool = ForceOpt,
):
    """Average the weights of a run's last N checkpoints into a new checkpoint.

    Example: mtcli average --run runs/base --last 5   then   mtcli eval --checkpoint runs/base/checkpoints/average_last5
    """
    from mtcli.average import average_last

    if output is not None:  # every other folder writer takes --out; the old name works for one more release
        if out is not None:
            raise MtcliError("give --out only (--output is its old name)")
        logger.warning("warning: --output is deprecated and goes in the next release: use --out")
        out = output
    print(average_last(run, last, out, force))


@app.command(cls=_Command, short_help="Export a checkpoint to Transformers, CTranslate2 or Argos Translate.")
def export(
    run: Path = RunOpt,
    checkpoint: Path = CheckpointOpt,
    format: str = typer.Option(
        ...,
        "--format",
        help="hf (Transformers model + tokenizer; or transformers), ctranslate2 (or ct2), or argos (a .argosmodel "
        "package); any case.",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Folder to write (argos: a .argosmodel file): new or empty (or an earlier export: --force)."
    ),
    force: bool = ForceOpt,
    quantization: str = typer.Option(
        "none", help="CTranslate2 weights: none (float32), int8, int8_float32, float16, bfloat16, int8_bfloat16."
    ),
    overrides: list[str] = DecodeSetOpt,
    probe: Path = ProbeOpt,
    probe_ref: Path = ProbeRefOpt,
    probe_lines: int = ProbeLinesOpt,
    no_check: bool = NoCheckOpt,
    glossary: Path = typer.Option(
        None,
        "--glossary",
        help="A model trained with data.terminology: the parity report also compares term accuracy on the probe "
        "lines that hold this glossary's terms, marked as decode.constraints soft marks them.",
    ),
):
    """Export a checkpoint: a Hugging Face Transformers directory (AutoModelForSeq2SeqLM + AutoTokenizer), a
    CTranslate2 model directory with the SentencePiece model beside it, or an Argos Translate package (a .argosmodel
    file that argostranslate and LibreTranslate install).

    Needs: pip install 'mtcli\\[export]'.

    Every export is checked: the exported model and mtcli translate a probe set (the run's valid split, or --probe,
    plus stress lines), greedy and beam; the comparison is printed and written to parity.json in the export. An
    export that diverges (float32: under 99% identical lines or reference BLEU off by over 0.2; int8 and other
    reduced precisions: BLEU off by over 1.0, or more empty or repeating outputs than mtcli's) is refused with
    exit status 2 unless --no-check.

    The run's decode settings go into the export where its format has a place for them (Transformers'
    generation_config.json; mtcli.json's translate_batch arguments for CTranslate2); --set decode.KEY=VALUE changes
    them, e.g. --set decode.length_norm=power --set decode.early_stopping=true: the search CTranslate2 runs.

    Example: mtcli export --run runs/toy --format hf --out toy-hf
    (or --format ctranslate2 --quantization int8 --out toy-ct2, or --format argos --out toy.argosmodel)
    """
    from mtcli.checkpoint import read_config, resolve_checkpoint
    from mtcli.config_loader import with_overrides
    from mtcli.export import export_ctranslate2, export_hf

    if format.lower() not in FORMATS:
        raise MtcliError(f"--format {format}: choose hf, ctranslate2 or argos (or transformers, ct2)")
    format = FORMATS[format.lower()]
    if format == "hf" and quantization != "none":
        raise MtcliError("--quantization applies to --format ctranslate2 and argos only")
    if quantization not in CT2_QUANTIZATIONS:
        raise MtcliError(f"--quantization {quantization}: choose one of {', '.join(CT2_QUANTIZATIONS)}")
    ckpt = resolve_checkpoint(run, checkpoint)
    parity = parity_options(probe, probe_ref, probe_lines, no_check, glossary)
    decode = with_overrides(read_config(ckpt), overrides, ("decode",)).decode if overrides else None
    if format == "hf":
        print(export_hf(ckpt, out, force, parity, decode))
    elif format == "argos":
        from mtcli.argos import export_argos

        print(export_argos(ckpt, out, quantization, force, parity, decode))
    else:
        print(export_ctranslate2(ckpt, out, quantization, force, parity, decode))


@app.command(cls=_Command, short_help="Check an export's files against the sizes and hashes its parity.json records.")
def verify(
    export: Path = typer.Argument(..., help="An export folder (hf, ctranslate2) or an .argosmodel package."),
):
    """Check that an export is still what its parity report describes: every file parity.json records (size and
    sha256) is there with the same bytes. Prints one line per file that is missing or differs and exits with status 2;
    files the report does not record are listed as such (not checked).

    Example: mtcli verify toy-hf   (or mtcli verify toy.argosmodel)
    """
    from mtcli.parity import verify_export

    problems, unrecorded, checked = verify_export(export)
    for name in unrecorded:
        print(f"{name}: not in parity.json (not checked)")
    for line in problems:
        print(line)
    if problems:
        raise MtcliError(f"{export}: {len(problems)} of {checked} files differ from its parity.json (listed above)")
    print(f"{export}: the {checked} files parity.json records are intact")


def parity_options(probe, probe_ref, probe_lines: int, no_check: bool, glossary: Path | None = None):
    from mtcli.parity import ParityOptions  # it checks them

    return ParityOptions(probe, probe_ref, probe_lines, not no_check, glossary)


@app.command(
    "import",
    cls=_Command,
    short_help="Import a Hugging Face MarianMT (opus-mt) model, or an mtcli HF export, as a run.",
)
def import_model(
    hf: str = typer.Option(
        ..., "--hf", help="A MarianMT model folder, or a Hub name such as Helsinki-NLP/opus-mt-en-de."
    ),
    out: Path = typer.Option(..., "--out", help="Run directory to write: new or empty (an earlier import: --force)."),
    revision: str = typer.Option(None, help="Hub revision (branch, tag or commit) of a Hub name."),
    force: bool = ForceOpt,
    probe: Path = ProbeOpt,
    probe_ref: Path = ProbeRefOpt,
    probe_lines: int = ProbeLinesOpt,
    no_check: bool = ImportNoCheckOpt,
):
    """Import a MarianMT model (config.json, model.safetensors or pytorch_model.bin, source.spm, target.spm,
    vocab.json) as a run directory that translate, eval, export, average and train (--set train.init_from=DIR) take.

    Example: mtcli import --hf Helsinki-NLP/opus-mt-en-de --out runs/opus-en-de   then   mtcli translate --run
    runs/opus-en-de "I love apples"
    """
    from mtcli.marian import import_marian

    print(import_marian(hf, out, revision, force, parity_options(probe, probe_ref, probe_lines, no_check)))


@app.command(cls=_Command, short_help="Draw the cross-attention of a translation as a heat map.")
def attention(
    sentence: str = typer.Argument(..., help="The sentence to translate."),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Picture to write (.png, .svg or .pdf); an existing file needs --force."
    ),
    run: Path = RunOpt,
    checkpoint: Path = CheckpointOpt,
    layer: int = typer.Option(None, help="Decoder layer, from 0 (default: the mean over layers)."),
    head: int = typer.Option(None, help="Attention head, from 0 (default: the mean over heads)."),
    device: str = DeviceOpt,
    force: bool = typer.Option(False, "--force", help="Replace an existing --out picture."),
):
    """Translate a sentence (greedy) and draw which source pieces each output piece attended to. Needs matplotlib:
    pip install 'mtcli\\[plot]'.

    Example: mtcli attention "I love apples" --run runs/toy --out attn.png --layer 1
    """
    from mtcli.outputs import check_file_target
    from mtcli.pictures import cross_attention, plot_attention
    from mtcli.translate import Translator

    check_file_target(out, force, [run, checkpoint], "--out")
    result = cross_attention(Translator.from_run(run, checkpoint, device, precision="fp32"), sentence)
    print(result.translation)
    print(plot_attention(result, out, layer, head, force))


@app.command(cls=_Command, short_help="Serve a model over HTTP: LibreTranslate's API, batching, a page to try it.")
def serve(
    run: Path = RunOpt,
    checkpoint: Path = CheckpointOpt,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(5000, help="Port (0: a free one, printed on start)."),
    precision: str = PrecisionOpt,
    ensemble: list[Path] = EnsembleOpt,
    overrides: list[str] = DecodeSetOpt,
    device: str = DeviceOpt,
    api_keys: Path = typer.Option(None, "--api-keys", help="File of API keys, one per line (default: open access)."),
    queue_size: int = typer.Option(4096, "--queue-size", help="Sentences that may wait; more get 503 + Retry-After."),
    max_wait_ms: float = typer.Option(40.0, "--max-wait-ms", help="Longest wait for requests to batch with."),
    timeout: float = typer.Option(60.0, help="Seconds a request may take before it is answered 503."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body (413 above)."),
    max_sentences: int = typer.Option(512, "--max-sentences", help="Sentences per request (413 above)."),
    max_chars: int = typer.Option(20_000, "--max-chars", help="Characters per text (413 above)."),
    max_beam: int = typer.Option(16, "--max-beam", help="Largest beam (and alternatives + 1) a request may ask."),
    max_tokens: int = typer.Option(
        16_384, "--max-tokens", help="Source subwords per request, after tokenizing (413 above)."
    ),
    body_timeout: float = typer.Option(10.0, "--body-timeout", help="Seconds for a request's body to arrive (408)."),
    glossary: Path = typer.Option(
        None,
        "--glossary",
        help="A glossary for every request (`source term<TAB>target term` lines); a request's own `glossary` field "
        "(a list of [source, target] pairs) replaces it for that request.",
    ),
    max_glossary: int = typer.Option(1000, "--max-glossary", help="Pairs in a request's own glossary (413 above)."),
):
    """Serve a trained run over HTTP: POST /translate and GET /languages (LibreTranslate's API), POST /v1/translate
    (every decode setting, scores, n-best), GET /health, /metrics and / (a page to try it). Needs the serve extra:
    pip install 'mtcli\\[serve]'. SIGTERM or Ctrl-C stops accepting, answers every accepted request, then exits.

    Example: mtcli serve --run runs/multi30k --port 5000   then open http://127.0.0.1:5000/
    """
    from mtcli.checkpoint import read_config, resolve_checkpoint
    from mtcli.serve import serve as run_server  # says which extra to install when one is missing
    from mtcli.serve_requests import ServeLimits, read_api_keys
    from mtcli.translate import load_translator

    if not 0 <= port <= 65535:  # before the model loads
        raise MtcliError(f"--port {port}: choose 0 to 65535 (0: a free one)")
    limits = ServeLimits(
        max_body_bytes,
        max_sentences,
        max_chars,
        queue_size,
        timeout,
        max_wait_ms,
        max_beam,
        read_api_keys(api_keys),
        max_tokens=max_tokens,
        body_timeout=body_timeout,
        max_glossary=max_glossary,
    )
    ckpt = resolve_checkpoint(run, checkpoint)
    translator, decode = load_translator(
        ckpt, read_config(ckpt), overrides or [], device, ensemble or [], glossary=glossary, precision=precision
    )
    run_server(translator, decode, limits, host, port)


def main() -> None:
    try:
        app()
    except MtcliError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        from mtcli.outputs import DISK_FULL

        if e.errno not in DISK_FULL:
            raise
        # a write the command did not name itself (outputs.new_file and new_folder do): the path when there is one
        where = f" writing {e.filename}" if e.filename else ""
        reason = os.strerror(e.errno).lower()
        print(f"error: {reason}{where}; free some space and run the command again", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
