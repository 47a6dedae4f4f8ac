"""Synthetic models: a preset's weights generated in place on each device, with planted structure.

Random weights would make MTP drafts worthless (acceptance near 0), which measures nothing. So the presets
plant a token chain the drafter can learn nothing about and still predict:

* The embedding gives every token a random code; the LM head's row for token ``u`` is the code of
  ``chain⁻¹(u)``. With nothing else in the residual stream, the model predicts ``chain(x)`` after ``x``.
  The chain is a fixed permutation: one cycle through the printable ASCII bytes (so a text prompt goes on
  as text) and one through every other ordinary token; special tokens map to themselves.
* Every layer is random and runs its full computation, but its outputs into the residual stream (attention's
  ``o_proj``, the MLPs' ``down_proj``) are scaled by ``layer_scale`` times a gain. Small scales keep the chain
  dominant; larger ones let the context-dependent layers change the next token more and more often.
* The MTP head passes the embedding of its input token straight through ``fc`` (identity on that half; the
  hidden half is random and scaled like a layer), so it predicts ``chain(token)``: the draft is right exactly
  when the layers did not change the main model's argmax.

Each tensor is generated from its own seed (`random.tensor_seed`), so a stage generates exactly what
whole-model generation would, and a GPU gets the same numbers as a virtual CPU device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from strata_cfg.schema.presets import preset_config

from ..backend import Device
from ..experts.host import host_empty
from ..models.qwen3_moe import ModelArgs, Shapes
from .progress import Progress
from .random import tensor_seed, uniform_
from .tokenizer import ByteTokenizer

GAIN = 32.0
"""Calibrates ``layer_scale``: with this gain the presets' default scales give drafts accepted about 50–80%
of the time (measured on ``tiny``; see tests/test_rt_synthetic.py)."""

PRINTABLE_PULL = 0.75
"""LM-head scale of tokens that are not printable ASCII: when the layers do change the next token, it is
then more often printable, so a synthetic model's text stays readable characters."""

_SQRT3 = math.sqrt(3.0)


def chain_permutation(vocab: int, seed: int) -> np.ndarray:
    """The planted next-token map [V]: a cycle over printable bytes, a cycle over other ordinary tokens."""
    rng = np.random.default_rng(seed)
    perm = np.arange(vocab, dtype=np.int64)
    specials = set(ByteTokenizer.SPECIALS.values())
    printable = [t for t in range(32, 127) if t < vocab]
    others = [t for t in range(vocab) if t not in specials and not 32 <= t < 127]
    for group in (printable, others):
        order = rng.permutation(np.array(group, dtype=np.int64))
        perm[order] = np.roll(order, -1)
    return perm


def output_scale(args: ModelArgs, layer_scale: float) -> float:
    """Scale of each layer's contribution to the residual stream.

    The planted token wins its logit by about H against other tokens' N(0, H) noise, so the perturbation
    that flips the argmax a given fraction of the time grows like sqrt(H / ln V); 2L outputs add up like
    sqrt(2L). Dividing those out makes one ``layer_scale`` mean about the same acceptance for every preset.
    """
    h, v, n = args.hidden_size, args.vocab_size, args.num_hidden_layers + args.mtp_layers
    return layer_scale * GAIN * math.sqrt(h / math.log(v)) / math.sqrt(2 * n)


class SyntheticModel:
    """A preset plus seed and scale: its ``config.json`` and an in-place weight generator."""

    def __init__(self, preset: str, seed: int, layer_scale: float) -> None:
        """``layer_scale`` as the plan resolved it (``model.layer_scale``: the preset's default unless the
        profile set one)."""
        self.preset, self.seed, self.layer_scale = preset, seed, layer_scale
        self.config: dict[str, Any] = preset_config(preset)
        self.args = ModelArgs.from_config(self.config)
        self.chain = chain_permutation(self.args.vocab_size, seed)
        self.out_scale = output_scale(self.args, self.layer_scale)

    def load(
        self,
        shapes: Shapes,
        device: Device,
        dtype: Any,
        progress: Progress | None = None,
        label: str = "",
        host: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        """Generate every tensor in ``shapes`` on ``device``; those named in ``host`` (a stage's routed
        experts behind an expert cache) into host memory instead, pinned on a GPU machine, with the same
        values (generated on the device one expert at a time, then copied down)."""
        total = sum(int(np.prod(s)) * np.dtype(dtype).itemsize for s in shapes.values())
        bar = progress(label or f"generating on {device}", total) if progress else None
        out: dict[str, Any] = {}
        with device.use():
            for name, shape in shapes.items():
                if name in host:
                    out[name] = self._host_tensor(name, shape, device, dtype)
                else:
                    out[name] = self.tensor(name, shape, device, dtype)
                if bar:
                    bar.advance(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        if bar:
            bar.close()
        return out

    def _host_tensor(self, name: str, shape: tuple[int, ...], device: Device, dtype: Any) -> np.ndarray:
        """A stacked [E, ...] tensor in host memory, generated on ``device`` an item at a time."""
        arr = host_empty(shape, dtype, pinned=device.is_cuda, near=device.index)
        item = tuple(shape[1:])
        std = self._std(name, shape)
        for e in range(shape[0]):
            part = device.empty(item, dtype)
            uniform_(part, tensor_seed(self.seed, name), std * _SQRT3, offset=e * int(np.prod(item)))
            arr[e] = device.to_host(part)
        return arr

    def tensor(self, name: str, shape: tuple[int, ...], device: Device, dtype: Any) -> Any:
        """One named tensor, a pure function of (preset, seed, layer_scale, name)."""
        xp = device.xp
        h = self.args.hidden_size
        if name.endswith(("norm.weight", "layernorm.weight", "norm_embedding.weight", "norm_hidden.weight")):
            return xp.ones(shape, dtype=dtype)
        if name.endswith(".bias"):
            return xp.zeros(shape, dtype=dtype)
        if name == "model.embed_tokens.weight":
            return self._uniform(name, shape, device, dtype, 1.0)
        if name == "lm_head.weight":
            # Row u is the code of chain⁻¹(u), scaled so that the winning logit is about sqrt(H).
            codes = self._uniform("model.embed_tokens.weight", shape, device, dtype, 1.0)  # [V, H]
            inverse = np.argsort(self.chain)  # [V] chain⁻¹
            scale = np.full(shape[0], PRINTABLE_PULL / math.sqrt(h), dtype=np.float32)  # [V]
            scale[32:127] = 1.0 / math.sqrt(h)  # printable ASCII keeps the full scale
            return codes[xp.asarray(inverse)] * xp.asarray(scale.astype(dtype))[:, None]  # [V, H]
        if name == "mtp.fc.weight":
            fc = self._uniform(name, shape, device, dtype, self.out_scale / math.sqrt(h))  # [H, 2H]
            fc[:, :h] = xp.eye(h, dtype=dtype)  # the embedding half passes the token's code through
            return fc
        return self._uniform(name, shape, device, dtype, self._std(name, shape))

    def _std(self, name: str, shape: tuple[int, ...]) -> float:
        """The standard deviation of a plain random tensor: 1 / sqrt(fan in), times the layers' output
        scale for what they add to the residual stream."""
        std = 1.0 / math.sqrt(shape[-1])
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            std *= self.out_scale
        return std

    def _uniform(self, name: str, shape: tuple[int, ...], device: Device, dtype: Any, std: float) -> Any:
        out = device.empty(shape, dtype)
        return uniform_(out, tensor_seed(self.seed, name), std * _SQRT3)
