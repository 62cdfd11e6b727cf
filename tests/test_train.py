"""Training: schedule, loss, checkpoints (round trip, atomic writes), exact resume, signals, DDP on 2 CPU processes."""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import invoke, losses

import mtcli.loss
import mtcli.train
from mtcli import checkpoint as ckpt
from mtcli.average import average_checkpoints
from mtcli.batching import epoch_batches
from mtcli.config import TrainConfig
from mtcli.config_loader import load_config, replaced
from mtcli.data import prepare
from mtcli.errors import MtcliError
from mtcli.loss import LossModel, projection_cross_entropy, symmetric_kl
from mtcli.train import lr_at, train

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(cache_dir, **overrides):
    """The toy corpus with a very small model: a few updates take a second or two."""
    settings = {
        "data.cache_dir": str(cache_dir),
        "model.layers": 1,
        "model.d_model": 32,
        "model.heads": 2,
        "model.d_ff": 64,
        "train.max_tokens": 4096,
        "train.max_updates": 16,
        "train.valid_every": 8,
        "train.log_every": 1,
        "train.warmup": 4,
        "train.valid_max_sentences": 20,
        "train.threads": 1,
    }
    settings.update(overrides)
    return load_config("toy.yaml", [f"{k}={v}" for k, v in settings.items()])


@pytest.fixture(scope="module")
def cache_dir(toy_cache):
    """The session's toy data cache (tiny_config changes only the model and training), prepared here before the DDP and
    subprocess tests read it from several processes at once."""
    prepare(tiny_config(toy_cache))
    return toy_cache


# ---------------------------------------------------------------------------------------------------------------------
# Pure pieces


def test_inverse_sqrt_schedule_at_warmup_boundaries():
    cfg = TrainConfig(lr=7e-4, warmup=4000)
    assert lr_at(1, cfg) == pytest.approx(7e-4 / 4000)
    assert lr_at(2000, cfg) == pytest.approx(3.5e-4)
    assert lr_at(4000, cfg) == pytest.approx(7e-4)
    assert lr_at(16000, cfg) == pytest.approx(3.5e-4)
    # It is the paper's formula d^-0.5 * min(step^-0.5, step * warmup^-1.5) for d = 512.
    for step in (1, 100, 3999, 4000, 4001, 50000):
        paper = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert lr_at(step, TrainConfig(lr=512**-0.5 * 4000**-0.5, warmup=4000)) == pytest.approx(paper)


def test_constant_and_cosine_schedules():
    constant = TrainConfig(lr=1e-3, warmup=10, schedule="constant")
    assert lr_at(5, constant) == pytest.approx(5e-4) and lr_at(10, constant) == lr_at(1000, constant) == 1e-3
    cosine = TrainConfig(lr=1e-3, warmup=10, schedule="cosine", max_updates=110, min_lr=1e-5)
    assert lr_at(10, cosine) == pytest.approx(1e-3)
    assert lr_at(60, cosine) == pytest.approx((1e-3 + 1e-5) / 2)
    assert lr_at(110, cosine) == pytest.approx(1e-5)


def test_label_smoothed_loss_against_a_hand_computed_value():
    """eps spread uniformly over the vocabulary: (1 - eps) * nll + eps * mean over classes of -log p."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0]])
    labels = torch.tensor([0, 3, 2])
    eps = 0.1
    # hidden @ identity = the logits, so the fused projection + loss sees exactly these scores
    loss = projection_cross_entropy(logits, torch.eye(4), labels, eps)
    expected = 0.0
    for row, label in zip(logits, labels.tolist()):
        log_p = row.log_softmax(-1)
        expected += (1 - eps) * -log_p[label] + eps * -log_p.mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


@pytest.fixture(params=["cpu", "branch-free"])
def loss_path(request, monkeypatch):
    """The fused loss's two ways to its log-sum-exp: the CPU's (at the target, with a branch for underflow) and the
    one GPUs and torch.compile take (at each row's most likely token)."""
    if request.param == "branch-free":
        monkeypatch.setattr(mtcli.loss, "branch_free", lambda device: True)
    return request.param


@pytest.mark.parametrize("rows", [5, 1024, 2500])  # one chunk, exactly one, several with a remainder
def test_fused_projection_loss_equals_the_unfused_one_with_gradients(rows, loss_path):
    torch.manual_seed(0)
    hidden = torch.randn(rows, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.3).requires_grad_()
    labels = torch.randint(4, 50, (rows,))
    fused = projection_cross_entropy(hidden, weight, labels, 0.1) * 0.37
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = F.cross_entropy(hidden @ weight.t(), labels, label_smoothing=0.1, reduction="sum") * 0.37
    reference.backward()
    assert float(fused.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # validation: no gradients kept, same value
        assert float(projection_cross_entropy(hidden, weight, labels, 0.1)) == pytest.approx(
            float(fused.detach()) / 0.37
        )


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_fused_projection_loss_is_exact_where_the_target_probability_underflows(dtype, loss_path):
    """The loss takes log-sum-exp as z_j - log p_j; a target 200 logits below the best has p_y = 0 in every dtype
    (fp16's smallest number is 6e-8), and must still get its true loss (~200), not inf."""
    hidden = torch.tensor([[200.0, 0.0], [0.0, 1.0]], requires_grad=True)
    weight = torch.eye(2)
    labels = torch.tensor([1, 1])
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = projection_cross_entropy(hidden, weight, labels, 0.0)
    loss.backward()
    reference = F.cross_entropy(hidden.detach() @ weight.t(), labels, reduction="sum")
    assert float(loss.detach()) == pytest.approx(float(reference), rel=1e-3) and float(reference) > 200
    assert torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("rows", [5, 1024, 2500])
def test_fused_projection_loss_under_cpu_bf16_autocast_matches_a_bf16_reference(rows):
    """The CPU bf16 path pads the rows to a multiple of attention.ROW_MULTIPLE: the padding must not show."""
    torch.manual_seed(0)
    hidden = torch.randn(rows, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.3).requires_grad_()
    labels = torch.randint(4, 50, (rows,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = projection_cross_entropy(hidden, weight, labels, 0.1)
    fused.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.dtype == torch.float32
    logits = (hidden.detach().bfloat16() @ weight.detach().bfloat16().t()).float()
    reference = F.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum")
    assert float(fused.detach()) == pytest.approx(float(reference), rel=2e-3)


def reference_symmetric_kl(hidden1, hidden2, weight):
    logp1, logp2 = (torch.log_softmax(h @ weight.t(), dim=1) for h in (hidden1, hidden2))
    return ((logp1.exp() - logp2.exp()) * (logp1 - logp2)).sum()


@pytest.mark.parametrize("rows", [5, 1024, 2500])
@pytest.mark.parametrize("bf16", [False, True])
def test_fused_rdrop_kl_equals_the_unfused_one_with_gradients(rows, bf16):
    """R-Drop's symmetric KL, fused and chunked (bf16 also pads rows), against autograd on whole logits."""
    torch.manual_seed(0)
    base = torch.randn(rows, 16)
    hidden = torch.cat([base, base + 0.3 * torch.randn(rows, 16)]).requires_grad_()
    weight = (torch.randn(50, 16) * 0.3).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        fused = symmetric_kl(hidden[:rows], hidden[rows:], weight) * 0.37
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    cast = (lambda t: t.bfloat16().float()) if bf16 else (lambda t: t)  # what the bf16 products see
    h, w = cast(hidden), cast(weight)
    reference = reference_symmetric_kl(h[:rows], h[rows:], w) * 0.37
    reference.backward()
    assert weight.grad.dtype == torch.float32 and float(reference) > 0
    assert float(fused.detach()) == pytest.approx(float(reference.detach()), rel=2e-2 if bf16 else 1e-4)
    for fused_grad, reference_grad in zip(grads, (hidden.grad, weight.grad)):
        if bf16:  # the fused gradients pass through bf16 products: compare as a whole
            assert (fused_grad - reference_grad).norm() < 0.02 * reference_grad.norm()
        else:
            torch.testing.assert_close(fused_grad, reference_grad, atol=1e-5, rtol=1e-4)


def test_rdrop_runs_the_batch_twice_with_independent_dropout():
    """Without dropout both runs agree: the loss is the plain one. With dropout the two runs differ (the KL term,
    seen by changing alpha under the same masks, is positive); in evaluation mode R-Drop is off."""
    from mtcli.config import ModelConfig
    from mtcli.model import Transformer

    torch.manual_seed(0)
    src, tgt = torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 5))
    src_pad = torch.zeros(3, 7, dtype=torch.bool)
    src_pad[0, 5:] = True
    real = torch.ones(3, 5, dtype=torch.bool)
    real[1, 3:] = False
    index = real.flatten().nonzero().squeeze(1)
    batch = src, src_pad, tgt, index, torch.randint(4, 40, (index.numel(),))
    shape = {"layers": 1, "d_model": 32, "heads": 2, "d_ff": 64}

    model = Transformer(ModelConfig(**shape, dropout=0.0, attention_dropout=0.0), 40, 40, True)
    assert float(LossModel(model, 0.1, rdrop=5.0)(*batch)) == pytest.approx(float(LossModel(model, 0.1)(*batch)))

    model = Transformer(ModelConfig(**shape, dropout=0.3), 40, 40, True)
    losses = []
    for alpha in (1.0, 5.0):
        torch.manual_seed(1)  # the same dropout masks for both
        losses.append(float(LossModel(model, 0.1, rdrop=alpha)(*batch)))
    assert losses[1] > losses[0] + 1e-3
    model.eval()
    assert float(LossModel(model, 0.1, rdrop=5.0)(*batch)) == float(LossModel(model, 0.1)(*batch))


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints


def _wiring_model_and_batches():
    """A tiny dropout-free model and two micro-batches of unequal target lengths, from token ids."""
    from mtcli.batching import collate
    from mtcli.config import ModelConfig
    from mtcli.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(layers=1, d_model=16, heads=2, d_ff=32, dropout=0.0), 40, 40, joint_vocab=True)
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(4, 40, (n,), generator=g).tolist(), torch.randint(4, 40, (m,), generator=g).tolist())
             for n, m in ((3, 9), (7, 2), (5, 4), (2, 11), (6, 3))]  # fmt: skip
    first, second = pairs[:2], pairs[2:]
    batches = [collate([s for s, _ in part], [t for _, t in part]) for part in (first, second)]
    return model, batches, collate([s for s, _ in pairs], [t for _, t in pairs])


def test_the_trainer_uses_the_configured_label_smoothing():
    """A Trainer built from a config with train.label_smoothing 0.3 gives the loss projection_cross_entropy gives
    with 0.3 (not with 0 or the default 0.1)."""
    from mtcli.loss import target_states
    from mtcli.update import Trainer

    model, (batch, _), _ = _wiring_model_and_batches()
    cfg = load_config("toy.yaml", ["train.label_smoothing=0.3"])
    trainer = Trainer.build(model, cfg.train, torch.float32, torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        got = trainer.loss_model(batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index, batch.labels)
        hidden = target_states(model, batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index)
        expected = {eps: projection_cross_entropy(hidden, model.output.weight, batch.labels, eps) for eps in (0.0, 0.3)}
    torch.testing.assert_close(got, expected[0.3])
    assert not torch.allclose(got, expected[0.0])


def test_micro_batches_of_one_update_give_the_gradient_of_their_concatenation():
    """Each micro-batch's loss is normalised by the update's target tokens, not its own: one update over two
    micro-batches of unequal length has the gradient of one step over both at once."""
    from mtcli.update import Trainer, train_step

    model, micro_batches, whole = _wiring_model_and_batches()
    grads = []
    for batches in (micro_batches, [whole]):
        trainer = Trainer.build(model, TrainConfig(), torch.float32, torch.device("cpu"))
        trainer.optimizer.step = lambda: grads.append([p.grad.clone() for p in model.parameters()])  # no update
        tokens = sum(b.n_tgt_tokens for b in batches)
        assert tokens == whole.n_tgt_tokens
        train_step(trainer, batches, tokens, lr=1e-3, clip_norm=0.0)
    assert micro_batches[0].n_tgt_tokens != micro_batches[1].n_tgt_tokens
    for split, joined in zip(*grads):
        torch.testing.assert_close(split, joined, atol=1e-6, rtol=1e-4)


def test_config_differences_name_every_changed_key_dotted():
    """What a resume (restore_training) and a distill rerun refuse: each key whose value differs, however deep."""
    was = {"model": {"d_ff": 64, "layers": 2}, "data": {"clean": {"copies": True}, "path": "a"}}
    now = {"model": {"d_ff": 128, "layers": 2}, "data": {"clean": {"copies": False}}, "train": {"lr": 0.1}}
    assert ckpt.config_differences(was, now) == [
        ("data.clean.copies", True, False),
        ("data.path", "a", None),
        ("model.d_ff", 64, 128),
        ("train.lr", None, 0.1),
    ]
    assert ckpt.config_differences(was, was) == []


@pytest.mark.parametrize(
    "vocab", [{"</s>": 0, "<unk>": "1"}, {"</s>": 0, "<unk>": 1.0}, {"</s>": 0, "<unk>": True}, {"</s>": [0]}]
)
def test_a_vocabulary_with_ids_that_are_not_whole_numbers_is_one_line_naming_it(tmp_path, vocab):
    """An imported model's vocab.json beside a checkpoint: ids of mixed types raised a TypeError from sorting."""
    from mtcli.tokenizer import _read_vocab

    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(vocab))
    with pytest.raises(MtcliError, match=rf"^{path}: expected a JSON object of pieces to the ids 0..n-1"):
        _read_vocab(path)


@pytest.mark.model
def test_checkpoint_round_trip(cache_dir, tmp_path):
    cfg = tiny_config(cache_dir, **{"train.max_updates": 3, "train.valid_every": 3})
    result = train(cfg, tmp_path / "run")
    path = ckpt.last_checkpoint(tmp_path / "run")
    assert path.name == "update_00000003" and ckpt.best_checkpoint(tmp_path / "run") == path
    model, config, tokenizer = ckpt.load_model(path)
    assert config == cfg
    original = result.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert model.output.weight is model.src_embed.weight  # tying survives the round trip
    state = torch.load(path / "state.pt", weights_only=True)  # loads without unpickling code
    assert state["update"] == 3 and "optimizer" in state and "rng" in state
    prepared = prepare(cfg).tokenizer
    sentences = ["I love apples", "She really likes green apples"]
    assert tokenizer.encode_src(sentences) == prepared.encode_src(sentences)  # the run's own SentencePiece model
    assert tokenizer.decode_tgt(prepared.encode_tgt(["我喜欢苹果"])) == ["我喜欢苹果"]


@pytest.mark.model
def test_interrupted_save_leaves_the_previous_checkpoint_loadable(cache_dir, tmp_path, monkeypatch):
    cfg = tiny_config(cache_dir, **{"train.max_updates": 2, "train.valid_every": 2})
    result = train(cfg, tmp_path / "run")
    run = tmp_path / "run"
    good = ckpt.last_checkpoint(run)

    def crash(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(MtcliError) as err:
        ckpt.save_checkpoint(run, 3, result.model, cfg, prepare(cfg).tokenizer, {"update": 3})
    message = str(err.value)  # the folder, the reason, the space needed, what is left
    assert "update_00000003" in message and "disk full (simulated)" in message and "MB free" in message
    assert f"the last checkpoint, {good}, is intact" in message and "--resume" in message
    monkeypatch.undo()
    assert ckpt.last_checkpoint(run) == good
    assert not [p for p in ckpt.checkpoint_dir(run).iterdir() if p.name.startswith(".")]  # temp folder removed
    ckpt.load_model(good)
    # A kill leaves no cleanup at all: the half-written folder has a temporary name and is never picked. The next
    # save (or a resume) removes it, and best.json's half-written file, once their process is gone; a process still
    # saving keeps its own.
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    folder = ckpt.checkpoint_dir(run)
    stale, running = folder / f".update_00000009.tmp-{dead.pid}", folder / f".update_00000009.tmp-{os.getppid()}"
    for left in (stale, running):
        left.mkdir()
        (left / "model.safetensors").write_bytes(b"garbage")
    (folder / f".best.json.tmp-{dead.pid}").write_text('{"checkpoint": ')
    assert ckpt.last_checkpoint(run) == good
    saved = ckpt.save_checkpoint(run, 3, result.model, cfg, prepare(cfg).tokenizer, {"update": 3})
    assert ckpt.last_checkpoint(run) == saved
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [running.name]
    stale.mkdir()
    ckpt.remove_temporary(run)
    assert not stale.exists() and running.is_dir()


@pytest.mark.model
def test_training_refuses_to_overwrite_a_run_and_resume_needs_a_checkpoint(cache_dir, tmp_path):
    cfg = tiny_config(cache_dir, **{"train.max_updates": 1, "train.valid_every": 1})
    with pytest.raises(MtcliError, match="no checkpoint to resume"):
        train(cfg, tmp_path / "run", resume=True)
    train(cfg, tmp_path / "run")
    with pytest.raises(MtcliError, match="--resume"):
        train(cfg, tmp_path / "run")
    other = tiny_config(cache_dir, **{"model.d_ff": 128, "train.max_updates": 2})
    with pytest.raises(MtcliError, match="model.d_ff"):
        train(other, tmp_path / "run", resume=True)
    # The refused resume left the run's own config, which the message tells the user to resume with.
    own = load_config(tmp_path / "run" / "config.yaml", ["train.max_updates=2"])
    assert own.model.d_ff == 64
    moved = tmp_path / "moved-cache"
    cache_dir.rename(moved)  # where the data cache lives is not part of what a resume must match
    try:
        assert train(replaced(own, **{"data.cache_dir": str(moved)}), tmp_path / "run", resume=True).update == 2
    finally:
        moved.rename(cache_dir)


@pytest.mark.model
def test_a_corrupt_checkpoint_is_a_one_line_error(cache_dir, tmp_path):
    train(tiny_config(cache_dir, **{"train.max_updates": 1, "train.valid_every": 1}), tmp_path / "run")
    model_file = ckpt.last_checkpoint(tmp_path / "run") / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:1000])  # truncated
    with pytest.raises(MtcliError, match="not a"):
        ckpt.load_model(model_file.parent)
    model_file.write_bytes(b"garbage")
    with pytest.raises(MtcliError, match="not a"):
        ckpt.load_model(model_file.parent)


# ---------------------------------------------------------------------------------------------------------------------
# Exact resume


@pytest.mark.model
@pytest.mark.parametrize("decode_precision, sampling", [("fp32", 0.0), ("bf16", 0.0), ("fp32", 0.3)])
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(
    cache_dir, tmp_path, decode_precision, sampling, monkeypatch
):
    """Stopped at update 7 (between validations, in the first epoch) and resumed: bit-identical per-update losses and
    weights, across an epoch boundary and a validation. The stopped run validates at 7 and the full one does not,
    so validation must not draw from training's random streams, whatever precision it decodes in (bf16 decoding
    once did, through a probe: the resumed run's dropout masks then differed from update 8 on). With subword
    sampling, the resumed epoch must get the same pieces as the uninterrupted one; there the stopped and resumed runs
    take their updates from the GPU's feed (feed.py: micro-batches collated on a thread one update ahead, epochs
    planned one ahead, sampling on the planner's thread), the full run from the CPU's in-line feed."""
    big_batches = {
        "train.max_tokens": 8192,
        "train.precision": "fp32",
        "decode.precision": decode_precision,
        "data.sampling_alpha": sampling,
    }
    full = train(tiny_config(cache_dir, **big_batches), tmp_path / "full")
    if sampling:
        monkeypatch.setattr(mtcli.train, "prepares_ahead", lambda device: True)
    part = tiny_config(cache_dir, **big_batches, **{"train.max_updates": 7})
    train(part, tmp_path / "part")
    resumed = train(tiny_config(cache_dir, **big_batches), tmp_path / "part", resume=True)
    assert resumed.update == full.update == 16
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    state = torch.load(ckpt.last_checkpoint(tmp_path / "part") / "state.pt", weights_only=True)
    assert state["epoch"] >= 1  # the resumed part crossed an epoch boundary, so the data position was tested too
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.system
def test_sigterm_saves_and_the_run_resumes(cache_dir, tmp_path):
    """A real process: SIGTERM mid-run finishes the update, writes a checkpoint, says how to resume, exits 143."""
    run = tmp_path / "run"
    sets = {**_set_args(cache_dir), "train.max_updates": 400, "train.valid_every": 400}
    cmd = [sys.executable, "-m", "mtcli", "train", "--config", "toy.yaml", "--run-dir", str(run)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("update       3"):
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 143, output
    assert "resume with: mtcli train" in output and "--resume" in output
    assert "valid update" not in output  # a stop request saves and exits; it does not validate first
    saved = ckpt.last_checkpoint(run)
    stopped_at = int(saved.name.split("_")[1])
    assert 3 <= stopped_at < 400
    resumed = subprocess.run(
        cmd + ["--resume", "--set", f"train.max_updates={stopped_at + 2}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert ckpt.last_checkpoint(run).name == f"update_{stopped_at + 2:08d}"
    assert [json.loads(x)["update"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, stopped_at + 3)
    )


def _set_args(cache_dir):
    return {
        "data.cache_dir": str(cache_dir),
        "model.layers": 1,
        "model.d_model": 32,
        "model.heads": 2,
        "model.d_ff": 64,
        "train.log_every": 1,
        "train.threads": 1,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Distributed


def _ddp_worker(rank, world, port, cache_dir, run_dir, out_dir, tokens_per_update):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    cfg = tiny_config(
        cache_dir,
        **{
            "train.max_updates": 5,
            "train.valid_every": 5,
            "model.dropout": 0.0,
            "train.tokens_per_update": tokens_per_update,
        },
    )
    result = train(cfg, run_dir)
    torch.save(result.model.state_dict(), Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.system
def test_two_process_ddp_keeps_ranks_identical_and_matches_one_process(cache_dir, tmp_path):
    cfg = tiny_config(cache_dir)
    train_split = prepare(cfg).split("train")
    per_batch = train_split.tgt_lens.sum() / len(
        epoch_batches(train_split.src_lens, train_split.tgt_lens, cfg.train.max_tokens, cfg.train.seed, 0)
    )
    tokens_per_update = int(2 * per_batch)  # one process: 2 micro-batches per update; two processes: 1 each
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(
        _ddp_worker, args=(2, port, cache_dir, tmp_path / "ddp", tmp_path, tokens_per_update), nprocs=2, join=True
    )
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs across ranks"
    assert [json.loads(x)["update"] for x in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]
    # One process with accumulation sees the same batches per update: same losses up to float reduction order.
    single = tiny_config(
        cache_dir,
        **{
            "train.max_updates": 5,
            "train.valid_every": 5,
            "model.dropout": 0.0,
            "train.tokens_per_update": tokens_per_update,
        },
    )
    one = train(single, tmp_path / "single")
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    # Weights: Adam divides by sqrt(v), so a gradient that is float noise around zero (the key bias's is zero by
    # construction: softmax ignores it) moves by up to one learning rate per update in a direction
    # set by the reduction order. A real divergence (another batch, a gradient not averaged) moves the losses above
    # and the weight matrices on average; biases and gains are only bounded.
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    bound = 3 * sum(lrs)  # Adam steps of up to ~1.5 lr (bias-corrected), the two runs in opposite directions
    for name, tensor in one.model.state_dict().items():
        diff = (tensor - rank0[name]).abs()
        assert diff.max() <= bound, f"{name}: max difference {diff.max():.2e} over {bound:.2e}"
        assert tensor.dim() < 2 or diff.mean() < 1e-4, f"{name}: mean difference {diff.mean():.2e}"


@pytest.mark.model
def test_nonfinite_losses_stop_the_run_with_a_clear_error(cache_dir, tmp_path, monkeypatch):
    cfg = tiny_config(cache_dir, **{"train.max_updates": 20, "train.valid_every": 2, "train.max_nonfinite": 3})
    calls = {"n": 0}
    original = LossModel.forward

    def explode_after_two_updates(self, *args):
        calls["n"] += 1
        loss = original(self, *args)
        return loss * float("nan") if calls["n"] > 2 else loss

    monkeypatch.setattr(LossModel, "forward", explode_after_two_updates)
    start = time.time()
    with pytest.raises(MtcliError, match="non-finite") as err:
        train(cfg, tmp_path / "run")
    assert "update_00000002" in str(err.value)  # names the intact last checkpoint
    assert ckpt.last_checkpoint(tmp_path / "run").name == "update_00000002"
    assert time.time() - start < 60
    model, _, _ = ckpt.load_model(ckpt.last_checkpoint(tmp_path / "run"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(losses(tmp_path / "run")[-1])


@pytest.mark.model
def test_average_refuses_different_architectures_and_averages_equal_ones(cache_dir, tmp_path):
    cfg = tiny_config(cache_dir, **{"train.max_updates": 2, "train.valid_every": 1, "train.keep_last": 5})
    train(cfg, tmp_path / "a")
    first, second = ckpt.list_checkpoints(tmp_path / "a")
    averaged = average_checkpoints([first, second], tmp_path / "avg")
    model, _, _ = ckpt.load_model(averaged)
    a, b = ckpt.load_model(first)[0].state_dict(), ckpt.load_model(second)[0].state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, (a[name] + b[name]) / 2)
    train(tiny_config(cache_dir, **{"train.max_updates": 1, "train.valid_every": 1, "model.d_ff": 128}), tmp_path / "b")
    with pytest.raises(MtcliError, match="different architectures"):
        average_checkpoints([first, ckpt.last_checkpoint(tmp_path / "b")], tmp_path / "bad")


@pytest.mark.model
def test_max_epochs_ends_with_a_validated_checkpoint(cache_dir, tmp_path):
    cfg = tiny_config(
        cache_dir,
        **{"train.max_epochs": 1, "train.max_updates": 1000, "train.valid_every": 1000, "train.max_tokens": 8192},
    )
    result = train(cfg, tmp_path / "run")
    assert result.stopped_by == "max_epochs" and 5 < result.update < 20
    assert ckpt.last_checkpoint(tmp_path / "run").name == f"update_{result.update:08d}"
    assert json.loads((ckpt.checkpoint_dir(tmp_path / "run") / "best.json").read_text())["update"] == result.update


# ---------------------------------------------------------------------------------------------------------------------
# The best checkpoint and early stopping


@pytest.fixture
def scripted_losses(monkeypatch):
    """Validation reports the losses in this list, one per validation in order (the real validation still runs, for
    its other figures): a loss curve that goes down and up again, which a few updates of real training do not give."""
    real, script = mtcli.train.validation_loss, []
    monkeypatch.setattr(mtcli.train, "validation_loss", lambda *a, **k: {**real(*a, **k), "loss": script.pop(0)})
    return script


def valid_lines(run: Path) -> list[tuple[int, float, str]]:
    """(update, loss, verdict) of each `valid update` line of train.log: verdict `best` or `no improvement (n)`."""
    found = re.findall(
        r"valid update +(\d+) \| loss ([\d.]+) \|.*\| (best|no improvement \(\d+\)) \|", (run / "train.log").read_text()
    )
    return [(int(u), float(loss), verdict) for u, loss, verdict in found]


@pytest.mark.model
def test_valid_metric_loss_picks_the_lowest_loss_which_translate_and_eval_then_use(
    cache_dir, tmp_path, scripted_losses
):
    """train.valid_metric: loss. The best checkpoint is the one with the lowest validation loss (here neither the first,
    the last nor the highest), pruning by keep_last spares it, and translate and eval pick it by default."""
    scripted_losses += [3.0, 1.0, 4.0, 2.0]  # at updates 2, 4, 6, 8
    run = tmp_path / "run"
    settings = {"train.valid_metric": "loss", "train.valid_every": 2, "train.max_updates": 8, "train.keep_last": 1}
    train(tiny_config(cache_dir, **settings), run)
    assert not scripted_losses  # one validation per 2 updates
    verdicts = [(2, 3.0, "best"), (4, 1.0, "best"), (6, 4.0, "no improvement (1)"), (8, 2.0, "no improvement (2)")]
    assert valid_lines(run) == verdicts
    best = json.loads((ckpt.checkpoint_dir(run) / "best.json").read_text())
    assert best["metric"] == "loss" and best["checkpoint"] == "update_00000004" and best["update"] == 4, best
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["update_00000004", "update_00000008"]
    expected = ckpt.checkpoint_dir(run) / "update_00000004"
    translated = invoke("translate", "--run", run, "--beam", "1", "I love apples")
    assert f"checkpoint: {expected} (best by validation)" in translated.stderr
    scored = json.loads(invoke("eval", "--run", run, "--split", "valid", "--beam", "1", "--json").stdout)
    assert scored["checkpoint"] == str(expected)


@pytest.mark.model
@pytest.mark.parametrize("metric", ["loss", "bleu"])
def test_patience_stops_a_run_that_no_longer_improves(cache_dir, tmp_path, metric):
    """train.patience: 2 validations in a row without a better score end the run, whichever metric is watched. The
    learning rate is so small that no float32 weight moves, so every validation scores exactly as the first: updates 2
    (best), 4 and 6 (no improvement)."""
    settings = {"train.valid_metric": metric, "train.patience": 2, "train.valid_every": 2, "train.max_updates": 40}
    result = train(tiny_config(cache_dir, **settings, **{"train.lr": 1e-30}), tmp_path / "run")
    assert result.stopped_by == "early_stopping" and result.update == 6
    assert [u for u, _, _ in valid_lines(tmp_path / "run")] == [2, 4, 6]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "early stopping: no improvement in 2 validations" in log and "done: early_stopping at update 6" in log
    assert ckpt.last_checkpoint(tmp_path / "run").name == "update_00000006"  # the run ends on a saved checkpoint
    assert ckpt.best_checkpoint(tmp_path / "run").name == "update_00000002"


@pytest.mark.model
def test_patience_counts_validations_since_the_best_and_across_a_resume(cache_dir, tmp_path, scripted_losses):
    """An improvement starts the count again; a resumed run goes on counting from its checkpoint (the best score and
    the count are in state.pt), so it stops where the uninterrupted run stops."""
    settings = {"train.valid_metric": "loss", "train.patience": 2, "train.valid_every": 2, "train.max_updates": 40}
    # updates 2, 4, 6, 8, 10: best, worse (1), best again (0), worse (1), worse (2): stop at 10, not at 8
    losses_at = [5.0, 5.5, 4.0, 4.5, 4.2]
    scripted_losses += losses_at
    whole = train(tiny_config(cache_dir, **settings), tmp_path / "whole")
    assert whole.stopped_by == "early_stopping" and whole.update == 10 and not scripted_losses
    assert ckpt.best_checkpoint(tmp_path / "whole").name == "update_00000006"
    # Stopped at update 8 with one validation without improvement, then resumed: one more stops it at 10.
    scripted_losses += losses_at[:4]
    part = train(tiny_config(cache_dir, **{**settings, "train.max_updates": 8}), tmp_path / "part")
    assert part.stopped_by == "max_updates" and not scripted_losses
    scripted_losses += [4.2, 4.3, 4.4]  # a resume that forgot the count or the best score would go on past 10
    resumed = train(tiny_config(cache_dir, **settings), tmp_path / "part", resume=True)
    assert resumed.stopped_by == "early_stopping" and resumed.update == 10
    assert valid_lines(tmp_path / "part") == valid_lines(tmp_path / "whole")
    assert ckpt.best_checkpoint(tmp_path / "part").name == "update_00000006"
