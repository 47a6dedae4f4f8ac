"""The roofline's byte arithmetic and a prompt's FLOPs, against sums written out by hand for a tiny model."""

from __future__ import annotations

import pytest

from strata_cfg.schema.facts import ModelFacts, expected_distinct_experts
from strata_runtime.bench.ceilings import decode_step_bytes, prompt_flops

# Two layers, the second dense: hidden 4, 2 query heads and 1 KV head of dim 2, 4 experts of width 3, top-2,
# dense MLP width 6, vocabulary 10, float16 (2 bytes).
TINY = ModelFacts(
    source="test",
    dtype="float16",
    vocab_size=10,
    hidden_size=4,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=2,
    intermediate_size=6,
    moe_intermediate_size=3,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=(1,),
)


def test_one_row_step_bytes_add_up_by_hand() -> None:
    attention = (4 * 4 + 2 * 4 * 2 + 4 * 4 + 2 * 2 + 2 * 4) * 2  # q, k+v, o, q/k norms, two RMSNorms: 120
    router = 4 * 4 * 2  # 32
    dense_mlp = 3 * 4 * 6 * 2  # 144
    expert = 3 * 4 * 3 * 2  # 72
    head = (10 * 4 + 4) * 2  # LM head and final norm: 88
    kv = 2 * 1 * 5 * (2 * 1 * 2 * 2)  # 2 layers x 1 row x 5 positions x (k and v, 1 head, dim 2, 2 bytes)

    step = decode_step_bytes(TINY, rows=1, positions=5, kv_dtype="float16")

    assert step.dense == 2 * attention + router + dense_mlp == 416
    assert step.sparse_layers == 1 and step.distinct_experts == 2
    assert step.experts == 2 * expert == 144
    assert step.head == head and step.kv == kv == 80
    assert step.total == 416 + 144 + 88 + 80
    assert step.seconds(728.0) == pytest.approx(1.0)
    assert step.arithmetic().endswith("total 728 B")
    assert step.arithmetic(728e3).endswith("/ 728 kB/s = 1 ms per step (1,000 rows/s)")


def test_more_rows_read_more_distinct_experts_and_more_kv() -> None:
    # Two rows of random top-2 routing over 4 experts reach 4 * (1 - (1/2)^2) = 3 experts on average.
    assert expected_distinct_experts(4, 2, 2) == pytest.approx(3.0)
    step = decode_step_bytes(TINY, rows=2, positions=5)
    assert step.experts == 3 * 72 and step.kv == 2 * 80
    counted = decode_step_bytes(TINY, rows=2, positions=5, distinct_experts=4)
    assert counted.experts == 4 * 72


def test_prompt_flops_by_hand() -> None:
    n = 3
    attention_params = 4 * 4 + 2 * 4 * 2 + 4 * 4  # 48 per layer
    sparse = 4 * 4 + 2 * 3 * 4 * 3  # router + the 2 experts a token runs: 88
    dense = 3 * 4 * 6  # 72
    flops = prompt_flops(TINY, n)
    assert flops.weights == 2 * (2 * attention_params + sparse + dense) == 512
    assert flops.attention == 2 * 2 * 2 * 2 * 2 * ((n + 1) / 2)  # layers x (qk + pv) x 2 FLOPs x heads x dim
    assert flops.head == pytest.approx(2 * 10 * 4 / n)
    assert flops.total == pytest.approx(512 + 64 + 80 / 3)
    assert flops.arithmetic().startswith("603 FLOP per token (weights 512 FLOP + attention 64 FLOP")
