"""The packaged demo model (``strata_cfg/data/models/austen``): transformers reads it as the runtime does.

transformers' ``Qwen3MoeForCausalLM`` loads the shipped float16 checkpoint (per-expert tensors; it ignores the
``mtp.*`` ones) in float32, as the runtime computes on virtual CPU devices. On an English prompt, encoded
byte by byte as the runtime's tokenizer does, the logits must agree at the parity test's tolerance
(tests/test_rt_parity.py: 1e-4 relative) on the demo's two stages, and 32 greedy tokens must be the same.
The prompt's next bytes must also be far likelier than a random model makes them: it was trained.

The MTP head has no transformers reference, so the training script's own torch model
(``scripts/demo_torch_model.py``), loaded from the shipped tensors, is held to the runtime's drafting: the
first step from the model's hidden states, and two chained steps from the head's own output, each attending
to what the drafter's KV cache holds then. That pins the script to the runtime, so a retrained model drafts
as it was trained to.
"""

from __future__ import annotations

import numpy as np
import pytest
from rt_plans import make_plan
from script_loader import load_script

from strata_cfg.schema.packaged import packaged_dir
from strata_runtime.api import Request
from strata_runtime.engine import Engine
from strata_runtime.layout import Layout
from strata_runtime.model import Model
from strata_runtime.weights.tokenizer import tokenizer_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

AUSTEN = packaged_dir("austen")
PROMPT = "It was a fine morning at Uppercross, and the two sisters walked out together"
STEPS = 32
CROSS_ENTROPY = 2.5
"""Nats per byte of the prompt that the trained model must beat."""


@pytest.fixture(scope="module")
def hf() -> object:
    return transformers.Qwen3MoeForCausalLM.from_pretrained(AUSTEN, dtype=torch.float32).eval()


def test_the_runtime_reads_the_demo_model_with_its_byte_tokenizer() -> None:
    """No tokenizer.json: the runtime's byte tokenizer, which needs no optional package, is the model's."""
    tok = tokenizer_for(str(AUSTEN), 384)
    assert type(tok).__name__ == "ByteTokenizer" and tok.encode(PROMPT) == list(PROMPT.encode())


def test_logits_and_greedy_tokens_match_transformers(hf: object) -> None:
    prompt = list(PROMPT.encode())
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()  # [P, V]
        ref_tokens = hf.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()

    plan = make_plan(model_dir=AUSTEN, stages=2, context=256, prefill_chunk=32)
    model = Model.from_plan(plan)
    logits = model.logits(model.forward(np.array(prompt), Layout.of([(0, len(prompt), 0)])))  # [P, V]
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)  # [P-1, V]
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nats = -log_probs[np.arange(len(prompt) - 1), prompt[1:]].mean()
    assert nats < CROSS_ENTROPY, f"{nats:.2f} nats per byte"  # a random model: about ln(384) = 5.95

    engine = Engine(plan)
    handle = engine.submit(Request(tuple(prompt), STEPS))
    while engine.step():
        pass
    tokens = [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]
    assert tokens == ref_tokens


def _training_model() -> object:
    module = load_script("demo_torch_model")
    from safetensors.torch import load_file

    model = module.Model(module.Shape()).eval()
    module.import_tensors(model, load_file(AUSTEN / "model.safetensors"))
    return model


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_the_training_scripts_drafting_is_the_runtimes() -> None:
    prompt = list(PROMPT.encode())
    q = len(prompt) - 4  # the drafter has caught up on positions [0, q); chained steps run at q and q + 1
    with torch.no_grad():
        tm = _training_model()
        tokens = torch.tensor([prompt])
        hidden, main, _ = tm(tokens)
        drafts, _ = tm.draft(tokens, hidden, 3)
        steps = [s[0].numpy() for s in drafts]  # each [P-1, V]: row r predicts token r + 2

    model = Model.from_plan(make_plan(model_dir=AUSTEN, stages=2, context=256, draft_tokens=4))
    normed = model.forward(np.array(prompt), Layout.of([(0, len(prompt), 0)]))  # [P, H]
    assert _rel(model.logits(normed), main[0].numpy()) < 1e-4
    drafter = {0: model.drafters[0]}
    out1 = model.mtp(drafter, np.array(prompt[1 : q + 1]), normed[:q], Layout.of([(0, q, 0)]))  # [q, H]
    out2 = model.mtp(drafter, np.array([prompt[q + 1]]), out1[q - 1 :], Layout.of([(0, 1, q)]))  # [1, H]
    out3 = model.mtp(drafter, np.array([prompt[q + 2]]), out2, Layout.of([(0, 1, q + 1)]))  # [1, H]
    assert _rel(model.mtp.logits(out1), steps[0][:q]) < 1e-4
    assert _rel(model.mtp.logits(out2)[0], steps[1][q]) < 1e-4
    assert _rel(model.mtp.logits(out3)[0], steps[2][q + 1]) < 1e-4
