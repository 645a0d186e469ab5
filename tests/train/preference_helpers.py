"""Collated pairwise / feedback batches built by hand, exactly as the batch contract describes them.

S sequences in contract order (chosen_0..chosen_{B-1}, rejected_0..; or completion_0.., kl_0..) become
either a right-padded (S, T) batch with attention_mask, or one padding-free row with position_ids and
cu_seq_lens; both carry sequence_ids (-1 on padding) and sequence_ends (flat index of each last token).
"""

from __future__ import annotations

import dataclasses

import torch
from train_helpers import as_batch

from tuneforge.batch import Batch, Layout

PAD_ID = 2
IGNORE = -100

Sequence = tuple[list[int], list[int]]  # (input_ids, labels)


def collate_sequences(sequences: list[Sequence], padding_free: bool, rows: str = "pairwise") -> Batch:
    layout = Layout(rows=rows, flat=padding_free)
    return as_batch(_columns(sequences, padding_free), layout, num_rows=len(sequences) // 2)


def with_targets(batch: Batch, **targets) -> Batch:
    """The batch with these targets added (e.g. precomputed ref_logps)."""
    return dataclasses.replace(batch, targets={**batch.targets, **targets})


def _columns(sequences: list[Sequence], padding_free: bool) -> dict:
    if padding_free:
        ids, labels, positions, owners, ends, bounds = [], [], [], [], [], [0]
        for index, (seq_ids, seq_labels) in enumerate(sequences):
            ids += seq_ids
            labels += seq_labels
            positions += list(range(len(seq_ids)))
            owners += [index] * len(seq_ids)
            ends.append(len(ids) - 1)
            bounds.append(len(ids))
        cu = torch.tensor(bounds, dtype=torch.int32)
        longest = max(len(s[0]) for s in sequences)
        return {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
            "sequence_ids": torch.tensor([owners]),
            "sequence_ends": torch.tensor(ends),
        }
    width = max(len(s[0]) for s in sequences)
    ids, labels, mask, owners, ends = [], [], [], [], []
    for index, (seq_ids, seq_labels) in enumerate(sequences):
        pad = width - len(seq_ids)
        ids.append(seq_ids + [PAD_ID] * pad)
        labels.append(seq_labels + [IGNORE] * pad)
        mask.append([1] * len(seq_ids) + [0] * pad)
        owners.append([index] * len(seq_ids) + [-1] * pad)
        ends.append(index * width + len(seq_ids) - 1)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(mask),
        "labels": torch.tensor(labels),
        "sequence_ids": torch.tensor(owners),
        "sequence_ends": torch.tensor(ends),
    }


def prompt_completion(prompt: list[int], completion: list[int]) -> Sequence:
    """A sequence whose labels are -100 on the prompt and the tokens on the completion."""
    return prompt + completion, [IGNORE] * len(prompt) + completion


def random_tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=generator).tolist()


def pairwise_sequences(
    prompt_lens: list[int], chosen_lens: list[int], rejected_lens: list[int], seed: int = 0
) -> list[Sequence]:
    """B pairs: chosen_0..chosen_{B-1}, rejected_0..rejected_{B-1}; pair i shares its prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = [random_tokens(g, n) for n in prompt_lens]
    chosen = [prompt_completion(p, random_tokens(g, n)) for p, n in zip(prompts, chosen_lens, strict=True)]
    rejected = [prompt_completion(p, random_tokens(g, n)) for p, n in zip(prompts, rejected_lens, strict=True)]
    return chosen + rejected


def pairwise_batch(prompt_lens, chosen_lens, rejected_lens, padding_free=False, seed=0) -> Batch:
    return collate_sequences(pairwise_sequences(prompt_lens, chosen_lens, rejected_lens, seed), padding_free)


def feedback_batch(
    prompt_lens: list[int], completion_lens: list[int], tags: list[int], padding_free=False, seed=0
) -> Batch:
    """B samples: completion_i = prompt_i + its completion, kl_i = prompt_i + sample (i+1) % B's completion."""
    g = torch.Generator().manual_seed(seed)
    prompts = [random_tokens(g, n) for n in prompt_lens]
    completions = [random_tokens(g, n) for n in completion_lens]
    size = len(prompts)
    own = [prompt_completion(p, c) for p, c in zip(prompts, completions, strict=True)]
    kl = [prompt_completion(prompts[i], completions[(i + 1) % size]) for i in range(size)]
    batch = collate_sequences(own + kl, padding_free, rows="feedback")
    batch.targets["kto_tags"] = torch.tensor(tags)
    return batch


def brute_force_logps(model, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log p(target) and target counts of each sequence, from its full (len, vocab) logits, run alone."""
    logps, counts = [], []
    for ids, labels in sequences:
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        log_probs = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(labels[1:])
        supervised = targets != IGNORE
        picked = log_probs[supervised].gather(-1, targets[supervised][:, None]).squeeze(-1)
        logps.append(picked.sum())
        counts.append(float(supervised.sum()))
    return torch.stack(logps), torch.tensor(counts)
