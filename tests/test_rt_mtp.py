"""The MTP head against a small float64 reference written here, independent of the runtime's code.

transformers drops MTP weights, so the reference is this file: norms on the embedding and on the hidden
state, fc on cat[norm(emb), norm(hidden)] (in that order), one decoder layer (GQA attention with q/k norm and
NeoX RoPE, top-k MoE), mtp.norm, and the shared LM head. The head's weights are re-drawn at random (norm
weights too), so a swapped concatenation or a missing norm cannot pass.
"""

from __future__ import annotations

import numpy as np
from rt_plans import make_plan

from strata_runtime.api import SamplingParams
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.speculative import commit, draft
from strata_runtime.layout import Layout
from strata_runtime.model import Model


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


class ReferenceLayer:
    """One decoder layer in float64 with its own growing KV."""

    def __init__(self, layer, args) -> None:
        f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
        at, mlp = layer.self_attn, layer.mlp
        self.w = {n: f(getattr(at, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        self.ln1, self.ln2 = f(layer.input_layernorm), f(layer.post_attention_layernorm)
        self.router, self.gu, self.down = f(mlp.gate), f(mlp.experts.gate_up_proj), f(mlp.experts.down_proj)
        self.a = args
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def __call__(self, x: np.ndarray, pos: int) -> np.ndarray:
        a, w = self.a, self.w
        n, k, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = rms(x, self.ln1, a.rms_norm_eps)
        q = rope(rms((w["q_proj"] @ h).reshape(n, d), w["q_norm"], a.rms_norm_eps), pos, a.rope_theta)
        key = rope(rms((w["k_proj"] @ h).reshape(k, d), w["k_norm"], a.rms_norm_eps), pos, a.rope_theta)
        del self.keys[pos:], self.values[pos:]
        self.keys.append(key)
        self.values.append((w["v_proj"] @ h).reshape(k, d))
        keys, values = np.stack(self.keys, 1), np.stack(self.values, 1)  # [K, L, D]
        out = np.empty((n, d))
        for head in range(n):
            kv = head // (n // k)
            s = keys[kv] @ q[head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[head] = (p / p.sum()) @ values[kv]
        x = x + w["o_proj"] @ out.reshape(-1)
        h = rms(x, self.ln2, a.rms_norm_eps)
        logits = self.router @ h
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[: a.num_experts_per_tok]
        weights = probs[top] / (probs[top].sum() if a.norm_topk_prob else 1.0)
        i = self.down.shape[2]
        moe = np.zeros_like(x)
        for e, wt in zip(top, weights, strict=True):
            gu = self.gu[e] @ h
            moe += wt * (self.down[e] @ (gu[:i] / (1 + np.exp(-gu[:i])) * gu[i:]))
        return x + moe


def test_mtp_head_and_chained_drafts_match_a_float64_reference() -> None:
    model = Model.from_plan(make_plan(stages=2, draft_tokens=4, context=64))
    mtp, args = model.mtp, model.args
    rng = np.random.default_rng(42)
    layer = mtp.layer
    for arr in (
        mtp.pre_fc_norm_embedding,
        mtp.pre_fc_norm_hidden,
        mtp.norm,
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.self_attn.q_norm,
        layer.self_attn.k_norm,
    ):
        arr[...] = rng.uniform(0.5, 1.5, arr.shape)
    mtp.fc[...] = rng.standard_normal(mtp.fc.shape) / np.sqrt(mtp.fc.shape[1])

    prompt = rng.integers(32, 127, size=9)
    nxt = int(rng.integers(32, 127))
    normed = model.forward(prompt, Layout.of([(0, len(prompt), 0)]))  # [n, H] post-final-norm
    commit(model, 0, 0, len(prompt), normed, [*prompt[1:].tolist(), nxt], tracked=True)
    proposals = draft(model, 0, nxt, 3, Sampler(SamplingParams(), 0))

    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    emb, head = f64(model.stages[0].embed_tokens), f64(model.last.lm_head)
    ref_layer = ReferenceLayer(layer, args)
    eps = args.rms_norm_eps

    def step(token: int, hidden: np.ndarray, pos: int) -> np.ndarray:
        x = f64(mtp.fc) @ np.concatenate(
            [
                rms(emb[token], f64(mtp.pre_fc_norm_embedding), eps),
                rms(hidden, f64(mtp.pre_fc_norm_hidden), eps),
            ]
        )
        return rms(ref_layer(x, pos), f64(mtp.norm), eps)

    following = [*prompt[1:].tolist(), nxt]
    for pos in range(len(prompt)):  # catch-up over the prompt: (token t+1, main hidden at t)
        out = step(following[pos], f64(normed[pos]), pos)
    drafter = model.drafters[0]
    chain, pos = [], len(prompt)
    for j in range(3):
        logits = head @ out
        rel = np.abs(drafter.logits[j] - logits).max() / np.abs(logits).max()
        assert rel < 1e-4, f"draft {j}: relative error {rel:.2e}"
        chain.append(int(np.argmax(logits)))
        out = step(chain[-1], out, pos)  # chained: the head's own post-norm output is the next hidden
        pos += 1
    assert proposals.tokens == chain


def test_sampled_drafts_for_a_window_decided_on_the_device_are_drawn_there_as_the_host_draws_them(
    monkeypatch,
) -> None:
    """A host-launched window that the device decides recomputes q there, so its sampled proposals are drawn
    on the drafters' device: the same tokens as the host's draw at the same uniforms, without the
    vocabulary-wide row coming back and without a host q. A request with a penalty, or a window the host
    verifies, still draws on the host, with q."""
    from strata_runtime.backend import Device

    model = Model.from_plan(make_plan(stages=1, draft_tokens=4, context=64))
    rng = np.random.default_rng(5)
    prompt = rng.integers(32, 127, size=9)
    nxt = int(rng.integers(32, 127))
    normed = model.forward(prompt, Layout.of([(0, len(prompt), 0)]))
    commit(model, 0, 0, len(prompt), normed, [*prompt[1:].tolist(), nxt], tracked=True)
    fetched: list[tuple[int, ...]] = []
    real = Device.to_host
    monkeypatch.setattr(Device, "to_host", lambda self, a: fetched.append(tuple(a.shape)) or real(self, a))
    vocab = model.last.lm_head.shape[0]

    def run(params: SamplingParams, on_device: bool):
        fetched.clear()
        drafter = model.drafters[0]
        kept = drafter.length
        out = draft(model, 0, nxt, 3, Sampler(params, 17), on_device)
        drafter.rewind(kept)  # the drafts ran the head on; the next run starts where this one did
        return out, [s for s in fetched if vocab in s]

    hot = SamplingParams(temperature=1.5, top_k=40, top_p=0.95)
    host, host_rows = run(hot, False)
    here, rows = run(hot, True)
    assert here.tokens == host.tokens and len(set(host.tokens)) > 1
    assert len(host.q) == 3 and host_rows and not here.q and not rows
    penalised = SamplingParams(temperature=1.5, top_k=40, presence_penalty=0.5)
    kept, kept_rows = run(penalised, True)
    assert len(kept.q) == 3 and kept_rows
