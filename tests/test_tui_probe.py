"""A new profile from a machine probe: nvidia-smi's CSV parsed, a profile that resolves, its guesses said."""

from __future__ import annotations

import secrets
import tomllib

from strata_cfg.plan.from_profile import resolve_text
from strata_cfg.tui.probe import probe_profile_text, run_probe

H200_SMI = "0, NVIDIA H200, 143771\n"
"""What ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` printed on an
H200."""


def test_a_probed_h200_becomes_a_profile_that_resolves_on_it():
    result = run_probe(lambda: H200_SMI)
    text = probe_profile_text("h200-box", result)
    assert tomllib.loads(text)["machine"]["gpus"] == [
        {"name": "NVIDIA H200", "vram_mib": 143771, "bandwidth_gbs": 4800}
    ]
    plan = resolve_text(text, "profiles/h200-box.toml").plan
    assert plan.profile == "h200-box" and [g.vram_mib for g in plan.machine.gpus] == [143771]
    assert plan.serve is not None and plan.serve.host == "127.0.0.1"


def test_several_gpus_get_an_auto_split_and_an_unknown_card_is_flagged():
    vram = [4096 * (1 + secrets.randbelow(8)) for _ in range(3)]
    names = ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", "Mystery Card"]
    csv = "".join(f"{i}, {name}, {v}\n" for i, (name, v) in enumerate(zip(names, vram, strict=True)))
    text = probe_profile_text("box", run_probe(lambda: csv), schema="./strata-profile.schema.json")
    assert text.startswith("#:schema ./strata-profile.schema.json\n")
    data = tomllib.loads(text)
    assert data["split"]["layers"] == "auto"
    assert [g["vram_mib"] for g in data["machine"]["gpus"]] == vram
    assert data["description"] == "2x NVIDIA GeForce RTX 4090, Mystery Card"
    mystery = next(line for line in text.splitlines() if "Mystery Card" in line and "vram_mib" in line)
    assert "bandwidth is a guess" in mystery
    assert len(resolve_text(text, "box.toml").plan.machine.gpus) == 3


def test_a_failed_probe_gives_a_virtual_cpu_profile_that_says_why():
    def no_driver() -> str:
        raise OSError(
            "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the driver"
        )

    result = run_probe(no_driver)
    assert result.gpus == () and "couldn't communicate with the driver" in (result.error or "")
    text = probe_profile_text("laptop", result)
    assert "couldn't communicate with the driver" in text.splitlines()[0]
    plan = resolve_text(text, "laptop.toml").plan
    assert plan.machine.backend == "cpu" and plan.stages[0].device == "cpu:0"
    assert run_probe(lambda: "").error == "the probe found no GPUs"
