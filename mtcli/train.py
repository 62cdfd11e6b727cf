"""`mtcli train`: the training loop, validation with checkpoints, and the learning-rate schedule.

    for each update, until train.max_updates (or max_epochs, early stopping, SIGINT/SIGTERM):
        plan  = this process's micro-batches of the next update (batching.plan_updates, one list per epoch;
                feed.py collates them, ahead on background threads when training on a GPU)
        train_step: forward/backward each micro-batch (DDP all-reduces on the last), clip, step;
                    an update whose gradients are not finite is skipped
        every log_every: log line, metrics.jsonl, TensorBoard; every valid_every: validate, checkpoint, early stop

Single process or `torchrun --nproc_per_node N -m mtcli train ...`. Every rank computes the same epoch's batch list
from the seed and takes a disjoint shard of it, so the data position is one pair (epoch, update in epoch) shared by
all ranks, and a resumed run sees exactly the batches an uninterrupted one would have. One update (`train_step`) is
in update.py, checkpoints in checkpoint.py, the run directory's lock and train.log in rundir.py, processes and signals
in distributed.py, the loss in loss.py.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtcli import checkpoint as ckpt
from mtcli.batching import (
    Batch,
    accumulation_steps,
    collate,
    epoch_batches,
    length_limit,
    plan_updates,
    usable_examples,
)
from mtcli.checkpoint import TrainState
from mtcli.config import Config, TrainConfig
from mtcli.config_loader import replaced
from mtcli.data import EncodedSplit, PreparedData, SampledSplit
from mtcli.device import DTYPES, allow_tf32, choose_precision, precision_name
from mtcli.distributed import Dist, StopSignal, prepare_once
from mtcli.errors import MtcliError
from mtcli.evaluate import validation_bleu, validation_loss
from mtcli.feed import EpochPlan, UpdateFeed
from mtcli.log import logger
from mtcli.metrics import Metrics, UpdateRecord
from mtcli.mixture import epoch_examples
from mtcli.model import Transformer
from mtcli.rundir import open_run_dir, torchrun_restart
from mtcli.tokenizer import Specials
from mtcli.update import Trainer, train_step


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
# The loop


@dataclass
class Run:
    """The training loop's context: one object instead of long parameter lists."""

    cfg: Config
    run_dir: Path
    data: PreparedData
    dist: Dist
    trainer: Trainer
    state: TrainState
    metrics: Metrics
    train_split: EncodedSplit
    usable: np.ndarray  # training examples that fit the length limits
    accum: int  # micro-batches per update and process
    sampling_logged: bool = False  # data.sampling_alpha: its cost is logged once per run

    @property
    def model(self) -> Transformer:
        return self.trainer.model


@dataclass
class TrainResult:
    model: Transformer
    run_dir: Path
    update: int
    stopped_by: str  # "max_updates", "max_epochs", "early_stopping", "SIGINT", "SIGTERM"


def train(cfg: Config, run_dir: Path | None = None, resume: bool = False) -> TrainResult:
    """Train `cfg` into `run_dir` (default runs/<config name>); with resume, continue from its last checkpoint."""
    cfg = fine_tuning_config(cfg)
    tc = cfg.train
    d, device = Dist.from_env(tc.device)
    run_dir = Path(run_dir or Path("runs") / plain_run_name(cfg.name))
    if tc.threads:
        torch.set_num_threads(tc.threads)
    resume = resume or torchrun_restart(run_dir)
    opened = open_run_dir(run_dir, resume, d)
    stop, run, feed = StopSignal(), None, None
    try:
        run = start_run(cfg, run_dir, d, device, resume)
        state, stopped_by, saved_at = run.state, "max_updates", run.state.update
        guided = tc.guided_alignment > 0
        if guided and not run.train_split.has_links:
            raise MtcliError(
                f"train.guided_alignment: the data cache {run.data.folder} has no word alignments; "
                "set data.alignments: true (a new cache is prepared)"
            )
        if tc.init_from and state.update == 0:  # the starting model's scores: what fine-tuning has to beat
            validate_and_save(run)
        feed = update_feed(run, guided)
        while state.update < tc.max_updates:
            prepared = feed.take(state.epoch, state.next_in_epoch)
            if prepared is None:
                stopped_by, state.epoch, state.next_in_epoch = "max_epochs", tc.max_epochs, 0
                break
            state.epoch, state.next_in_epoch, plan = prepared.epoch, prepared.index + 1, prepared.plan
            batches = [batch.to(device, non_blocking=True) for batch in prepared.batches]
            lr = lr_at(state.update + 1, tc)
            step = train_step(run.trainer, batches, plan.tgt_tokens, lr, tc.clip_norm)
            if not step.finite:
                skip_nonfinite_update(run)
                continue
            state.update, state.skipped = state.update + 1, 0
            record = UpdateRecord(state.update, step.loss_sum, lr, step.gnorm, plan.tgt_tokens, time.time())
            run.metrics.add(record, plan.padding)
            stop_now = stop.requested(d)
            valid_due = state.update % tc.valid_every == 0 or state.update == tc.max_updates
            save_due = valid_due or stop_now or (tc.save_every and state.update % tc.save_every == 0)
            if state.update % tc.log_every == 0 or save_due:  # a checkpoint never runs ahead of metrics.jsonl
                run.metrics.flush(state.epoch)
            if valid_due:
                saved_at = state.update
                if validate_and_save(run):
                    stopped_by = "early_stopping"
                    break
            elif save_due and not stop_now:
                saved_at, _ = state.update, save(run)
            if stop_now:
                stopped_by, saved_at, path = stop.name, state.update, save(run)
                logger.info(f"stopped by {stop.name} at update {state.update}; saved {path}")
                break
        run.metrics.flush(state.epoch)
        if stopped_by == "max_epochs" and saved_at != state.update:  # the last epoch ended between validations
            validate_and_save(run)
        skipped = f"; {state.skipped_total} update(s) skipped for non-finite gradients" if state.skipped_total else ""
        logger.info(f"done: {stopped_by} at update {state.update}{skipped}; run directory {run_dir}")
    finally:
        stop.restore()
        if feed is not None:
            feed.close()
        if run is not None:
            run.metrics.close()
        opened.close()
    return TrainResult(run.model, run_dir, state.update, stopped_by)


def fine_tuning_config(cfg: Config) -> Config:
    """With train.init_from: the starting checkpoint's model section (the architecture is fixed by its weights) and
    its tokenizer (data.tokenizer, unless set), so fine-tuning keeps the vocabulary; `cfg` as it is otherwise."""
    if not cfg.train.init_from:
        return cfg
    start = ckpt.resolve_member(cfg.train.init_from)
    changes = {"model": ckpt.read_config(start).to_dict()["model"]}
    if not cfg.data.tokenizer:
        changes["data.tokenizer"] = str(start)
    return replaced(cfg, **changes)


def plain_run_name(name: str) -> str:
    """The config's `name` as the folder under ./runs: one plain name, never a path that leads elsewhere."""
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise MtcliError(f"name: {name[:80]!r} is not a plain run name (no / or ..); to write elsewhere use --run-dir")
    return name


def start_run(cfg: Config, run_dir: Path, d: Dist, device: torch.device, resume: bool) -> Run:
    """Data, model (same initialisation on every rank), optimizer and precision; the checkpoint when resuming."""
    tc = cfg.train
    data = prepare_once(cfg, d)
    tokenizer = data.tokenizer
    if d.main:
        tokenizer.copy_to(run_dir)
    train_split = data.split("train")
    usable = usable_examples(train_split, cfg)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    model = Transformer(
        cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint, tokenizer.specials
    ).to(device)
    logger.info(f"model: {model.num_parameters():,} parameters ({model.describe()})")
    if tc.init_from and not resume:
        start = ckpt.resolve_member(tc.init_from)
        ckpt.load_weights(model, start)
        logger.info(f"fine-tuning: weights from {start}, a fresh optimizer")
    precision, why = choose_precision(tc.precision, device)
    started = ckpt.read_metadata(ckpt.last_checkpoint(run_dir)).get("train_precision") if resume else None
    if tc.precision == "auto" and started in DTYPES and started != precision:
        precision, why = started, f"as the run started; auto would pick {precision} ({why})"  # exact resume
    logger.info(f"precision: {precision} ({why})")
    allow_tf32(device)  # what fp32 leaves to plain matrix products on a GPU
    trainer = Trainer.build(model, tc, DTYPES[precision], device, d.world)
    state = TrainState()
    if resume:
        last = ckpt.last_checkpoint(run_dir)
        state = ckpt.restore_training(last, model, trainer.optimizer, trainer.scaler, cfg, d.rank, d.world)
    else:  # each rank draws its own dropout masks; a resume restores the saved streams instead
        torch.manual_seed(tc.seed * 1000 + d.rank)
        random.seed(tc.seed * 1000 + d.rank)
    if d.main:  # only now: a refused --resume must leave the run's own config in place
        (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    accum = accumulation_steps(train_split, usable, cfg, d.world)
    logger.info(
        f"training: {len(usable):,} pairs, {accum} micro-batch(es) of <= {tc.max_tokens} tokens per update "
        f"and process, {d.world} process(es), {precision} on {device}; up to update {tc.max_updates}"
    )
    metrics = Metrics(run_dir, d, tc, state.update)
    return Run(cfg, run_dir, data, d, trainer, state, metrics, train_split, usable, accum)


def update_feed(run: Run, links: bool) -> UpdateFeed:
    """The loop's updates: prepared ahead on background threads (and pinned) when training on a GPU, in line on a
    CPU (feed.py says why)."""
    device, specials = run.trainer.device, run.model.specials
    return UpdateFeed(
        lambda epoch: plan_epoch(run, epoch),
        lambda split, examples: collate_examples(split, examples, specials, links),
        run.cfg.train.max_epochs,
        ahead=prepares_ahead(device),
        pin=device.type == "cuda",
    )


def prepares_ahead(device: torch.device) -> bool:
    return device.type == "cuda"


def plan_epoch(run: Run, epoch: int) -> EpochPlan:
    """This process's updates of epoch `epoch`: the epoch's token-budget batches (seeded by epoch) grouped into
    updates and sharded over the processes."""
    tc = run.cfg.train
    split = epoch_split(run, epoch)
    # with data.train_corpora weights, each corpus's pairs as many times as its weight (seeded by epoch)
    usable = epoch_examples(run.train_split, run.usable, run.cfg, epoch)
    lens = split.src_lens[usable], split.tgt_lens[usable]
    batches = [usable[b] for b in epoch_batches(*lens, tc.max_tokens, tc.seed, epoch)]
    updates = plan_updates(batches, split.src_lens, split.tgt_lens, run.accum, run.dist.rank, run.dist.world)
    if not updates:
        raise MtcliError(
            f"the training split makes fewer batches than the {run.dist.world} processes; lower "
            "train.max_tokens or use fewer processes"
        )
    return EpochPlan(split, updates)


def epoch_split(run: Run, epoch: int) -> EncodedSplit | SampledSplit:
    """The training split as this epoch sees it: the cached ids, or a fresh sampled segmentation of them."""
    dc = run.cfg.data
    if not dc.sampling_alpha:
        return run.train_split
    start = time.time()
    split = SampledSplit(run.train_split, run.data.tokenizer, dc, run.cfg.train.seed, epoch, length_limit(run.cfg))
    if not run.sampling_logged:  # once per run: what sampling costs and how much longer it makes the pairs
        run.sampling_logged = True
        growth = split.tgt_lens[run.usable].sum() / run.train_split.tgt_lens[run.usable].sum()
        logger.info(
            f"subword sampling (alpha {dc.sampling_alpha:g}"
            + (f", nbest {dc.sampling_nbest}" if dc.spm_model_type == "unigram" else "")
            + f"): epoch {epoch + 1} re-encoded in {time.time() - start:.1f} s, target side x{growth:.2f} tokens"
        )
    return split


def collate_examples(
    split: EncodedSplit | SampledSplit, indices: np.ndarray, specials: Specials, links: bool = False
) -> Batch:
    """A micro-batch of training pairs; `links`: with their piece alignments (train.guided_alignment)."""
    srcs, tgts = [split.src(i) for i in indices], [split.tgt(i) for i in indices]
    return collate(srcs, tgts, specials=specials, links=[split.links(i) for i in indices] if links else None)


def skip_nonfinite_update(run: Run) -> None:
    """Count a skipped update; fp16 stops when its loss scale collapses, other precisions after max_nonfinite in a
    row, naming the last good checkpoint."""
    state, scaler = run.state, run.trainer.scaler
    state.skipped += 1
    state.skipped_total += 1
    if scaler.is_enabled():
        if scaler.get_scale() < 1e-4:
            raise MtcliError(
                f"update {state.update}: the fp16 loss scale fell below 1e-4 (gradients keep "
                "overflowing); try train.precision=bf16 or fp32, or a lower train.lr"
            )
        return
    if state.skipped >= run.cfg.train.max_nonfinite:
        last = ckpt.last_checkpoint(run.run_dir)
        raise MtcliError(
            f"update {state.update}: {state.skipped} non-finite losses in a row; stopping. Last "
            f"checkpoint: {last or 'none'}. Lower train.lr, set train.clip_norm or use "
            "train.precision=fp32, then resume"
        )
    logger.warning(f"warning: update {state.update + 1}: non-finite loss or gradient; update skipped")


# ---------------------------------------------------------------------------------------------------------------------
# Validation and checkpoints


def validate_and_save(run: Run) -> bool:
    """Validate (rank 0), save, update best and patience; True when early stopping says stop."""
    tc, state, d = run.cfg.train, run.state, run.dist
    stop = False
    if d.main and "valid" in run.data.roles:
        start = time.time()
        device, valid = run.trainer.device, run.data.split("valid")
        # Validation must leave training's random streams as it found them (decoding may draw: sampling, probes),
        # or a run that validated at an update would continue differently from one that did not (exact resume).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            metrics = validation_loss(run.model, valid, run.cfg, device, run.trainer.autocast)
            if tc.valid_metric == "bleu":
                metrics["bleu"] = validation_bleu(run.model, run.data.tokenizer, valid, run.cfg, device)
        value = metrics["bleu"] if tc.valid_metric == "bleu" else -metrics["loss"]
        improved = state.best_score is None or value > state.best_score
        if improved:
            state.best_score, state.bad_validations = value, 0
        else:
            state.bad_validations += 1
        run.metrics.tb.log(state.update, "valid/", **metrics)
        bleu = f" | bleu {metrics['bleu']:.2f}" if "bleu" in metrics else ""
        logger.info(
            f"valid update {state.update:>7} | loss {metrics['loss']:.3f} | ppl {metrics['ppl']:.2f}{bleu}"
            f"{' | best' if improved else f' | no improvement ({state.bad_validations})'}"
            f" | {time.time() - start:.1f} s"
        )
    elif d.main:
        improved = True
        logger.info(f"update {state.update}: no valid split, so no validation; checkpoint only")
    path = save(run)  # every rank: the checkpoint holds every rank's RNG streams
    if d.main:
        if improved:
            ckpt.write_best(run.run_dir, path, state.update, tc.valid_metric, state.best_score)
        ckpt.prune_checkpoints(run.run_dir, tc.keep_last)
        if tc.patience and state.bad_validations >= tc.patience:
            logger.info(f"early stopping: no improvement in {tc.patience} validations")
            stop = True
    best = math.nan if state.best_score is None else state.best_score
    stop_flag, best, bad = d.broadcast([float(stop), best, float(state.bad_validations)])
    state.best_score = None if math.isnan(best) else best
    state.bad_validations = int(bad)
    return bool(stop_flag)


def save(run: Run) -> Path | None:
    """Rank 0 writes the checkpoint; every rank's RNG streams go into it, so each resumes its own."""
    rngs = run.dist.gather_objects(ckpt.rng_state(run.trainer.device))
    if not run.dist.main:
        return None
    payload = ckpt.training_payload(run.state, run.trainer.optimizer, run.trainer.scaler, rngs)
    precision = {"train_precision": precision_name(run.trainer.dtype)}
    return ckpt.save_checkpoint(
        run.run_dir, run.state.update, run.model, run.cfg, run.data.tokenizer, payload, precision
    )
