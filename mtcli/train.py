"""`mtcli train`: the training loop, its schedule, loss, precision, validation, checkpoints and resume.

Single process or `torchrun --nproc_per_node N -m mtcli train ...` (DistributedDataParallel: NCCL on GPUs, gloo on
CPU). Every rank computes the same epoch's batch list from the seed and takes a disjoint shard of it, so the data
position is one pair (epoch, update-in-epoch) shared by all ranks, and a resumed run sees exactly the batches an
uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mtcli import checkpoint as ckpt
from mtcli.config import Config, TrainConfig
from mtcli.data import PreparedData, batch_indices, cache_folder, collate, prepare
from mtcli.device import choose_precision, keep_freed_memory, resolve_device
from mtcli.errors import MtcliError
from mtcli.evaluate import score
from mtcli.log import Progress, TensorBoard, format_duration, logger, setup_logging
from mtcli.loss import LossModel, projection_cross_entropy, target_states
from mtcli.model import Transformer
from mtcli.translate import Translator

# ---------------------------------------------------------------------------------------------------------------------
# The learning-rate schedule


def lr_at(update: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step number `update` (1-based): linear warm-up to cfg.lr, then the schedule."""
    warmup = cfg.warmup
    if warmup and update < warmup:
        return cfg.lr * update / warmup
    if cfg.schedule == "inverse_sqrt":  # the paper's d^-0.5 * min(step^-0.5, step * warmup^-1.5), peak = cfg.lr
        return cfg.lr * math.sqrt(max(warmup, 1) / update)
    if cfg.schedule == "cosine":
        progress = min(1.0, (update - warmup) / max(1, cfg.max_updates - warmup))
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    return cfg.lr


# ---------------------------------------------------------------------------------------------------------------------
# Distributed set-up


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_name: str) -> tuple[Dist, torch.device]:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            device = resolve_device(device_name)
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)  # so RNG state saved and restored is this GPU's
            return cls(), device
        d = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
        device = resolve_device(device_name)
        if device.type == "cuda":
            device = torch.device("cuda", d.local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
        return d, device


def prepare_once(cfg: Config, d: Dist) -> PreparedData:
    """Local rank 0 builds the data cache; the other processes on the node wait for it, then read it."""
    if d.local_rank == 0:
        return prepare(cfg, log=logger.info)
    meta = cache_folder(cfg.data) / "meta.json"
    while not meta.is_file():
        time.sleep(2)
    return prepare(cfg, log=lambda *_: None)


# ---------------------------------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainState:
    update: int = 0  # optimizer steps taken
    epoch: int = 0
    group: int = 0  # next update-sized group of batches within the epoch
    best_score: float | None = None
    bad_validations: int = 0
    skipped: int = 0  # updates skipped for a non-finite loss


@dataclass
class TrainResult:
    model: Transformer
    run_dir: Path
    update: int
    stopped_by: str  # "max_updates", "max_epochs", "early_stopping", "SIGINT", "SIGTERM"


def train(cfg: Config, run_dir: Path | None = None, resume: bool = False) -> TrainResult:
    """Train `cfg` into `run_dir` (default runs/<config name>); with resume, continue from its last checkpoint."""
    tc = cfg.train
    d, device = Dist.from_env(tc.device)
    run_dir = Path(run_dir or Path("runs") / cfg.name)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    if device.type == "cpu":
        keep_freed_memory()
    setup_run_dir(run_dir, cfg, resume, d)
    data = prepare_once(cfg, d)
    if d.main:
        data.tokenizer.copy_to(run_dir)
    train_split = data.split("train")
    usable = usable_examples(train_split, cfg)

    # Model, optimizer, precision. The seed makes initialisation identical on every rank.
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    tokenizer = data.tokenizer
    model = Transformer(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).to(device)
    logger.info(
        f"model: {model.num_parameters():,} parameters ({cfg.model.n_encoder_layers}+"
        f"{cfg.model.n_decoder_layers} layers, d_model {cfg.model.d_model}, {cfg.model.heads} heads, "
        f"d_ff {cfg.model.d_ff}, {cfg.model.norm}-norm, vocabulary {tokenizer.tgt_vocab_size}"
        f"{', tied' if cfg.model.tie_embeddings else ''})"
    )
    dtype = choose_precision(tc.precision, device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        logger.warning("warning: bf16 on a CPU without bf16 units can be ~100x slower than fp32 (train.precision)")
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=tc.betas,
        eps=tc.eps,
        fused=device.type in ("cuda", "cpu"),
    )

    state = TrainState()
    accum = accumulation_steps(train_split, usable, cfg, d.world)
    if resume:
        state = restore(run_dir, model, optimizer, scaler, cfg, d)
    if d.main:  # only now: a refused --resume must leave the run's own config in place
        (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    # Each rank draws its own dropout masks; restore() put back the saved streams instead when resuming.
    if not resume:
        torch.manual_seed(tc.seed * 1000 + d.rank)
        random.seed(tc.seed * 1000 + d.rank)

    loss_model: nn.Module = LossModel(model, tc.label_smoothing)
    if d.world > 1:
        loss_model = nn.parallel.DistributedDataParallel(
            loss_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if tc.compile:
        loss_model = torch.compile(loss_model, dynamic=True)

    tb = TensorBoard(run_dir / "tb" if d.main else None)
    metrics_file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if d.main else None
    stop = StopSignal()
    progress = Progress(tc.max_updates, enabled=d.main)
    logger.info(
        f"training: {len(usable):,} pairs, {accum} micro-batch(es) of <= {tc.max_tokens} tokens per update "
        f"and process, {d.world} process(es), {dtype_name(dtype)} on {device}; up to update {tc.max_updates}"
    )

    # Per update, kept until the next log line so the loss costs no extra host sync: (n, loss sum, lr, gnorm, target
    # tokens, wall-clock time at its end).
    pending: list[tuple[int, torch.Tensor, float, float, int, float]] = []
    window = {"tokens": 0, "real": 0, "padded": 0, "start": time.time(), "first_update": state.update, "loss": None}
    stopped_by, saved_at, groups, groups_epoch = "max_updates", state.update, [], None
    try:
        # For each update: the next `accum` batches of this rank's shard; forward/backward each (gradients all-reduced
        # on the last only); step unless the loss was not finite; then log, validate, checkpoint or stop as due.
        while state.update < tc.max_updates:
            if tc.max_epochs and state.epoch >= tc.max_epochs:
                stopped_by = "max_epochs"
                break
            if groups_epoch != state.epoch:
                groups, groups_epoch = epoch_groups(train_split, usable, cfg, state.epoch, accum, d), state.epoch
                if not groups:
                    raise MtcliError(
                        f"the training split makes fewer batches than the {d.world} processes; lower "
                        "train.max_tokens or use fewer processes"
                    )
            if state.group >= len(groups):
                state.epoch, state.group = state.epoch + 1, 0
                continue
            local_batches, global_tokens, real, padded = groups[state.group]
            state.group += 1
            model.train()
            loss_sum = torch.zeros((), device=device)
            for i, indices in enumerate(local_batches):
                batch = collate(train_split, indices).to(device, non_blocking=True)
                last = i == len(local_batches) - 1
                with contextlib.nullcontext() if last or d.world == 1 else loss_model.no_sync():
                    with autocast:
                        loss = loss_model(batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index, batch.labels)
                    # Normalise by the update's target tokens over all ranks (DDP averages, hence * world).
                    scaler.scale(loss * (d.world / global_tokens)).backward()
                loss_sum += loss.detach()
            lr = lr_at(state.update + 1, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm if tc.clip_norm > 0 else math.inf)
            gnorm_value = float(gnorm)  # one host sync per update, needed to skip non-finite steps
            if not math.isfinite(gnorm_value):
                skip_nonfinite_update(state, optimizer, scaler, tc, run_dir)
                continue
            state.skipped = 0
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            state.update += 1
            pending.append((state.update, loss_sum, lr, gnorm_value, global_tokens, time.time()))
            window["tokens"] += global_tokens
            window["real"] += real
            window["padded"] += padded

            stop_now = stop.requested(d)
            if state.update % tc.log_every == 0 or stop_now or state.update == tc.max_updates:
                flush_metrics(pending, window, state, tc, d, tb, metrics_file, progress)
            elif d.main:
                show_progress(progress, window, state, tc, lr)
            if state.update % tc.valid_every == 0 or state.update == tc.max_updates:
                progress.clear()
                early_stop = validate_and_save(
                    model, data, cfg, run_dir, state, optimizer, scaler, d, tb, device, autocast
                )
                saved_at = state.update
                if early_stop:
                    stopped_by = "early_stopping"
                    break
            elif tc.save_every and state.update % tc.save_every == 0:
                save(model, data, cfg, run_dir, state, optimizer, scaler, d)
                saved_at = state.update
            if stop_now:
                stopped_by = stop.name
                progress.clear()
                path = save(model, data, cfg, run_dir, state, optimizer, scaler, d)
                saved_at = state.update
                if d.main:
                    logger.info(f"stopped by {stop.name} at update {state.update}; saved {path}")
                break
        flush_metrics(pending, window, state, tc, d, tb, metrics_file, progress)
        if stopped_by == "max_epochs" and saved_at != state.update:  # the last epoch ended between validations
            validate_and_save(model, data, cfg, run_dir, state, optimizer, scaler, d, tb, device, autocast)
    finally:
        stop.restore()
        progress.clear()
        tb.close()
        if metrics_file:
            metrics_file.close()
    if d.main:
        logger.info(f"done: {stopped_by} at update {state.update}; run directory {run_dir}")
    return TrainResult(model, run_dir, state.update, stopped_by)


def skip_nonfinite_update(state: TrainState, optimizer, scaler, tc: TrainConfig, run_dir: Path) -> None:
    """Drop this update's gradients; fp16 lowers its loss scale, other precisions stop after max_nonfinite in a row."""
    optimizer.zero_grad(set_to_none=True)
    state.skipped += 1
    if scaler.is_enabled():
        scaler.update()
        if scaler.get_scale() < 1e-4:
            raise MtcliError(
                f"update {state.update}: the fp16 loss scale fell below 1e-4 (gradients keep "
                "overflowing); try train.precision=bf16 or fp32, or a lower train.lr"
            )
        return
    if state.skipped >= tc.max_nonfinite:
        last = ckpt.last_checkpoint(run_dir)
        raise MtcliError(
            f"update {state.update}: {state.skipped} non-finite losses in a row; stopping. Last "
            f"checkpoint: {last or 'none'}. Lower train.lr, set train.clip_norm or use "
            "train.precision=fp32, then resume"
        )
    logger.warning(f"warning: update {state.update + 1}: non-finite loss or gradient; update skipped")


def show_progress(progress: Progress, window: dict, state: TrainState, tc: TrainConfig, lr: float) -> None:
    elapsed = time.time() - window["start"]
    done = state.update - window["first_update"]
    eta = elapsed / done * (tc.max_updates - state.update) if done else None
    loss = f"loss {window['loss']:.3f} | " if window["loss"] is not None else ""  # as of the last log line
    progress.update(
        state.update,
        f"update {state.update}/{tc.max_updates} | epoch {state.epoch + 1} | {loss}lr {lr:.2e} | "
        f"{window['tokens'] / max(elapsed, 1e-9):,.0f} tok/s",
        eta,
    )


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def setup_run_dir(run_dir: Path, cfg: Config, resume: bool, d: Dist) -> None:
    existing = ckpt.last_checkpoint(run_dir)
    if existing is not None and not resume:
        raise MtcliError(
            f"{run_dir} already holds checkpoints (newest: {existing.name}); continue it with --resume, "
            "or choose another --run-dir"
        )
    if resume and existing is None:
        raise MtcliError(f"--resume: {run_dir} has no checkpoint to resume from")
    if d.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_temporary(run_dir)
    setup_logging(run_dir / "train.log" if d.main else None, quiet=not d.main)


def usable_examples(split, cfg: Config) -> np.ndarray:
    """Training examples that fit the model's positions and the batch budget (the rest are left out, with a note)."""
    limit = min(cfg.model.max_positions, cfg.train.max_tokens)
    ok = (split.src_lens <= limit) & (split.tgt_lens <= limit)
    left_out = int((~ok).sum())
    if left_out:
        logger.warning(
            f"note: {left_out} training pairs longer than {limit} tokens (model.max_positions or "
            "train.max_tokens) are left out"
        )
    if not ok.any():
        raise MtcliError("no training pair fits model.max_positions and train.max_tokens")
    return np.flatnonzero(ok)


def accumulation_steps(split, usable: np.ndarray, cfg: Config, world: int) -> int:
    """Micro-batches per update and process to reach train.tokens_per_update target tokens (1 when it is 0)."""
    tc = cfg.train
    if not tc.tokens_per_update:
        return 1
    batches = batch_indices(split.src_lens[usable], split.tgt_lens[usable], tc.max_tokens, tc.seed, 0)
    per_batch = split.tgt_lens[usable].sum() / len(batches)
    return max(1, round(tc.tokens_per_update / (per_batch * world)))


def epoch_groups(split, usable: np.ndarray, cfg: Config, epoch: int, accum: int, d: Dist):
    """This rank's micro-batches for each update of an epoch, with the update's global target tokens and padding
    counts. Every rank computes the same global list, so token counts need no communication."""
    tc = cfg.train
    src_lens, tgt_lens = split.src_lens[usable], split.tgt_lens[usable]
    batches = [usable[b] for b in batch_indices(src_lens, tgt_lens, tc.max_tokens, tc.seed, epoch)]
    batches = batches[: len(batches) - len(batches) % d.world]
    per_update = accum * d.world
    groups = []
    for start in range(0, len(batches), per_update):
        chunk = batches[start : start + per_update]
        src, tgt = [split.src_lens[b] for b in chunk], [split.tgt_lens[b] for b in chunk]
        tgt_tokens = sum(int(t.sum()) for t in tgt)
        real = sum(int(s.sum()) for s in src) + tgt_tokens
        padded = sum(len(s) * int(s.max()) + len(t) * int(t.max()) for s, t in zip(src, tgt))
        groups.append((chunk[d.rank :: d.world], tgt_tokens, real, padded))
    return groups


class StopSignal:
    """SIGINT/SIGTERM ask the loop to finish the current update, save and stop; a second Ctrl-C stops at once."""

    def __init__(self):
        self.name: str | None = None
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner's worker): no handlers
                pass

    def _handle(self, signum, frame):
        if self.name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        logger.warning(f"\n{self.name}: finishing this update, then saving a checkpoint (Ctrl-C again to abort)")

    def requested(self, d: Dist) -> bool:
        if d.world == 1:
            return self.name is not None
        flag = torch.tensor([0 if self.name is None else (2 if self.name == "SIGTERM" else 1)])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank signalled: all stop at the same update
        if int(flag) and self.name is None:
            self.name = "SIGTERM" if int(flag) == 2 else "SIGINT"
        return int(flag) > 0

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def flush_metrics(pending, window, state, tc, d, tb, metrics_file, progress, quiet=False) -> None:
    """Write per-update losses (reduced over ranks), the log line and TensorBoard scalars; reset the window."""
    if not pending:
        return
    sums = torch.stack([p[1] for p in pending]).float()
    if d.world > 1:
        dist.all_reduce(sums)
    losses = [s / p[4] for s, p in zip(sums.tolist(), pending)]
    elapsed = max(time.time() - window["start"], 1e-9)
    speed = window["tokens"] / elapsed
    eff = window["real"] / max(window["padded"], 1e-9)
    last_update, _, lr, gnorm, _, _ = pending[-1]
    if d.main:
        for (update, _, lr_i, gnorm_i, tokens, end), loss in zip(pending, losses):
            record = {"update": update, "loss": loss, "lr": lr_i, "gnorm": gnorm_i, "tokens": tokens, "time": end}
            metrics_file.write(json.dumps(record) + "\n")
            tb.log(update, "train/", loss=loss, lr=lr_i, gnorm=gnorm_i)
        metrics_file.flush()
        tb.log(last_update, "train/", tokens_per_s=speed, padding_efficiency=eff)
        if not quiet:
            progress.clear()
            eta = elapsed / max(last_update - window["first_update"], 1) * (tc.max_updates - last_update)
            logger.info(
                f"update {last_update:>7} | epoch {state.epoch + 1:>3} | loss {sum(losses) / len(losses):.3f} | "
                f"lr {lr:.2e} | gnorm {gnorm:.2f} | {speed:,.0f} tgt tok/s | pad eff {eff:.2f} | "
                f"ETA {format_duration(eta)}"
            )
    pending.clear()
    window.update(
        tokens=0, real=0, padded=0, start=time.time(), first_update=last_update, loss=sum(losses) / len(losses)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Validation and checkpoints


@torch.inference_mode()
def validation_loss(model: Transformer, data: PreparedData, cfg: Config, device, autocast) -> dict:
    split = data.split("valid")
    model.eval()
    nll_sum, smoothed_sum, tokens = 0.0, 0.0, 0
    for indices in batch_indices(split.src_lens, split.tgt_lens, cfg.train.max_tokens, 0, 0, shuffle=False):
        batch = collate(split, indices, max_len=cfg.model.max_positions).to(device)
        with autocast:
            real = target_states(model, batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index)
            nll_sum += float(projection_cross_entropy(real, model.output.weight, batch.labels, 0.0))
            smoothed_sum += float(
                projection_cross_entropy(real, model.output.weight, batch.labels, cfg.train.label_smoothing)
            )
        tokens += batch.n_tgt_tokens
    nll = nll_sum / max(tokens, 1)
    return {"loss": smoothed_sum / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 50))}


def validation_bleu(model: Transformer, data: PreparedData, cfg: Config, device) -> float:
    """Greedy BLEU on (the first valid_max_sentences of) the valid split, through the same path as `mtcli eval`."""
    sources, references = data.split("valid").texts()
    if cfg.train.valid_max_sentences:
        sources, references = sources[: cfg.train.valid_max_sentences], references[: cfg.train.valid_max_sentences]
    translator = Translator(model, data.tokenizer, cfg, device, warn=logger.warning)
    decode = dataclasses.replace(cfg.decode, beam=1, nbest=1, sampling=False)
    model.eval()
    hypotheses = translator.translate_best(sources, decode)
    return score(hypotheses, references, cfg.data.tgt_lang)["bleu"]


def validate_and_save(model, data, cfg, run_dir, state, optimizer, scaler, d, tb, device, autocast) -> bool:
    """Validate (rank 0), save, update best and patience; True when early stopping says stop."""
    tc = cfg.train
    decision = torch.zeros(1)
    if d.main:
        if "valid" in data.roles:
            start = time.time()
            metrics = validation_loss(model, data, cfg, device, autocast)
            if tc.valid_metric == "bleu":
                metrics["bleu"] = validation_bleu(model, data, cfg, device)
            value = metrics["bleu"] if tc.valid_metric == "bleu" else -metrics["loss"]
            improved = state.best_score is None or value > state.best_score
            if improved:
                state.best_score, state.bad_validations = value, 0
            else:
                state.bad_validations += 1
            tb.log(state.update, "valid/", **metrics)
            bleu = f" | bleu {metrics['bleu']:.2f}" if "bleu" in metrics else ""
            logger.info(
                f"valid update {state.update:>7} | loss {metrics['loss']:.3f} | ppl {metrics['ppl']:.2f}{bleu}"
                f"{' | best' if improved else f' | no improvement ({state.bad_validations})'}"
                f" | {time.time() - start:.1f} s"
            )
        else:
            improved = True
            logger.info(f"update {state.update}: no valid split, so no validation; checkpoint only")
        path = save(model, data, cfg, run_dir, state, optimizer, scaler, d)
        if improved:
            ckpt.write_json_atomic(
                ckpt.checkpoint_dir(run_dir) / "best.json",
                {"checkpoint": path.name, "update": state.update, "metric": tc.valid_metric, "score": state.best_score},
            )
        ckpt.prune_checkpoints(run_dir, tc.keep_last)
        if tc.patience and state.bad_validations >= tc.patience:
            logger.info(f"early stopping: no improvement in {tc.patience} validations")
            decision[0] = 1
    else:
        save(model, data, cfg, run_dir, state, optimizer, scaler, d)  # joins the RNG gather
    if d.world > 1:
        decision = decision.to(_comm_device())  # NCCL needs a GPU tensor; broadcast fills it in place
        dist.broadcast(decision, src=0)
        best = torch.tensor(
            [state.best_score if state.best_score is not None else float("nan"), state.bad_validations],
            dtype=torch.float64,
        )
        best = best.to(_comm_device())
        dist.broadcast(best, src=0)
        state.best_score = None if math.isnan(float(best[0])) else float(best[0])
        state.bad_validations = int(best[1])
    return bool(float(decision[0]))


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(model, data, cfg, run_dir, state: TrainState, optimizer, scaler, d: Dist) -> Path | None:
    """Rank 0 writes the checkpoint; every rank's RNG streams go into it, so each resumes its own."""
    rngs = [rng_state()]
    if d.world > 1:
        rngs = [None] * d.world
        dist.all_gather_object(rngs, rng_state())
    if not d.main:
        return None
    payload = {
        "update": state.update,
        "epoch": state.epoch,
        "group": state.group,
        "best_score": state.best_score,
        "bad_validations": state.bad_validations,
        "world_size": d.world,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rngs,
    }
    return ckpt.save_checkpoint(run_dir, state.update, model, cfg, data.tokenizer, payload)


def restore(run_dir, model, optimizer, scaler, cfg: Config, d: Dist) -> TrainState:
    path = ckpt.last_checkpoint(run_dir)
    meta = ckpt.read_metadata(path)
    saved = json.loads(meta["config"])
    saved["data"].pop("cache_dir", None)  # where the cache lives does not change what is in it
    current = cfg.to_dict()
    current["data"].pop("cache_dir", None)
    for section in ("model", "data"):
        if saved[section] != current[section]:
            diff = [f"{section}.{k}" for k in saved[section] if saved[section][k] != current[section].get(k)]
            raise MtcliError(
                f"--resume: {run_dir} was trained with different {section} settings ({', '.join(diff)}); "
                f"resume with the run's own config: --config {run_dir / 'config.yaml'}"
            )
    ckpt.load_weights(model, path)
    payload = ckpt.load_state(path)
    optimizer.load_state_dict(payload["optimizer"])
    if scaler.is_enabled() and payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    elif scaler.is_enabled() or payload["scaler"]:
        logger.warning(
            "note: the run's precision changed (fp16 loss scaling on one side only); the loss scale starts afresh"
        )
    if payload["world_size"] == d.world:
        rng = payload["rng"][d.rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(_as_tuple(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning(
            f"note: resuming with {d.world} processes instead of {payload['world_size']}: data order and "
            "dropout streams differ from an uninterrupted run"
        )
        torch.manual_seed(cfg.train.seed * 1000 + d.rank + payload["update"])
    logger.info(f"resumed from {path} (update {payload['update']}, epoch {payload['epoch'] + 1})")
    return TrainState(
        update=payload["update"],
        epoch=payload["epoch"],
        group=payload["group"],
        best_score=payload["best_score"],
        bad_validations=payload["bad_validations"],
    )


def _as_tuple(value):
    """random.setstate needs tuples; a loaded checkpoint may hold lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value
