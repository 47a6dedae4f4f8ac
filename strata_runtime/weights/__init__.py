"""Where a model's numbers come from: a checkpoint directory, or a synthetic preset generated in place.

`checkpoint` reads safetensors straight onto each stage's device; `synthetic` generates a preset's weights
with planted structure (from `random`'s counter-based values); `tokenizer` turns text into ids and back for
either; `progress` reports the bytes loaded.
"""
