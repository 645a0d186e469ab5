"""NEFTune (Jain et al. 2023, transformers' neftune_noise_alpha): uniform noise added to the input embeddings in the
training forward, U(-1, 1) x alpha / sqrt(L x d), d the hidden size and L the length of the token's sample.

transformers takes L as the padded row length; here it is each sample's own token count, whatever the batch layout,
so a sample gets the same noise padded, packed or in one padding-free row (where the row length would be the whole
micro-batch's). The noise exists only inside `noising(batch)`, around the training forward, and only while the
embedding module is in training mode: never in evaluation, rollouts, a reference's forward or the saved model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tuneforge.batch import Batch, position_samples
from tuneforge.trunk import unwrapped


def sample_lengths(batch: Batch) -> torch.Tensor | None:
    """(rows, seq) float: the token count of the sample each position belongs to; None when the inputs do not say
    (then the row length is used, as transformers does)."""
    inputs = batch.model_inputs
    ids = inputs.get("input_ids")
    if ids is None:
        return None
    if batch.layout.samples_share_rows and "position_ids" in inputs:
        sample = position_samples(inputs)
        return torch.bincount(sample.flatten())[sample].float()
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.sum(dim=1, keepdim=True).expand_as(ids).float()
    return None


class NEFTune:
    """A forward hook on the model's input embeddings; remove() takes it off."""

    def __init__(self, model: torch.nn.Module, alpha: float) -> None:
        self.alpha = alpha
        self._active = False
        self._lengths: torch.Tensor | None = None
        self._handle = unwrapped(model).get_input_embeddings().register_forward_hook(self._add_noise)

    @contextlib.contextmanager
    def noising(self, batch: Batch) -> Iterator[None]:
        self._active, self._lengths = True, sample_lengths(batch)
        try:
            yield
        finally:
            self._active, self._lengths = False, None

    def _add_noise(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not (self._active and module.training):
            return output
        lengths = self._lengths
        if lengths is None or lengths.shape != output.shape[:2]:
            lengths = torch.full(output.shape[:2], float(output.shape[1]), device=output.device)
        scale = self.alpha / torch.sqrt(lengths.to(output.device) * output.shape[-1])
        noise = torch.empty_like(output).uniform_(-1.0, 1.0) * scale[..., None].to(output.dtype)
        return output + noise

    def remove(self) -> None:
        self._handle.remove()
