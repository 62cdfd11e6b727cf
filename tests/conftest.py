"""Fixtures shared by the test files (the real corpora in ../shared/data, a tiny corpus made on the spot, trained
toy models), and the test tiers:

    unit    (no marker)           seconds each; no model training, no subprocess, no shared corpora: `make test-fast`
    model   @pytest.mark.model    trains a toy model, or uses a fixture that does
    system  @pytest.mark.system   starts processes or servers, or reads the shared corpora

A fixture that trains is declared with `@training_fixture(...)` instead of `@pytest.fixture(...)`: collection fails
when a test that uses it (directly or through other fixtures) is marked neither model nor system, and a unit test
that starts a training run anyway fails at once.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mtcli  # noqa: F401  (first of the project, before torch loads: OpenMP's short wait, mtcli/__init__.py)

TIERS = ("model", "system")
TRAINING_FIXTURES: set[str] = set()


def training_fixture(*args, **kwargs):
    """pytest.fixture for a fixture that trains a model: the tests that use it must be marked model or system."""

    def declare(function):
        TRAINING_FIXTURES.add(function.__name__)
        return pytest.fixture(*args, **kwargs)(function)

    return declare


def _tier(item) -> str:
    marks = {mark.name for mark in item.iter_markers()} & set(TIERS)
    return "system" if "system" in marks else "model" if "model" in marks else "unit"


def pytest_collection_modifyitems(config, items):
    unmarked = [
        f"{item.nodeid} (uses {', '.join(sorted(TRAINING_FIXTURES & set(item.fixturenames)))})"
        for item in items
        if _tier(item) == "unit" and TRAINING_FIXTURES & set(item.fixturenames)
    ]
    if unmarked:
        raise pytest.UsageError(
            "unit tests may not train; mark these @pytest.mark.model (or system):\n  " + "\n  ".join(unmarked)
        )


@pytest.fixture(autouse=True)
def _unit_tests_do_not_train(request, monkeypatch):
    """A unit test that starts a training run (mtcli.train.start_run) fails with the reason, whatever path it took."""
    if _tier(request.node) != "unit":
        return

    def refuse(*args, **kwargs):
        pytest.fail("this unit test trains a model: mark it @pytest.mark.model (or use a fixture), or stop training")

    import mtcli.train

    monkeypatch.setattr(mtcli.train, "start_run", refuse)


@pytest.fixture(autouse=True)
def _on_the_cpu_unless_marked_cuda(request, monkeypatch):
    """Every test runs on the CPU, on a GPU machine too: its figures and bit-exact checks (exact resume) are the
    CPU's, and CUDA's atomics would break the latter. `train.device: auto` then means the CPU here and in the
    processes a test starts. Tests marked @pytest.mark.cuda keep the GPU, and skip without one."""
    import torch

    if request.node.get_closest_marker("cuda"):
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name pytest-timeout's kills at the end of the run: on a loaded machine they, not the code, fail tests."""
    timed_out = [
        report.nodeid
        for kind in ("failed", "error")
        for report in terminalreporter.stats.get(kind, [])
        if "Timeout" in str(getattr(report, "longrepr", ""))
    ]
    if timed_out:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        terminalreporter.write_line(
            f"{len(timed_out)} test(s) stopped by pytest-timeout's {config.getini('timeout')} s limit (load average "
            f"{load} on {os.cpu_count()} cores): on a loaded machine rerun them with PYTEST_ARGS='--timeout=0', "
            "or on an idle one (README, Development)",
            red=True,
        )


SHARED_DATA = Path(__file__).parents[1] / ".." / "shared" / "data"

# A small closed vocabulary, so valid/test use only characters SentencePiece saw in train.
WORDS_EN = "the a cat dog house red blue big small runs eats sees man woman child tree green old new".split()
WORDS_DE = "der die das Katze Hund Haus rot blau groß klein läuft isst sieht Mann Frau Kind Baum grün alt neu".split()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared real corpora (multi30k/, tatoeba-zh-en/); tests that use it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared corpora not found at {SHARED_DATA.resolve()} (expected ../shared/data next to the repo)")
    return SHARED_DATA.resolve()


def tiny_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` deterministic English-like / German-like sentence pairs of 2 to 8 words."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        k = rng.randint(2, 8)
        pairs.append((" ".join(rng.choices(WORDS_EN, k=k)), " ".join(rng.choices(WORDS_DE, k=k))))
    return pairs


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    """A folder of line-aligned plain text: train (300 pairs), valid and test (20 each) as <split>.en / <split>.de."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for split, n, seed in (("train", 300, 1), ("valid", 20, 2), ("test", 20, 3)):
        pairs = tiny_pairs(n, seed)
        (folder / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        (folder / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return folder


@pytest.fixture
def log():
    """The messages the `mtcli` logger emits during the test (info and above), as strings."""
    lines: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("mtcli")
    handler, level = ListHandler(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def invoke(*args, input=None):
    """Run the mtcli command in-process; it must succeed."""
    from mtcli.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def losses(run_dir: Path) -> list[float]:
    """The per-update training losses a run logged in metrics.jsonl."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_toy(run: Path, cache: Path, settings: dict | None = None) -> Path:
    """`mtcli train --config toy.yaml` into `run` (data cached under `cache`), each setting as --set KEY=VALUE."""
    settings = {"data.cache_dir": cache, **(settings or {})}
    sets = [x for key, value in settings.items() for x in ("--set", f"{key}={value}")]
    invoke("train", "--config", "toy.yaml", "--run-dir", run, *sets)
    return run


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory) -> Path:
    """The data cache of every test that trains on the toy corpus: runs with toy.yaml's data settings find the corpus
    prepared (SentencePiece fitted, splits encoded) by the first of them. Caches are keyed by a hash of the data
    settings, so a run with other settings (another vocabulary) prepares its own folder beside it. Tests of cache
    building itself keep their own folder."""
    return tmp_path_factory.mktemp("toy-cache")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """The data cache of the tests that prepare the shared real corpora: each corpus, at its recipe's settings, is
    fitted and encoded once per session (tens of seconds each) rather than once per test."""
    return tmp_path_factory.mktemp("corpus-cache")


@training_fixture(scope="session")
def toy_run(tmp_path_factory, toy_cache):
    """The toy config, shortened: about half a minute on 2 cores. Runs in ./runs/toy of a scratch folder."""
    home = tmp_path_factory.mktemp("toy")
    settings = {"train.max_updates": 300, "train.valid_every": 150, "train.keep_last": 3}
    return train_toy(home / "runs" / "toy", toy_cache, settings)
