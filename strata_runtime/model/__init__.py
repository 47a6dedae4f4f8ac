"""The model as the plan places it: stages of layers on their devices, the MTP head, and the KV caches.

`placed` builds the whole model from a plan (`Model.from_plan`) and runs a window through its stages;
`stage` is one device's run of layers with their KV; `mtp` is the MTP head and each slot's drafter;
`kvcache` is the per-slot KV with rewind; `adjust` keeps every slot's token counts and logit bias on the last
stage's device.
"""

from ..models.ops.adjust import PROMPT_SEEN, Adjusts, adjust_row, mask_logits
from ..models.ops.choose import Draws
from ..models.ops.distribution import distribution, inv_temperature, inverse_cdf, log_min_p, verify_sampled
from .placed import Model

__all__ = [
    "PROMPT_SEEN",
    "Adjusts",
    "Draws",
    "Model",
    "adjust_row",
    "distribution",
    "inv_temperature",
    "inverse_cdf",
    "log_min_p",
    "mask_logits",
    "verify_sampled",
]
