"""The whole model as the plan places it: stages on their devices, the MTP head and drafters on the last.

`Model.from_plan` loads (or generates) each stage's tensors straight onto that stage's device. `forward`
runs a window through every stage in order, moving its hidden rows from device to device; the engine's
pipelined schedule calls `Stage.forward` itself instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from strata_cfg.schema.plan import LaunchPlan

from ..api import PlanMismatch, Tokenizer
from ..backend import DTYPES, Array, Device, enable_peer_access, transfer
from ..layout import Layout
from ..models.qwen3_moe import ModelArgs, stage_shapes
from ..weights.checkpoint import Checkpoint, load_tensors
from ..weights.progress import Progress
from ..weights.synthetic import SyntheticModel
from ..weights.tokenizer import ByteTokenizer, tokenizer_for
from .mtp import Drafter, MtpHead
from .stage import Stage

WeightStore = dict[tuple[Any, ...], dict[str, Array]]
"""Each stage's tensors by what determines them (model, device, layers, dtype, shapes), so that models of one
profile with the same stage layout (benchmark arms) hold one copy of the weights."""


def compute_dtypes(plan: LaunchPlan, device: Device) -> tuple[DTypeLike, DTypeLike]:
    """(weight/activation dtype, KV dtype) on ``device``: the plan's on GPUs, float32 on CPU devices."""
    if not device.is_cuda:
        return np.float32, np.float32
    out = []
    for what, name in (("model.dtype", plan.model.facts.dtype), ("memory.kv_dtype", plan.memory.kv_dtype)):
        if name not in DTYPES:
            raise PlanMismatch(
                f'{what} = {name!r}: CuPy has no {name} arrays; use "float16" (bfloat16 checkpoints are '
                "converted on load)"
            )
        out.append(DTYPES[name])
    return out[0], out[1]


def _check_facts(plan: LaunchPlan, args: ModelArgs) -> None:
    facts = plan.model.facts
    for field in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
    ):
        planned, actual = getattr(facts, field), getattr(args, field)
        if planned != actual:
            raise PlanMismatch(
                f"the plan was resolved for {field} = {planned}, but the model has {actual}; resolve again"
            )


class Model:
    """Stages in order, plus the MTP head and one drafter per slot on the last stage's device."""

    def __init__(
        self,
        stages: list[Stage],
        args: ModelArgs,
        mtp: MtpHead | None,
        drafters: dict[int, Drafter],
        tokenizer: Tokenizer,
    ) -> None:
        self.stages, self.args, self.mtp, self.drafters = stages, args, mtp, drafters
        self.tokenizer = tokenizer
        self.peer_access: list[str] = []
        """One line per pair of stage GPUs: whether they copy to each other directly."""

    @property
    def last(self) -> Stage:
        return self.stages[-1]

    @classmethod
    def from_plan(
        cls, plan: LaunchPlan, progress: Progress | None = None, weights: WeightStore | None = None
    ) -> Model:
        """Build the plan's model. ``weights`` (optional) shares tensors between models of the same stage
        layout, so that benchmark arms of one profile hold one copy of the weights."""
        devices = [Device.parse(s.device) for s in plan.stages]
        for d in dict.fromkeys(devices):
            d.check()
        peer_access = enable_peer_access(devices)
        if plan.model.synthetic is not None:
            if plan.model.layer_scale is None:
                raise PlanMismatch("a synthetic preset without model.layer_scale: resolve the plan again")
            synth = SyntheticModel(plan.model.synthetic, plan.model.seed, plan.model.layer_scale)
            config, ckpt = synth.config, None
        elif plan.model.path is not None:
            ckpt = Checkpoint(plan.model.path)
            config, synth = ckpt.config, None
        else:
            raise PlanMismatch("the plan names neither a model path nor a synthetic preset")
        args = ModelArgs.from_config(config)
        _check_facts(plan, args)
        has_mtp = plan.model.facts.mtp_layers > 0
        drafting = plan.spec.mtp or plan.batch.mtp
        if drafting and not has_mtp:
            raise PlanMismatch("the plan drafts with MTP, but the model has no MTP weights")
        slots, context = max(plan.batch.slots, 1), plan.memory.context
        stages: list[Stage] = []
        tensors: dict[str, Array] = {}
        for sp, device in zip(plan.stages, devices, strict=True):
            first, last = sp.index == 0, sp.index == len(plan.stages) - 1
            dtype, kv_dtype = compute_dtypes(plan, device)
            shapes = stage_shapes(args, sp.layers, first=first, last=last, mtp=last and drafting)
            label = f"stage {sp.index} on {device}"
            key = (
                plan.model.model_dump_json(),
                str(device),
                sp.layers,
                first,
                last,
                str(np.dtype(dtype)),
                tuple(shapes),
            )
            if weights is not None and key in weights:
                tensors = weights[key]
            elif synth is not None:
                tensors = synth.load(shapes, device, dtype, progress, label)
            else:
                assert ckpt is not None
                tensors = load_tensors(ckpt, shapes, device, dtype, progress, label)
            if weights is not None:
                weights[key] = tensors
            stages.append(
                Stage(
                    sp.index,
                    device,
                    sp.layers,
                    args,
                    tensors,
                    first=first,
                    last=last,
                    slots=slots,
                    context=context,
                    kv_dtype=kv_dtype,
                )
            )
        mtp, drafters = None, {}
        last_stage = stages[-1]
        if drafting:
            dtype, kv_dtype = compute_dtypes(plan, last_stage.device)
            first_stage = stages[0]

            def embed(ids: np.ndarray) -> Array:
                return transfer(first_stage.embed(ids), first_stage.device, last_stage.device)

            mtp = MtpHead(tensors, args, last_stage.device, last_stage.rope, last_stage.lm_head, embed)
            ids = list(plan.last_stage.drafters) or list(range(slots))
            shared = None
            if last_stage.device.is_cuda:
                # One MTP KV [1, S, K, T, D] for every drafter (each keeps a view of its slot), so that one
                # CUDA graph can serve draft windows of any slots.
                shape = (1, slots, args.num_key_value_heads, context, args.head_dim)
                shared = (last_stage.device.zeros(shape, kv_dtype), last_stage.device.zeros(shape, kv_dtype))
                if mtp.use_cuda(*shared) is not None:
                    shared = None
            drafters = {
                s: Drafter(
                    s,
                    last_stage.device,
                    args,
                    context,
                    dtype,
                    kv_dtype,
                    kv_arrays=(shared[0][:, s : s + 1], shared[1][:, s : s + 1]) if shared else None,
                )
                for s in ids
            }
        if ckpt is not None:
            tokenizer = tokenizer_for(str(ckpt.directory), args.vocab_size, config)
        else:
            tokenizer = ByteTokenizer(args.vocab_size)
        model = cls(stages, args, mtp, drafters, tokenizer)
        model.peer_access = peer_access
        return model

    # ---- running windows ---------------------------------------------------------------------------

    def forward(self, tokens: np.ndarray, layout: Layout) -> Array:
        """A window through every stage: post-final-norm hidden rows [R, H] on the last stage's device."""
        hidden = self.stages[0].embed(tokens)  # [R, H]
        prev = self.stages[0].device
        for stage in self.stages:
            hidden = stage.forward(transfer(hidden, prev, stage.device), layout)  # [R, H]
            prev = stage.device
        return self.last.final_norm(hidden)

    def logits(self, normed: Array) -> Array:
        return self.last.logits(normed)

    def rewind(self, slot: int, length: int) -> None:
        """Forget positions [length, ...) of ``slot`` on every stage."""
        for stage in self.stages:
            stage.kv.rewind(slot, length)

    def kv_lengths(self, slot: int) -> list[int]:
        return [int(s.kv.lengths[slot]) for s in self.stages]
