"""The MTP head's 8-bit LM head (``spec.draft_head = "int8"``): how it rounds, the logits it gives, and an
engine that drafts through it (greedy text the same, sampled text with the same distribution)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from rt_engine_helpers import generate, two_sample_p
from rt_plans import make_plan

from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.models.ops.int8 import linear_int8, quantize_rows


def _weights(seed: int, n: int, k: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    w = (g.standard_normal((n, k)) * 0.05).astype(np.float16)
    w[5] = 0  # a row of zeros
    w[7] *= 40  # a row far larger than the rest
    return w


def test_each_row_rounds_to_its_own_scale_in_any_number_of_blocks() -> None:
    w = _weights(1, 70, 96)
    q, scale = quantize_rows(np, w, rows_at_once=16)
    w32 = w.astype(np.float32)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert scale[5] == 1 and not q[5].any()  # zeros stay zeros
    live = np.arange(70) != 5
    assert np.allclose(scale[live], np.abs(w32[live]).max(axis=1) / 127, rtol=1e-6)
    assert (np.abs(q[live]).max(axis=1) == 127).all()  # each row's largest weight takes the full range
    assert (np.abs(q.astype(np.float32) * scale[:, None] - w32) <= scale[:, None] * (0.5 + 1e-4)).all()
    whole = quantize_rows(np, w)
    assert np.array_equal(whole[0], q) and np.array_equal(whole[1], scale)


def test_the_logits_are_the_rounded_weights_products_within_the_rounding_bound() -> None:
    """`linear_int8` (the kernel's NumPy twin, in blocks of rows) gives x @ (q * scale).T, and each logit
    lies within half a step of each weight times |x| of the fp16 head's; the top token mostly stays."""
    w = _weights(2, 3000, 256)
    x = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    q, scale = quantize_rows(np, w)
    out = np.full((6, 3000), np.nan, np.float32)
    linear_int8(np, q, scale, x, out)
    rounded = x @ (q.astype(np.float32) * scale[:, None]).T
    assert np.allclose(out, rounded, rtol=1e-5, atol=1e-5)
    exact = x @ w.astype(np.float32).T
    bound = 0.5 * scale[None, :] * np.abs(x).sum(axis=1)[:, None]
    assert (np.abs(out - exact) <= bound + 1e-4).all()
    assert (np.abs(out - exact) > 0).any()  # it is not the fp16 head
    assert (out.argmax(axis=1) == exact.argmax(axis=1)).sum() >= 5


def _with_head(plan: LaunchPlan, head: str) -> LaunchPlan:
    return plan.model_copy(update={"spec": plan.spec.model_copy(update={"draft_head": head})})


PROMPTS = [b"The river", b"A second, longer prompt here", b"x" * 20]


@pytest.mark.parametrize(("stages", "slots", "batch_mtp"), [(1, 1, False), (2, 2, True)])
def test_drafting_through_the_8bit_head_gives_the_same_greedy_text(stages, slots, batch_mtp) -> None:
    """The 8-bit head only proposes: the text is the shared head's, and its proposals hold about as often
    (the tiny model's drafts are close enough to its own choices that most hold either way)."""
    plan = make_plan(
        stages=stages,
        slots=slots,
        batch_mtp=batch_mtp,
        draft_tokens=4,
        context=160,
        prefill_chunk=16,
        adaptive_depth=False,
    )
    int8, shared = Engine(_with_head(plan, "int8")), Engine(plan)
    head = int8.model.mtp.draft_head
    assert head is not None and shared.model.mtp.draft_head is None
    assert head.nbytes == plan.model.facts.int8_head_bytes()
    rows = np.random.default_rng(4).standard_normal((2, plan.model.facts.hidden_size)).astype(np.float32)
    mine, theirs = int8.model.mtp.logits(rows), shared.model.mtp.logits(rows)
    assert mine.shape == theirs.shape and not np.array_equal(mine, theirs)  # drafts read the 8-bit head
    bound = 0.5 * head.scale[None, :] * np.abs(rows).sum(axis=1)[:, None]  # half a step a weight
    assert (np.abs(mine - theirs) <= bound + 1e-4).all()
    for prompt in PROMPTS:
        assert generate(int8, tuple(prompt), 40) == generate(shared, tuple(prompt), 40)
    made, held = int8.totals["proposals"], int8.totals["accepted"]
    assert made > 0 and held >= 0.8 * shared.totals["accepted"], (held, shared.totals["accepted"])


def _first_tokens(eng: Engine, requests: int) -> Counter[tuple[int, ...]]:
    seen: Counter[tuple[int, ...]] = Counter()
    for seed in range(requests):
        h = eng.submit(Request(tuple(PROMPTS[0]), 3, SamplingParams(temperature=1.0, top_k=3, seed=seed)))
        while eng.step():
            pass
        seen[tuple(t for _ in range(h.events.qsize()) for t in h.events.get().token_ids)] += 1
    return seen


def test_sampled_drafting_through_the_8bit_head_keeps_the_models_distribution() -> None:
    """Over 1,200 seeds, a request's first three tokens (one window's accepted proposals and the draw after
    them) come out as often drafted through the 8-bit head as without drafting: a proposal is drawn from the
    8-bit head's distribution and accepted against that same distribution."""
    pytest.importorskip("torch")  # for the chi-square survival function
    kw = {"stages": 1, "context": 96, "prefill_chunk": 8, "adaptive_depth": False}
    drafting = Engine(_with_head(make_plan(draft_tokens=3, **kw), "int8"))
    plain = Engine(make_plan(draft_tokens=0, **kw))
    looked, without = _first_tokens(drafting, 1200), _first_tokens(plain, 1200)
    assert drafting.totals["accepted"] > 0
    p_value, dof = two_sample_p(looked, without)
    assert dof >= 10 and p_value > 1e-3, f"{dof} degrees of freedom, p = {p_value:.2e}"
