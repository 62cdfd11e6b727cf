"""The model's contracts: causal masking, padding invariance, cached decoding equal to full decoding, tied weights,
attention equal to a reference softmax(QK^T)V, and no fully masked query rows."""

import math

import pytest
import torch
import torch.nn.functional as F

from mtcli.cache import KVCache
from mtcli.config import ModelConfig
from mtcli.model import Transformer
from mtcli.tokenizer import BOS, EOS, PAD

VOCAB = 40


def make_model(norm="post", **kwargs):
    torch.manual_seed(0)
    cfg = ModelConfig(layers=2, d_model=32, heads=4, d_ff=64, norm=norm, max_positions=64, **kwargs)
    return Transformer(cfg, VOCAB, VOCAB, joint_vocab=True).eval()


def make_batch(lengths, seed=1):
    """Right-padded sources ending in EOS, as collate builds them."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    src = torch.full((len(lengths), S), PAD)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = torch.randint(4, VOCAB, (n - 1,), generator=g)
        src[row, n - 1] = EOS
    return src, src == PAD


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_future_target_tokens_do_not_change_earlier_outputs(norm):
    model = make_model(norm)
    src, mask = make_batch([7, 5])
    memory = model.encode(src, mask)
    tgt = torch.randint(4, VOCAB, (2, 8))
    tgt[:, 0] = BOS
    out = model.decode(tgt, memory, mask)
    for t in range(1, 8):
        changed = tgt.clone()
        changed[:, t:] = torch.randint(4, VOCAB, (2, 8 - t))
        out2 = model.decode(changed, memory, mask)
        torch.testing.assert_close(out2[:, :t], out[:, :t], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out2[:, t:], out[:, t:])  # the test can see a change where one is allowed


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_does_not_change_real_positions(norm):
    model = make_model(norm)
    src, mask = make_batch([6])
    tgt = torch.tensor([[BOS, 9, 10, 11, 12]])
    ref_memory = model.encode(src, mask)
    ref = model.decode(tgt, ref_memory, mask)
    # Same sentence padded on the source side (batched with a longer one) and on the target side.
    padded_src = torch.cat([src, torch.full((1, 5), PAD)], dim=1)
    padded_mask = padded_src == PAD
    padded_tgt = torch.cat([tgt, torch.full((1, 3), PAD)], dim=1)
    memory = model.encode(padded_src, padded_mask)
    torch.testing.assert_close(memory[:, :6], ref_memory, atol=1e-5, rtol=1e-5)
    out = model.decode(padded_tgt, memory, padded_mask)
    torch.testing.assert_close(out[:, :5], ref, atol=1e-5, rtol=1e-5)
    # And inside a real mixed batch.
    other, _ = make_batch([11], seed=5)
    both = torch.cat([padded_src, other], dim=0)
    both_mask = both == PAD
    out_batch = model.decode(torch.cat([padded_tgt, padded_tgt]), model.encode(both, both_mask), both_mask)
    torch.testing.assert_close(out_batch[:1, :5], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_cached_step_decoding_equals_full_decoding(norm, positions):
    model = make_model(norm, positions=positions)
    src, mask = make_batch([7, 4, 6])
    memory = model.encode(src, mask)
    tgt = torch.randint(4, VOCAB, (3, 9))
    tgt[:, 0] = BOS
    full = model.decode(tgt, memory, mask)
    cache = KVCache.for_model(model, rows=3, max_len=12, device="cpu")
    steps = torch.cat([model.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(9)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    assert cache.length == 9


def test_cache_groups_beams_and_reorders():
    """Beams of a sentence share one copy of the cross-attention keys; reorder follows back-pointers."""
    model = make_model("pre")
    src, mask = make_batch([7, 4])
    memory = model.encode(src, mask)
    beams = 3
    tgt = torch.randint(4, VOCAB, (2 * beams, 6))
    tgt[:, 0] = BOS
    full = model.decode(tgt, memory.repeat_interleave(beams, 0), mask.repeat_interleave(beams, 0))
    cache = KVCache.for_model(model, rows=2 * beams, max_len=8, device="cpu")
    outs = [model.decode(tgt[:, :1], memory, mask, cache)]
    assert cache.layers[0].cross_k.shape[0] == 2  # one per sentence, not per beam
    # Swap beams within each sentence, then continue with the swapped prefixes.
    perm = torch.tensor([2, 0, 1, 4, 5, 3])
    cache.reorder(perm)
    tgt = tgt[perm]
    full = full[perm]
    for t in range(1, 6):
        outs.append(model.decode(tgt[:, t : t + 1], memory, mask, cache))
    torch.testing.assert_close(torch.cat(outs, 1)[:, 1:], full[:, 1:], atol=1e-5, rtol=1e-5)
    # Dropping the second sentence shrinks both kinds of cache.
    cache.reorder(torch.tensor([0, 1, 2]), sentences=torch.tensor([0]))
    assert cache.layers[0].k.shape[0] == 3 and cache.layers[0].cross_k.shape[0] == 1


def test_sdpa_causal_mask_is_top_left_aligned():
    """The trap the next test guards against: with one query and several keys, is_causal=True lets the query see
    only the first key, not all of them."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal, v[:, :, :1])  # attends to key 0 alone
    assert not torch.allclose(causal, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_one_token_step_sees_every_cached_position(norm):
    """A one-token step at position t gives the full causal decode's output at t, for several t: it must attend to
    all t + 1 written positions (with is_causal=True it would see only the first, see the test above)."""
    model = make_model(norm)
    src, mask = make_batch([5, 7])
    memory = model.encode(src, mask)
    tgt = torch.randint(4, VOCAB, (2, 7))
    tgt[:, 0] = BOS
    full = model.decode(tgt, memory, mask)
    layer = model.decoder[0].self_attn
    x = torch.randn(2, 7, model.cfg.d_model)
    reference = layer(x, causal=True)  # the whole prefix at once
    layer_cache = KVCache.for_model(model, rows=2, max_len=8, device="cpu").layers[0]
    cache = KVCache.for_model(model, rows=2, max_len=8, device="cpu")
    for t in range(7):
        step = model.decode(tgt[:, t : t + 1], memory, mask, cache)
        torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
        one = layer(x[:, t : t + 1], causal=True, cache=layer_cache, start=t)
        torch.testing.assert_close(one[:, 0], reference[:, t], atol=1e-5, rtol=1e-5)
        if t > 0:  # the step differs from attending to position 0 alone, so the check can see that mistake
            only_first = F.scaled_dot_product_attention(*_step_qkv(layer, x, t), is_causal=True)
            assert not torch.allclose(layer.out(only_first.transpose(1, 2).flatten(2))[:, 0], one[:, 0], atol=1e-4)


def _step_qkv(layer, x, t):
    """The query of position t and the keys/values of positions 0..t, as the attention layer computes them."""
    q, k, v = layer.qkv(x[:, : t + 1]).view(x.shape[0], t + 1, 3, layer.heads, -1).permute(2, 0, 3, 1, 4)
    return q[:, :, t:], k, v


def test_multi_token_call_on_a_filled_cache_is_refused():
    model = make_model("pre")
    src, mask = make_batch([5])
    memory = model.encode(src, mask)
    cache = KVCache.for_model(model, rows=1, max_len=8, device="cpu")
    model.decode(torch.tensor([[BOS]]), memory, mask, cache)
    with pytest.raises(ValueError, match="start at position 0"):
        model.decode(torch.tensor([[5, 6]]), memory, mask, cache)


def test_sdpa_attention_matches_reference_and_no_row_is_fully_masked():
    model = make_model("post")
    attn = model.encoder[0].self_attn
    src, mask = make_batch([6, 3])
    x = model._embed(model.src_embed, src)
    key_mask = model.attention_mask(mask)  # (B, 1, 1, S)
    assert key_mask.any(dim=-1).all(), "every query row must have at least one key (sources end in EOS)"
    # Reference: explicit softmax(QK^T / sqrt(d))V with -inf on padded keys.
    B, S, d = x.shape
    q, k, v = attn.qkv(x).view(B, S, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // 4)
    scores = scores.masked_fill(~key_mask, float("-inf"))
    ref = attn.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, d))
    torch.testing.assert_close(attn(x, key_mask), ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(model.encode(src, mask)).all()


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_autocast_attention_matches_fp32_sdpa(causal):
    """Under CPU autocast, attention runs as batched products with an fp32 softmax instead of SDPA."""
    from mtcli.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 6, 8, generator=g) for _ in range(3))
    key_mask = None if causal else torch.tensor([6, 2, 4])[:, None] > torch.arange(6)  # (B, S)
    mask = None if causal else key_mask[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, causal, 0.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attention_without_gradients_matches_sdpa(causal):
    """Without gradients (translation, validation) a CPU runs attention as batched products, not SDPA: same result
    in fp32, including a one-query step against strided cached keys, and gradients still go through SDPA."""
    from mtcli.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 6, 8, generator=g) for _ in range(3))
    key_mask = None if causal else torch.tensor([6, 2, 4])[:, None] > torch.arange(6)
    mask = None if causal else key_mask[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with torch.inference_mode():
        torch.testing.assert_close(attend(q, k, v, mask, causal, 0.0), ref, atol=1e-6, rtol=1e-5)
        cache_k = torch.randn(3, 4, 10, 8, generator=g)  # a preallocated cache, read up to position 6
        cache_k[:, :, :6] = k
        step = attend(q[:, :, -1:], cache_k[:, :, :6], v, mask, False, 0.0)
    torch.testing.assert_close(step, F.scaled_dot_product_attention(q[:, :, -1:], k, v, attn_mask=mask))
    q.requires_grad_(True)
    attend(q, k, v, mask, causal, 0.0).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _plain_layer(kind: str, layer, memory, mask):
    """The layer's computation with stock autograd ops (no row padding, no hand-written backward)."""
    from mtcli.attention import attend
    from mtcli.cpu_kernels import merge_heads, split_heads

    if kind == "self":
        return lambda x: layer.out(merge_heads(attend(*split_heads(layer.qkv(x), 3, 2), None, True, 0.0)))
    if kind == "cross":

        def cross(x):
            k, v = split_heads(layer.kv(memory), 2, 2)
            (q,) = split_heads(layer.q(x), 1, 2)
            return layer.out(merge_heads(attend(q, k, v, mask, False, 0.0)))

        return cross
    if kind == "ffn-swish":
        return lambda x: layer.down(F.silu(layer.up(x)))
    return lambda x: layer.down(F.relu(layer.up(x)))


@pytest.mark.parametrize("fused", [True, False], ids=["onednn-linear", "public-linear"])
@pytest.mark.parametrize("kind", ["self", "cross", "ffn", "ffn-swish"])
def test_row_padded_layers_under_cpu_autocast_equal_the_plain_computation(kind, fused, monkeypatch):
    """Under CPU bf16 autocast, projections run on rows padded to a multiple of 64 (so oneDNN kernels repeat across
    batches), with rows padded, unpadded, heads split and merged by hand-written autograd functions, and bias and ReLU
    in oneDNN's epilogue where its probe passes (else F.linear on the padded rows): outputs and every gradient must
    be those of the plain computation, and the zero rows must not leak out."""
    from mtcli import cpu_kernels
    from mtcli.attention import CrossAttention, SelfAttention
    from mtcli.cpu_kernels import ROW_MULTIPLE
    from mtcli.model import FeedForward

    if fused and not cpu_kernels.onednn_linear_works(torch.bfloat16):
        pytest.skip("oneDNN's fused bf16 linear does not run on this CPU (its probe refused it)")
    if not fused:
        monkeypatch.setattr(cpu_kernels, "onednn_linear_works", lambda dtype: False)

    torch.manual_seed(0)
    cfg = ModelConfig(
        layers=1, d_model=16, heads=2, d_ff=24, dropout=0.0, activation="swish" if "swish" in kind else "relu"
    )
    layer = {"self": SelfAttention(16, 2, 0.0), "cross": CrossAttention(16, 2, 0.0)}.get(kind) or FeedForward(cfg)
    x = torch.randn(3, 7, 16, requires_grad=True)  # 21 rows: padded to 64
    memory = torch.randn(3, 5, 16, requires_grad=True)
    mask = (torch.tensor([5, 2, 4])[:, None] > torch.arange(5))[:, None, None, :]
    assert (3 * 7) % ROW_MULTIPLE and (3 * 5) % ROW_MULTIPLE
    padded = {"self": lambda t: layer(t, causal=True), "cross": lambda t: layer(t, memory, mask)}.get(kind, layer)
    results = []
    for fn in (_plain_layer(kind, layer, memory, mask), padded):
        layer.zero_grad()
        x.grad = memory.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x)
        (y.float() * torch.arange(16.0)).sum().backward()
        grads = [x.grad, memory.grad] + [p.grad for p in layer.parameters()]
        results.append([y.detach().float()] + [g.clone() for g in grads if g is not None])
    assert results[1][0].shape == (3, 7, 16)
    assert len(results[0]) == len(results[1])
    for plain, row_padded in zip(*results):
        torch.testing.assert_close(row_padded, plain, atol=1e-2, rtol=1e-2)


def test_fast_cpu_dropout_on_a_residual_equals_adding_the_dropped_output():
    """Dropout.residual(x, y) is x + dropout(y) (the same mask for the same seed), gradients included."""
    from mtcli.cpu_kernels import Dropout

    drop = Dropout(0.3).train()
    x, y = torch.randn(50, 40, requires_grad=True), torch.randn(50, 40, requires_grad=True)
    results = []
    for fn in (lambda: x + drop(y), lambda: drop.residual(x, y)):
        x.grad = y.grad = None
        torch.manual_seed(5)
        out = fn()
        (out * torch.arange(40.0)).sum().backward()
        results.append((out.detach(), x.grad.clone(), y.grad.clone()))
    assert (results[1][2] == 0).float().mean().item() > 0.2  # the mask reaches the gradient
    for reference, fused in zip(*results):
        torch.testing.assert_close(fused, reference)


def test_three_way_tied_embeddings_are_one_tensor():
    model = make_model()
    assert model.src_embed.weight is model.tgt_embed.weight is model.output.weight
    separate = Transformer(model.cfg, VOCAB, VOCAB + 3, joint_vocab=False)
    assert separate.tgt_embed.weight is separate.output.weight
    assert separate.src_embed.weight is not separate.tgt_embed.weight
    from dataclasses import replace

    untied = Transformer(replace(model.cfg, tie_embeddings=False), VOCAB, VOCAB, joint_vocab=True)
    assert untied.output.weight is not untied.tgt_embed.weight
    # Three-way tying saves exactly two vocabulary x d_model matrices.
    assert untied.num_parameters() - model.num_parameters() == 2 * VOCAB * model.cfg.d_model


def test_base_config_parameter_count_is_near_the_paper():
    with torch.device("meta"):  # shapes only
        model = Transformer(ModelConfig(), 37000, 37000, joint_vocab=True)
    assert 60e6 < model.num_parameters() < 66e6  # the paper reports 65M


def test_fast_cpu_dropout_keeps_the_rate_and_the_expectation():
    from mtcli.cpu_kernels import Dropout

    drop = Dropout(0.1).train()
    x = torch.ones(400, 500)
    y = drop(x)
    assert abs((y == 0).float().mean().item() - 0.1) < 0.005
    assert abs(y.mean().item() - 1.0) < 0.01
    assert torch.allclose(y[y != 0], torch.tensor(1 / 0.9))
    assert not torch.equal(y, drop(x))  # a new mask every call
    assert torch.equal(drop.eval()(x), x)


def test_source_word_dropout_hides_source_tokens_in_training_only():
    src, mask = make_batch([9, 6])
    other = src.clone()
    other[src > EOS] = torch.randint(4, VOCAB, (int((src > EOS).sum()),))  # same lengths, other words
    model = make_model(src_word_dropout=0.2)
    assert torch.equal(model.encode(src, mask), make_model().encode(src, mask))  # evaluation: no effect

    def train_encode(rate, ids):
        model = make_model(src_word_dropout=rate, dropout=0.0).train()  # word dropout is the only random draw
        torch.manual_seed(3)
        return model.encode(ids, mask)

    torch.testing.assert_close(train_encode(0.999, other), train_encode(0.999, src))  # every word hidden
    assert not torch.allclose(train_encode(0.2, other), train_encode(0.2, src))  # most words seen
    assert not torch.allclose(train_encode(0.2, src), train_encode(0.0, src))  # some hidden


def test_pad_embedding_is_zero_and_gradients_flow():
    model = make_model().train()
    assert model.src_embed.weight[PAD].abs().sum() == 0
    src, mask = make_batch([5, 3])
    tgt = torch.tensor([[BOS, 5, 6], [BOS, 7, PAD]])
    logits = model(src, mask, tgt)
    F.cross_entropy(logits.flatten(0, 1), torch.tensor([5, 6, EOS, 7, EOS, PAD]), ignore_index=PAD).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "learned" not in n)


def test_private_onednn_ops_are_probed_and_refused_when_they_fail_or_disagree(monkeypatch):
    """oneDNN's private ops are used only where they run on this CPU and agree with the public ops (AVX2-only CPUs
    have no bf16 kernel for the fused linear): an op that raises or computes something else is refused, and
    translation's layers then stay plain nn.Linear."""
    from mtcli import cpu_kernels

    real = torch.ops.mkldnn._linear_pointwise
    linear_works = cpu_kernels.onednn_linear_works.__wrapped__  # uncached: probed anew each call
    packed_works = cpu_kernels.packed_linear_works.__wrapped__

    def raises(*args):
        raise RuntimeError("could not create a primitive descriptor")

    def disagrees(x, w, b, *rest):
        return real(x, w, b, *rest) + 1

    for fake in (raises, disagrees):
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fake)
        for dtype in (torch.float32, torch.bfloat16):
            assert not linear_works(dtype)
            assert not packed_works(dtype)
        monkeypatch.setattr(cpu_kernels, "packed_linear_works", packed_works)
        model = make_model()
        assert not any(isinstance(m, cpu_kernels.PackedLinear) for m in cpu_kernels.pack_linears(model).modules())
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", real)
    assert linear_works(torch.float32) and packed_works(torch.float32)  # fp32 oneDNN runs on every x86 CPU
