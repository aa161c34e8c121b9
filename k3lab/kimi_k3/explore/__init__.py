"""What the notebooks show of Kimi-K3 in particular (its E8M0 scales and FP4 codes, its MoonViT
tower, tokenizer and chat format), as plain functions returning plain values; ``k3lab.explore`` re-exports them
beside its model-free helpers."""
