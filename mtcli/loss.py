"""The training loss: label-smoothed cross-entropy over the real (non-padding) target positions.

The vocabulary projection and the loss are fused and computed in chunks of rows: each chunk's logits are made,
turned into the loss and into gradients for the hidden states and the output matrix at once, then dropped. So the
(tokens x vocabulary) logits never exist whole, nothing of that size is kept for the backward pass, and the
memory-bound passes over it shrink from about a dozen (projection, log-softmax, its backward, label smoothing's
extra terms, zero-filled gradients) to four (the projection, one softmax, the two gradient products): about half
of a CPU update on the benchmark setting (docs/benchmarks.md, "Figures behind the code").

Label smoothing spreads eps uniformly over the vocabulary, as `F.cross_entropy(label_smoothing=eps)` does:
loss = (1 - eps) * -log p[y] + eps * mean_v(-log p[v]).
"""

from __future__ import annotations

import torch
from torch import nn

from mtcli.cpu_kernels import pad_to_row_multiple
from mtcli.model import Transformer

CHUNK_ROWS = 1024


def chunks(rows) -> tuple[range | list[int], int]:
    """The first row of each chunk, and the rows per chunk: CHUNK_ROWS, or all rows in one chunk under torch.compile,
    where a loop over rows / CHUNK_ROWS chunks would fix the row count in the graph (a recompile for nearly every
    batch), and Inductor fuses the passes itself; the logits of one micro-batch then exist whole for a moment."""
    if torch.compiler.is_compiling():
        return [0], rows
    return range(0, rows, CHUNK_ROWS), CHUNK_ROWS


def _product_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the fused losses' matrix products run in: the autocast dtype when autocast is on, else the input's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def branch_free(device: torch.device) -> bool:
    """Whether the loss must not branch on its data: on a GPU a branch reads the device from the host (waiting for
    every queued kernel), and torch.compile is kept away from control flow on tensor values. On a CPU in eager mode
    the read costs nothing."""
    return device.type != "cpu" or torch.compiler.is_compiling()


def log_sum_exp(logits: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp (fp32) from its softmax, lse = z_j - log p_j for any token j. Branch-free (GPU, compile):
    at the row's most likely token, whose probability is at least 1 / V, exact in every dtype, fp16 included; one more
    pass over the probabilities. On a CPU: at the target (already gathered), and where its probability underflows (a
    hopeless prediction), from the logits directly; 9 % faster at the benchmark's shapes."""
    if branch_free(logits.device):
        p_best, best = probs.max(dim=1)
        return logits.gather(1, best[:, None]).squeeze(1).float() - p_best.float().log()
    p_target = probs.gather(1, labels[:, None]).squeeze(1).float()
    lse = target - p_target.log()
    tiny = p_target < (1e-4 if probs.dtype == torch.float16 else 1e-30)  # fp16's smallest normal number: 6e-5
    if tiny.any():
        lse[tiny] = torch.logsumexp(logits[tiny].float(), dim=1)
    return lse


class _FusedProjectionCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, eps: float, needs_grad: bool, dtype: torch.dtype):
        """hidden: (N, d), weight: (V, d), bias: (V,) or None (a fixed output bias: no gradient), labels: (N,). The
        matrix products run in `dtype` (the autocast dtype, or the inputs' own); softmax, loss and the output-matrix
        gradient are accumulated in fp32. Returns the summed loss (fp32 scalar)."""
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly below
            return _FusedProjectionCrossEntropy._forward(ctx, hidden, weight, bias, labels, eps, needs_grad, dtype)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, labels, eps, needs_grad, dtype):
        N, V = hidden.shape[0], weight.shape[0]
        hidden_dtype = hidden.dtype
        if hidden.device.type == "cpu" and dtype != torch.float32:
            # CPU bf16 products run oneDNN kernels built for each exact shape (milliseconds per new one), and the last
            # chunk's row count is new almost every batch: zero rows round it up to a multiple of ROW_MULTIPLE. They add
            # nothing to grad_weight (their h is 0); their losses and grad_hidden rows are dropped.
            hidden = pad_to_row_multiple(hidden.to(dtype))
            labels = torch.cat([labels, labels.new_zeros(hidden.shape[0] - N)])
        else:
            hidden = hidden.to(dtype)
        w = weight.to(dtype)
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_grad else None
        # fp32: one logits buffer for every chunk, written by the matrix product: a fresh (n, V) tensor per chunk
        # costs page faults on CPU and allocator traffic on GPU.
        starts, chunk = chunks(hidden.shape[0])
        rows = hidden.shape[0] if len(starts) == 1 else chunk
        buffer = (
            torch.empty(rows, V, dtype=torch.float32, device=hidden.device) if hidden.dtype == torch.float32 else None
        )
        # mean_v z_v = h . mean_v w_v: label smoothing's uniform term as a matrix-vector product, not a pass over z
        w_mean = weight.float().mean(dim=0)
        bias_mean = bias.float().mean() if bias is not None else 0.0  # a tensor: float() would wait for the device
        w_sum = (w_mean * V).to(w.dtype) if needs_grad else None
        for start in starts:
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            n = h.shape[0]
            if h.dtype == torch.float32:
                logits = torch.mm(h, w.t(), out=buffer[:n])  # (n, V)
            else:
                logits = h @ w.t()  # bf16/fp16: the product's own dtype; softmax computes in fp32 internally
            if bias is not None:
                logits += bias.to(logits.dtype)
            # One fused softmax pass (in the logits' dtype: bf16 probabilities are what the bf16 products below take).
            probs = torch.softmax(logits, dim=1)
            target = logits.gather(1, y[:, None]).squeeze(1).float()
            lse = log_sum_exp(logits, probs, y, target)
            mean_logit = h.float() @ w_mean + bias_mean
            total += (lse - (1 - eps) * target - eps * mean_logit)[: N - start].sum()
            if not needs_grad:
                continue
            # d loss / d z = softmax(z) - (1 - eps) * onehot(y) - eps / V. The softmax goes through both matrix
            # products as is; the one-hot and uniform terms are added as a row gather and a rank-one correction.
            grad_h = probs @ w  # (n, d)
            grad_h.sub_(w.index_select(0, y), alpha=1 - eps)
            grad_h.sub_(w_sum, alpha=eps / V)
            grad_hidden[start : start + n] = grad_h
            if h.dtype == torch.float32:
                grad_weight.addmm_(probs.t(), h)
            else:
                grad_weight.add_((probs.t() @ h).float())
            grad_weight.index_add_(0, y, h.float(), alpha=-(1 - eps))
            grad_weight.sub_(h.sum(dim=0, dtype=torch.float32), alpha=eps / V)  # broadcast over every row
        if grad_hidden is not None:
            grad_hidden = grad_hidden[:N].to(hidden_dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output.float()
        grads = grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype)
        return grads[0], grads[1], None, None, None, None, None


def projection_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed label-smoothed cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, without materialising
    logits. `bias` is the model's fixed output bias (MarianMT's final_logits_bias), or None."""
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedProjectionCrossEntropy.apply(
        hidden, weight, bias, labels, label_smoothing, needs_grad, _product_dtype(hidden)
    )


def target_states(model: Transformer, src, src_pad_mask, tgt_in, tgt_index) -> torch.Tensor:
    """Decoder outputs at the real target positions only, (N, d): padding never reaches the vocabulary."""
    hidden = model.decode_hidden(tgt_in, model.encode(src, src_pad_mask), src_pad_mask)  # (B, T, d)
    return hidden.flatten(0, 1).index_select(0, tgt_index)


def guided_alignment_loss(weights: torch.Tensor, align_index: torch.Tensor, align_weight: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy between the alignment heads' attention (B, T, S) and the word alignments: for each
    aligned target position, -sum over its links of (1 / its links) * log attention (Garg et al. 2019's loss,
    Marian's `ce` guided-alignment cost)."""
    attention = weights.flatten().index_select(0, align_index)
    return -(align_weight * attention.clamp_min(1e-9).log()).sum()


class _FusedSymmetricKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden1, hidden2, weight, bias, dtype: torch.dtype):
        """hidden1, hidden2: (N, d), the same target positions under two dropout masks; weight: (V, d). Returns the
        summed KL(p1 || p2) + KL(p2 || p1) = sum (p1 - p2) * (log p1 - log p2) (fp32 scalar), and keeps the gradients.
        Products run in `dtype`; log-probabilities are fp32, since the two distributions are close and their
        difference is what counts."""
        with torch.autocast(hidden1.device.type, enabled=False):
            return _FusedSymmetricKL._forward(ctx, hidden1, hidden2, weight, bias, dtype)

    @staticmethod
    def _forward(ctx, hidden1, hidden2, weight, bias, dtype):
        N, hidden_dtype = hidden1.shape[0], hidden1.dtype
        h1, h2, w = hidden1.to(dtype), hidden2.to(dtype), weight.to(dtype)
        if h1.device.type == "cpu" and dtype != torch.float32:  # shapes oneDNN has seen (see the cross-entropy)
            # zero rows in both: equal distributions, no KL, no gradient
            h1, h2 = pad_to_row_multiple(h1), pad_to_row_multiple(h2)
        total = torch.zeros((), dtype=torch.float32, device=h1.device)
        grad1, grad2 = torch.empty_like(h1), torch.empty_like(h2)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        starts, chunk = chunks(h1.shape[0])
        for start in starts:
            x1, x2 = h1[start : start + chunk], h2[start : start + chunk]
            shift = bias.float() if bias is not None else 0.0  # the fixed output bias, if any
            logp1 = torch.log_softmax((x1 @ w.t()).float() + shift, dim=1)
            logp2 = torch.log_softmax((x2 @ w.t()).float() + shift, dim=1)
            p1 = logp1.exp()
            diff = logp1.sub_(logp2)  # log p1 - log p2
            gap = logp2.exp_().neg_().add_(p1)  # p1 - p2
            total += torch.dot(gap.flatten(), diff.flatten())
            # d/dz1 = p1 * (diff - <p1, diff>) + gap;  d/dz2 = -(p2 * (diff - <p2, diff>) + gap), per row
            p2 = p1 - gap
            g2 = torch.addcmul(gap, p2, diff - (p2 * diff).sum(1, keepdim=True)).neg_().to(dtype)
            g1 = torch.addcmul(gap, p1, diff.sub_((p1 * diff).sum(1, keepdim=True))).to(dtype)
            grad1[start : start + chunk] = g1 @ w
            grad2[start : start + chunk] = g2 @ w
            grad_weight.add_((g1.t() @ x1).float()).add_((g2.t() @ x2).float())
        ctx.save_for_backward(grad1[:N].to(hidden_dtype), grad2[:N].to(hidden_dtype), grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad1, grad2, grad_weight = ctx.saved_tensors
        scale = grad_output.float()
        g = scale.to(grad1.dtype)
        return grad1 * g, grad2 * g, (grad_weight * scale).to(ctx.weight_dtype), None, None


def symmetric_kl(
    hidden1: torch.Tensor, hidden2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Summed KL(p1 || p2) + KL(p2 || p1) between the distributions `hidden @ weight.T (+ bias)` predicts, without
    keeping logits (R-Drop's regulariser)."""
    return _FusedSymmetricKL.apply(hidden1, hidden2, weight, bias, _product_dtype(hidden1))


class LossModel(nn.Module):
    """The model plus its loss in one forward, so DDP and torch.compile see a single module call.

    With R-Drop (alpha > 0, training only) the batch runs twice in one forward, with independent dropout masks; the
    loss per target token is the mean of the two cross-entropies plus alpha / 4 * the symmetric KL between the two
    predictions, which is the paper's CE1 + CE2 + alpha / 2 * (KL12 + KL21) halved. The training loss logged is this
    sum; validation losses have no R-Drop term."""

    def __init__(self, model: Transformer, label_smoothing: float, rdrop: float = 0.0, guided_alignment: float = 0.0):
        super().__init__()
        self.model, self.label_smoothing, self.rdrop = model, label_smoothing, rdrop
        self.guided_alignment = guided_alignment

    def forward(self, src, src_pad_mask, tgt_in, tgt_index, labels, align_index=None, align_weight=None):
        """The summed loss; with guided alignment (and the batch's links: align_index, align_weight) plus its
        weight times guided_alignment_loss."""
        weight, bias = self.model.output.weight, self.model.output_bias
        if self.guided_alignment and align_index is not None and self.model.training:
            model = self.model
            memory = model.encode(src, src_pad_mask)
            hidden, attention = model.decode_aligned(tgt_in, memory, src_pad_mask, None, model.cfg.alignment_heads)
            real = hidden.flatten(0, 1).index_select(0, tgt_index)
            loss = projection_cross_entropy(real, weight, labels, self.label_smoothing, bias)
            return loss + self.guided_alignment * guided_alignment_loss(attention, align_index, align_weight)
        if not (self.rdrop > 0 and self.model.training):
            real = target_states(self.model, src, src_pad_mask, tgt_in, tgt_index)
            return projection_cross_entropy(real, weight, labels, self.label_smoothing, bias)
        twice_index = torch.cat([tgt_index, tgt_index + tgt_in.numel()])  # the copy's rows follow the batch's
        real = target_states(self.model, src.repeat(2, 1), src_pad_mask.repeat(2, 1), tgt_in.repeat(2, 1), twice_index)
        n = labels.shape[0]
        cross_entropy = projection_cross_entropy(real, weight, labels.repeat(2), self.label_smoothing, bias) / 2
        return cross_entropy + self.rdrop / 4 * symmetric_kl(real[:n], real[n:], weight, bias)
