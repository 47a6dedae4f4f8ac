"""llama.cpp as a peer of `strata bench`: the model written as GGUF (read back tensor by tensor), the tools'
command lines and output, and the arm end to end with a stand-in ``llama-bench`` on PATH (CPU)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.bench import llamacpp
from strata_runtime.bench.gguf_export import ExportError, gguf_name, write_gguf
from strata_runtime.bench.peer import model_config

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The demo profile's model (the packaged demo checkpoint) as an engine holds it, every stage's tensors
    together, and its config.json."""
    from strata_runtime.engine import Engine
    from strata_runtime.model.placed import WeightStore

    plan = resolve_profile("profiles/demo.toml")
    weights = WeightStore()
    Engine(plan, weights=weights)
    tensors = {k: np.asarray(v) for st in weights.stages.values() for k, v in st.tensors.items()}
    return model_config(plan), tensors


def _read(path: Path) -> tuple[Any, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: np.asarray(t.data) for t in reader.tensors}


def _field(reader: Any, key: str) -> Any:
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]


def test_the_gguf_holds_every_tensor_as_llama_cpp_names_it(tmp_path: Path, tiny) -> None:
    config, tensors = tiny
    path = tmp_path / "tiny.gguf"
    written = write_gguf(path, config, tensors, "tiny")
    reader, out = _read(path)
    layers, experts, inter = (
        config["num_hidden_layers"],
        config["num_experts"],
        config["moe_intermediate_size"],
    )
    assert _field(reader, "general.architecture") == "qwen3moe"
    assert _field(reader, "qwen3moe.block_count") == layers
    assert _field(reader, "qwen3moe.expert_count") == experts
    assert _field(reader, "qwen3moe.expert_used_count") == config["num_experts_per_tok"]
    assert _field(reader, "qwen3moe.expert_feed_forward_length") == inter
    assert _field(reader, "qwen3moe.attention.key_length") == config["head_dim"]
    assert _field(reader, "qwen3moe.vocab_size") == config["vocab_size"]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"  # the runtime's byte-level ids (next test)
    attention = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"]
    per_block = [*attention, "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    want = {f"blk.{j}.{n}.weight" for j in range(layers) for n in per_block}
    assert set(out) == want | {"token_embd.weight", "output_norm.weight", "output.weight"}  # no MTP head
    assert written == sum(a.nbytes for a in out.values())
    for name, arr in tensors.items():
        mapped = gguf_name(name)
        if mapped is not None:
            np.testing.assert_array_equal(out[mapped], arr.astype(out[mapped].dtype))
            assert out[mapped].dtype == (np.float16 if arr.ndim > 1 else np.float32)
    # The fused gate/up [E, 2I, H] becomes llama.cpp's separate gate and up stacks [E, I, H].
    gate_up = tensors["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(out["blk.1.ffn_gate_exps.weight"], gate_up[:, :inter].astype(np.float16))
    np.testing.assert_array_equal(out["blk.1.ffn_up_exps.weight"], gate_up[:, inter:].astype(np.float16))


def _strings(reader: Any, key: str) -> list[str]:
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode() for i in f.data]


def test_the_gguf_carries_the_runtimes_byte_level_ids_or_only_the_vocabulary_size(
    tmp_path: Path, tiny
) -> None:
    """A byte-level model's GGUF names every id as the runtime's tokenizer reads it, so llama.cpp's ids
    and text are the runtime's: byte b as byte-level BPE's character for b with no merge that could join
    two, the specials as control tokens, the rest unused; a checkpoint with a tokenizer of its own gets
    none, only the vocabulary size."""
    from strata_runtime.bench.gguf_export import NEVER_MERGED
    from strata_runtime.weights.tokenizer import ByteTokenizer

    config, tensors = tiny
    write_gguf(tmp_path / "b.gguf", config, tensors, "tiny")
    reader = gguf.GGUFReader(str(tmp_path / "b.gguf"))
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    assert len(tokens) == len(types) == config["vocab_size"] > 259
    assert (
        _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "default"
    )
    # GPT-2's byte table: printable bytes stand for themselves, the rest for U+0100 on, in byte order.
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "\u0120" and tokens[ord("\n")] == "\u010a"
    assert tokens[0] == "\u0100" and tokens[0xAD] == "\u0143" and tokens[0xFF] == "\u00ff"
    assert len(set(tokens[:256])) == 256 and set(types[:256]) == {gguf.TokenType.NORMAL}
    assert _strings(reader, "tokenizer.ggml.merges") == [NEVER_MERGED]
    first, second = NEVER_MERGED.split(" ")
    assert first in ByteTokenizer.SPECIALS and second in ByteTokenizer.SPECIALS  # never a piece of text
    tok = ByteTokenizer(config["vocab_size"])
    for text, i in ByteTokenizer.SPECIALS.items():
        assert tokens[i] == text and types[i] == gguf.TokenType.CONTROL and tok.encode(text) == [i]
    assert set(types[259:]) == {gguf.TokenType.UNUSED} and tok.decode(list(range(259, len(tokens)))) == ""
    assert len(set(tokens)) == len(tokens)  # every id its own token
    assert _field(reader, "tokenizer.ggml.eos_token_id") == ByteTokenizer.SPECIALS["<|endoftext|>"]
    assert _field(reader, "tokenizer.ggml.eot_token_id") == ByteTokenizer.SPECIALS["<|im_end|>"]
    assert set(tok.eos_ids) == {ByteTokenizer.SPECIALS["<|endoftext|>"], ByteTokenizer.SPECIALS["<|im_end|>"]}
    assert not _field(reader, "tokenizer.ggml.add_bos_token")
    write_gguf(tmp_path / "n.gguf", config, tensors, "tiny", vocabulary="none")
    reader = gguf.GGUFReader(str(tmp_path / "n.gguf"))
    assert _field(reader, "tokenizer.ggml.model") == "none" and "tokenizer.ggml.tokens" not in reader.fields
    assert _field(reader, "qwen3moe.vocab_size") == config["vocab_size"]


def test_a_checkpoint_with_its_own_tokenizer_is_written_without_a_vocabulary(tmp_path: Path) -> None:
    from types import SimpleNamespace as NS

    from strata_runtime.bench.gguf_export import vocabulary_of

    (tmp_path / "tokenizer.json").write_text("{}")
    assert vocabulary_of(NS(model=NS(path=str(tmp_path)))) == "none"  # type: ignore[arg-type]
    assert vocabulary_of(NS(model=NS(path=str(tmp_path / "elsewhere")))) == "bytes"  # type: ignore[arg-type]
    assert vocabulary_of(resolve_profile("profiles/demo.toml")) == "bytes"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"shared_expert_intermediate_size": 64}, "shared expert"),
        ({"mlp_only_layers": [1]}, "dense MLP layers"),
        ({"norm_topk_prob": False}, "renormalises"),
        ({"attention_bias": True}, "attention biases"),
    ],
)
def test_a_model_llama_cpp_would_compute_otherwise_is_refused(tmp_path: Path, tiny, change, says) -> None:
    config, tensors = tiny
    with pytest.raises(ExportError, match=says):
        write_gguf(tmp_path / "x.gguf", {**config, **change}, tensors, "tiny")
    assert not (tmp_path / "x.gguf").exists()


def test_a_missing_tensor_is_named(tmp_path: Path, tiny) -> None:
    config, tensors = tiny
    partial = {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.k_proj.weight"}
    with pytest.raises(ExportError, match=r"blk\.2\.attn_k\.weight"):
        write_gguf(tmp_path / "x.gguf", config, partial, "tiny")


def test_tools_are_found_on_path_and_their_absence_skips_in_one_line() -> None:
    found = llamacpp.find_tools(lambda t: f"/opt/{t}" if t == "llama-bench" else None)
    assert found == {"llama-bench": "/opt/llama-bench"}
    assert "is on PATH" in str(llamacpp.skip_reason({}, "solo"))
    assert llamacpp.skip_reason(found, "solo") is None
    assert "llama-batched-bench" in str(llamacpp.skip_reason(found, "two-decodes"))
    assert "no counterpart" in str(llamacpp.skip_reason(found, "read-beside-decode"))


def test_each_workload_runs_the_matching_llama_cpp_test() -> None:
    tools = {"llama-bench": "lb", "llama-batched-bench": "lbb"}

    def cmds(workload: str) -> list[list[str]]:
        asked = llamacpp.Workload(workload, 64, 4096, 3, (1, 2, 4, 8))
        return [c for _, c in llamacpp.commands(tools, "m.gguf", asked)]

    (solo,) = cmds("solo")
    assert solo[0] == "lb" and solo[solo.index("-n") + 1] == "64" and solo[solo.index("-p") + 1] == "0"
    assert solo[solo.index("-ngl") + 1] == llamacpp.FULL_OFFLOAD and solo[solo.index("-r") + 1] == "3"
    (prompt,) = cmds("prompt")
    assert prompt[prompt.index("-p") + 1] == "4096" and prompt[prompt.index("-n") + 1] == "0"
    one, many = cmds("clients")
    assert one[0] == "lb" and many[0] == "lbb" and many[many.index("-npl") + 1] == "2,4,8"
    assert int(many[many.index("-c") + 1]) >= 8 * (llamacpp.BATCHED_PROMPT + 64)
    assert many[many.index("-npp") + 1] == str(llamacpp.BATCHED_PROMPT)
    (two,) = cmds("two-decodes")
    assert two[two.index("-npl") + 1] == "2"
    # Given the runtime's prompt length, each stream reads a prompt that long (and the context holds them).
    short = llamacpp.Workload("clients", 64, 0, 3, (1, 2, 4, 8), stream_prompt=17)
    _, many = [c for _, c in llamacpp.commands(tools, "m.gguf", short)]
    assert many[many.index("-npp") + 1] == "17" and int(many[many.index("-c") + 1]) >= 8 * (17 + 64)


def test_a_peer_stream_reads_a_prompt_as_long_as_the_runtimes_requests() -> None:
    """llama-batched-bench's streams read prompts of the runtime's requests' mean length, so both decode
    from KV of the same length."""
    from strata_cfg.schema.workloads import PROMPTS
    from strata_runtime.bench.harness import mean_prompt_tokens
    from strata_runtime.weights.tokenizer import ByteTokenizer

    tok = ByteTokenizer(512)
    lengths = [len(tok.encode(text)) for text in PROMPTS]
    assert mean_prompt_tokens("clients", tok, 64, 512, len(PROMPTS)) == round(sum(lengths) / len(lengths))
    assert mean_prompt_tokens("clients", tok, 64, 512, 1) == lengths[0]
    assert mean_prompt_tokens("two-decodes", tok, 64, 512, 8) == round((lengths[0] + lengths[1]) / 2)
    assert mean_prompt_tokens("prompt", tok, 64, 512, 1) == 1  # no decoding request


def _done(stdout: str, rc: int = 0, stderr: str = "") -> SimpleNamespace:
    return SimpleNamespace(returncode=rc, stdout=stdout, stderr=stderr)


BENCH_TG = json.dumps([{"n_prompt": 0, "n_gen": 64, "avg_ts": 212.5}])
BATCHED = "\n".join(
    [
        "main: n_kv_max = 1600",
        *(json.dumps({"pp": 128, "tg": 64, "pl": n, "speed_tg": 100.0 * n}) for n in (2, 4, 8)),
    ]
)


def test_clients_pair_each_stream_count_with_llama_cpp_and_a_failure_is_a_note() -> None:
    tools = {"llama-bench": "lb", "llama-batched-bench": "lbb"}
    outputs = {"lb": _done(BENCH_TG), "lbb": _done(BATCHED)}
    asked = llamacpp.Workload("clients", 64, 0, 2, (1, 2, 4, 8))
    run = llamacpp.run_peer(tools, "m.gguf", asked, run=lambda cmd, **kw: outputs[cmd[0]])
    assert run.figures[1].what == "2 streams, pp128 tg64"
    assert [(f.case, f.tok_s) for f in run.figures] == [
        ("1 clients", 212.5),
        ("2 clients", 200.0),
        ("4 clients", 400.0),
        ("8 clients", 800.0),
    ]
    ours = {"1 clients": {"median": {"tok_s": 425.0}}, "8 clients": {"median": {"tok_s": 400.0}}}
    lines = llamacpp.render(run, {"serial": ours})
    assert any("1 clients" in ln and "= 2.00x" in ln for ln in lines)
    assert any("8 clients" in ln and "= 0.50x" in ln for ln in lines)
    # llama.cpp's decode rate leaves out reading the prompts: beside it goes our generation rate.
    ours["8 clients"]["median"]["generation_tok_s"] = 1000.0
    lines = llamacpp.render(run, {"serial": ours})
    assert any("8 clients" in ln and "1,000.0 tok/s generating = 1.25x" in ln for ln in lines)
    # Every arm goes beside each figure, each with its ratio.
    other = {"8 clients": {"median": {"tok_s": 1600.0}}}
    lines = llamacpp.render(run, {"serial": ours, "batch": other})
    eight = [ln for ln in lines if "-> " in ln and ("8 clients" in ln or ln.startswith(" " * 20))]
    assert any("-> serial 1,000.0" in ln for ln in eight) and any(
        "-> batch 1,600.0 tok/s = 2.00x" in ln for ln in eight
    )
    assert llamacpp.ratios(run, {"serial": ours, "batch": other}) == {
        "serial": {"1 clients": 2.0, "8 clients": 1.25},
        "batch": {"8 clients": 2.0},
    }
    solo = llamacpp.Workload("solo", 64, 0, 2, ())
    failed = llamacpp.run_peer(
        tools, "m.gguf", solo, run=lambda cmd, **kw: _done("", 1, "error: unknown model architecture")
    )
    assert failed.figures == [] and failed.notes == [
        "llama-bench exited 1: error: unknown model architecture"
    ]


STAND_IN = """\
#!{python}
# A stand-in llama-bench: checks the model it is given as llama.cpp's loader would start to, then reports.
import json, sys
import gguf
args = sys.argv[1:]
model = gguf.GGUFReader(args[args.index("-m") + 1])
names = {{t.name for t in model.tensors}}
assert "blk.0.ffn_gate_exps.weight" in names and "token_embd.weight" in names, names
n_gen = int(args[args.index("-n") + 1])
print(json.dumps([{{"n_prompt": 0, "n_gen": n_gen, "avg_ts": 1.0}}]))
"""


def test_bench_runs_llama_cpp_beside_its_arm_on_the_model_it_writes(tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "llama-bench"
    tool.parent.mkdir()
    tool.write_text(STAND_IN.format(python=sys.executable))
    tool.chmod(0o755)
    keep = tmp_path / "model.gguf"
    env = {**os.environ, "PATH": f"{tool.parent}{os.pathsep}{os.environ['PATH']}"}
    args = ["bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo", "--repeats", "1"]
    args += ["--tokens", "8", "--peer", "llama.cpp", "--gguf", str(keep)]
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "llama.cpp on the same weights" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "tg8" in ln)
    assert "1.0 tok/s" in line and "-> solo" in line
    assert keep.stat().st_size > 0 and f"wrote {keep}" in out.stderr
    # Run again: the kept file holds the plan's weights, so it is reused, not written again.
    before = keep.stat().st_mtime_ns
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    assert f"reusing {keep}, written from the plan's weights" in out.stderr and "tg8" in out.stdout
    assert keep.stat().st_mtime_ns == before
    # Without the tools the peer is skipped in one line and the arm still runs.
    bare = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=300, env=bare
    )
    assert out.returncode == 0, out.stderr
    skipped = "[llama.cpp] skipped: none of llama-bench, llama-batched-bench or llama-server is on PATH"
    assert skipped in out.stderr
    assert "llama.cpp on the same weights" not in out.stdout


def test_strata_gguf_writes_the_profiles_model_once(tmp_path: Path, tiny) -> None:
    """`strata gguf PROFILE OUT` writes the engine's own weights; an existing file is never overwritten."""
    out = tmp_path / "demo.gguf"
    cmd = [sys.executable, "-m", "strata_cfg", "gguf", "profiles/demo.toml", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "as llama.cpp's qwen3moe" in done.stdout and "byte-level vocabulary" in done.stdout
    reader, written = _read(out)
    assert f"weights {_field(reader, 'strata.weights')}: " in done.stdout
    assert _field(reader, "general.architecture") == "qwen3moe"
    _, tensors = tiny
    np.testing.assert_array_equal(
        written["blk.0.attn_q.weight"], tensors["model.layers.0.self_attn.q_proj.weight"].astype(np.float16)
    )
    before = out.stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr and not again.stdout
    assert out.stat().st_mtime_ns == before


def test_without_the_gguf_package_the_export_says_how_to_install_it(
    tmp_path: Path, tiny, monkeypatch
) -> None:
    config, tensors = tiny
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ExportError, match=r"needs the gguf package: pip install 'strata-cfg\[gguf\]'"):
        write_gguf(tmp_path / "x.gguf", config, tensors, "tiny")


def test_a_disk_without_room_is_refused_before_anything_is_written(tmp_path: Path, tiny, monkeypatch) -> None:
    import shutil

    from strata_runtime.bench import gguf_export

    config, tensors = tiny
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(gguf_export.shutil, "disk_usage", lambda _: usage._replace(free=1 << 20))
    with pytest.raises(ExportError, match=r"GiB and .* has 0\.0 GiB free"):
        write_gguf(tmp_path / "x.gguf", config, tensors, "tiny")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ExportError, match="there is no folder"):
        write_gguf(tmp_path / "absent" / "x.gguf", config, tensors, "tiny")


def test_a_write_that_fails_midway_leaves_no_half_model_where_a_later_run_would_reuse_it(
    tmp_path: Path, tiny, monkeypatch
) -> None:
    """`--gguf PATH` reuses a file that exists, so a failed write (a full disk, Ctrl-C) must leave PATH as it
    was: absent, or the earlier complete file."""
    config, tensors = tiny
    path = tmp_path / "x.gguf"
    write = gguf.GGUFWriter.write_tensor_data
    calls = []

    def fail_on_the_third(self, data, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return write(self, data, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fail_on_the_third)
    with pytest.raises(OSError, match="No space"):
        write_gguf(path, config, tensors, "tiny")
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"an earlier complete file")
    calls.clear()
    with pytest.raises(OSError, match="No space"):
        write_gguf(path, config, tensors, "tiny")
    assert [p.name for p in tmp_path.iterdir()] == [
        "x.gguf"
    ] and path.read_bytes() == b"an earlier complete file"
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write)
    write_gguf(path, config, tensors, "tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]
    assert _field(_read(path)[0], "general.architecture") == "qwen3moe"


def test_llama_cpp_runs_on_the_plans_gpus_split_by_layer_in_the_plans_proportions() -> None:
    """A plan split 20 / 28 over two GPUs: llama.cpp sees those GPUs alone, in stage order (through this
    process's own CUDA_VISIBLE_DEVICES where set), and splits by layer 20 / 28, in each tool's syntax; one
    GPU: only that GPU, no split; CPU devices: no GPU at all."""
    from strata_cfg.plan.from_profile import resolve_profile

    split = resolve_profile("profiles/h200-x2.toml", ["split.layers=[20]"])
    place = llamacpp.Placement.of_plan(split, {})
    assert place.gpus == (0, 1) and place.layers == (20, 28)
    assert llamacpp.Placement.of_plan(split, {}).environment() == {"CUDA_VISIBLE_DEVICES": "0,1"}
    seen = llamacpp.Placement.of_plan(split, {"CUDA_VISIBLE_DEVICES": "5, 3"})
    assert seen.environment() == {"CUDA_VISIBLE_DEVICES": "5,3"}
    with pytest.raises(ValueError, match="not all among CUDA_VISIBLE_DEVICES=6"):
        llamacpp.Placement.of_plan(split, {"CUDA_VISIBLE_DEVICES": "6"})
    tools = {"llama-bench": "lb", "llama-batched-bench": "lbb"}
    asked = llamacpp.Workload("clients", 64, 0, 2, (1, 2, 4), placement=place)
    (_, bench), (_, batched) = llamacpp.commands(tools, "m.gguf", asked)
    assert bench[bench.index("-sm") + 1] == "layer" and bench[bench.index("-ts") + 1] == "20/28"
    assert batched[batched.index("-ts") + 1] == "20,28"

    one = llamacpp.Placement.of_plan(resolve_profile("profiles/h200.toml"), {})
    assert one.gpus == (0,) and one.environment() == {"CUDA_VISIBLE_DEVICES": "0"} and one.split("/") == []
    cpu = llamacpp.Placement.of_plan(resolve_profile("profiles/demo.toml"), {})
    assert cpu.gpus == () and cpu.environment() == {"CUDA_VISIBLE_DEVICES": ""}
    assert llamacpp.Placement().environment() == {}  # unknown: llama.cpp chooses


def test_each_llama_cpp_tool_runs_in_the_placements_environment_and_is_shown_with_it() -> None:
    from strata_cfg.plan.from_profile import resolve_profile

    place = llamacpp.Placement.of_plan(resolve_profile("profiles/h200-x2.toml"), {})
    tools = {"llama-bench": "lb", "llama-batched-bench": "lbb"}
    envs: dict[str, str] = {}
    outputs = {"lb": _done(BENCH_TG), "lbb": _done(BATCHED)}

    def run(cmd: list[str], **kw: Any) -> SimpleNamespace:
        envs[cmd[0]] = kw["env"]["CUDA_VISIBLE_DEVICES"]
        return outputs[cmd[0]]

    asked = llamacpp.Workload("clients", 64, 0, 2, (1, 2, 4, 8), placement=place)
    peer = llamacpp.run_peer(tools, "m.gguf", asked, run=run)
    assert envs == {"lb": "0,1", "lbb": "0,1"}
    assert [c[:2] for c in peer.commands] == [
        ["CUDA_VISIBLE_DEVICES=0,1", "lb"],
        ["CUDA_VISIBLE_DEVICES=0,1", "lbb"],
    ]
    assert any("ran: CUDA_VISIBLE_DEVICES=0,1 lb" in line for line in llamacpp.render(peer, {"serial": {}}))


def test_a_kept_gguf_is_reused_only_for_the_weights_it_was_written_from(tmp_path: Path, tiny) -> None:
    """A file written with a plan's fingerprint stands for that plan's model alone: another seed of the
    same synthetic preset, another layer scale or another dtype is refused, naming the file and what to
    do; a file another tool wrote (no fingerprint) is taken as it is."""
    from strata_runtime.bench.gguf_export import fingerprint, kept_file, write_gguf

    config, tensors = tiny
    plan = resolve_profile("profiles/h200.toml")
    mine = tmp_path / "mine.gguf"
    write_gguf(mine, config, tensors, "demo", weights_from=fingerprint(plan))
    assert kept_file(mine, plan) == (
        True,
        f"reusing {mine}, written from the plan's weights ({fingerprint(plan)})",
    )
    for change in ("model.seed=7", "model.layer_scale=0.5", 'model.dtype="bfloat16"'):
        other = resolve_profile("profiles/h200.toml", [change])
        usable, line = kept_file(mine, other)
        assert not usable and f"{mine} holds other weights" in line and "pass another --gguf" in line, change
    theirs = tmp_path / "theirs.gguf"
    write_gguf(theirs, config, tensors, "demo")
    usable, line = kept_file(theirs, plan)
    assert usable and "another tool wrote" in line
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    usable, line = kept_file(tmp_path / "junk.gguf", plan)
    assert not usable and "cannot read" in line


def test_experts_that_do_not_fit_stay_in_host_memory_in_llama_cpp_as_in_the_plan() -> None:
    """Two 20 GB GPUs that hold 15 layers' routed experts each: llama.cpp keeps the routed experts of each
    GPU's other layers in host memory (its tensor override, whose pattern matches exactly those layers'
    expert tensors in the GGUF's names), in every tool, and says so in a note; all experts in VRAM: none."""
    import re

    from strata_cfg.plan.from_profile import resolve_profile

    plan = resolve_profile("profiles/rtx3080-20g-x2.toml")
    place = llamacpp.Placement.of_plan(plan, {})
    e = plan.model.facts.num_experts
    fits = {g.index: g.experts_resident // e for g in plan.gpus}
    expected = [j for s in plan.stages for j in range(s.layers[0] + fits[s.gpu], s.layers[1])]
    assert list(place.host_experts) == expected and 0 < len(expected) < 48
    tools = {"llama-bench": "lb", "llama-batched-bench": "lbb"}
    asked = llamacpp.Workload("clients", 64, 0, 2, (1, 2, 4), placement=place)
    (_, bench), (_, batched) = llamacpp.commands(tools, "m.gguf", asked)
    pattern = bench[bench.index("-ot") + 1]
    assert batched[batched.index("-ot") + 1] == pattern and pattern.endswith("=CPU")
    regex = re.compile(pattern.removesuffix("=CPU"))
    for j in range(48):
        for part in ("gate", "up", "down"):
            assert bool(regex.search(f"blk.{j}.ffn_{part}_exps.weight")) == (j in expected), (j, part)
        assert not regex.search(f"blk.{j}.attn_q.weight") and not regex.search(f"blk.{j}.ffn_gate_inp.weight")
    peer = llamacpp.run_peer(tools, "m.gguf", asked, run=lambda cmd, **kw: _done(BENCH_TG))
    assert any(f"routed experts of {len(expected)} layers stay in host memory" in n for n in peer.notes)
    assert llamacpp.Placement.of_plan(resolve_profile("profiles/h200.toml"), {}).offload() == []


def test_the_runtimes_device_memory_is_given_back_before_llama_cpp_loads_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`strata bench --peer llama.cpp` runs llama.cpp's tools where no arm holds the GPU: where its GGUF file
    must be written from the arms' weights, only after that and after the arms' engines and weights are
    gone, each device's pool released; where the file is ready, before any arm is built. On a GPU whose
    model takes over half its memory, llama.cpp's own copy would not fit beside ours."""
    import argparse
    import gc
    import weakref

    from strata_cfg.plan.from_profile import resolve_path
    from strata_cfg.schema.plan_file import write_plan
    from strata_runtime.backend import Device
    from strata_runtime.commands import bench
    from strata_runtime.engine import Engine

    live: weakref.WeakSet[Engine] = weakref.WeakSet()
    built = [0]  # engines built by the run (set to 0 before each)
    init = Engine.__init__

    def recording(self: Engine, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        live.add(self)
        built[0] += 1

    released: list[str] = []

    def release(self: Device) -> None:  # no collection here: what is alive now keeps its memory
        released.append(f"{self} with {len(live)} engine(s) alive")

    monkeypatch.setattr(Engine, "__init__", recording)
    monkeypatch.setattr(Device, "release_memory", release)
    keep = tmp_path / "model.gguf"
    seen: dict[str, Any] = {}

    def run_peer(tools: dict[str, str], path: str, asked: Any, **kw: Any) -> llamacpp.PeerRun:
        gc.collect()
        seen.update(
            engines=len(live), built=built[0], written=Path(path).stat().st_size, released=sorted(released)
        )
        return llamacpp.PeerRun([llamacpp.Figure("solo", "tg8", 1.0)])

    monkeypatch.setattr(llamacpp, "find_tools", lambda: {"llama-bench": "llama-bench"})
    monkeypatch.setattr(llamacpp, "run_peer", run_peer)
    plan = write_plan(resolve_path("profiles/demo.toml", ("batch.slots=1",)).plan, tmp_path / "solo.json")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--arm", f"solo={plan}", "--workload", "solo", "--repeats", "1", "--tokens", "8"]
    args = parser.parse_args([*argv, "--peer", "llama.cpp", "--gguf", str(keep)])
    assert bench.run(args) == 0
    written = keep.stat().st_size
    assert written > 0 and seen == {
        "engines": 0,
        "built": 1,
        "written": written,
        "released": ["cpu:0 with 0 engine(s) alive", "cpu:1 with 0 engine(s) alive"],
    }
    # Run again: the file is ready, so llama.cpp runs first, before any arm is built, and nothing is released.
    built[0] = 0
    released.clear()
    assert bench.run(args) == 0
    assert seen == {"engines": 0, "built": 0, "written": written, "released": []}
    assert built[0] == 1  # the arm ran after it


def test_llama_cpp_is_not_started_where_the_closed_arms_left_too_little_room_and_the_bench_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the GGUF file had to be written after the arms and the plan's GPUs then have less free memory
    than the file holds, llama.cpp is not started (it would fail to load): the peer is skipped in one line
    that says how to run it before the arms instead, and the arm's figures still come."""
    import argparse

    from strata_cfg.plan.from_profile import resolve_path
    from strata_cfg.schema.plan_file import write_plan
    from strata_runtime.backend import Device
    from strata_runtime.commands import bench

    started: list[str] = []
    monkeypatch.setattr(Device, "release_memory", lambda self: None)
    monkeypatch.setattr(Device, "memory_free", lambda self: (1 << 20, 80 << 30))  # 1 MiB free a device
    monkeypatch.setattr(llamacpp, "find_tools", lambda: {"llama-bench": "llama-bench"})
    monkeypatch.setattr(llamacpp, "run_peer", lambda *a, **kw: started.append("llama-bench"))
    plan = write_plan(resolve_path("profiles/demo.toml", ("batch.slots=1",)).plan, tmp_path / "solo.json")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    keep = tmp_path / "model.gguf"
    argv = ["--arm", f"solo={plan}", "--workload", "solo", "--repeats", "1", "--tokens", "8", "--json"]
    args = parser.parse_args([*argv, "--peer", "llama.cpp", "--gguf", str(keep)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.run(args) == 0
    report = json.loads(out.getvalue())
    skipped = report["peers"]["llama.cpp"]["skipped"]
    assert started == [] and "GiB free, less than the model's" in skipped and f"--gguf {keep}" in skipped
    assert report["arms"]["solo"]["solo"]["median"]["tok_s"] > 0
