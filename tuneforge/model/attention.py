"""Padding-free attention: sdpa that runs a flattened batch one sequence at a time.

A padding-free micro-batch is one row holding every sample back to back, with position ids restarting
at 0 and the sequence boundaries in `cu_seq_lens_q` (the keyword transformers' flash-attention path
reads). Plain sdpa would attend over the whole row under a block-diagonal mask: N^2 work for a row of
N tokens, most of it masked out. This implementation runs sdpa's causal kernel on each sequence
instead (sum of n_i^2 / 2), which is what flash-attention's varlen kernel does on a GPU.

It is registered with transformers as PACKED_SDPA. Calls without `cu_seq_lens_q` (generation, padded
batches) and sliding-window layers take transformers' own sdpa path with its mask, unchanged.
"""

from __future__ import annotations

import torch

PACKED_SDPA = "tuneforge_packed_sdpa"
# the keywords of a padding-free batch that the model forwards down to its attention
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")  # sdpa_attention_forward ignores the varlen keywords
    if bounds is None or kwargs.get("sliding_window") or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    edges = bounds.tolist()
    pieces = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None,
                               dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
        for s, e in zip(edges[:-1], edges[1:], strict=True)
    ]
    return torch.cat(pieces, dim=1), None  # (1, N, heads, head_dim), as sdpa_attention_forward returns


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
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "_supports_attention_backend", False))
