"""Marian C++ as a fourth peer on the M30K-small spec (../shared/peers/README.md): training throughput, as bench.sh.

Marian comes from the PyPI wheel pymarian 1.12.42: its `_pymarian.main` is the whole marian command line (training is
its default mode), exposed as the console script `pymarian`. The wheel needs no torch; it gets its own venv,
$MTCLI_PEERS_HOME/venvs/pymarian. Data: the peers' piece files and joint vocabulary ($MTCLI_PEERS_HOME/data/m30k,
made by `setup.sh hf_marian` if missing), read as pre-tokenized text. 10 warm-up + 100 timed updates under the
peers' CPU lock; with --disp-freq 1 marian logs every update with the running count of target labels (non-pad
target tokens incl. </s>), and each log line is timestamped here as it arrives, so the window is exact.

    python benchmarks/marian_peer.py [--json PATH] [--warmup N --timed M]   (other than 10 + 100: a check only)

Prints `PEER marian train_tgt_tok_per_s=.. wall_s=.. peak_rss_mb=..` and the JSON (report.py's, as bench.sh: the last
line of stdout, or PATH), with marian's command line and the deviations from the spec. Log: runs/bench-marian/log.
"""

import argparse
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from ast import literal_eval
from pathlib import Path

PYMARIAN = "1.12.42"
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"  # read-only: report.py and setup.sh only
HOME = Path(os.environ.get("MTCLI_PEERS_HOME", Path.home() / ".cache" / "mtcli-peers"))
LOCK = Path(os.environ.get("MTCLI_PEERS_LOCK", HOME / "cpu.lock"))
VENV, DATA, RUN = HOME / "venvs" / "pymarian", HOME / "data" / "m30k", HOME / "runs" / "bench-marian"

SPEC = [  # M30K-small, as marian spells it
    "--type", "transformer", "--enc-depth", "3", "--dec-depth", "3", "--dim-emb", "256",
    "--transformer-heads", "4", "--transformer-dim-ffn", "1024", "--transformer-ffn-activation", "relu",
    # pre-norm: norm before each block, dropout + residual after it, and a final norm on top of each stack
    "--transformer-preprocess", "n", "--transformer-postprocess", "da", "--transformer-postprocess-top", "n",
    "--transformer-postprocess-emb", "d",
    "--transformer-dropout", "0.1", "--transformer-dropout-attention", "0", "--transformer-dropout-ffn", "0",
    "--tied-embeddings-all", "--output-omit-bias",  # one matrix for both embeddings and the output layer, no bias
    # ce-sum: the only cost type whose log line carries exact label counts (see DEVIATIONS)
    "--label-smoothing", "0.1", "--cost-type", "ce-sum",
    "--optimizer", "adam", "--optimizer-params", "0.9", "0.98", "1e-09", "--learn-rate", "0.001",
    "--lr-warmup", "400", "--lr-decay-inv-sqrt", "400", "--clip-norm", "0",
    # batches by token count; mini-batch x maxi-batch >= 29,000 sentences, so each epoch is sorted as one pool
    "--mini-batch-words", "4096", "--mini-batch", "1000", "--maxi-batch", "100", "--maxi-batch-sort", "trg",
    "--max-length", "256", "--shuffle-in-ram",  # the longest pair is 56 pieces: marian would drop those over 50
    # marian's CPU ops are single-threaded (MKL sequential): 2 cores = 2 workers, each half of every batch
    "--cpu-threads", "2", "--sync-sgd", "--data-threads", "1", "--seed", "1",
]  # fmt: skip

DEVIATIONS = [
    "batch: --mini-batch-words 4096 counts the non-pad SOURCE tokens (incl. </s>) of a batch, not the target's, and"
    " closes the batch when the count first exceeds 4096, so it overshoots by up to one sentence; German has ~3.5%"
    " more pieces than English here, so updates hold more than 4,096 target tokens (tgt_tokens_per_update; HF"
    " ~4,010, fairseq ~3,410). --mini-batch-fit (marian's usual memory-based sizing) is off.",
    "threads: marian runs every CPU op single-threaded (MKL sequential), so --cpu-threads 2 --sync-sgd makes two"
    " workers that each take half of the batch's sentences, sum their gradients and make one update together:"
    " data parallelism over the 2 cores, not 2 intra-op threads. Each epoch's batches are built in one go on a"
    " background thread (marian's prefetch), where the peers build theirs inline.",
    "loss: --cost-type ce-sum, whose log line is the only one with exact label counts. Adam sees the summed"
    " gradient: the same update as the per-token mean up to each batch's weight (its token count, a few % apart)"
    " and eps 1e-9 acting at that scale (ce-mean-words logs the mean cost only, no counts).",
    "build: the wheel's own kernels are compiled for AVX only (--build-info: COMPILE_AVX2 and COMPILE_AVX512 OFF);"
    " its matrix products go through statically linked MKL, which picks its kernels at run time (on an AMD CPU too,"
    " with no MKL_* override set here).",
    "process: the timed process is the `pymarian` console script (Python + the 1 GB _pymarian library with marian"
    " and its CUDA code linked in), so peak RSS includes the interpreter and the library pages touched; marian also"
    " preallocates a 2 GB workspace per worker (--workspace default), counted only as far as it is touched.",
]


def setup():
    """The pymarian venv and, if missing, the peers' data; both are kept for later runs."""
    if not (VENV / ".done").exists():
        subprocess.run([os.environ.get("PEERS_PYTHON", "python3"), "-m", "venv", VENV], check=True)
        # pymarian needs no torch (it requires pyyaml, tqdm, requests, portalocker, huggingface-hub)
        subprocess.run([VENV / "bin" / "pip", "install", f"pymarian=={PYMARIAN}"], stdout=sys.stderr, check=True)
        (VENV / ".done").touch()
    if not (DATA / ".done").exists():  # setup.sh makes the data with any peer, under the lock it takes itself
        subprocess.run(["bash", PEERS / "setup.sh", "hf_marian"], stdout=sys.stderr, check=True)


def npz_params(path):
    """Parameter count of a saved marian model, from the shapes in the .npy headers (no numpy in this process)."""
    total = 0
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.startswith("special:"):  # marian keeps its model config in the npz as a char array
                continue
            with z.open(name) as f:
                head = f.read(10)
                size = int.from_bytes(head[8:10], "little")  # .npy version 1 header
                shape = literal_eval(f.read(size).decode("latin1"))["shape"]
            total += math.prod(shape)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="-", help="write the JSON here instead of the last line of stdout")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timed", type=int, default=100)
    args = ap.parse_args()
    if (args.warmup, args.timed) != (10, 100):
        print(f"marian: {args.warmup} + {args.timed} updates is a check of the path, not the spec", file=sys.stderr)
    setup()
    shutil.rmtree(RUN, ignore_errors=True)  # marian resumes from a model it finds: start clean
    RUN.mkdir(parents=True)
    # Marian's vocabulary convention (as hf_marian.py): </s> 0, <unk> 1, then the joint pieces; no <pad> row.
    pieces = (DATA / "joint_vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    vocab = {"</s>": 0, "<unk>": 1} | {p: i for i, p in enumerate(pieces, 2)}
    (RUN / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")

    marian = str(VENV / "bin" / "pymarian")
    # marian prints its version (and its whole log) on stderr
    version = subprocess.run([marian, "--version"], capture_output=True, text=True).stderr.strip()
    n = args.warmup + args.timed
    cmd = [marian, "--model", f"{RUN}/model.npz", "--train-sets", f"{DATA}/train.sp.en", f"{DATA}/train.sp.de",
           "--vocabs", f"{RUN}/vocab.json", f"{RUN}/vocab.json", *SPEC,
           "--after", f"{n}u", "--disp-freq", "1", "--lr-report"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")  # as lib.sh (MKL is sequential here anyway)
    # "Ep. 1 : Up. 11 : Sen. 3,904 : Cost 8.9 * 4,226 @ 4,226 after 46,321 : Time 1.52s : 2780.1 words/s : ..."
    update_line = re.compile(r"Up\. (\d+) : .* @ ([\d,]+) after ([\d,]+) : Time ([\d.]+)s")
    ends, labels, labels_after, logged_s = {}, {}, {}, {}
    print(f"marian: waiting for the CPU lock {LOCK}", file=sys.stderr)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as lock, open(RUN / "log", "w") as log:
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"marian: {n} updates, log {RUN / 'log'}", file=sys.stderr)
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in child.stdout:
            now = time.perf_counter()  # the end of an update is when its log line appears
            log.write(line)
            if m := update_line.search(line):
                u = int(m[1])
                ends[u], logged_s[u] = now, float(m[4])
                labels[u], labels_after[u] = (int(x.replace(",", "")) for x in m.group(2, 3))
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode or sorted(ends) != list(range(1, n + 1)):
        tail = "".join((RUN / "log").read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"marian failed (exit {child.returncode}), the end of {RUN / 'log'}:\n{tail}")

    timed = range(args.warmup + 1, n + 1)
    wall = ends[n] - ends[args.warmup]
    tok = labels_after[n] - labels_after[args.warmup]
    assert tok == sum(labels[u] for u in timed), "marian's label counts do not add up"
    result = {
        "peer": "marian",
        "train_tgt_tok_per_s": tok / wall, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024,
        "tgt_tokens": tok, "tgt_tokens_per_update": tok / args.timed,
        "warmup_updates": args.warmup, "timed_updates": args.timed,
        # marian's own timer over the same updates (each update's Time is printed to 0.01 s)
        "toolkit_logged_tok_per_s": tok / sum(logged_s[u] for u in timed),
        "params": npz_params(RUN / "model.npz"),
        "batch": "--mini-batch-words 4096: non-pad source tokens (incl. </s>) > 4096 closes a batch; 2 workers x half",
        "marian_command": shlex.join(cmd), "deviations": DEVIATIONS,
        "versions": {"pymarian": PYMARIAN, "marian": version},
    }  # fmt: skip
    (RUN / "result.json").write_text(json.dumps(result) + "\n")
    subprocess.run([sys.executable, PEERS / "report.py", "bench", args.json, RUN / "result.json"], check=True)


if __name__ == "__main__":
    main()
