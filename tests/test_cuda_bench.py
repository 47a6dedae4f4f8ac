"""`strata bench` on a GPU, end to end: the step and vram workloads, and the ceilings of prompt and solo.

The demo's tiny synthetic model on cuda:0, with the GPU's real memory in the profile. Speed is not judged
(the model is far too small to say anything about it); what is checked is that each figure is measured and
agrees with the arithmetic the report states (a roofline is bytes over the measured rate, and so on).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    cp = pytest.importorskip("cupy")
    vram = cp.cuda.runtime.memGetInfo()[1] // (1 << 20)
    path = tmp_path_factory.mktemp("bench") / "gpu-tiny.toml"
    path.write_text(
        f"""name = "gpu-tiny"
[machine]
backend = "cuda"
gpus = [{{ name = "GPU", vram_mib = {vram}, bandwidth_gbs = 1000 }}]
[model]
synthetic = "tiny"
dtype = "float16"
[batch]
slots = 2
mtp = false
[spec]
draft_tokens = 0
[memory]
context = 512
prefill_chunk = 64
"""
    )
    return str(path)


def bench_run(profile: str, *args: str) -> tuple[dict, str]:
    """``strata bench PROFILE ARGS --json``: its figures, and what it said on stderr as it ran."""
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "bench", profile, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def bench(profile: str, *args: str) -> dict:
    return bench_run(profile, *args)[0]


def test_step_times_each_decode_attention_kernel_in_one_run(profile: str) -> None:
    """``--vary model.decode_attention``: the whole step with each kernel, interleaved in one model, at
    every row count; the tiny preset's shape takes tensor cores under ``"auto"``."""
    res = bench(profile, "--workload", "step", "--vary", "model.decode_attention=auto,cuda_cores")
    arms = res["kernel_arms"]
    names = ["profile@decode_attention:auto", "profile@decode_attention:cuda_cores"]
    assert arms["kernels"] == dict(zip(names, ["tensor cores", "CUDA cores"], strict=True))
    assert res["attention"] == "tensor cores (attn_tc)"  # the first plan's, for every other table
    assert [r["rows"] for r in arms["rows"]] == [1, 2, 4, 8]
    for r in arms["rows"]:
        assert list(r["ms"]) == names and min(r["ms"].values()) > 0
        assert all(len(t) == r["rows"] for t in r["tokens"].values())


def test_step_times_every_row_count_against_the_roofline(profile: str) -> None:
    res, said = bench_run(profile, "--workload", "step")
    # it says each part as it ends, in order (the whole takes minutes on a large model)
    parts = ["weights of 4 layers made", *(f"the step at {r} row" for r in (1, 2, 4, 8)), "the token choices"]
    at = [said.find(f"[step] {p}") for p in parts]
    assert -1 not in at and at == sorted(at), said
    assert res["device"] == "cuda:0" and res["model"]["layers"] == 4 and res["copy_gbs"] > 0
    assert [r["rows"] for r in res["rows"]] == [1, 2, 4, 8]
    copy = res["copy_gbs"] * 1e9
    for r in res["rows"]:
        assert r["eager_ms"] > 0 and r["graph_ms"] > 0
        assert r["bytes"]["total"] == sum(r["bytes"][k] for k in ("dense", "experts", "head", "kv"))
        # The roofline is the step's bytes over the copy rate measured in the same run, and the reported
        # fraction is that over the graph's time: both are arithmetic on the other figures.
        assert r["roofline_ms"] == pytest.approx(r["bytes"]["total"] / copy * 1e3)
        assert r["graph_of_roofline"] == pytest.approx(r["roofline_ms"] / r["graph_ms"])
        assert 2 <= r["distinct_experts_last_layer"] <= min(8, 2 * r["rows"])  # tiny: top-2 of 8 experts
    assert res["rows"][0]["distinct_experts_last_layer"] == 2
    kv = [r["bytes"]["kv"] for r in res["rows"]]
    assert kv == [kv[0] * r["rows"] for r in res["rows"]]  # each row reads its own KV at the same position
    assert set(res["per_kernel_us_per_layer"]) == {"1", "8"}
    for kernels in res["per_kernel_us_per_layer"].values():
        assert {"qkv+rope", "attention", "moe"} <= set(kernels) and min(kernels.values()) > 0
    nbytes, rates = res["per_kernel_bytes_per_layer"], res["per_kernel_gbs"]
    for rows, kernels in res["per_kernel_us_per_layer"].items():
        for name, us in kernels.items():  # each group's rate is its bytes over its time
            assert rates[rows][name] == pytest.approx(nbytes[rows][name] / us / 1e3)
    assert nbytes["8"]["qkv+rope"] == nbytes["1"]["qkv+rope"] > 0  # weights read once for every row
    assert nbytes["8"]["attention"] == 8 * nbytes["1"]["attention"]  # each row reads its own KV


def test_vram_reads_what_the_engine_holds_after_load_and_a_full_context_request(profile: str) -> None:
    res = bench(profile, "--workload", "vram")
    assert res["context"] == 512 and res["prompt_tokens"] + res["generated_tokens"] == 511
    (gpu,) = res["gpus"]
    assert gpu["device"] == "cuda:0" and gpu["planned_in_use_mib"] > 0
    assert gpu["after_load_mib"] > 0 and gpu["after_full_context_request_mib"] > 0
    ratio = gpu["after_load_mib"] / gpu["planned_in_use_mib"]  # both rounded to 0.1 MiB
    assert gpu["load_vs_plan"] + 1 == pytest.approx(ratio, rel=0.05)


def test_prompt_reports_the_measured_matrix_rate(profile: str) -> None:
    res = bench(profile, "--workload", "prompt", "--prompt-tokens", "400", "--repeats", "2")
    ceiling = res["ceiling"]
    arm = ceiling["arms"]["serial"]
    assert ceiling["matrix_flop_s"] > 1e12
    assert arm["flop_s"] == pytest.approx(arm["tok_s"] * ceiling["flops_per_token"])
    assert arm["of_matrix_rate"] == pytest.approx(arm["flop_s"] / ceiling["matrix_flop_s"])
    assert res["arms"]["serial"]["prompt"]["median"]["prompt_tokens"] == 400


def test_solo_reports_its_fraction_of_the_one_row_roofline(profile: str) -> None:
    res = bench(profile, "--workload", "solo", "--arms", "solo", "--tokens", "16", "--repeats", "1")
    ceiling = res["ceiling"]
    assert ceiling["copy_bytes_s"] > 1e11 and ceiling["roofline_tok_s"] > 0
    rate = res["arms"]["solo"]["solo"]["median"]["tok_s"]
    assert ceiling["arms"]["solo"]["of_one_row_roofline"] == pytest.approx(rate / ceiling["roofline_tok_s"])


def test_step_arms_script_times_every_arm_at_every_position(profile: str) -> None:
    """``scripts/step_arms.py`` on the GPU: the whole step with two splits of a row on tensor cores
    and on CUDA cores, at a position inside one run and one past it, each timed; the tiny preset's shape
    takes tensor cores."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "step_arms.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            profile,
            "--positions",
            "100,300",
            "--rows",
            "1,2",
            "--rounds",
            "1",
            "--repeats",
            "3",
            "--json",
            "kept=tc",
            "chunk=tc:0",
            "split=cuda_cores",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert [(r["position"], r["rows"]) for r in res["results"]] == [(100, 1), (100, 2), (300, 1), (300, 2)]
    for r in res["results"]:
        assert set(r["ms"]) == {"kept", "chunk", "split"} and min(r["ms"].values()) > 0
        assert all(len(t) == r["rows"] for t in r["tokens"].values())
    assert [a["split"] for a in res["arms"]] == ["", "0/16/128/64", ""]
