"""Padding-free attention: sdpa that runs a flattened batch one sequence at a time.

A padding-free micro-batch is one row holding every sample back to back, with position ids restarting
at 0 and the sequence boundaries in `cu_seq_lens_q` (the keyword transformers' flash-attention path
reads). Plain sdpa would attend over the whole row under a block-diagonal mask: N^2 work for a row of
N tokens, most of it masked out. This implementation runs sdpa's causal kernel on each sequence
instead (sum of n_i^2 / 2), which is what flash-attention's varlen kernel does on a GPU.

It also runs *shared-prompt* rows (`shared_prefix`), the layout a preference batch takes when its two
answers to one prompt go through the model together, and an RL batch when its G sampled answers to one prompt
do: [prompt, answer 1, answer 2, ...] with each later answer's position ids continuing from the prompt, so the
prompt is computed once instead of G times. Each group's prompt + answer 1 is one causal sequence; every later
answer attends to the prompt and causally to itself, never to another answer.

It is registered with transformers as PACKED_SDPA. Calls without `cu_seq_lens_q` or `shared_prefix`
(generation, padded batches) and sliding-window layers take transformers' own sdpa path with its mask.

Its per-sequence calls never take cuDNN's attention: on an H100 (torch 2.11) cuDNN builds a graph for each new
shape, ~2.3 ms of CPU per call forward and again backward, and a padding-free batch brings new lengths at every
step (a 1.1B model's step took 1.6 s instead of ~0.1). Flash and memory-efficient attention have no such cost; on
a CPU the choice is the same as without the restriction.

On a CPU, half-precision sequences (bf16 autocast, pure bf16) run torch's flash kernel in fp32 (`_InFp32`): more
precise gradients, faster on an Intel Xeon (W1 +10 %), no slower in a step on an AMD EPYC (docs/performance.md).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tuneforge.model.recompute import remember
from tuneforge.trunk import unwrapped

PACKED_SDPA = "tuneforge_packed_sdpa"
SHARED_PREFIX = "shared_prefix"  # (groups, 2 + answers) long: start, prompt length, each answer's length (0: none)
# the keywords of a padding-free batch that the model forwards down to its attention
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", SHARED_PREFIX)
# every sdpa kernel but cuDNN's, in torch's order of preference (see the module's docstring)
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = kwargs.pop(SHARED_PREFIX, None)
    if groups is not None:
        if kwargs.get("sliding_window") or query.shape[0] != 1:
            raise ValueError("shared-prompt rows need one flattened row and layers without a sliding window")
        with sdpa_kernel(WITHOUT_CUDNN):
            return _shared_prefix_attention(module, query, key, value, groups, dropout, scaling, **kwargs)
    bounds = kwargs.get("cu_seq_lens_q")  # sdpa_attention_forward ignores the varlen keywords
    if bounds is None or kwargs.get("sliding_window") or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    with sdpa_kernel(WITHOUT_CUDNN):
        return _per_sequence_attention(module, query, key, value, bounds, dropout, scaling, **kwargs)


def host_list(values: torch.Tensor) -> list:
    """values.tolist(), read once per forward: every layer gets the same boundaries tensor, and on a GPU each read waits
    for the device to finish all queued work (a synchronisation per layer, which keeps the host from running ahead)."""
    global _last_read
    last = _last_read  # one read: another thread may replace it
    if last is not None and last[0]() is values and last[1] == values._version:
        return last[2]
    out = values.tolist()
    _last_read = (weakref.ref(values), values._version, out)
    return out


_last_read: tuple[weakref.ref, int, list] | None = None


def _per_sequence_attention(module, query, key, value, bounds, dropout, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    edges = host_list(bounds)
    lengths = [e - s for s, e in zip(edges[:-1], edges[1:], strict=True)]
    # split, not slices: the gradient of a split is one cat, where each slice's would be a zeroed full-size tensor
    sequences = zip(*(t[:, :, edges[0]:edges[-1]].split(lengths, dim=2) for t in (query, key, value)), strict=True)
    if kwargs.get("position_bias") is None and kwargs.get("softcap") is None:
        # sdpa's causal kernel as sdpa_attention_forward calls it without a mask, each sequence's output kept once:
        # by sdpa for its backward, o_proj's input a recipe on those (recompute.py)
        attend = _causal_in_fp32 if _upcasts(query, dropout) else _causal_sdpa
        outputs = [attend(q, k, v, dropout, scaling) for q, k, v in sequences]
        return remember(_side_by_side(*outputs), _side_by_side, *outputs), None
    pieces = [
        sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
        for q, k, v in sequences
    ]
    return torch.cat(pieces, dim=1), None  # (1, N, heads, head_dim), as sdpa_attention_forward returns


def _causal_sdpa(q, k, v, dropout, scaling):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=q.shape[2] > 1,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _upcasts(query: torch.Tensor, dropout: float) -> bool:
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) and not dropout


def _causal_in_fp32(q, k, v, dropout, scaling):
    return _InFp32.apply(q, k, v, None, scaling)


class _InFp32(torch.autograd.Function):
    """Attention of half-precision inputs on a CPU, computed by torch's flash kernel in fp32: causal, or under an
    additive mask.

    On a CPU the kernel's half-precision variant rounds the probabilities and their gradients to half precision
    before its products and runs those products a small block at a time; in fp32 it is both more precise (the
    gradients of k and v 2.5-4x closer to an fp64 reference) and faster: 1.6x-3x forward and backward from 64 tokens
    up on an Intel Xeon with avx512_bf16, 0.8x-1.8x by length on an AMD EPYC (docs/performance.md). It keeps what
    sdpa keeps: the inputs and the output in their own dtype, and each row's logsumexp; backward casts them up again.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        with torch.autocast("cpu", enabled=False):
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.float(), k.float(), v.float(), 0.0, mask is None, attn_mask=mask, scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, logsumexp, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp, mask = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.float(), q.float(), k.float(), v.float(), out.float(), logsumexp, 0.0, mask is None,
            attn_mask=mask, scale=ctx.scale)
        return *(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)), None, None


def _side_by_side(*outputs: torch.Tensor) -> torch.Tensor:
    """sdpa's (1, heads, n, head_dim) outputs of consecutive sequences as one (1, N, heads, head_dim) tensor."""
    return torch.cat([o.transpose(1, 2) for o in outputs], dim=1)


def _shared_prefix_attention(module, query, key, value, groups, dropout, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(q, k, v, visible):
        if _upcasts(q, dropout):
            mask = None if visible is None else torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            return _InFp32.apply(q, k, v, mask, scaling).transpose(1, 2)
        return sdpa_attention_forward(module, q, k, v, visible, dropout=dropout, scaling=scaling,
                                      is_causal=visible is None, **kwargs)[0]

    pieces = []
    for start, prompt, first, *others in host_list(groups):
        end = start + prompt + first
        pieces.append(attend(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None))
        for length in others:
            if not length:
                continue
            own = slice(end, end + length)
            keys = torch.cat([key[:, :, start : start + prompt], key[:, :, own]], dim=2)
            values = torch.cat([value[:, :, start : start + prompt], value[:, :, own]], dim=2)
            # the answer's i-th token sees the whole prompt and the answer's tokens up to itself
            visible = torch.ones(length, prompt + length, dtype=torch.bool, device=query.device).tril(prompt)
            pieces.append(attend(query[:, :, own], keys, values, visible[None, None]))
            end += length
    return torch.cat(pieces, dim=1), None


def register() -> None:
    """Make PACKED_SDPA a name transformers accepts (idempotent); its masks are sdpa's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)


def describe(implementation: str) -> str:
    return "sdpa (padding-free)" if implementation == PACKED_SDPA else implementation


def supports_padding_free(model: torch.nn.Module) -> bool:
    """True when the model routes attention through transformers' attention interface (which forwards
    position ids and cu_seq_lens to the kernel), so a flattened batch keeps its samples apart."""
    base = unwrapped(model)
    return bool(getattr(base, "_supports_attention_backend", False))


def runs_shared_prefix(model: torch.nn.Module) -> bool:
    """True when the model runs PACKED_SDPA (which reads `shared_prefix`) and has no sliding-window layers,
    so the answers to one prompt (a preference pair, an RL group) can share one forward of their prompt."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return config._attn_implementation == PACKED_SDPA and not sliding


def batch_layouts(model: torch.nn.Module) -> tuple[bool, bool]:
    """(flat, shared_prefix): whether the loaded model keeps the samples of a flattened (padding-free) batch
    apart, and whether it can run shared-prompt rows. The workflow asks this once and puts the answer in the
    batch layout; nothing reads the model's attention settings again."""
    return supports_padding_free(model), runs_shared_prefix(model)
