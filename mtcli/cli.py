"""The `mtcli` command: parses options, loads the config and calls one library function per command."""

from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path

import typer

from mtcli.errors import MtcliError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Train, run and score Transformer machine-translation models from one config file.",
)
data_app = typer.Typer(no_args_is_help=True, help="Prepare corpora: download, SentencePiece, encode, cache.")
app.add_typer(data_app, name="data", help="Prepare a corpus: fetch, fit SentencePiece, encode, cache.")

ConfigOpt = typer.Option(
    ...,
    "--config",
    "-c",
    help="YAML config: a path, or the name of a shipped config "
    "(base.yaml, big.yaml, multi30k.yaml, opus100-en-zh.yaml, toy.yaml).",
)
SetOpt = typer.Option(None, "--set", help="Override a config key, e.g. --set train.lr=5e-4 (repeatable).")


@data_app.command("prepare", short_help="Fetch, clean, fit SentencePiece, encode and cache every split.")
def data_prepare(
    config: str = ConfigOpt,
    overrides: list[str] = SetOpt,
    force: bool = typer.Option(False, help="Rebuild the cache even if it exists."),
):
    """Download (or read) the corpus, fit SentencePiece, clean, encode and cache every split.

    Example: mtcli data prepare --config multi30k.yaml --set data.path=../shared/data/multi30k
    """
    from mtcli.config import load_config
    from mtcli.data import batch_indices, padding_efficiency, prepare

    cfg = load_config(config, overrides or [])
    data = prepare(cfg, log=_err, force=force)
    train = data.split("train")
    batches = batch_indices(train.src_lens, train.tgt_lens, cfg.train.max_tokens, cfg.train.seed, 0)
    eff = padding_efficiency(batches, train.src_lens, train.tgt_lens)
    _err(
        f"batches at max_tokens {cfg.train.max_tokens}: {len(batches):,} per epoch, padding efficiency "
        f"{eff['all']:.3f} (source {eff['src']:.3f}, target {eff['tgt']:.3f})"
    )


@app.command(short_help="Train a model from a config (prepares the data first).")
def train(
    config: str = ConfigOpt,
    overrides: list[str] = SetOpt,
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default: runs/<config name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its last checkpoint."),
):
    """Train a Transformer (prepares the data first if its cache is missing).

    Example: mtcli train --config toy.yaml   (multi-GPU: torchrun --nproc_per_node 8 -m mtcli train --config base.yaml)
    """
    from mtcli.config import load_config
    from mtcli.train import train as run_training

    cfg = load_config(config, overrides or [])
    result = run_training(cfg, run_dir, resume)
    if result.stopped_by in ("SIGINT", "SIGTERM"):
        _err(
            f"interrupted: resume with: mtcli train --config {result.run_dir / 'config.yaml'} "
            f"--run-dir {result.run_dir} --resume"
        )
        raise typer.Exit(130 if result.stopped_by == "SIGINT" else 143)


@app.command(short_help="Translate sentences, a file or stdin.")
def translate(
    text: list[str] = typer.Argument(None, help="Sentences to translate; `-` or none with a pipe reads stdin."),
    run: Path = typer.Option(None, "--run", help="Run directory (default: the latest run under ./runs)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="A checkpoint folder (default: the run's best)."),
    input_file: Path = typer.Option(None, "--input", "-i", help="Translate this file, one sentence per line."),
    output_file: Path = typer.Option(None, "--output", "-o", help="Write translations here (default: stdout)."),
    beam: int = typer.Option(None, help="Beam size (1: greedy); default from the run's config."),
    nbest: int = typer.Option(None, help="Print the n best (`i ||| translation ||| score`)."),
    lenpen: float = typer.Option(None, help="Length penalty alpha (0 disables)."),
    max_len_a: float = typer.Option(None, "--max-len-a", help="Output limit: a * source length + b."),
    max_len_b: int = typer.Option(None, "--max-len-b", help="Output limit: a * source length + b."),
    sampling: bool = typer.Option(None, "--sampling/--no-sampling", help="Sample instead of searching."),
    temperature: float = typer.Option(None, help="Sampling temperature."),
    top_k: int = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0: all)."),
    top_p: float = typer.Option(None, "--top-p", help="Sample from the smallest set with this probability."),
    batch_tokens: int = typer.Option(None, "--batch-tokens", help="Source subwords per batch."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
):
    """Translate sentences, a file or stdin with a trained run.

    Example: mtcli translate "I love apples"   |   mtcli translate --input news.en --output news.zh --beam 5
    """
    from mtcli.translate import Translator, decode_settings, resolve_checkpoint

    stdin = text in ([], None, ["-"]) and input_file is None
    if stdin and sys.stdin.isatty() and text != ["-"]:
        raise MtcliError("nothing to translate: give sentences, --input FILE, or pipe text into stdin")
    if input_file is not None and not input_file.is_file():
        raise MtcliError(f"--input {input_file}: no such file")
    try:
        out = open(output_file, "w", encoding="utf-8") if output_file else sys.stdout
    except OSError as e:
        raise MtcliError(f"--output {output_file}: cannot write ({e.strerror})") from None
    try:
        translator = Translator.load(resolve_checkpoint(run, checkpoint), device)
        decode = decode_settings(
            translator.config,
            beam=beam,
            nbest=nbest,
            lenpen=lenpen,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            sampling=sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            batch_tokens=batch_tokens,
        )
        counter = 0

        def emit(results):
            nonlocal counter
            for hyps in results:
                if decode.nbest > 1:
                    out.writelines(f"{counter} ||| {h.text} ||| {h.score:.4f}\n" for h in hyps)
                else:
                    out.write(hyps[0].text + "\n")
                counter += 1
            out.flush()

        if stdin:
            for chunk in _stdin_chunks():
                emit(translator.translate(chunk, decode))
        else:
            lines = _read_lines(input_file) if input_file else list(text)
            bar = _LineProgress(len(lines)) if input_file else None
            emit(translator.translate(lines, decode, progress=bar.advance if bar else None))
            if bar:
                bar.close()
    finally:
        if output_file:
            out.close()


@app.command("eval", short_help="Score a split or files: sacreBLEU and chrF with signatures.")
def evaluate(
    run: Path = typer.Option(None, "--run", help="Run directory (default: the latest run under ./runs)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="A checkpoint folder (default: the run's best)."),
    split: str = typer.Option(None, help="A role from data.splits: test (default) or valid."),
    src: Path = typer.Option(None, "--src", help="Source file to translate instead of a split."),
    ref: Path = typer.Option(None, "--ref", help="Reference file for --src."),
    beam: int = typer.Option(None, help="Beam size (1: greedy); default from the run's config."),
    lenpen: float = typer.Option(None, help="Length penalty alpha."),
    batch_tokens: int = typer.Option(None, "--batch-tokens", help="Source subwords per batch."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Translate a split (or --src/--ref files) and report sacreBLEU and chrF with their signatures.

    Example: mtcli eval --run runs/multi30k --split test --beam 5
    """
    from mtcli.data import eval_texts
    from mtcli.evaluate import evaluate as run_eval
    from mtcli.translate import Translator, decode_settings, resolve_checkpoint

    if (src is None) != (ref is None):
        raise MtcliError("--src and --ref go together")
    if src is not None and split is not None:
        raise MtcliError("give either --split or --src/--ref, not both")
    ckpt_path = resolve_checkpoint(run, checkpoint)
    translator = Translator.load(ckpt_path, device)
    cfg = translator.config
    if src is not None:
        sources, references, stem = _read_lines(src), _read_lines(ref), src.name
        if len(sources) != len(references):
            raise MtcliError(f"line counts differ: {src} has {len(sources)} lines, {ref} has {len(references)}")
    else:
        role = split or "test"
        sources, references = eval_texts(cfg, role)
        stem = role
    decode = decode_settings(cfg, beam=beam, lenpen=lenpen, batch_tokens=batch_tokens, nbest=1, sampling=False)
    run_dir = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent
    bar = _LineProgress(len(sources))
    result = run_eval(
        translator, sources, references, decode, run_dir / "eval", f"{stem}.{ckpt_path.name}", progress=bar.advance
    )
    bar.close()
    result["checkpoint"] = str(ckpt_path)
    if as_json:
        print(json.dumps(result, indent=1, ensure_ascii=False))
    else:
        print(f"{result['bleu_detail']}  [{result['signature']}]")
        print(f"chrF2 = {result['chrf']:.2f}  [{result['chrf_signature']}]")
        print(f"hypotheses: {result['hypotheses']}\nreferences: {result['references']}")
        print(f"check: {result['command']}")


@app.command(short_help="Average a run's last N checkpoints into a new one.")
def average(
    run: Path = typer.Option(..., "--run", help="Run directory."),
    last: int = typer.Option(5, "--last", help="Average the last N numbered checkpoints."),
    output: Path = typer.Option(
        None, "--output", help="Checkpoint folder to write (default: <run>/checkpoints/average_last<N>)."
    ),
):
    """Average the weights of a run's last N checkpoints into a new checkpoint.

    Example: mtcli average --run runs/base --last 5   then   mtcli eval --checkpoint runs/base/checkpoints/average_last5
    """
    from mtcli.checkpoint import average_checkpoints, checkpoint_dir, list_checkpoints

    found = list_checkpoints(run)
    if last < 1:
        raise MtcliError("--last must be at least 1")
    if len(found) < last:
        raise MtcliError(
            f"{run} has {len(found)} checkpoint(s), fewer than --last {last}; raise train.keep_last to keep more"
        )
    out = output or checkpoint_dir(run) / f"average_last{last}"
    average_checkpoints(found[-last:], out)
    _err(f"averaged {', '.join(p.name for p in found[-last:])}")
    print(out)


# ---------------------------------------------------------------------------------------------------------------------


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _read_lines(path: Path) -> list[str]:
    from mtcli.corpus import check_utf8

    check_utf8(path)
    # Only "\n" ends a line: universal newlines would split at a lone "\r", str.splitlines at form feeds and U+2028,
    # and either would shift every later line against its reference or output.
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n").removesuffix("\r") for line in f]


def _stdin_chunks(max_lines: int = 256):
    """Lines from stdin in order, grouped by what has arrived: one at a time when typed, in batches when piped."""
    lines: queue.Queue = queue.Queue(maxsize=4 * max_lines)

    def reader():
        try:
            for number, raw in enumerate(sys.stdin.buffer, start=1):
                try:
                    lines.put(raw.decode("utf-8").rstrip("\n").removesuffix("\r"))
                except UnicodeDecodeError as e:
                    lines.put(
                        MtcliError(
                            f"stdin line {number}: not valid UTF-8 ({e.reason}); convert the input to "
                            "UTF-8, e.g. with iconv"
                        )
                    )
                    return
        except OSError as e:
            lines.put(MtcliError(f"reading stdin failed: {e}"))
            return
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    chunk: list[str] = []
    while True:
        item = lines.get() if not chunk else _get_nowait(lines)
        if isinstance(item, MtcliError):
            if chunk:
                yield chunk  # translate what came before the bad line, then stop
            raise item
        if item is None or item is _EMPTY:
            if chunk:
                yield chunk
                chunk = []
            if item is None:
                return
            continue
        chunk.append(item)
        if len(chunk) == max_lines:
            yield chunk
            chunk = []


_EMPTY = object()


def _get_nowait(q: queue.Queue):
    try:
        return q.get_nowait()
    except queue.Empty:
        return _EMPTY


class _LineProgress:
    """`translated N/M lines` on stderr, rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, total: int):
        self.total, self.done, self.tty, self.next_mark = total, 0, sys.stderr.isatty(), 0.1

    def advance(self, n: int) -> None:
        self.done += n
        if self.tty:
            sys.stderr.write(f"\rtranslated {self.done}/{self.total} lines")
        elif self.done >= self.next_mark * self.total or self.done == self.total:
            sys.stderr.write(f"translated {self.done}/{self.total} lines\n")
            self.next_mark = self.done / self.total + 0.1
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def main() -> None:
    try:
        app()
    except MtcliError as e:
        _err(f"error: {e}")
        sys.exit(2)
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
