"""Data: dataset_info.json -> raw rows -> Conversations -> stage encoder -> (packing) -> cached token rows.

splits = build(cfg, tokenizer)          # DataSplits(train, eval, stats)
rows = preview(cfg, tokenizer, n=3)     # rendered samples, supervised spans between ⟦ and ⟧
collate = Collator(pad_token_id, layout)  # rows -> a tuneforge.batch.Batch (tuneforge.data.collate)
encoders.ENCODERS                       # the encoders a stage row names (register_encoder adds one)
"""

from tuneforge.data.pipeline import DataSplits, build, preview

__all__ = ["DataSplits", "build", "preview"]
