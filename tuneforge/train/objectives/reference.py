"""The reference model of DPO / KTO / GRPO: log-probs of the frozen starting point.

Two kinds, two methods, `logps(policy_model, batch) -> (S,)` per sequence (dpo, kto) and
`token_logps(policy_model, batch) -> (n,)` per supervised token (grpo's KL penalty):
- AdapterReference: the policy itself with its peft adapters disabled (lora / oft): no second copy of
  the weights in memory.
- ModelReference: a separate frozen model (a copy of the initial policy for full / freeze, or a
  `ref_model` the user named, possibly with adapters of its own).
Both run under torch.no_grad in eval mode (dropout off) and put the model back in the mode it was in.

When a batch carries precomputed `ref_logps`, the objectives read those and never call the reference;
the precompute step calls `reference_logps`, the same code the objectives run on the fly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from tuneforge.batch import Batch
from tuneforge.errors import ConfigError
from tuneforge.train.objectives.logps import sequence_logps
from tuneforge.train.objectives.token_logps import ReferenceRows, reference_rows, token_logps


@runtime_checkable
class Reference(Protocol):
    def logps(self, policy_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """(S,) fp32 summed log-probs of each sequence's supervised tokens under the reference."""
        ...

    def token_logps(self, policy_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """(n,) fp32 log-probs of the batch's supervised targets under the reference (token_logps' order)."""
        ...

    def target_rows(self, policy_model: torch.nn.Module, batch: Batch) -> ReferenceRows:
        """What the reference's vocabulary projection reads at the batch's supervised targets (asft's KL over the
        whole vocabulary): its hidden states and head, or its logits; see token_logps.reference_rows."""
        ...


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """model.eval() inside, the previous training mode restored afterwards (even on error)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class AdapterReference:
    """The policy with its adapters disabled (`with model.disable_adapter()`): the base model."""

    def __init__(self, head: str = "auto", chunk_tokens: int | None = None) -> None:
        self.head, self.chunk_tokens = head, chunk_tokens

    def logps(self, policy_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with self._base(policy_model):
            out = sequence_logps(policy_model, batch, head=self.head, chunk_tokens=self.chunk_tokens)
        return out.logps.detach()

    def token_logps(self, policy_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with self._base(policy_model):
            return token_logps(policy_model, batch, head=self.head, chunk_tokens=self.chunk_tokens).detach()

    def target_rows(self, policy_model: torch.nn.Module, batch: Batch) -> ReferenceRows:
        with self._base(policy_model):
            return reference_rows(policy_model, batch, self.head,
                                  head_context=lambda: self._base(policy_model))

    def _base(self, policy_model: torch.nn.Module) -> contextlib.AbstractContextManager:
        if not hasattr(policy_model, "disable_adapter"):
            raise ConfigError(
                f"the reference is the policy without its adapters, but {type(policy_model).__name__} has "
                f"no peft adapters; use finetuning_type lora / oft, or give a separate reference model "
                f"(ref_model) for full / freeze"
            )
        stack = contextlib.ExitStack()
        for context in (torch.no_grad(), eval_mode(policy_model), policy_model.disable_adapter()):
            stack.enter_context(context)
        return stack


class ModelReference:
    """A separate frozen model (kept in eval mode, its parameters never require grad)."""

    def __init__(self, ref_model: torch.nn.Module, head: str = "auto", chunk_tokens: int | None = None) -> None:
        self.model = ref_model
        self.model.requires_grad_(False)
        self.model.eval()
        self.head, self.chunk_tokens = head, chunk_tokens

    def logps(self, policy_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with torch.no_grad(), eval_mode(self.model):
            out = sequence_logps(self.model, batch, head=self.head, chunk_tokens=self.chunk_tokens)
        return out.logps.detach()

    def token_logps(self, policy_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with torch.no_grad(), eval_mode(self.model):
            return token_logps(self.model, batch, head=self.head, chunk_tokens=self.chunk_tokens).detach()

    def target_rows(self, policy_model: torch.nn.Module, batch: Batch) -> ReferenceRows:
        with eval_mode(self.model):
            return reference_rows(self.model, batch, self.head)


def reference_logps(
    reference: Reference, policy_model: torch.nn.Module, batch: Batch
) -> torch.Tensor:
    """One collated micro-batch -> (S,) fp32 reference log-probs, in the batch's sequence order.

    The precompute step stores these as ref_chosen_logps / ref_rejected_logps (ref_logps / ref_kl_logps)."""
    return reference.logps(policy_model, batch).float()


def batch_reference_logps(
    reference: Reference | None, policy_model: torch.nn.Module, batch: Batch, stage: str
) -> torch.Tensor:
    """The batch's precomputed `ref_logps` when it has them, else the reference's, on the fly."""
    precomputed = batch.targets.get("ref_logps")
    if precomputed is not None:
        return precomputed.float()
    if reference is None:
        raise ConfigError(
            f"{stage} needs reference log-probs, but the batch has no ref_logps and no reference model "
            f"was given; use lora / oft (the reference is the base without adapters) or set ref_model"
        )
    return reference_logps(reference, policy_model, batch)
