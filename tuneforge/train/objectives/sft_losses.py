"""The per-token losses of the lm objective: each a pure function of one chunk of fp32 logits (n, vocab) and its
targets (n,), returning (n,) losses. The chunked head path (token_logps.py) calls one on each chunk, so every
variant keeps its memory bound, and the objective sums them: the loss is normalized by supervised tokens over the
whole optimizer step (packing and gradient accumulation as for plain cross-entropy).

- cross_entropy: -log p(target), smoothed with transformers' label_smoothing_factor.
- dft (Dynamic Fine-Tuning, Wu et al. 2025): each token's cross-entropy weighted by its probability p(target),
  taken as a constant, so unlikely tokens pull less.
- eaft (entropy-adaptive): weighted by (H / 3) ** alpha, H the entropy of the 20 most likely tokens (log 20 = 3.0 is
  its largest value), a constant: confident predictions pull less.
- asft (anchored DFT): dft + alpha x KL(reference || policy) over the whole vocabulary, the reference being the
  starting model, which keeps the policy near it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOKEN_LOSSES = ("cross_entropy", "dft", "eaft", "asft")
ENTROPY_TOP_K = 20
ENTROPY_SCALE = 3.0  # about log(ENTROPY_TOP_K): the top-k entropy's largest value


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction="none", label_smoothing=smoothing)


def dft(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = cross_entropy(logits, targets)
    return loss * torch.exp(-loss).detach()


def top_k_entropy(logits: torch.Tensor, k: int = ENTROPY_TOP_K) -> torch.Tensor:
    """The entropy of the distribution renormalized over each row's k largest logits."""
    log_p = logits.topk(min(k, logits.shape[-1]), dim=-1).values.log_softmax(dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def eaft(logits: torch.Tensor, targets: torch.Tensor, alpha: float) -> torch.Tensor:
    weight = (top_k_entropy(logits.detach()) / ENTROPY_SCALE) ** alpha
    return cross_entropy(logits, targets) * weight


def kl_from_reference(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || policy) of each row: sum over the vocabulary of q (log q - log p)."""
    log_q = ref_logits.log_softmax(dim=-1)
    return (log_q.exp() * (log_q - logits.log_softmax(dim=-1))).sum(dim=-1)


def asft(logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    return dft(logits, targets) + alpha * kl_from_reference(logits, ref_logits)


@dataclass(frozen=True)
class TokenLoss:
    """Which per-token loss, with its parameter: alpha of eaft / asft, label_smoothing of cross_entropy."""

    kind: str = "cross_entropy"
    alpha: float = 0.0
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in TOKEN_LOSSES:
            raise ValueError(f"kind must be one of {TOKEN_LOSSES}, not {self.kind!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), not {self.label_smoothing}")
        if self.label_smoothing and self.kind != "cross_entropy":
            raise ValueError(f"label smoothing applies to cross_entropy, not {self.kind}")

    @property
    def needs_reference(self) -> bool:
        return self.kind == "asft"

    @property
    def is_nll(self) -> bool:
        """Whether the loss is the mean negative log-likelihood (so exp(loss) is a perplexity)."""
        return self.kind == "cross_entropy" and not self.label_smoothing

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
        logits = logits.float()
        if self.kind == "cross_entropy":
            return cross_entropy(logits, targets, self.label_smoothing)
        if self.kind == "dft":
            return dft(logits, targets)
        if self.kind == "eaft":
            return eaft(logits, targets, self.alpha)
        if ref_logits is None:
            raise ValueError("asft needs the reference's logits")
        return asft(logits, targets, ref_logits.float(), self.alpha)


PLAIN = TokenLoss()
