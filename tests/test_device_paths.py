"""What the GPU path depends on, checked on any machine: how often a training update and a search step read the
device from the host (each read waits for the GPU), torch.compile without graph breaks or per-batch recompiles,
the device and precision rules, and a CUDA smoke test that runs only where there is a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mtcli.loss
from mtcli import device as device_rules
from mtcli.batching import collate
from mtcli.config import ModelConfig, TrainConfig
from mtcli.distributed import Dist
from mtcli.errors import MtcliError
from mtcli.host_reads import count_host_reads
from mtcli.model import Transformer
from mtcli.search import beam_search, greedy_search, sample
from mtcli.update import Trainer, train_step

VOCAB = 300


def tiny_model(dropout: float = 0.1) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(layers=1, d_model=64, heads=4, d_ff=128, dropout=dropout)
    return Transformer(cfg, VOCAB, VOCAB, joint_vocab=True)


def random_batches(shapes, seed: int = 0, device="cpu"):
    """collate'd batches of random ids, one per (sentences, source length, target length)."""
    rng = np.random.default_rng(seed)
    return [
        collate([rng.integers(4, VOCAB, S) for _ in range(B)], [rng.integers(4, VOCAB, T) for _ in range(B)]).to(device)
        for B, S, T in shapes
    ]


class StepCounter:
    """Counts decoder calls of a model (one per search step)."""

    def __init__(self, model):
        self.steps, self.decode = 0, model.decode
        model.decode = self

    def __call__(self, *args, **kwargs):
        self.steps += 1
        return self.decode(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Host reads


@pytest.mark.parametrize("rdrop", [0.0, 0.5])
def test_a_training_update_reads_the_device_at_most_twice_whatever_its_micro_batches(rdrop, monkeypatch):
    """The GPU's path: a CPU's fused loss may branch on its data (a read is free there), a GPU's may not."""
    monkeypatch.setattr(mtcli.loss, "branch_free", lambda device: True)
    trainer = Trainer.build(tiny_model(), TrainConfig(lr=1e-3, rdrop=rdrop), torch.float32, torch.device("cpu"))
    batches = random_batches([(8, 12, 14), (5, 30, 21), (16, 6, 7), (3, 40, 41)])
    with count_host_reads() as reads:
        step = train_step(trainer, batches, sum(b.n_tgt_tokens for b in batches), 1e-3, 1.0)
    assert step.finite and reads.total <= 2, reads.by_name


@pytest.mark.parametrize("search", ["greedy", "beam", "beam-nbest-ngram", "sample"])
def test_search_steps_read_the_device_once_each(search):
    """Sentences with different length limits leave the batch at different steps, some at their limit."""
    model = tiny_model().eval()
    (batch,) = random_batches([(6, 9, 2)])
    max_lens = torch.tensor([1, 3, 6, 9, 12, 20])
    counter = StepCounter(model)
    with count_host_reads() as reads:
        if search == "greedy":
            greedy_search(model, batch.src, batch.src_pad_mask, max_lens)
        elif search == "beam":
            beam_search(model, batch.src, batch.src_pad_mask, max_lens, beam_size=4, lenpen=0.6)
        elif search == "beam-nbest-ngram":
            beam_search(model, batch.src, batch.src_pad_mask, max_lens, beam_size=3, nbest=3, no_repeat_ngram=2)
        else:
            sample(model, batch.src, batch.src_pad_mask, max_lens, top_k=5, generator=torch.Generator().manual_seed(1))
    assert counter.steps >= 10
    # + 1 before the steps (the length limits); sampling reads its sums once more at the end
    assert reads.total <= counter.steps + (2 if search == "sample" else 1), reads.by_name


def test_the_counter_sees_each_kind_of_read():
    t = torch.tensor([1.5, 2.0])
    with count_host_reads() as reads:
        float(t[0]), int(t[1]), bool(t[0] > 1), t.tolist(), t.sum().item(), t.nonzero(), t.cpu(), [0, 1, 2][t.long()[1]]
    assert reads.total == 8 and set(reads.by_name) == {
        "__float__",
        "__int__",
        "__bool__",
        "tolist",
        "item",
        "nonzero",
        "cpu",
        "__index__",
    }
    assert torch.Tensor.item.__name__ == "item"  # put back


def test_fp16_training_steps_scale_the_loss_and_learn():
    """fp16 (the precision of GPUs without bf16) with the loss scaler, here under CPU autocast: finite updates, the
    scale in use, the loss falling on a repeated batch."""
    trainer = Trainer.build(tiny_model(), TrainConfig(lr=1e-3), torch.float16, torch.device("cpu"))
    (batch,) = random_batches([(16, 20, 22)])
    steps = [train_step(trainer, [batch], batch.n_tgt_tokens, 1e-3, 1.0) for _ in range(5)]
    assert all(step.finite for step in steps) and trainer.scaler.get_scale() >= 2**15
    assert float(steps[-1].loss_sum) < 0.95 * float(steps[0].loss_sum)


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.model  # compiles (~10 s each on 2 cores)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_has_no_graph_breaks_and_one_graph_for_every_batch_shape(dtype, monkeypatch):
    """torch.compile(dynamic=True) of the model and its fused loss, as train.compile does: a symbolic is_causal, a
    data-dependent branch or a host read in the loss would break the graph; a loop over a batch's row chunks would
    fix its row count and recompile for nearly every batch. fp32 takes SDPA on a CPU, as every precision does on a
    GPU (a symbolic is_causal: 6 breaks, 9 graphs); bf16 runs under CPU autocast, where the CPU fast path must stand
    aside."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    # Graph breaks and recompiles are Dynamo's; AOTAutograd traces the backward too. Inductor's code generation (20 s
    # more here) is left to `make gpu-check`'s graph_breaks step.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    eager = Trainer.build(tiny_model(dropout=0.0), TrainConfig(lr=1e-3), dtype, torch.device("cpu"))
    trainer = Trainer.build(tiny_model(dropout=0.0), TrainConfig(lr=1e-3, compile=True), dtype, torch.device("cpu"))
    for batch in random_batches([(8, 12, 14), (6, 20, 9), (9, 7, 23)]):  # no dropout: the same losses
        compiled_loss = train_step(trainer, [batch], batch.n_tgt_tokens, 1e-3, 1.0).loss_sum
        eager_loss = train_step(eager, [batch], batch.n_tgt_tokens, 1e-3, 1.0).loss_sum
        assert float(compiled_loss) == pytest.approx(float(eager_loss), rel=2e-2 if dtype == torch.bfloat16 else 1e-4)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# Devices and precision


def test_tests_run_on_the_cpu_unless_marked_cuda():
    import os

    assert not torch.cuda.is_available() and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert device_rules.resolve_device("auto").type == "cpu"


def test_gpus_with_emulated_bf16_train_in_fp16(monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a V100 or T4 (emulation); auto must pick fp16 with loss scaling."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert device_rules.choose_precision("auto", cuda)[0] == "fp16"
    assert device_rules.choose_precision("auto", cuda, training=False)[0] == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert device_rules.choose_precision("auto", cuda) == ("bf16", "Tesla V100 has bf16 tensor cores")


def test_more_torchrun_processes_than_gpus_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MtcliError, match=r"more processes on this node than it has GPUs \(1\).*--nproc_per_node 1"):
        Dist.from_env("auto")


# ---------------------------------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_training_steps_and_a_beam_search(precision):
    device = torch.device("cuda")
    dtype = device_rules.DTYPES[precision]
    model = tiny_model().to(device)
    trainer = Trainer.build(model, TrainConfig(lr=1e-3), dtype, device)
    batches = random_batches([(8, 12, 14), (5, 30, 21)], device=device)
    with count_host_reads("cuda") as reads:
        steps = [train_step(trainer, [b], b.n_tgt_tokens, 1e-3, 1.0) for b in batches]
    assert all(s.finite for s in steps) and reads.total <= 2 * len(steps)
    assert trainer.scaler.is_enabled() == (precision == "fp16")
    model.eval()
    with torch.autocast("cuda", dtype=dtype):
        hyps = beam_search(model, batches[0].src, batches[0].src_pad_mask, torch.full((8,), 10, device=device), 4)
    assert len(hyps) == 8 and all(len(h[0].tokens) <= 10 for h in hyps)


@pytest.mark.cuda
def test_cuda_attention_uses_a_fused_sdpa_kernel():
    """Flash or memory-efficient attention, not the math fallback, for causal self-attention and padded keys."""
    q = k = v = torch.randn(4, 8, 32, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(4, 1, 1, 32, dtype=torch.bool, device="cuda")
    mask[0, ..., -3:] = False
    math = torch.nn.attention.SDPBackend.MATH
    assert torch._fused_sdp_choice(q, k, v, None, 0.0, True) != math.value
    assert torch._fused_sdp_choice(q, k, v, mask, 0.0, False) != math.value
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16(),
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.system
def test_gpu_check_runs_from_the_checkout_and_says_what_it_skipped(tmp_path):
    """`make gpu-check`'s script with a few quick steps: exit 0, one JSON report, the GPU-only step skipped here."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "report.json"
    steps = "environment,host_reads,base_bench"
    proc = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu.sh"), "--only", steps, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())["steps"]
    assert report["environment"]["status"] == report["host_reads"]["status"] == "ok"
    assert report["base_bench"]["status"] == "skipped" and "skipped ['base_bench']" in proc.stdout
    reads = report["host_reads"]["result"]
    assert reads["per_update_of_4_micro_batches"] <= 2 and reads["beam4_reads"] <= reads["beam4_steps"] + 1
    # a rerun replaces its own report; a file it did not write, or a folder, is refused and left as it was
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": 1}\n')
    for target in (foreign, tmp_path):
        refused = subprocess.run(
            ["bash", str(root / "benchmarks" / "gpu.sh"), "--only", "environment", "--out", str(target)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and "--out" in refused.stderr, refused.stderr
    assert foreign.read_text() == '{"mine": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.json",
        "report.json",
    ]
    rerun = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu.sh"), "--only", "environment", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0 and list(json.loads(out.read_text())["steps"]) == ["environment"]
