"""A trainable torch Qwen3-MoE with a Qwen3-Next style MTP head, for `train_demo_model.py`.

The forward pass is the one ``strata_runtime/models/qwen3_moe.py`` and transformers' ``Qwen3MoeForCausalLM``
compute (pre-norm layers, GQA with per-head q/k RMSNorm before NeoX RoPE, fp32 softmax routing to the top-k
experts renormalised, SwiGLU experts), and the MTP head is the one ``strata_runtime/model/mtp.py`` runs.
Module attribute names follow the checkpoint names, so `export_tensors` only has to split the fused experts
into the per-expert layout (``experts.{e}.{gate,up,down}_proj.weight``) that both transformers 4 and 5 read.

The MTP head is trained as the runtime drafts. At position q it reads the embedding of token q+1 and the
main model's post-final-norm hidden state at q, and predicts token q+2 (step 1). A chained draft (step k > 1)
reads the head's own output of step k-1 at q-1 instead of the hidden state, and attends, as the drafter's
KV cache holds it then, to step 1's keys up to position q-k+1 and to steps 2..k's keys at q-k+2..q.

Dimension letters: B batch, T positions, H hidden, N query heads, K kv heads, D head dim, E experts,
I expert width, V vocab, S chained steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    """The model's sizes, written to ``config.json`` by `config_json`."""

    vocab_size: int = 384
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096


def config_json(shape: Shape, eos_token_id: int) -> dict[str, Any]:
    """A ``Qwen3MoeForCausalLM`` config; ``num_nextn_predict_layers`` tells the runtime about the MTP head."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        # Every layer is sparse; transformers still wants the dense width.
        "intermediate_size": 4 * shape.moe_intermediate_size,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 1,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float16",
    }


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` with fp32 statistics."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(shape: Shape, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, D/2], as transformers computes them (fp32 inverse frequencies)."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))  # [D/2]
    freqs = torch.arange(positions, device=device).float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on x [B, N, T, D]: the first and second halves of each head rotate together."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        n, k, d, h = s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.hidden_size
        self.q_proj = nn.Linear(h, n * d, bias=False)
        self.k_proj = nn.Linear(h, k * d, bias=False)
        self.v_proj = nn.Linear(h, k * d, bias=False)
        self.o_proj = nn.Linear(n * d, h, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, s.rms_norm_eps), RMSNorm(d, s.rms_norm_eps)
        self.n, self.k, self.d = n, k, d

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, N, T, D], and k, v [B, N, T, D] with each kv head repeated for its query heads."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n, self.d)).transpose(1, 2)  # [B, N, T, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.k, self.d)).transpose(1, 2)  # [B, K, T, D]
        v = self.v_proj(x).view(b, t, self.k, self.d).transpose(1, 2)  # [B, K, T, D]
        g = self.n // self.k  # query head h reads kv head h // g
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [B, N, T, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n * self.d))  # [B, T, H]


def chained_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Step S's attention (S = len(keys)) as the drafter's KV cache holds it for a chained draft.

    Row q attends to step 1's keys at positions <= q-S+1 and to step m's key at q-S+m (m = 2..S); keys and
    values are [B, N, T, D], each step's computed at every position. Rows near the start whose earlier steps
    do not exist see only what does (their losses are masked by the caller).
    """
    steps, t = len(keys), q.shape[2]
    pos = torch.arange(t, device=q.device)
    scores = [(q @ keys[0].transpose(-1, -2)) * scale]  # [B, N, T, T]
    allowed = pos[None, :] <= pos[:, None] - (steps - 1)  # [T, T]
    scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
    shifted_values = []
    for m in range(2, steps + 1):
        lag = steps - m  # step m's row at q - lag
        k_m = F.pad(keys[m - 1], (0, 0, lag, 0))[:, :, :t]  # [B, N, T, D]
        v_m = F.pad(values[m - 1], (0, 0, lag, 0))[:, :, :t]  # [B, N, T, D]
        s = ((q * k_m).sum(-1) * scale).masked_fill(pos < lag, float("-inf"))  # [B, N, T]
        scores.append(s[..., None])
        shifted_values.append(v_m)
    probs = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)  # [B, N, T, T + S - 1]
    out = probs[..., :t] @ values[0]  # [B, N, T, D]
    for j, v_m in enumerate(shifted_values):
        out = out + probs[..., t + j, None] * v_m
    return out


class SparseMoeBlock(nn.Module):
    """Router, top-k in fp32 renormalised, experts fused as [E, 2I, H] (gate first) and [E, H, I]."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        e, i, h = s.num_experts, s.moe_intermediate_size, s.hidden_size
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.top_k = s.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output [B, T, H] and its load-balancing loss (Switch Transformer style)."""
        shape, h = x.shape, x.shape[-1]
        rows = x.reshape(-1, h)  # [R, H]
        probs = self.gate(rows).float().softmax(-1)  # [R, E]
        top_w, top_idx = probs.topk(self.top_k, dim=-1)  # [R, k]
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(rows)  # [R, H]
        i = self.down_proj.shape[2]
        for e in range(self.gate_up_proj.shape[0]):
            row, choice = (top_idx == e).nonzero(as_tuple=True)  # assignments to expert e
            if row.numel() == 0:
                continue
            gu = rows[row] @ self.gate_up_proj[e].T  # [c, 2I]
            y = (F.silu(gu[:, :i]) * gu[:, i:]) @ self.down_proj[e].T  # [c, H]
            out.index_add_(0, row, y * top_w[row, choice, None])
        experts = probs.shape[-1]
        load = F.one_hot(top_idx, experts).float().sum((0, 1)) / top_idx.numel()  # [E]
        balance = experts * (load * probs.mean(0)).sum()
        return out.view(shape), balance


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.mlp = SparseMoeBlock(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, Any]:
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.feed_forward(x)

    def feed_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, balance = self.mlp(self.post_attention_layernorm(x))
        return x + y, balance


class MtpHead(nn.Module):
    """``mtp.*``: two pre-fc norms, fc (2H -> H), one decoder layer, a final norm; the LM head is shared."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        h = s.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, s.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, s.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(s)])
        self.norm = RMSNorm(h, s.rms_norm_eps)
        self.scale = s.head_dim**-0.5

    def chain(
        self, embedded: torch.Tensor, hidden: torch.Tensor, steps: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each step's post-norm output [B, T, H] for rows (embedding of token q+1 [B, T, H], hidden at q),
        and the summed load-balancing loss."""
        layer = self.layers[0]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        balance = hidden.new_zeros(())
        e = self.pre_fc_norm_embedding(embedded)  # [B, T, H]
        for step in range(steps):
            if step:  # the previous step's output at q-1 stands in for the hidden state at q
                hidden = F.pad(outs[-1], (0, 0, 1, 0))[:, :-1]  # [B, T, H]
            x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [B, T, H]
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            keys.append(k)
            values.append(v)
            if step == 0:
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = chained_attention(q, keys, values, self.scale)
            x, b = layer.feed_forward(x + layer.self_attn.merge(att))
            outs.append(self.norm(x))
            balance = balance + b
        return outs, balance


class Model(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.shape = s
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(s) for _ in range(s.num_hidden_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.mtp = MtpHead(s)
        self._init()

    def _init(self) -> None:
        """GPT-2 style: N(0, 0.02), with the projections into the residual stream scaled down by depth."""
        g = torch.Generator().manual_seed(0)
        deep = (2 * (self.shape.num_hidden_layers + 1)) ** -0.5
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                std = 0.02 * (deep if name.endswith(("o_proj.weight", "down_proj")) else 1.0)
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The main model: post-final-norm hidden states [B, T, H], logits [B, T, V], and the mean
        load-balancing loss of its MoE blocks."""
        cos, sin = rope_tables(self.shape, tokens.shape[1], tokens.device)
        x = self.embed_tokens(tokens)  # [B, T, H]
        balance = x.new_zeros(())
        for layer in self.layers:
            x, b = layer(x, cos, sin)
            balance = balance + b
        hidden = self.norm(x)  # [B, T, H]: the LM head's input and the MTP head's
        return hidden, self.lm_head(hidden), balance / len(self.layers)

    def draft(
        self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each MTP step's logits [B, T-1, V] (row q predicts token q+2) from the main model's hidden
        states [B, T, H], and the mean load-balancing loss of the MTP layer."""
        t = tokens.shape[1]
        cos, sin = rope_tables(self.shape, t - 1, tokens.device)
        embedded = self.embed_tokens(tokens[:, 1:])  # [B, T-1, H]: token q+1 for row q
        outs, balance = self.mtp.chain(embedded, hidden[:, :-1], steps, cos, sin)
        return [self.lm_head(o) for o in outs], balance / steps


def _checkpoint_name(name: str) -> str:
    """A module's parameter name as the checkpoint spells it (the main model's under ``model.``)."""
    return name if name.startswith(("mtp.", "lm_head.")) else "model." + name


def export_tensors(model: Model) -> dict[str, torch.Tensor]:
    """Checkpoint names and layouts: ``model.*``, ``lm_head.weight`` and ``mtp.*``, experts per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        full = _checkpoint_name(name)
        if name.endswith("mlp.gate_up_proj"):
            base = full.removesuffix("gate_up_proj") + "experts"
            i = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = p[e, :i]
                out[f"{base}.{e}.up_proj.weight"] = p[e, i:]
        elif name.endswith("mlp.down_proj"):
            base = full.removesuffix("down_proj") + "experts"
            for e in range(p.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = p[e]
        else:
            out[full] = p
    return {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in out.items()}


def import_tensors(model: Model, tensors: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint written by `export_tensors` (float16 widened to float32)."""
    own: dict[str, torch.Tensor] = {}
    experts = range(model.shape.num_experts)
    for name in model.state_dict():
        full = _checkpoint_name(name)
        if name.endswith("mlp.gate_up_proj"):
            base = full.removesuffix("gate_up_proj") + "experts"
            own[name] = torch.stack(
                [
                    torch.cat(
                        [tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"]]
                    )
                    for e in experts
                ]
            )
        elif name.endswith("mlp.down_proj"):
            base = full.removesuffix("down_proj") + "experts"
            own[name] = torch.stack([tensors[f"{base}.{e}.down_proj.weight"] for e in experts])
        else:
            own[name] = tensors[full]
    model.load_state_dict({k: v.float() for k, v in own.items()})
