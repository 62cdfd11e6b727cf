"""`make faults`: the fault matrix, run and counted (a few minutes on 2 cores; `--kills N` sets the SIGKILL count).

Training and data preparation are killed with SIGKILL at random moments and inside checkpoint and cache writes;
saves hit a full disk; gradients turn NaN; a torchrun worker dies; two runs share a directory; bad inputs of every
kind go in; a 100 MB stdin streams through `translate`. Each case checks what the user depends on (loadable
checkpoints, exact resume, one-line errors with status 2, nothing half-written, bounded memory) and the script
prints the counts: kills survived, bad inputs tried, peak RSS.

Faults are injected from outside (signals) or by `python tests/faults.py worker FAULT -- <mtcli args>`, which runs
the real `mtcli` command with one function wrapped: a pause inside a write (so that a kill lands there), a full
disk, a NaN loss. mtcli itself has no fault hooks.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: faults_serve beside it
from faults_serve import serve_faults  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


# ---------------------------------------------------------------------------------------------------------------------
# The worker: mtcli with one fault injected


def worker(fault: str, args: list[str]) -> None:
    import errno

    import mtcli.checkpoint
    import mtcli.data
    import mtcli.loss

    name, _, arg = fault.partition(":")
    if name == "slow-save":  # a pause after the weights are written, before the folder is renamed into place
        original = mtcli.checkpoint.save_safetensors

        def slow(*a, **k):
            original(*a, **k)
            time.sleep(float(arg or 0.5))

        mtcli.checkpoint.save_safetensors = slow
    elif name == "slow-prepare":  # a pause inside the cache write, per split
        original_encode = mtcli.data._encode_split

        def slow_encode(*a, **k):
            time.sleep(float(arg or 1.0))
            return original_encode(*a, **k)

        mtcli.data._encode_split = slow_encode
    elif name == "enospc-from":  # the Nth checkpoint write and later ones find the disk full
        original, calls = mtcli.checkpoint.save_safetensors, [0]

        def full(*a, **k):
            calls[0] += 1
            if calls[0] >= int(arg):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return original(*a, **k)

        mtcli.checkpoint.save_safetensors = full
    elif name in ("nan-at", "nan-from"):  # the loss (and so every gradient) is NaN at these forward calls
        original_forward, calls = mtcli.loss.LossModel.forward, [0]
        at = {int(x) for x in arg.split(",")} if name == "nan-at" else set()

        def forward(self, *a):
            calls[0] += 1
            loss = original_forward(self, *a)
            bad = calls[0] in at or (name == "nan-from" and calls[0] >= int(arg))
            return loss * float("nan") if bad else loss

        mtcli.loss.LossModel.forward = forward
    sys.argv = ["mtcli", *args]
    from mtcli.cli import main

    main()


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def record(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, ok, detail))
    print(f"  [{'ok' if ok else 'FAILED'}] {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def mtcli(*args, fault: str | None = None) -> list[str]:
    head = (
        [sys.executable, str(Path(__file__).resolve()), "worker", fault, "--"]
        if fault
        else [sys.executable, "-m", "mtcli"]
    )
    return [*head, *map(str, args)]


def run(cmd: list[str], timeout: int = 300, cwd: Path = ROOT, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, **kwargs)


def sets(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]


def train_settings(cache: Path, **extra) -> dict:
    """The toy corpus with a small model in fp32 on one thread: bit-exact across processes, ~20 updates/s."""
    return {
        "data.cache_dir": cache,
        "model.layers": 1,
        "model.d_model": 48,
        "model.heads": 2,
        "model.d_ff": 96,
        "train.max_updates": 240,
        "train.valid_every": 80,
        "train.valid_max_sentences": 20,
        "train.save_every": 8,
        "train.keep_last": 1000,
        "train.log_every": 4,
        "train.threads": 1,
        "train.precision": "fp32",
        **extra,
    }


def update_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(update, loss) for every update a run logged; conftest.losses gives the losses alone, for the tests."""
    return [(r["update"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def weights(run_dir: Path) -> dict:
    from mtcli.checkpoint import last_checkpoint, load_model

    return load_model(last_checkpoint(run_dir))[0].state_dict()


def checkpoints_sound(run_dir: Path) -> tuple[bool, str]:
    """Every checkpoint under its final name loads (weights, training state, tokenizer)."""
    from mtcli.checkpoint import list_checkpoints, load_model, load_state
    from mtcli.errors import MtcliError

    found = list_checkpoints(run_dir)
    for path in found:
        try:
            load_model(path)
            load_state(path)
        except MtcliError as e:
            return False, f"{path.name}: {e}"
    return True, f"{len(found)} checkpoints load"


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> tuple[bool, str]:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    ok = proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr
    ok = ok and all(n in lines[0] for n in needles)
    return ok, (lines[0][:160] if lines else f"status {proc.returncode}: {proc.stderr.strip()[-200:]}")


def wait_for(predicate, timeout: float, interval: float = 0.01) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(interval)
    return False


# ---------------------------------------------------------------------------------------------------------------------
# Training and preparation under SIGKILL


def kills(work: Path, cache: Path, count: int, rng: random.Random) -> int:
    """SIGKILL training `count` times (every third kill inside a checkpoint write, some during start-up, the rest a
    random number of updates in), resuming after each; then the finished run must equal an uninterrupted one, loss
    for loss and weight for weight."""
    print(f"training killed {count} times:", flush=True)
    reference = work / "reference"
    settings = train_settings(cache)
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", reference, *sets(settings)), timeout=600)
    if not record("reference run", proc.returncode == 0, proc.stderr.strip()[-200:] if proc.returncode else ""):
        return 0
    survived, round_, run_dir = 0, 0, None
    while survived < count:
        if run_dir is None or _finished(run_dir, settings):
            if run_dir is not None:
                _compare(run_dir, reference, f"round {round_}")
            round_ += 1
            run_dir = work / f"killed-{round_}"
        from mtcli.checkpoint import last_checkpoint

        resume = ["--resume"] if last_checkpoint(run_dir) is not None else []
        inside_save = survived % 3 == 2
        cmd = mtcli(
            "train",
            "--config",
            "toy.yaml",
            "--run-dir",
            run_dir,
            *resume,
            *sets(settings),
            fault="slow-save:0.5" if inside_save else None,
        )
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if inside_save:  # the temporary folder of a checkpoint being written
            landed = wait_for(lambda folder=run_dir / "checkpoints": _writing(folder), 120)
        elif survived % 3 == 0 and rng.random() < 0.5:  # during start-up (~3 s on an idle machine)
            time.sleep(rng.uniform(0.5, 3.0))
            landed = True
        else:  # a random number of updates in; counted by progress, not seconds, so a slow machine gets there too
            target = min(_logged_update(run_dir) + rng.randint(1, 48), settings["train.max_updates"] - 1)
            landed = wait_for(lambda c=child, r=run_dir, t=target: c.poll() is not None or _logged_update(r) >= t, 180)
            time.sleep(rng.uniform(0.0, 0.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        sound, detail = checkpoints_sound(run_dir)
        detail += f", killed after update {_logged_update(run_dir)} was logged"
        survived += bool(
            record(
                f"kill {survived + 1}{' inside a checkpoint write' if inside_save else ''}", sound and landed, detail
            )
        )
        if not sound:
            break
    resume = ["--resume"] if last_checkpoint(run_dir) is not None else []
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *resume, *sets(settings)), timeout=600)
    if record(
        "resume to the end after the last kill",
        proc.returncode == 0,
        proc.stderr.strip()[-200:] if proc.returncode else "",
    ):
        _compare(run_dir, reference, f"round {round_}")
    return survived


def _logged_update(run_dir: Path) -> int:
    """The last update in metrics.jsonl (written every train.log_every updates), 0 before the first."""
    try:
        lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
        return json.loads(lines[-1])["update"] if lines else 0
    except (OSError, ValueError, KeyError):  # missing, or a line being written
        return 0


def _writing(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.startswith(".update_") for p in folder.iterdir())


def _finished(run_dir: Path, settings: dict) -> bool:
    from mtcli.checkpoint import last_checkpoint

    last = last_checkpoint(run_dir)
    return last is not None and last.name == f"update_{settings['train.max_updates']:08d}"


def _compare(run_dir: Path, reference: Path, name: str) -> None:
    import torch

    mine, theirs = update_losses(run_dir), update_losses(reference)
    a, b = weights(run_dir), weights(reference)
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    detail = f"{len(mine)} per-update losses and final weights bit-identical"
    if mine != theirs or not same_weights:  # say where it went apart, so that a rare failure can be traced
        first = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
        detail = (
            f"{len(mine)} vs {len(theirs)} records, first difference at record {first}: "
            f"{mine[first] if first < len(mine) else None} vs {theirs[first] if first < len(theirs) else None}; "
            f"weights equal: {same_weights} (--keep keeps the runs)"
        )
    record(f"killed and resumed run ({name}) equals the uninterrupted one", mine == theirs and same_weights, detail)


def prepare_kills(work: Path, count: int) -> int:
    """SIGKILL `mtcli data prepare` inside its cache write; the half-written cache must never be taken for a complete
    one, and the next prepare must build the same cache as an undisturbed one."""
    print(f"data preparation killed {count} times inside the cache write:", flush=True)
    cache, clean = work / "prepare-cache", work / "prepare-clean"
    args = ["data", "prepare", "--config", "toy.yaml"]
    survived = 0
    for i in range(count):
        child = subprocess.Popen(
            mtcli(*args, "--set", f"data.cache_dir={cache}", fault="slow-prepare:1.0"),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        landed = wait_for(lambda: cache.is_dir() and any(".tmp-" in p.name for p in cache.iterdir()), 60)
        time.sleep(0.3 * i)
        child.send_signal(signal.SIGKILL)
        child.wait()
        complete = [p for p in cache.iterdir() if not p.name.startswith(".") and (p / "meta.json").is_file()]
        complete = [p for p in complete if p.name != "toy-corpus"]
        survived += record(
            f"prepare kill {i + 1}",
            landed and not complete,
            "no cache under its final name" if not complete else str(complete),
        )
    proc = run(mtcli(*args, "--set", f"data.cache_dir={cache}"))
    ref = run(mtcli(*args, "--set", f"data.cache_dir={clean}"))
    built = [p for p in cache.iterdir() if (p / "meta.json").is_file() and not p.name.startswith(".")]
    ref_built = [p for p in clean.iterdir() if (p / "meta.json").is_file() and not p.name.startswith(".")]
    same = (
        proc.returncode == 0
        and ref.returncode == 0
        and [p.name for p in built] == [p.name for p in ref_built]
        and all(
            (a / f).read_bytes() == (b / f).read_bytes()
            for a, b in zip(built, ref_built)
            for f in ("train.src.bin", "train.tgt.bin", "spm.model")
        )
    )
    record("prepare after the kills builds what an undisturbed prepare builds", same)
    return survived


# ---------------------------------------------------------------------------------------------------------------------
# Full disk, NaN, torchrun, two runs, safety


def disk_full(work: Path, cache: Path) -> None:
    run_dir = work / "enospc"
    settings = train_settings(cache, **{"train.max_updates": 40})
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *sets(settings), fault="enospc-from:3"))
    ok, detail = one_line_error(proc, "cannot write checkpoint", "No space left on device", "MB free", "is intact")
    record("full disk during a save: one-line error naming the path and the space needed", ok, detail)
    sound, detail = checkpoints_sound(run_dir)
    record("full disk: the previous checkpoints are intact", sound, detail)
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, "--resume", *sets(settings)))
    record("full disk: the run resumes once space is back", proc.returncode == 0 and _finished(run_dir, settings))


def nonfinite(work: Path, cache: Path) -> None:
    settings = train_settings(cache, **{"train.max_updates": 30})
    run_dir = work / "nan"
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *sets(settings), fault="nan-at:5,9,10"))
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    ok = proc.returncode == 0 and "3 update(s) skipped for non-finite gradients" in log and _finished(run_dir, settings)
    record(
        "NaN gradients at 3 updates: skipped and counted, the run finishes",
        ok,
        "3 skipped" if ok else proc.stderr[-200:],
    )
    run_dir = work / "nan-persistent"
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *sets(settings), fault="nan-from:12"))
    ok, detail = one_line_error(proc, "non-finite", "Last checkpoint:", "update_00000008")
    record("persistent NaN: the run stops naming the last good checkpoint", ok, detail)


def torchrun_restart(work: Path, cache: Path) -> None:
    run_dir = work / "torchrun"
    settings = train_settings(cache, **{"train.max_updates": 120})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "-m",
        "mtcli",
        "train",
        "--config",
        "toy.yaml",
        "--run-dir",
        str(run_dir),
        *sets(settings),
    ]
    agent = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    first = run_dir / "checkpoints" / "update_00000016"
    killed = wait_for(first.is_dir, 240, 0.05) and _kill_rank(agent.pid, 1)
    try:
        out, _ = agent.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # a hung restart is a failure, and must not leave workers behind
        os.killpg(agent.pid, signal.SIGKILL)
        out = agent.communicate()[0] + "\n(hung: killed after 300 s)"
    ok = killed and agent.returncode == 0 and _finished(run_dir, settings)
    ok = ok and [u for u, _ in update_losses(run_dir)] == list(range(1, settings["train.max_updates"] + 1))
    record(
        "torchrun worker killed: --max-restarts 1 resumes and finishes with the same update count",
        ok,
        "restarted and finished at update 120" if ok else out[-300:],
    )


def _kill_rank(agent_pid: int, rank: int) -> bool:
    """SIGKILL the torchrun worker whose RANK is `rank` (a child of the agent)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):
            continue
        if parent == agent_pid and f"RANK={rank}".encode() in env:
            os.kill(int(proc.name), signal.SIGKILL)
            return True
    return False


def two_runs(work: Path, cache: Path) -> None:
    run_dir = work / "shared-dir"
    settings = train_settings(cache, **{"train.max_updates": 100000, "train.save_every": 0})
    first = subprocess.Popen(
        mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *sets(settings)),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = wait_for(
        lambda: (run_dir / "train.log").is_file() and "training:" in (run_dir / "train.log").read_text(), 120
    )
    second = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *sets(settings)))
    first.send_signal(signal.SIGKILL)
    first.wait()
    ok, detail = one_line_error(second, "is being trained by process", str(first.pid))
    record("a second run into a directory in use is refused (lock file with the holder's pid)", started and ok, detail)


def pickle_payload(work: Path, cache: Path) -> None:
    """A state.pt holding an object whose unpickling would write a marker file: refused, marker never written."""
    run_dir = work / "pickle"
    settings = train_settings(cache, **{"train.max_updates": 8})
    run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, *sets(settings)))
    marker = work / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    import torch

    from mtcli.checkpoint import last_checkpoint

    torch.save({"update": 8, "evil": Payload()}, last_checkpoint(run_dir) / "state.pt", pickle_module=pickle)
    proc = run(mtcli("train", "--config", "toy.yaml", "--run-dir", run_dir, "--resume", *sets(settings)))
    ok, detail = one_line_error(proc, "state.pt: refused")
    record("a pickle payload in state.pt is refused and never runs", ok and not marker.exists(), detail)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


def bad_inputs(work: Path, cache: Path) -> int:
    print("bad input:", flush=True)
    tried = 0
    corpus = work / "corpora"
    words = "the a cat dog house red blue big small runs eats sees man woman child tree green old new".split()
    rng = random.Random(0)
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 8))) for _ in range(300)]

    def make(name: str, src: str | bytes, tgt: str | bytes) -> Path:
        folder = corpus / name
        folder.mkdir(parents=True, exist_ok=True)
        for lang, text in (("en", src), ("de", tgt)):
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            (folder / f"train.{lang}").write_bytes(data)
        return folder

    text = "\n".join(lines) + "\n"
    target = "\n".join(f"{line} !" for line in lines) + "\n"  # not a copy of the source (data.clean.copies)
    base = [
        "data",
        "prepare",
        "--config",
        "toy.yaml",
        "--set",
        "data.src_lang=en",
        "--set",
        "data.tgt_lang=de",
        "--set",
        "data.vocab_size=60",
        "--set",
        f"data.cache_dir={work / 'bad-cache'}",
    ]

    def prepare(folder: Path, *extra: str) -> subprocess.CompletedProcess:
        return run(mtcli(*base, "--set", f"data.path={folder}", *extra))

    def no_half_cache() -> bool:
        root = work / "bad-cache"
        return not root.is_dir() or not any(p.name.startswith(".") for p in root.iterdir())

    cases = [
        ("an empty training file", make("empty", "", ""), ["train.en", "is empty"]),
        ("a training file of blank lines", make("blank", "\n\n \n", "\n\n\n"), ["train", "blank"]),
        ("misaligned files", make("misaligned", text, "\n".join(lines[:-1]) + "\n"), ["line counts differ"]),
        (
            "bytes that are not UTF-8",
            make("latin1", text.encode() + b"caf\xe9\n", text.encode() + b"cafe\n"),
            ["train.en:301", "UTF-8"],
        ),
    ]
    for name, folder, needles in cases:
        ok, detail = one_line_error(prepare(folder), *needles)
        tried += 1
        record(name, ok and no_half_cache(), detail)
    # Accepted: a byte-order mark, CRLF line ends; filtered and counted: a 1 MB line.
    bom = prepare(make("bom", b"\xef\xbb\xbf" + text.encode(), target))
    prepare(make("plain", text, target))
    crlf = prepare(make("crlf", text.replace("\n", "\r\n"), target.replace("\n", "\r\n")))
    long_line = ("the cat " * 131_072).strip()  # 1 MB of words: far over data.max_len subwords
    long_ = prepare(make("long", text + long_line + "\n", target + "die Katze\n"))
    tried += 3
    record(
        "a byte-order mark is accepted (and is not part of the first sentence)",
        bom.returncode == 0 and _first_ids(work, "bom") == _first_ids(work, "plain"),
    )
    record(
        "CRLF line ends are accepted", crlf.returncode == 0 and _first_ids(work, "crlf") == _first_ids(work, "plain")
    )
    record(
        "a 1 MB single line is filtered and counted",
        long_.returncode == 0 and "1 over 250 subwords" in long_.stderr,
        [x for x in long_.stderr.splitlines() if "train" in x][-1:][0]
        if long_.returncode == 0
        else long_.stderr[-200:],
    )
    # Configs and options.
    for name, content, needles in (
        ("a config that is a YAML list", "- data\n- model\n", ["expected a mapping"]),
        ("a config that is a YAML scalar", "just words\n", ["expected a mapping"]),
        (
            "a misspelled config key",
            "data: {dataset: toy}\nmodel: {d_modle: 64}\n",
            ["model.d_modle", "did you mean `model.d_model`"],
        ),
    ):
        path = work / f"config-{tried}.yaml"
        path.write_text(content)
        ok, detail = one_line_error(
            run(mtcli("train", "--config", path, "--run-dir", work / "never")), str(path), *needles
        )
        tried += 1
        record(name, ok and not (work / "never").exists(), detail)
    ok, detail = one_line_error(
        run(mtcli("train", "--config", "toy.yaml", "--set", "train.lr", "--run-dir", work / "never")),
        "--set train.lr",
        "KEY=VALUE",
    )
    tried += 1
    record("--set without =", ok, detail)
    settings = train_settings(cache, **{"train.max_tokens": 2})
    ok, detail = one_line_error(
        run(mtcli("train", "--config", "toy.yaml", "--run-dir", work / "tiny-budget", *sets(settings))),
        "train.max_tokens",
        "shortest",
    )
    tried += 1
    record("train.max_tokens smaller than the shortest sentence", ok, detail)
    # Checkpoints.
    good = work / "reference"
    from mtcli.checkpoint import best_checkpoint, last_checkpoint

    broken = work / "broken-checkpoint"
    shutil.copytree(last_checkpoint(good), broken)
    model_file = broken / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    ok, detail = one_line_error(run(mtcli("eval", "--checkpoint", broken)), "model.safetensors", "not a")
    tried += 1
    record("a checkpoint with a truncated safetensors file", ok, detail)
    other = work / "other-vocab"
    settings = train_settings(cache, **{"train.max_updates": 4, "data.vocab_size": 500})
    run(mtcli("train", "--config", "toy.yaml", "--run-dir", other, *sets(settings)))
    ok, detail = one_line_error(
        run(mtcli("eval", "--run", good, "--checkpoint", best_checkpoint(other))), "another vocabulary"
    )
    tried += 1
    record("a checkpoint of another vocabulary given to eval of a different run", ok, detail)
    for last, needle in ((0, "at least 1"), (9999, "fewer than --last 9999")):
        ok, detail = one_line_error(run(mtcli("average", "--run", good, "--last", last)), needle)
        tried += 1
        record(f"average --last {last}", ok, detail)
    # Paths that a shell would mangle are plain paths here.
    odd = corpus / "dir with space" / "ü" / ".." / "ünïcode"
    odd.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        (odd / f"train.{lang}").write_text(text, encoding="utf-8")
    proc = prepare(odd)
    out = work / "out dir" / "翻译 $(touch pwned).txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    translated = run(mtcli("translate", "--run", good, "--output", out, "I love apples"))
    tried += 2
    record(
        "data.path with .., spaces and unicode is a plain path",
        proc.returncode == 0,
        proc.stderr.strip()[-200:] if proc.returncode else "",
    )
    record(
        "--output with spaces, unicode and shell syntax is a plain path",
        translated.returncode == 0 and out.is_file() and not (ROOT / "pwned").exists(),
    )
    return tried


def files_are_safe(work: Path) -> int:
    """Every command that writes, pointed at a folder holding someone's file, at the run itself, at `.` (a user's
    working directory) and at a file: refused with one line, status 2, and every byte below the user's folders, the
    run and the working directory the same before and after (checksums)."""
    import hashlib

    print("your files are safe:", flush=True)
    run_dir = work / "reference"
    home = work / "user"
    foreign, cwd = home / "thesis", home / "cwd"
    for folder in (foreign, cwd):
        folder.mkdir(parents=True, exist_ok=True)
    (foreign / "thesis.tex").write_text("precious\n")
    (cwd / "notes.txt").write_text("mine\n")
    afile = home / "out.txt"
    afile.write_text("someone's text\n")
    source = home / "in.en"
    source.write_text("I love apples\n")

    def checksums() -> dict[str, str]:
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for top in (home, run_dir)
            for p in sorted(top.rglob("*"))
            if p.is_file()
        }

    writers = {
        "export --format hf": lambda t: ("export", "--run", run_dir, "--format", "hf", "--out", t),
        "export --format ctranslate2": lambda t: ("export", "--run", run_dir, "--format", "ctranslate2", "--out", t),
        "average": lambda t: ("average", "--run", run_dir, "--last", "2", "--out", t),
        "import": lambda t: ("import", "--hf", run_dir, "--out", t),
        "train --run-dir": lambda t: ("train", "--config", "toy.yaml", "--run-dir", t, "--set", "train.max_updates=1"),
        "translate --output": lambda t: ("translate", "--run", run_dir, "--input", source, "--output", t),
        "eval --sentence-scores": lambda t: ("eval", "--run", run_dir, "--sentence-scores", t),
        "attention --out": lambda t: ("attention", "I love apples", "--run", run_dir, "--out", t),
    }
    targets = {"a folder with a foreign file": foreign, "the run itself": run_dir, ".": Path("."), "a file": afile}
    tried = 0
    for command, args in writers.items():
        for what, target in targets.items():
            if command.startswith("train") and what == "the run itself":
                continue  # the run is train's own: it answers "already holds checkpoints; --resume" (tested apart)
            before = checksums()
            proc = run(mtcli(*args(target)), cwd=cwd)
            tried += 1
            ok, detail = one_line_error(proc)
            same = checksums() == before
            record(f"{command} at {what}: refused, nothing changed", ok and same, detail if not ok else "")
    before = checksums()
    proc = run(mtcli("translate", "--run", run_dir, "--input", source, "--output", source))
    tried += 1
    record("translate --output equal to --input: refused", one_line_error(proc)[0] and checksums() == before)
    return tried


def _first_ids(work: Path, name: str):
    import numpy as np

    root = work / "bad-cache"
    folder = next(p for p in root.iterdir() if p.name.startswith(f"{name}-"))
    offsets = np.load(folder / "train.src.idx.npy")
    tokens = np.fromfile(folder / "train.src.bin", dtype=json.loads((folder / "meta.json").read_text())["dtype"])
    spm = __import__("sentencepiece").SentencePieceProcessor(model_file=str(folder / "spm.model"))
    return spm.decode(tokens[offsets[0] : offsets[1]].tolist())


def big_stdin(work: Path) -> float:
    """100 MB on stdin (1,000 lines of 100 KB, blank lines between): streamed, every line answered, memory bounded."""
    run_dir = work / "reference"
    words = "I love apples she likes green tea my mother reads books every day".split()
    rng = random.Random(1)
    line = (" ".join(rng.choices(words, k=20_000)) + " ")[:100_000].encode()
    cmd = mtcli("translate", "--run", run_dir, "--beam", "1")
    child = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    import threading

    def feed():
        for _ in range(1000):
            child.stdin.write(line + b"\n\n")
        child.stdin.close()

    threading.Thread(target=feed, daemon=True).start()
    answered = sum(1 for _ in child.stdout)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    peak_mb = usage.ru_maxrss / 1024
    ok = child.returncode == 0 and answered == 2000
    record(
        "100 MB stdin streams through translate with bounded memory",
        ok and peak_mb < 1500,
        f"{answered} of 2000 lines answered, peak RSS {peak_mb:,.0f} MB",
    )
    return peak_mb


# ---------------------------------------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of training (at least 20 for the full matrix)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    # on the CPU, on a GPU machine too (as the test suite): bit-exact resume and the 2-process torchrun runs need it
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    start = time.time()
    work = Path(tempfile.mkdtemp(prefix="mtcli-faults-"))
    cache = work / "cache"
    rng = random.Random(0)
    try:
        survived = kills(work, cache, args.kills, rng)
        prepare_survived = prepare_kills(work, 3)
        print("other faults:", flush=True)
        disk_full(work, cache)
        nonfinite(work, cache)
        torchrun_restart(work, cache)
        two_runs(work, cache)
        pickle_payload(work, cache)
        tried = bad_inputs(work, cache)
        safe_tried = files_are_safe(work)
        serve_tried = serve_faults(work, work / "reference", record)
        peak = big_stdin(work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\nkills survived: {survived}/{args.kills} (training), {prepare_survived}/3 (data prepare)")
    print(f"bad inputs tried: {tried}; peak RSS of translate on a 100 MB stdin: {peak:,.0f} MB")
    print(f"writing commands aimed at the user's files, the run and `.`: {safe_tried}; hostile requests: {serve_tried}")
    print(f"cases: {len(RESULTS) - len(failed)}/{len(RESULTS)} passed in {time.time() - start:.0f} s")
    if failed:
        sys.exit("faults: FAILED: " + "; ".join(failed))


if __name__ == "__main__":
    main()
