"""shift_attn: LongLoRA's shifted sparse attention (S²-Attn) while training, full attention otherwise.

In training, each sequence is cut into groups of a quarter of its length and attention stays inside a group
(causal); half of the heads first shift the sequence by half a group, so their groups straddle the others'
boundaries and information flows between groups from layer to layer. The cost falls from n² / 2 to n² / 8 per
sequence; evaluation and generation (the module in eval mode) attend over the whole sequence, as LongLoRA infers.
A shifted head's last group wraps around to the sequence's first tokens, as in LongLoRA's and LlamaFactory's code.

It runs on padding-free rows (each sequence's boundaries from cu_seq_lens_q), registered with transformers as
SHIFTED_SDPA; the weights and the saved model are unchanged (the saved config names no attention of ours).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tuneforge.model import attention

SHIFTED_SDPA = "tuneforge_shifted_sdpa"
GROUP_SIZE_RATIO = 0.25  # LongLoRA's (and LlamaFactory's) group size: a quarter of the sequence


def shifted_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0,
                             scaling: float | None = None) -> torch.Tensor:
    """S²-Attn over one causal sequence: query (1, heads, n, d), key / value (1, kv_heads, n, d) -> (1, n, heads, d)."""
    heads, length = query.shape[1], query.shape[2]
    key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))  # each query head's own
    size = max(1, int(length * GROUP_SIZE_RATIO))
    half, pad = size // 2, -length % size
    shifted = heads // 2  # the second half of the heads

    def grouped(x: torch.Tensor) -> torch.Tensor:  # (1, heads, n, d) -> (groups, heads, size, d)
        x = torch.cat([x[:, :shifted], x[:, shifted:].roll(-half, dims=2)], dim=1)
        x = F.pad(x, (0, 0, 0, pad))  # after every real token: causal attention never reaches it
        return x[0].unflatten(1, (-1, size)).transpose(0, 1)

    out = F.scaled_dot_product_attention(grouped(query), grouped(key), grouped(value), dropout_p=dropout,
                                         is_causal=True, scale=scaling)
    out = out.transpose(1, 2).reshape(1, -1, heads, query.shape[3])[:, :length]  # (1, n, heads, d)
    return torch.cat([out[:, :, :shifted], out[:, :, shifted:].roll(half, dims=1)], dim=2)


def shifted_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention-interface function: S²-Attn per sequence of a padding-free row in training, else PACKED_SDPA."""
    if not module.training:
        return attention.packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                       scaling=scaling, **kwargs)
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or kwargs.get(attention.SHARED_PREFIX) is not None:
        raise RuntimeError("shift_attn trains on padding-free rows of plain sequences (cu_seq_lens_q)")
    edges = attention.host_list(bounds)
    pieces = [shifted_sparse_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout, scaling)
              for s, e in zip(edges[:-1], edges[1:], strict=True)]
    return torch.cat(pieces, dim=1), None


def use_shifted_sparse_attention(model: torch.nn.Module) -> None:
    """Switch a model running PACKED_SDPA to SHIFTED_SDPA (S²-Attn in train mode)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SHIFTED_SDPA, shifted_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SHIFTED_SDPA, sdpa_mask)
    model.set_attn_implementation(SHIFTED_SDPA)
