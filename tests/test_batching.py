"""Batches: the token budget, determinism per (seed, epoch), sharding and update plans across processes, padding
counts, and collate (shift, padding, masks, labels at exactly the real target positions)."""

import numpy as np
import pytest
import torch

from mtcli.batching import (
    Batch,
    PaddingCounts,
    UpdatePlan,
    collate,
    epoch_batches,
    padding_counts,
    plan_updates,
    shard,
    token_budget_batches,
)
from mtcli.errors import MtcliError
from mtcli.feed import EpochPlan, UpdateFeed
from mtcli.tokenizer import BOS, EOS, PAD


def random_lengths(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 120, n)
    tgt = np.clip(src + rng.integers(-30, 30, n), 1, 120)
    return src.astype(np.int64), tgt.astype(np.int64)


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("max_tokens", [128, 1024, 4096])
def test_batches_stay_in_budget_and_cover_each_example_once(max_tokens):
    src, tgt = random_lengths()
    for epoch in range(3):
        batches = epoch_batches(src, tgt, max_tokens, seed=1, epoch=epoch)
        assert all(len(b) > 0 for b in batches)
        assert all(len(b) * src[b].max() <= max_tokens and len(b) * tgt[b].max() <= max_tokens for b in batches)
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(src)))
    # Sorting by length keeps padding low even on random lengths.
    assert (padding_counts(batches, src) + padding_counts(batches, tgt)).efficiency > 0.85


def test_batch_order_is_deterministic_per_seed_and_epoch():
    src, tgt = random_lengths()
    first = epoch_batches(src, tgt, 1024, seed=1, epoch=0)
    assert same(first, epoch_batches(src.copy(), tgt.copy(), 1024, seed=1, epoch=0))
    assert not same(first, epoch_batches(src, tgt, 1024, seed=1, epoch=1))
    assert not same(first, epoch_batches(src, tgt, 1024, seed=2, epoch=0))
    ordered = epoch_batches(src, tgt, 1024, seed=1, epoch=0, shuffle=False)
    assert same(ordered, epoch_batches(src, tgt, 1024, seed=7, epoch=3, shuffle=False))
    longest = [max(src[b].max(), tgt[b].max()) for b in ordered]
    assert longest == sorted(longest)


def test_sentence_over_budget_gets_a_batch_of_its_own():
    src, tgt = np.array([5, 300, 3, 4, 250]), np.array([5, 10, 3, 400, 2])
    batches = epoch_batches(src, tgt, 100, seed=1, epoch=0)
    for big in (1, 3, 4):  # each over the budget on one side
        assert [b.tolist() for b in batches if big in b] == [[big]]
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(5))


def test_translation_batches_keep_the_given_order_and_the_sentence_cap():
    lens = np.array([9, 3, 7, 7, 2, 5, 4])
    order = np.argsort(-lens, kind="stable")  # longest first, as translation sorts
    batches = token_budget_batches(order, lens, None, max_tokens=20, max_sentences=2)
    assert np.array_equal(np.concatenate(batches), order)  # consecutive runs of the order
    assert all(len(b) <= 2 and len(b) * lens[b].max() <= 20 for b in batches)
    assert [b.tolist() for b in batches] == [[0, 2], [3, 5], [6, 1], [4]]
    uncapped = token_budget_batches(order, lens, None, max_tokens=20)
    assert [b.tolist() for b in uncapped] == [[0, 2], [3, 5], [6, 1, 4]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_are_disjoint_equal_and_cover_all_but_a_remainder(world_size):
    src, tgt = random_lengths(1000)
    batches = epoch_batches(src, tgt, 512, seed=1, epoch=0)
    shards = [shard(batches, rank, world_size) for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    examples = np.concatenate([np.concatenate(s) for s in shards if s])
    assert len(examples) == len(set(examples.tolist()))  # no example on two ranks or twice on one
    used = sum(len(s) for s in shards)
    assert len(batches) - world_size < used <= len(batches)
    assert used % world_size == 0


@pytest.mark.parametrize(("world_size", "accum"), [(1, 1), (1, 3), (2, 2), (3, 1), (4, 3)])
def test_update_plans_split_each_update_across_ranks(world_size, accum):
    """The ranks' plans of update u together hold the batches a single process would take for it, each rank's
    come from its shard (what training runs), and every rank knows the whole update's target tokens."""
    src, tgt = random_lengths(1000)
    batches = epoch_batches(src, tgt, 512, seed=1, epoch=0)
    plans = [plan_updates(batches, src, tgt, accum, rank, world_size) for rank in range(world_size)]
    assert len({len(p) for p in plans}) == 1
    usable = batches[: len(batches) - len(batches) % world_size]
    position = 0
    for u in range(len(plans[0])):
        everyone = [b for rank in range(world_size) for b in plans[rank][u].batches]
        n = len(everyone)
        assert n <= accum * world_size and n % world_size == 0
        expected = usable[position : position + n]
        assert sorted(map(tuple, everyone)) == sorted(map(tuple, expected))
        assert {plans[rank][u].tgt_tokens for rank in range(world_size)} == {sum(int(tgt[b].sum()) for b in expected)}
        assert plans[0][u].padding == padding_counts(expected, src) + padding_counts(expected, tgt)
        position += n
    assert position == len(usable)
    for rank in range(world_size):
        assert same([b for p in plans[rank] for b in p.batches], shard(batches, rank, world_size))


def test_padding_counts_by_hand():
    src, tgt = np.array([2, 4, 3]), np.array([1, 1, 5])
    batches = [np.array([0, 1]), np.array([2])]
    assert padding_counts(batches, src) == PaddingCounts(9, 11)
    assert padding_counts(batches, tgt) == PaddingCounts(7, 7)
    assert (padding_counts(batches, src) + padding_counts(batches, tgt)).efficiency == pytest.approx(16 / 18)


def random_ids(n: int = 40, seed: int = 0) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    ids = lambda: rng.integers(EOS + 1, 100, rng.integers(1, 15)).astype(np.uint16)  # noqa: E731
    srcs, tgts = [ids() for _ in range(n)], [ids() for _ in range(n)]
    srcs[3] = np.zeros(0, dtype=np.uint16)  # an eval pair with an empty side
    tgts[4] = np.zeros(0, dtype=np.uint16)
    return srcs, tgts


def check_batch(batch, srcs, tgts):
    B = len(srcs)
    S, T = max(len(s) for s in srcs) + 1, max(len(t) for t in tgts) + 1
    assert batch.src.shape == batch.src_pad_mask.shape == (B, S)
    assert batch.tgt_in.shape == (B, T)
    assert batch.src.dtype == batch.tgt_in.dtype == batch.labels.dtype == torch.int64
    labels, positions = [], []
    for row, (s, t) in enumerate(zip(srcs, tgts)):
        s, t = s.tolist(), t.tolist()
        assert batch.src[row].tolist() == s + [EOS] + [PAD] * (S - len(s) - 1)
        assert batch.src_pad_mask[row].tolist() == [j >= len(s) + 1 for j in range(S)]
        assert batch.tgt_in[row].tolist() == [BOS] + t + [PAD] * (T - len(t) - 1)
        labels += t + [EOS]  # position j predicts tgt_in[j + 1], and the last real position predicts EOS
        positions += [row * T + j for j in range(len(t) + 1)]
    assert batch.labels.tolist() == labels and batch.n_tgt_tokens == len(labels)
    assert batch.tgt_index.tolist() == positions


def test_collate_shifts_pads_and_masks():
    srcs, tgts = random_ids()
    rows = [7, 3, 0, 4, 12, 39, 5]
    batch = collate([srcs[i] for i in rows], [tgts[i] for i in rows])
    check_batch(batch, [srcs[i] for i in rows], [tgts[i] for i in rows])
    moved = batch.to("meta")  # every field goes to the device, with its shape
    for name in ("src", "src_pad_mask", "tgt_in", "tgt_index", "labels"):
        assert getattr(moved, name).device.type == "meta" and getattr(moved, name).shape == getattr(batch, name).shape


def test_collate_truncates_to_max_len_with_specials():
    srcs, tgts = random_ids()
    batch = collate(srcs[:20], tgts[:20], max_len=6)
    assert batch.src.shape[1] <= 6 and batch.tgt_in.shape[1] <= 6
    check_batch(batch, [s[:5] for s in srcs[:20]], [t[:5] for t in tgts[:20]])


def test_collate_of_sources_only_is_what_translation_feeds_the_encoder():
    srcs, _ = random_ids()
    batch = collate(srcs[:5])
    assert batch.tgt_in is None and batch.labels is None and batch.n_tgt_tokens == 0
    S = max(len(s) for s in srcs[:5]) + 1
    for row, s in enumerate(srcs[:5]):
        assert batch.src[row].tolist() == s.tolist() + [EOS] + [PAD] * (S - len(s) - 1)
    assert torch.equal(batch.src_pad_mask, batch.src == PAD)


# ---------------------------------------------------------------------------------------------------------------------
# The feed of updates (feed.py)


def _fake_epochs(sizes: list[int], planned: list[int], fail_at: int | None = None):
    """plan_epoch over epochs of sizes[epoch % len(sizes)] updates of one micro-batch each; records what it
    planned; raises MtcliError when planning `fail_at`."""

    def plan_epoch(epoch: int) -> EpochPlan:
        planned.append(epoch)
        if epoch == fail_at:
            raise MtcliError("planning failed")
        updates = [UpdatePlan([np.array([epoch, i])], 1, PaddingCounts(1, 1)) for i in range(sizes[epoch % len(sizes)])]
        return EpochPlan(f"split {epoch}", updates)

    return plan_epoch


def _collate(split, examples) -> Batch:
    return collate([list(examples + 4)])


@pytest.mark.parametrize("ahead", [False, True])
def test_the_feed_walks_epochs_to_max_epochs_the_same_in_line_and_ahead(ahead):
    planned: list[int] = []
    feed = UpdateFeed(_fake_epochs([3, 1, 2], planned), _collate, max_epochs=3, ahead=ahead, pin=False)
    seen, position = [], (0, 0)
    while (prepared := feed.take(*position)) is not None:
        seen.append((prepared.epoch, prepared.index, prepared.batches[0].src[0, :2].tolist()))
        position = (prepared.epoch, prepared.index + 1)
    feed.close()
    assert seen == [(e, i, [e + 4, i + 4]) for e, n in ((0, 3), (1, 1), (2, 2)) for i in range(n)]
    assert planned == [0, 1, 2]  # each epoch once, none past max_epochs
    resumed = UpdateFeed(_fake_epochs([3, 1, 2], []), _collate, max_epochs=3, ahead=ahead, pin=False)
    assert resumed.take(0, 3).epoch == 1 and resumed.take(2, 2) is None  # a used-up epoch moves on


def test_the_feed_plans_the_next_epoch_ahead_and_raises_what_planning_raised():
    planned: list[int] = []
    feed = UpdateFeed(_fake_epochs([2], planned, fail_at=1), _collate, max_epochs=0, ahead=True, pin=False)
    assert feed.take(0, 0).index == 0
    assert feed.take(0, 1).index == 1
    with pytest.raises(MtcliError, match="planning failed"):  # epoch 1, planned while epoch 0 ran
        feed.take(0, 2)
    feed.close()
    assert planned[:2] == [0, 1]  # epoch 1 before the loop reached it
