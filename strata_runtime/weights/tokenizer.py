"""Tokenizers: byte-level for synthetic models, ``tokenizer.json`` (via ``tokenizers``) for checkpoints.

Both implement `strata_runtime.api.Tokenizer`. Chat prompts use the checkpoint's own chat template when it
has one (rendered with jinja2 when that is installed, in a sandbox and with the helpers transformers gives
templates), and a plain ChatML layout otherwise. Tools and tool calls are written in the Hermes layout
(`strata_runtime.chat`) wherever the template does not write them itself.
"""

from __future__ import annotations

import functools
import importlib
import json
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..chat import ChatTemplateError, has_tool_parts, plain_messages
from ..xml_calls import for_template, layout_of


def chatml(messages: list[dict[str, str]]) -> str:
    """The ChatML layout Qwen models use, ending where the assistant's reply begins."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""`chatml` as a Jinja template."""


class ByteTokenizer:
    """Ids 0..255 are bytes; a few special tokens follow. Any other id decodes to nothing."""

    SPECIALS = MappingProxyType({"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258})

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= max(self.SPECIALS.values()):
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least 259, not {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_ids: tuple[int, ...] = (self.SPECIALS["<|endoftext|>"], self.SPECIALS["<|im_end|>"])
        self.special_ids: tuple[int, ...] = tuple(sorted(self.SPECIALS.values()))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:  # special tokens are matched as whole strings, the rest as UTF-8 bytes
            cut = min(((rest.find(s), s) for s in self.SPECIALS if s in rest), default=(-1, ""))
            if cut[0] < 0:
                ids.extend(rest.encode("utf-8"))
                break
            ids.extend(rest[: cut[0]].encode("utf-8"))
            ids.append(self.SPECIALS[cut[1]])
            rest = rest[cut[0] + len(cut[1]) :]
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.SPECIALS.items()}
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if i in names and i not in self.eos_ids:
                out.append(names[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token: int) -> bytes:
        """A byte id's byte, a special token's name in UTF-8, and nothing for an unused id."""
        if 0 <= token < 256:
            return bytes([token])
        names = {v: k for k, v in self.SPECIALS.items()}
        return names[token].encode() if token in names else b""

    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    """`apply_chat_template`'s transcript as a Jinja template."""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """A plain transcript ending in ``assistant: ``. A synthetic model has no chat template (to read
        ``template_kwargs``), and ending on a printable byte keeps its planted token chain (and so the reply)
        in readable characters. Tools and calls are written in the Hermes layout
        (`strata_runtime.chat.plain_messages`)."""
        plain = plain_messages(messages, tools)
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant: ")


class HFTokenizer:
    """A checkpoint's ``tokenizer.json``, with its EOS ids and chat template."""

    def __init__(self, directory: str | Path, config: dict[str, Any]) -> None:
        try:
            tokenizers = importlib.import_module("tokenizers")
        except ImportError as exc:
            raise RuntimeError(
                "this checkpoint has a tokenizer.json; reading it needs the optional `tokenizers` package "
                "(pip install 'strata-cfg[hf]')"
            ) from exc
        directory = Path(directory)
        self._tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        tok_cfg = _read_json(directory / "tokenizer_config.json")
        gen_cfg = _read_json(directory / "generation_config.json")
        self.template: str | None = tok_cfg.get("chat_template")
        jinja = directory / "chat_template.jinja"
        if self.template is None and jinja.is_file():
            self.template = jinja.read_text()
        self.eos_ids = self._eos_ids(config, gen_cfg, tok_cfg)
        added = self._tok.get_added_tokens_decoder()
        self.special_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))
        """Ids of the special tokens (control tokens, never part of a text)."""
        decoder = json.loads(self._tok.to_str()).get("decoder")
        self._byte_level = '"ByteLevel"' in json.dumps(decoder)
        """Pieces are written in GPT-2's byte alphabet (the decoder is byte-level, alone or in a sequence)."""

    def _eos_ids(self, *configs: dict[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        for cfg in configs:
            eos = cfg.get("eos_token_id")
            ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
            token = cfg.get("eos_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and self._tok.token_to_id(token) is not None:
                ids.append(self._tok.token_to_id(token))
        return tuple(dict.fromkeys(int(i) for i in ids))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes, so that a token holding part of a UTF-8 character gives exactly that part: a
        byte-fallback piece (``<0xC3>``) its byte; a byte-level BPE piece (as Qwen's vocabulary has) its
        characters' bytes through GPT-2's alphabet; any other piece its text, with SentencePiece's ``▁``
        as the space it stands for."""
        found = self._tok.id_to_token(token)
        if found is None:
            return b""
        piece = str(found)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level:
            table = _unicode_to_byte()
            return bytes(table[ch] for ch in piece if ch in table)
        return piece.replace("\u2581", " ").encode()

    @property
    def chat_template(self) -> str:
        """The checkpoint's own template, or ChatML where it has none (as `apply_chat_template` uses)."""
        return self.template if self.template is not None else CHATML_TEMPLATE

    @property
    def template_knows_tools(self) -> bool:
        """Whether the checkpoint's template writes tools and calls itself (it reads ``tools`` and each
        message's ``tool_calls``); otherwise they are written in the Hermes layout before it renders."""
        return self.template is not None and "tools" in self.template and "tool_calls" in self.template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt the checkpoint's template renders (given ``tools`` where it knows them, and
        ``template_kwargs`` as more variables), or ChatML. `ChatTemplateError` where the template refuses
        the messages (its ``raise_exception``)."""
        tooled = bool(tools) or has_tool_parts(messages)
        template = _compiled(self.template) if self.template is not None else None
        if template is None:
            return self.encode(chatml(plain_messages(messages, tools)))
        if tooled and self.template_knows_tools:
            if layout_of(self.template) == "xml":  # it writes earlier calls' arguments one by one
                messages = for_template(messages)
            view: dict[str, Any] = {"messages": messages, "tools": tools or None}
        else:
            view = {"messages": plain_messages(messages, tools) if tooled else messages}
        try:
            text = template.render(**(template_kwargs or {}), **view, add_generation_prompt=True)
        except Exception as exc:  # a template's own refusal, or one that fails on these messages
            raise ChatTemplateError(f"the model's chat template cannot render these messages: {exc}") from exc
        return self.encode(text)


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    """A checkpoint's chat template compiled as transformers compiles it, or None without jinja2: in an
    immutable sandbox (a template is code from the checkpoint's files), with loop controls, transformers'
    ``tojson`` (no HTML escapes, keys in order), ``raise_exception`` and ``strftime_now``."""
    try:
        jinja2 = importlib.import_module("jinja2")
        sandbox = importlib.import_module("jinja2.sandbox")
    except ImportError:
        return None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def byte_level_chars() -> list[str]:
    """The printable character byte-level BPE writes each byte as (GPT-2's table), in byte order:
    printable Latin-1 bytes as themselves, the others as the characters from U+0100 on."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Each byte-level character's byte (`byte_level_chars` inverted)."""
    return {ch: b for b, ch in enumerate(byte_level_chars())}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def tokenizer_for(
    model_dir: str | None, vocab_size: int, config: dict[str, Any] | None = None
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a model directory (``tokenizer.json``), or byte-level for synthetic models.

    A checkpoint without ``tokenizer.json`` (such as a test model) falls back to byte-level ids.
    """
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir, config or {})
    return ByteTokenizer(max(vocab_size, 259))
