"""The plan's model as a GGUF file, so that llama.cpp runs the very same weights (`strata bench --peer
llama.cpp`, `strata gguf`).

The tensors are the ones an engine of the plan was built from (a synthetic preset's generated weights or a
checkpoint's), renamed to llama.cpp's ``qwen3moe`` layout: q/k/v/o and their norms per block, the router as
``ffn_gate_inp``, the routed experts as stacked ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps`` (the
fused gate/up [E, 2I, H] split in two). Matrices are written in fp16 and vectors in fp32, one tensor at a
time, so a model larger than host memory streams through. The MTP head is left out: llama.cpp's
``qwen3moe`` has none.

The vocabulary written is the runtime's byte-level one, for the models that use it (the synthetic presets
and checkpoints without a ``tokenizer.json``, such as the packaged demo): ids 0-255 are bytes, the three
special tokens that follow are control tokens (``<|endoftext|>`` and ``<|im_end|>`` end a generation),
and every other id is an unused placeholder, written as llama.cpp's byte-level BPE without merges. So
llama.cpp cuts a text into the same ids as the runtime and writes the same text back. A
checkpoint with its own ``tokenizer.json`` gets llama.cpp's "no vocabulary" type with the model's vocabulary
size, which is all ``llama-bench`` needs (it feeds random token ids); to serve or chat with a real
checkpoint in llama.cpp, convert it with llama.cpp's own converter, which also carries its tokenizer.

Each file carries `FINGERPRINT_KEY`: what its weights were made from (`fingerprint`), so that a file kept
for later runs (``strata bench --gguf PATH``) is reused only for the model it holds.

The ``gguf`` package (llama.cpp's own writer) is needed only here: ``pip install 'strata-cfg[gguf]'``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from strata_cfg.schema.plan import LaunchPlan

from ..model.placed import WeightStore
from ..weights.progress import Progress
from ..weights.tokenizer import ByteTokenizer, byte_level_chars
from .peer import model_config

ARCH = "qwen3moe"
VOCABULARIES = ("bytes", "none")
"""What `write_gguf` writes as the vocabulary: the runtime's byte-level tokens, or none (its size only)."""

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


class ExportError(ValueError):
    """The model cannot be written as llama.cpp's ``qwen3moe``; the message says why."""


def unsupported(config: Mapping[str, Any]) -> str | None:
    """Why llama.cpp's ``qwen3moe`` would compute something else than this model, or None."""
    if config.get("attention_bias"):
        return "attention biases (llama.cpp's qwen3moe has none)"
    if config.get("shared_expert_intermediate_size"):
        return "a shared expert (llama.cpp's qwen3moe has none)"
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        return "dense MLP layers between the MoE layers (llama.cpp's qwen3moe makes every layer MoE)"
    if not config.get("norm_topk_prob", True):
        return "top-k weights not renormalised (llama.cpp's qwen3moe always renormalises them)"
    return None


def gguf_name(name: str) -> str | None:
    """llama.cpp's name for the runtime tensor ``name`` (None: not written, e.g. the MTP head's)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    if not name.startswith("model.layers."):
        return None
    block, _, rest = name[len("model.layers.") :].partition(".")
    mapped = _LAYER_NAMES.get(rest)
    return f"blk.{block}.{mapped}" if mapped is not None else None


def _dtype(ndim: int) -> np.dtype[Any]:
    """How a tensor is written: matrices in fp16, vectors (norms) in fp32, as llama.cpp's converter does."""
    return np.dtype(np.float16 if ndim > 1 else np.float32)


Fetch = Callable[[], np.ndarray]
"""Gives a tensor's host array as written (fetched from the device only when called)."""


def gguf_tensors(tensors: Mapping[str, Any]) -> Iterator[tuple[str, Fetch, tuple[int, ...]]]:
    """(llama.cpp name, a function giving the host array as written, its shape) for every tensor written;
    the fused gate/up of each layer gives two. Arrays are fetched only when called (device to host)."""

    def host(arr: Any, rows: slice | None = None) -> Fetch:
        def get() -> np.ndarray:
            a = arr[:, rows] if rows is not None else arr
            a = a.get() if hasattr(a, "get") else np.asarray(a)
            return np.ascontiguousarray(a, dtype=_dtype(a.ndim))

        return get

    for name, arr in tensors.items():
        shape = tuple(int(n) for n in arr.shape)
        if name.startswith("model.layers.") and name.endswith(".mlp.experts.gate_up_proj"):
            block = name[len("model.layers.") :].partition(".")[0]
            e, two_i, h = shape
            i = two_i // 2
            yield f"blk.{block}.ffn_gate_exps.weight", host(arr, slice(0, i)), (e, i, h)
            yield f"blk.{block}.ffn_up_exps.weight", host(arr, slice(i, two_i)), (e, i, h)
            continue
        mapped = gguf_name(name)
        if mapped is not None:
            yield mapped, host(arr), shape


FINGERPRINT_KEY = "strata.weights"
"""The GGUF key of `fingerprint`."""


def fingerprint(plan: LaunchPlan) -> str:
    """What the plan's weights are made from, as a short hash: the model (preset, packaged name or
    checkpoint path), a synthetic preset's seed and layer scale, its configuration and the dtype its engine
    holds the weights in (float32 on CPU devices). Two plans with the same fingerprint write the same GGUF."""
    m = plan.model
    on_gpu = any(s.device.startswith("cuda") for s in plan.stages)
    source: dict[str, Any] = {
        "model": [m.synthetic, m.packaged, m.path],
        "dtype": m.facts.dtype if on_gpu else "float32",
        "config": model_config(plan),
    }
    if m.synthetic is not None:  # generated weights: these choose them
        source |= {"seed": m.seed, "layer_scale": m.layer_scale}
    text = json.dumps(source, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_fingerprint(path: str | Path) -> str | None:
    """The `fingerprint` a GGUF file was written with; None for a file without one (written by another
    tool, such as llama.cpp's converter). Reads the header only."""
    try:
        gguf: Any = importlib.import_module("gguf")
    except ImportError:
        raise ExportError("reading GGUF needs the gguf package: pip install 'strata-cfg[gguf]'") from None
    try:
        field = gguf.GGUFReader(str(path)).fields.get(FINGERPRINT_KEY)
    except (ValueError, OSError) as exc:
        raise ExportError(f"cannot read {path} as GGUF: {exc}") from None
    return None if field is None else str(field.contents())


def kept_file(path: str | Path, plan: LaunchPlan) -> tuple[bool, str]:
    """Whether the GGUF file kept at ``path`` may stand for the plan's model, and the line that says so: a
    file this module wrote for other weights may not; one without a `fingerprint` (another tool's) is
    taken as the user's choice."""
    try:
        found = read_fingerprint(path)
    except ExportError as exc:
        return False, str(exc)
    if found is None:
        return (
            True,
            f"reusing {path}, which another tool wrote: its weights are not checked against the plan's",
        )
    want = fingerprint(plan)
    if found != want:
        return False, (
            f"{path} holds other weights than the plan's {plan.model.label()} (written for {found}, the "
            f"plan's are {want}: another model, seed, layer_scale or dtype); remove it or pass another --gguf"
        )
    return True, f"reusing {path}, written from the plan's weights ({want})"


def write_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, Any],
    name: str,
    progress: Progress | None = None,
    vocabulary: str = "bytes",
    weights_from: str | None = None,
) -> int:
    """Write ``tensors`` (the runtime's names; NumPy or CuPy arrays) of a model with ``config`` (its
    ``config.json``) to ``path`` as GGUF, with ``vocabulary`` (one of `VOCABULARIES`); the bytes of tensor
    data written. ``progress`` makes a bar that advances by the bytes of each tensor written;
    ``weights_from``, the weights' `fingerprint`, is written under `FINGERPRINT_KEY`.

    The file is written beside ``path`` under a ``.partial`` name and renamed when complete, so ``path``
    never holds half a model (a later run reuses a file that exists there).

    Raises `ExportError` when llama.cpp would compute another model, a tensor is missing, or the disk
    holding ``path`` has less room than the tensors need.
    """
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {', '.join(VOCABULARIES)}, not {vocabulary!r}")
    problem = unsupported(config)
    if problem:
        raise ExportError(f"cannot export to GGUF: the model has {problem}")
    try:
        gguf: Any = importlib.import_module("gguf")
    except ImportError:
        raise ExportError("writing GGUF needs the gguf package: pip install 'strata-cfg[gguf]'") from None
    items = list(gguf_tensors(tensors))
    layers = int(config["num_hidden_layers"])
    need = {f"blk.{j}.{n}" for j in range(layers) for n in (*_LAYER_NAMES.values(), "ffn_gate_exps.weight")}
    need |= {"token_embd.weight", "output_norm.weight"}
    missing = sorted(need - {n for n, _, _ in items})
    if missing:
        raise ExportError(f"cannot export to GGUF: no tensor for {', '.join(missing[:3])}")
    sizes = [int(np.prod(shape)) * _dtype(len(shape)).itemsize for _, _, shape in items]
    path = Path(path)
    folder = path.resolve().parent
    if not folder.is_dir():
        raise ExportError(f"cannot write {path}: there is no folder {folder}")
    free = shutil.disk_usage(folder).free
    if free < sum(sizes):
        raise ExportError(
            f"cannot write {path}: the model's tensors take {sum(sizes) / 2**30:,.1f} GiB and {folder} has "
            f"{free / 2**30:,.1f} GiB free; write it to a disk with room"
        )
    partial = path.with_name(path.name + ".partial")
    try:
        written = _write(gguf, partial, config, items, sizes, name, progress, vocabulary, weights_from)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return written


def _write(
    gguf: Any,
    path: Path,
    config: Mapping[str, Any],
    items: list[tuple[str, Fetch, tuple[int, ...]]],
    sizes: list[int],
    name: str,
    progress: Progress | None,
    vocabulary: str,
    weights_from: str | None,
) -> int:
    """`write_gguf`'s file: the header, then each tensor of ``items`` (``sizes`` bytes each) in turn."""
    writer = gguf.GGUFWriter(str(path), ARCH)
    h = int(config["hidden_size"])
    writer.add_name(name)
    if weights_from is not None:
        writer.add_string(FINGERPRINT_KEY, weights_from)
    writer.add_context_length(int(config.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(h)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    head_dim = int(config.get("head_dim") or h // int(config["num_attention_heads"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10_000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_expert_count(int(config["num_experts"]))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(int(config["vocab_size"]))
    if vocabulary == "bytes":
        _add_byte_vocabulary(writer, int(config["vocab_size"]))
    else:
        writer.add_tokenizer_model("none")
    for (gname, _, shape), nbytes in zip(items, sizes, strict=True):
        writer.add_tensor_info(gname, shape, _dtype(len(shape)), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    bar = progress("writing GGUF", sum(sizes)) if progress is not None else None
    written = 0
    for _, get, _ in items:
        data = get()
        writer.write_tensor_data(data)
        written += data.nbytes
        if bar is not None:
            bar.advance(data.nbytes)
    writer.close()
    if bar is not None:
        bar.close()
    return written


NEVER_MERGED = "<|endoftext|> <|endoftext|>"
"""The one merge the vocabulary carries (llama.cpp requires the key): it joins two special tokens, which
are never pieces of text, so it never applies and every byte stays its own token."""


def byte_vocabulary(vocab_size: int) -> tuple[list[str], list[int]]:
    """The runtime's byte-level vocabulary (`ByteTokenizer`) as llama.cpp's byte-level BPE without merges:
    each id's token text and `gguf.TokenType` value. Byte b is a normal token written as its byte-level
    character, so llama.cpp cuts any text into its UTF-8 bytes, as the runtime does; the specials are
    control tokens; the rest are unused placeholders, which decode to nothing in both."""
    normal, control, unused = 1, 3, 5  # gguf.TokenType.NORMAL, CONTROL, UNUSED
    names = {i: s for s, i in ByteTokenizer.SPECIALS.items()}
    chars = byte_level_chars()
    tokens, types = [], []
    for i in range(vocab_size):
        if i < 256:
            tokens.append(chars[i])
            types.append(normal)
        elif i in names:
            tokens.append(names[i])
            types.append(control)
        else:
            tokens.append(f"<unused{i}>")
            types.append(unused)
    return tokens, types


def _add_byte_vocabulary(writer: Any, vocab_size: int) -> None:
    tokens, types = byte_vocabulary(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([NEVER_MERGED])
    end, im_end = ByteTokenizer.SPECIALS["<|endoftext|>"], ByteTokenizer.SPECIALS["<|im_end|>"]
    if im_end < vocab_size:  # the runtime's end-of-text ids end a generation in llama.cpp too
        writer.add_bos_token_id(end)
        writer.add_eos_token_id(end)
        writer.add_eot_token_id(im_end)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def vocabulary_of(plan: LaunchPlan) -> str:
    """The vocabulary `write_model` writes for the plan's model: the runtime's byte-level one unless the
    checkpoint has its own ``tokenizer.json``."""
    path = plan.model.path
    return "none" if path is not None and (Path(path) / "tokenizer.json").is_file() else "bytes"


def write_model(
    path: str | Path, plan: LaunchPlan, weights: WeightStore, progress: Progress | None = None
) -> int:
    """`write_gguf` of the model an engine of ``plan`` was built on: every stage's tensors in ``weights``."""
    tensors = {k: v for st in weights.stages.values() for k, v in st.tensors.items()}
    config, label, vocabulary = model_config(plan), plan.model.label(), vocabulary_of(plan)
    return write_gguf(path, config, tensors, label, progress, vocabulary, fingerprint(plan))
