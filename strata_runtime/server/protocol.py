"""The OpenAI wire format: request bodies in, engine `Request`s out, and the JSON the clients expect back.

Pure functions and pydantic models, no I/O, so every rule about bad input is testable without a server.
A body that cannot be served raises `ApiError`, whose message names the offending field and whose JSON is
OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``), so clients surface it as-is.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from strata_cfg.schema.sampling_options import PENALTY_BOUND, TEMPERATURE_MOST
from strata_cfg.schema.sampling_options import REPETITION_BOUNDS as REPETITION_RANGE

from ..api import (
    MAX_TOP_LOGPROBS,
    Request,
    SamplingParams,
    Tokenizer,
    TokenLogprob,
    token_name,
)
from ..chat import ToolCall
from ..structured import GrammarError, choice_grammar, json_grammar, regex_grammar, text_grammar
from .errors import ApiError as ApiError

if TYPE_CHECKING:
    from .tools import ToolUse

MAX_STOP_STRINGS = 4
"""OpenAI's own limit on ``stop`` sequences."""
MAX_DEPTH = 64
"""How deeply a body's arrays and objects may nest; the deepest valid body nests 4 deep."""
MAX_STOP_TOKEN_IDS = 64
"""The most ``stop_token_ids`` a request may give."""
MAX_BAD_WORDS = 256
"""The most ``bad_words`` a request may give."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a ``logit_bias`` value: -100 bans a token, +100 all but forces it."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat defaults to the rest of the context."""


# ----------------------------------------------------------------------------------------------------------
# Request bodies. Strict types: "5" is not an int and true is not a number. Unknown fields are ignored, as
# OpenAI-compatible servers do, so that clients sending newer optional fields keep working; fields that would
# change the answer and are not implemented are refused by name in `_refuse_unsupported`. A null optional
# field means its default, as OpenAI reads it.


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, raw: Any) -> Any:
        # `"temperature": null` asks for the default temperature; a null required field becomes "required".
        if not isinstance(raw, dict):
            return raw
        return {k: v for k, v in raw.items() if v is not None or k not in cls.model_fields}


class _Body(_Strict):
    model: str = Field(min_length=1)
    """The served model's id (``/v1/models``)."""
    max_tokens: int | None = Field(default=None, ge=0)
    """Tokens to generate at most; checked against the context once the prompt is tokenized. 0 only with a
    completion's ``echo``: the prompt alone, with its log-probabilities where asked."""
    temperature: float = Field(default=1.0, ge=0.0, le=TEMPERATURE_MOST)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    """An extension: 0 is no top-k cut."""
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_RANGE[0], le=REPETITION_RANGE[1])
    """An extension (as vLLM takes it): the logit of each token in the prompt or the reply so far is divided
    by it where positive and multiplied by it where not. 1: none."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """An extension (as vLLM and llama.cpp's server take it): after temperature, a token less likely than
    ``min_p`` times the most likely one is cut, before top-p. 0: no cut."""
    min_tokens: int = Field(default=0, ge=0)
    """An extension (as vLLM takes it): no end-of-text or stop token is chosen, and no stop string ends the
    reply, before it has this many tokens."""
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    """An extension (as vLLM takes it): only these tokens may be chosen."""
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    """An extension (as vLLM takes it): words the reply may not generate, each as the text's start and after
    a space (`strata_runtime.bad_words`)."""
    include_stop_str_in_output: bool = False
    """An extension (as vLLM takes it): a reply a stop string ended keeps that string at its end."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """An extension (as vLLM takes it): read only the prompt's last this many tokens (-1: as many as the
    context holds with room for one generated token); None reads it whole."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, a JSON object's key) -> bias in [-100, 100], added to that token's logit."""
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    """An extension (as vLLM takes it): token ids that end the reply, as the model's end-of-text does (the
    token itself is not returned)."""
    ignore_eos: bool = False
    """An extension (as vLLM and llama.cpp's server take it): generate past the model's end-of-text tokens,
    so a reply runs to ``max_tokens`` or a stop string."""
    n: int = Field(default=1, ge=1, le=16)
    """Choices to generate for each prompt, each a request of its own (`choices`)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """An extension (as vLLM takes it): a request reuses a slot's kept prompt only if that prompt was sent
    with the same salt (``memory.prefix_reuse``), so parties that share a server each send their own and
    cannot learn from the usage or the time to the first token what another sent."""
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    """An extension (as vLLM takes it): lower is sooner. Of the requests waiting for a slot, one of the
    lowest priority gets the next one free (`strata_runtime.api.Request.priority`)."""
    stream: bool = False
    stream_options: StreamOptions | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk carrying the usage counts."""


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, or token ids; a list of texts or of id lists is a batch, answered with a choice each."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each generated token's log-probability, and those of this many most likely tokens at its place."""
    echo: bool = False
    """Return the prompt before the completion (with ``logprobs``, the prompt tokens' figures too)."""
    suffix: str | None = None
    """The text that comes after the completion: the model fills in the middle (`FIM_TAGS`)."""


FIM_TAGS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
"""The tokens a fill-in-the-middle prompt is written with, as Qwen's coder models (and StarCoder's family,
which use them too) were trained: the prefix, the suffix, then the middle, which the model writes."""


def fim_ids(tokenizer: Tokenizer) -> tuple[int, int, int] | None:
    """The model's fill-in-the-middle tokens (`FIM_TAGS`), where its vocabulary holds each as one token."""
    ids = [tokenizer.encode(tag) for tag in FIM_TAGS]
    if not all(len(one) == 1 for one in ids):
        return None
    return ids[0][0], ids[1][0], ids[2][0]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str
    """The arguments as JSON text, as the reply that made the call gave them."""


class MessageToolCall(_Strict):
    """A call an earlier assistant message made (`strata_runtime.chat`)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A ``tool`` message's answer is to this call."""
    reasoning_content: str | None = None
    """An assistant message's reasoning, as a reply gave it (`ChatBody`): the model's chat template decides
    whether the prompt shows it (Qwen3's shows it only after the last user message)."""


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
"""OpenAI's reasoning efforts (``reasoning_effort`` on chat, ``reasoning.effort`` on the Responses API)."""
NO_THINKING_EFFORTS = ("none", "minimal")
"""The efforts that turn a model's thinking off, where its template has a switch (``enable_thinking``)."""


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """The newer name of ``max_tokens`` for chat."""
    logprobs: bool = False
    """Return each generated token's log-probability."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: also those of this many most likely tokens at each place."""
    chat_template_kwargs: dict[str, Any] | None = None
    """An extension (as vLLM takes it): more variables for the model's chat template, such as Qwen3's
    ``enable_thinking``."""
    continue_final_message: bool = False
    """An extension (as vLLM takes it): the last message is the start of the assistant's reply, which the
    model goes on with (a "prefill"), instead of a finished turn."""
    thinking_token_budget: int | None = Field(default=None, ge=1)
    """An extension (as vLLM takes it): a model that reasons in think blocks reasons for at most this many
    tokens; after them the block is closed and the reply goes on."""
    reasoning_effort: ReasoningEffort | None = None
    """How hard a model that reasons should think: given to the chat template as ``reasoning_effort`` (the
    templates of models with effort levels read it), and ``none`` or ``minimal`` turn Qwen3's thinking off
    (``enable_thinking: false``) unless ``chat_template_kwargs`` says otherwise."""


class TokenizeBody(_Strict):
    """``POST /tokenize`` (as vLLM serves it): a prompt's ids, or a chat's through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    """As a chat takes it: the last message is the start of the reply (counted as the chat would read it)."""


class DetokenizeBody(_Strict):
    """``POST /detokenize``: the text of token ids."""

    model: str | None = None
    tokens: list[int]


StreamOptions.model_rebuild()
_Body.model_rebuild()
CompletionBody.model_rebuild()
ChatBody.model_rebuild()
TokenizeBody.model_rebuild()
DetokenizeBody.model_rebuild()

_FIELDS = frozenset(
    name
    for m in (
        CompletionBody,
        ChatBody,
        ChatMessage,
        TextPart,
        MessageToolCall,
        FunctionCall,
        StreamOptions,
        TokenizeBody,
        DetokenizeBody,
    )
    for name in m.model_fields
)
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a batch: a list of strings or of token id lists",
    "stop": f"a string or a list of up to {MAX_STOP_STRINGS} strings",
    "content": "a string or a list of text parts",
}
"""What a union-typed field takes, said once instead of once per union member."""


def _field_path(loc: tuple[int | str, ...]) -> str:
    # pydantic puts union member tags ("str", "list[int]") into the location; keep only real fields/indices.
    parts = [str(p) for p in loc if isinstance(p, int) or p in _FIELDS]
    return ".".join(parts)


def _validation_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    path = _field_path(errors[0]["loc"])
    same = [e for e in errors if _field_path(e["loc"]) == path]
    leaf = path.rsplit(".", 1)[-1]
    if errors[0]["type"] == "missing":
        message = f"`{path}` is required"
    elif len(same) > 1 and leaf in _EXPECTED:
        message = f"`{path}` must be {_EXPECTED[leaf]}"
    elif path == "prompt" and len(errors) > 1:  # a list that fits no member, its items failing each one
        message = f"`prompt` must be {_EXPECTED['prompt']}"
    else:
        message = f"`{path}`: {errors[0]['msg']}"
    return ApiError(400, message, path or None)


def _parse(model: type[BaseModel], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_structure(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def check_structure(raw: Any) -> None:
    """Refuse a body that nests deeper than `MAX_DEPTH`, or holds text that is not valid Unicode (a lone
    UTF-16 surrogate, which JSON's ``"\\ud800"`` escape can spell and no tokenizer can encode), naming where.

    Iterative, so no body can exhaust the stack, and before validation, so every field is covered.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(raw, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if len(path) >= MAX_DEPTH:
            field = str(path[0])
            raise ApiError(400, f"`{field}` nests arrays or objects more than {MAX_DEPTH} deep", field)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(item, str | dict | list):
                stack.append((item, (*path, key)))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = ".".join(str(p) for p in path)
        code = ord(text[exc.start])
        raise ApiError(
            400,
            f"`{where}` is not valid Unicode text: it holds a lone surrogate U+{code:04X} at character "
            f"{exc.start} (a JSON \\u escape of half a surrogate pair)",
            where or None,
        ) from None


NOT_SAMPLED_HERE: dict[str, tuple[Any, ...]] = {
    "typical_p": (1, 1.0),
    "top_a": (0, 0.0),
    "tfs_z": (1, 1.0),
    "mirostat": (0,),
    "repeat_penalty": (1, 1.0),
    "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "logits_processors": (),
    "guided_whitespace_pattern": (),
}
"""Sampling fields other servers take (vLLM's extensions, llama.cpp's server's) that would change the reply
and that this server does not implement: each with the values that ask for nothing, which are accepted
(absent and null always are). Any other value is a 400 naming the field, never silently ignored."""


def parse_completion(raw: Any) -> CompletionBody:
    """Validate a ``/v1/completions`` body."""
    body: CompletionBody = _parse(CompletionBody, raw)
    _refuse_unsupported(body, {"best_of": (1,), **NOT_SAMPLED_HERE})
    return body


def parse_chat(raw: Any) -> ChatBody:
    """Validate a ``/v1/chat/completions`` body."""
    body: ChatBody = _parse(ChatBody, raw)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    neutral = {
        "functions": ([],),
        # Completion fields that some servers also take on chat: refused here rather than ignored.
        "echo": (False,),
        "best_of": (1,),
        **NOT_SAMPLED_HERE,
    }
    _refuse_unsupported(body, neutral)
    return body


def _refuse_unsupported(body: _Body, neutral: dict[str, tuple[Any, ...]]) -> None:
    """Refuse what would change the answer but is not implemented; ``neutral`` lists, per field, the values
    that ask for nothing (absent and null always do)."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "`stream_options` is only allowed when `stream` is true", "stream_options")
    extra = body.model_extra or {}
    for name, values in neutral.items():
        value = extra.get(name)
        # `type(v) is type(value)`: 0 is not false here, and 1.0 is not 1.
        if value is not None and not any(type(v) is type(value) and v == value for v in values):
            instead = f"leave it out or send {json.dumps(values[0])}" if values else "leave it out"
            raise ApiError(400, f"`{name}` is not supported by this server ({instead})", name)
    grammar_of(body)


def _check_response_format(value: Any) -> str | None:
    """The grammar a ``response_format`` asks the reply to follow (`strata_runtime.structured`): None for
    ``{"type": "text"}`` (free text, the default); any JSON object for ``json_object``; JSON that follows the
    schema of ``json_schema.schema`` (any JSON object where it gives none) for ``json_schema``. Whether the
    schema compiles over the model's vocabulary is checked later (`strata_runtime.structured.Grammars`)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None)
    if kind != "json_schema":
        raise ApiError(
            400,
            '`response_format` must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name": ..., "schema": {...}}}',
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(
            400,
            '`response_format.json_schema` must be an object: {"name": ..., "schema": {...}}',
            "response_format.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise ApiError(
            400,
            "`response_format.json_schema.name` must be 1 to 64 letters, digits, underscores or dashes",
            "response_format.json_schema.name",
        )
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ApiError(
            400, "`response_format.json_schema.schema` must be a JSON schema (an object)", SCHEMA_FIELD
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        field = "response_format.json_schema.strict"
        raise ApiError(400, f"`{field}` must be true or false", field)
    return json_grammar(schema)


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SCHEMA_FIELD = "response_format.json_schema.schema"


GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's earlier fields for structured output, each the ``structured_outputs`` key it stands for."""


def _asked_shape(body: _Body) -> tuple[str, Any] | None:
    """The one field of a body that asks for a shape beside ``response_format`` (``structured_outputs`` or
    a `GUIDED_FIELDS` field) and its value, or None; a 400 where there are several."""
    extra = body.model_extra or {}
    given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if extra.get(name) is not None]
    if not given:
        return None
    shaped = _check_response_format(extra.get("response_format")) is not None
    if len(given) > 1 or shaped:
        names = ", ".join(f"`{n}`" for n in (["response_format"] if shaped else []) + given)
        raise ApiError(400, f"give one of {names}, not several", given[-1])
    return given[0], extra[given[0]]


def grammar_of(body: _Body) -> str | None:
    """The grammar a validated body asks the reply to follow (None: free text): its ``response_format``,
    its ``structured_outputs`` (`_structured_outputs`) or one of vLLM's earlier `GUIDED_FIELDS`; one of
    them."""
    asked = _asked_shape(body)
    if asked is None:
        return _check_response_format((body.model_extra or {}).get("response_format"))
    name, value = asked
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _structured(GUIDED_FIELDS[name], value, name)


def grammar_field(body: _Body) -> str:
    """The field a 400 names where a body's grammar does not compile over the model's vocabulary."""
    asked = _asked_shape(body)
    if asked is None:
        return SCHEMA_FIELD
    name, value = asked
    if name != "structured_outputs":
        return name
    if isinstance(value, dict) and len(value) == 1:
        return f"structured_outputs.{next(iter(value))}"
    return SCHEMA_FIELD


STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
"""What ``structured_outputs`` may ask for, as vLLM takes it: one of them."""


def _structured_outputs(value: Any) -> str:
    """The grammar of vLLM's ``structured_outputs`` extension: ``{"json": SCHEMA}`` (an object, or its JSON
    text), ``{"json_object": true}``, ``{"regex": PATTERN}`` (the whole reply matches it), ``{"choice":
    [TEXT, ...]}`` (the reply is exactly one of them) or ``{"grammar": TEXT}`` (a Lark grammar with a
    ``start`` rule, or a GBNF one with a ``root`` rule), exactly one."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_KEYS:
        unknown = sorted(set(value) - set(STRUCTURED_KEYS)) if isinstance(value, dict) else []
        why = f" (not {', '.join(f'`{k}`' for k in unknown)})" if unknown else ""
        raise ApiError(
            400,
            "`structured_outputs` must be an object with exactly one of "
            + ", ".join(f"`{k}`" for k in STRUCTURED_KEYS)
            + why,
            "structured_outputs",
        )
    key, spec = next(iter(value.items()))
    return _structured(key, spec, f"structured_outputs.{key}")


def _structured(key: str, spec: Any, field: str) -> str:
    """The grammar of one `STRUCTURED_KEYS` kind of shape, ``spec`` as ``structured_outputs`` holds it;
    a 400 names ``field`` where it is malformed."""
    if key == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ApiError(
                    400, f"`{field}` is not JSON: {exc.msg} at character {exc.pos}", field
                ) from None
        if not isinstance(spec, dict):
            raise ApiError(400, f"`{field}` must be a JSON schema (an object, or its JSON text)", field)
        return json_grammar(spec)
    if key == "json_object":
        if spec is not True:
            raise ApiError(400, f"`{field}` must be true", field)
        return json_grammar(None)
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ApiError(400, f"`{field}` must be a list of one or more non-empty strings", field)
        return choice_grammar(spec)
    if not isinstance(spec, str) or not spec:
        raise ApiError(400, f"`{field}` must be a non-empty string", field)
    if key == "regex":
        return regex_grammar(spec)
    try:
        return text_grammar(spec)
    except GrammarError as exc:
        raise ApiError(400, f"`{field}` cannot be followed: {exc}", field) from None


# ----------------------------------------------------------------------------------------------------------
# From a validated body to an engine request.


@dataclass(frozen=True)
class Prepared:
    """A validated request ready for the engine, with what the response needs to echo."""

    request: Request
    prompt_tokens: int
    stream: bool
    include_usage: bool
    echo: str | None = None
    """The prompt's text, returned before the completion (completions with ``echo``)."""
    generate: bool = True
    """False for ``max_tokens: 0`` with ``echo``: the engine reads the prompt (and gives its first token,
    which the reply leaves out)."""
    choice: int = 0
    """Which of its prompt's ``n`` choices this is (`choices`)."""
    tools: ToolUse | None = None
    """A chat's tools, offered in its prompt: the reply's calls are read out of its text."""
    thinking: bool | None = None
    """A chat reply of a model that reasons (``<think>`` blocks): its reasoning is read apart from the rest
    (True: the prompt already opened the block). None: the reply is not read for reasoning."""
    think_tags: tuple[int, int] | None = None
    """The model's ``<think>`` and ``</think>`` ids, where it reasons: its usage counts the block's tokens."""


def check_model(name: str, served: str) -> None:
    if name != served:
        raise ApiError(
            404,
            f"the model `{name}` does not exist; this server serves `{served}`",
            "model",
            code="model_not_found",
        )


MAX_CHOICES = 64
"""The most choices one request may ask for, its prompts times ``n`` (each takes a slot, as a request of its
own does)."""


def prompts(
    body: CompletionBody, tokenizer: Tokenizer, vocab_size: int
) -> list[tuple[list[int], str | None]]:
    """A completion's prompts: each one's token ids, with its text where it came as text (an id prompt's text
    is its ids' decoding, which an echo then shows). A string or a list of ids is one prompt; a list of
    strings or of id lists is a batch. With a ``suffix``, each prompt is the prefix of a fill-in-the-middle
    prompt (`fim_ids`)."""
    read = _prompts(body, tokenizer, vocab_size)
    if not body.suffix:
        return read
    fim = fim_ids(tokenizer)
    if fim is None:
        raise ApiError(
            400,
            "`suffix`: this model has no fill-in-the-middle tokens (" + ", ".join(FIM_TAGS) + " as tokens "
            "of their own), so it cannot write the text between a prompt and a suffix",
            "suffix",
        )
    after = tokenizer.encode(body.suffix)
    return [([fim[0], *ids, fim[1], *after, fim[2]], text) for ids, text in read]


def _prompts(
    body: CompletionBody, tokenizer: Tokenizer, vocab_size: int
) -> list[tuple[list[int], str | None]]:
    p = body.prompt
    if isinstance(p, str):
        return [(tokenizer.encode(p), p)]
    if not p:
        raise ApiError(400, "`prompt` must not be empty", "prompt")
    ints = [x for x in p if isinstance(x, int)]
    if len(ints) == len(p):
        return [(_checked_ids(ints, vocab_size, "prompt"), None)]
    if len(p) * body.n > MAX_CHOICES:
        raise ApiError(
            400,
            f"`prompt`: a batch's prompts times `n` may be at most {MAX_CHOICES} choices "
            f"(got {len(p)} x {body.n})",
            "prompt",
        )
    out: list[tuple[list[int], str | None]] = []
    for i, one in enumerate(p):
        if isinstance(one, str):
            out.append((tokenizer.encode(one), one))
        else:
            assert isinstance(one, list)
            if not one:
                raise ApiError(400, f"`prompt.{i}` must not be empty", f"prompt.{i}")
            out.append((_checked_ids([int(x) for x in one], vocab_size, f"prompt.{i}"), None))
    return out


def _checked_ids(ids: list[int], vocab_size: int, where: str) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ApiError(
            400, f"`{where}`: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", where
        )
    return ids


def parse_tokenize(raw: Any) -> TokenizeBody:
    """Validate a ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""
    body: TokenizeBody = _parse(TokenizeBody, raw)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give `prompt` (text) or `messages` (a chat), exactly one of them", "prompt")
    if body.messages is not None and not body.messages:
        raise ApiError(400, "`messages` must hold at least one message", "messages")
    return body


def parse_detokenize(raw: Any, vocab_size: int) -> DetokenizeBody:
    """Validate a ``/detokenize`` body: every id in the vocabulary."""
    body: DetokenizeBody = _parse(DetokenizeBody, raw)
    bad = [i for i in body.tokens if not 0 <= i < vocab_size]
    if bad:
        raise ApiError(
            400, f"`tokens`: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})", "tokens"
        )
    return body


def chat_messages(body: ChatBody | TokenizeBody) -> list[dict[str, Any]]:
    """Messages as a chat template reads them: a role and a text each (text parts joined), an assistant's
    ``tool_calls`` (each call's arguments as a JSON object where its text is one, as templates that write
    them with ``tojson`` expect), a tool answer's ``tool_call_id``."""
    out = []
    for m in body.messages or []:
        parts = m.content if isinstance(m.content, list) else [TextPart(type="text", text=m.content or "")]
        message: dict[str, Any] = {"role": m.role, "content": "".join(part.text for part in parts)}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None and m.role == "assistant":
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def _arguments(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def prepare(
    body: _Body,
    ids: list[int],
    *,
    context: int,
    vocab_size: int,
    default_max_tokens: int | None,
    echo: str | None = None,
    tools: ToolUse | None = None,
) -> Prepared:
    """Check the prompt and ``max_tokens`` against the context, ``logit_bias`` against the vocabulary, and
    build the engine request.

    ``default_max_tokens`` None means "the rest of the context" (chat's default). ``echo``: the prompt's
    text, which a completion with ``echo`` returns before its reply. ``tools``: a chat's tools, whose calls
    the reply is read for, and which hold it to calls where it must make one.
    """
    cut = body.truncate_prompt_tokens
    if cut is not None:  # the prompt's last tokens only
        if cut == 0:
            raise ApiError(
                400,
                "`truncate_prompt_tokens` must be at least 1, or -1 for as many as the context holds",
                "truncate_prompt_tokens",
            )
        if echo is not None:
            raise ApiError(
                400,
                "`truncate_prompt_tokens` cannot be given with `echo` (which returns the whole prompt)",
                "echo",
            )
        ids = ids[-(context - 1 if cut == -1 else cut) :]
    n = len(ids)
    if n == 0:
        raise ApiError(400, "the prompt is empty after tokenization", "prompt")
    room = context - n
    param = "messages" if isinstance(body, ChatBody) else "prompt"
    if room < 1:
        raise ApiError(
            400,
            f"the prompt is {n} tokens, but the context is {context} tokens "
            f"(the prompt must leave room for at least one generated token)",
            param,
            code="context_length_exceeded",
        )
    asked = body.max_tokens
    name = "max_tokens"
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        asked, name = body.max_completion_tokens, "max_completion_tokens"
    if asked is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif asked > room:
        raise ApiError(
            400,
            f"`{name}` is {asked}, but the context is {context} tokens and the prompt uses {n}, "
            f"so at most {room} can be generated",
            name,
            code="context_length_exceeded",
        )
    else:
        max_tokens = asked
    echoing = isinstance(body, CompletionBody) and body.echo
    if max_tokens == 0 and not echoing:
        raise ApiError(
            400, f"`{name}` must be at least 1 (0 only with `echo`, which returns the prompt alone)", name
        )
    if body.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"`min_tokens` ({body.min_tokens}) must be at most the tokens the reply may have ({max_tokens})",
            "min_tokens",
        )
    if any(not w.strip() for w in body.bad_words or ()):
        raise ApiError(400, "`bad_words` must be words, none of them blank", "bad_words")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(s == "" for s in stop):
        raise ApiError(400, f"`stop` must be {_EXPECTED['stop']}, none of them empty", "stop")
    request = Request(
        prompt_ids=tuple(ids),
        max_tokens=max(max_tokens, 1),  # the engine reads a prompt by generating its first token
        sampling=SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            min_tokens=body.min_tokens,
            allowed_token_ids=(
                None
                if body.allowed_token_ids is None
                else tuple(_checked_ids(body.allowed_token_ids, vocab_size, "allowed_token_ids"))
            ),
            logit_bias=logit_bias(body.logit_bias or {}, vocab_size),
            bad_words=tuple(body.bad_words or ()),
            logprobs=asked_logprobs(body),
            prompt_logprobs=body.logprobs if isinstance(body, CompletionBody) and body.echo else None,
            grammar=(tools.grammar if tools is not None else None) or grammar_of(body),
        ),
        # The engine cuts stop strings (`strata_runtime.engine.stops`), as it does for `strata generate`.
        stop_strings=tuple(stop),
        keep_stop=body.include_stop_str_in_output,
        stop_ids=tuple(_checked_ids(body.stop_token_ids or [], vocab_size, "stop_token_ids")),
        request_id=new_id("chatcmpl" if isinstance(body, ChatBody) else "cmpl"),
        ignore_eos=body.ignore_eos,
        cache_salt=body.cache_salt or "",
        priority=body.priority,
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(
        request=request,
        prompt_tokens=n,
        stream=body.stream,
        include_usage=include_usage,
        echo=echo if echoing else None,
        generate=max_tokens > 0,
        tools=tools if tools is not None and tools.offered else None,
    )


def choices(prepared: Prepared, n: int) -> list[Prepared]:
    """``n`` choices of one prompt, each a request of its own. With a ``seed``, choice i is seeded with
    ``seed + i`` (the first as the same request with ``n`` 1 would be); without one, each draws a fresh
    seed."""
    seed = prepared.request.sampling.seed
    out = []
    for i in range(n):
        mine = None if seed is None else (seed + i) % 2**63
        request = replace(prepared.request, sampling=replace(prepared.request.sampling, seed=mine))
        out.append(replace(prepared, request=request, choice=i))
    return out


def asked_logprobs(body: _Body) -> int | None:
    """How many alternatives a body asks the log-probabilities of at each place (None: no log-probabilities):
    ``logprobs`` on completions, ``top_logprobs`` (0 unless given) where a chat sets ``logprobs``."""
    if isinstance(body, ChatBody):
        return (body.top_logprobs or 0) if body.logprobs else None
    if isinstance(body, CompletionBody):
        return body.logprobs
    return None


def logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` object as (token id, bias) pairs: each key a token id in decimal, each value
    within +-`MAX_LOGIT_BIAS`."""
    pairs = []
    for key, value in bias.items():
        if not (key.isdecimal() and key.isascii()) or str(int(key)) != key:
            raise ApiError(
                400, f"`logit_bias`: the key {key!r} is not a token id (a decimal integer)", "logit_bias"
            )
        token = int(key)
        if token >= vocab_size:
            raise ApiError(
                400,
                f"`logit_bias`: token id {token} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # also refuses NaN
            raise ApiError(
                400,
                f"`logit_bias`: the bias of token {token} is {value}; it must be in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                "logit_bias",
            )
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


# ----------------------------------------------------------------------------------------------------------
# Responses.

OpenAIFinish = Literal["stop", "length", "tool_calls"]


def new_id(prefix: str, joint: str = "-") -> str:
    """A fresh id: OpenAI's ``chatcmpl-...``, or with ``joint`` ``_`` Anthropic's ``msg_...`` and the
    Responses API's ``resp_...``."""
    return f"{prefix}{joint}{uuid.uuid4().hex[:24]}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage counts; ``cached_tokens``: prompt tokens the engine did not read again, because a slot
    kept them from an earlier request (``memory.prefix_reuse``); ``reasoning_tokens``: those of the replies'
    think blocks, where the model reasons (``completion_tokens_details``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def choice(
    chat: bool,
    index: int,
    text: str | None,
    finish: OpenAIFinish,
    logprobs: dict[str, Any] | None = None,
    calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    """One choice of a whole reply: a chat completion's (the text as the assistant's message, with its
    tool calls where it made any) or a text completion's."""
    body: dict[str, Any] = {"index": index}
    if chat:
        body["message"] = {"role": "assistant", "content": text}
        if calls:
            body["message"]["tool_calls"] = [c.openai() for c in calls]
    else:
        body["text"] = text
    return body | {"finish_reason": finish, "logprobs": logprobs}


def response(
    chat: bool, request_id: str, model: str, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    """A whole reply of ``choices`` (`choice`), with the usage of them all."""
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish: OpenAIFinish | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}],
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: OpenAIFinish | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob], offset: int, lead: int | None = None
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``entries``: each token, its log-probability, the most
    likely tokens at its place with the token itself among them, and where its text starts (``offset`` is
    where the first one's does, counted in characters of the tokens' texts). ``lead``: an echoed prompt's
    first token, which nothing before it gives a figure (null, as OpenAI gives it)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if lead is not None:
        name = token_name(tokenizer, lead)[0]
        tokens.append(name)
        token_logprobs.append(None)
        top.append(None)
        offsets.append(offset)
        offset += len(name)
    for e in entries:
        name = token_name(tokenizer, e.token)[0]
        tokens.append(name)
        token_logprobs.append(e.logprob)
        best = {token_name(tokenizer, t)[0]: lp for t, lp in e.top}
        best.setdefault(name, e.logprob)
        top.append(best)
        offsets.append(offset)
        offset += len(name)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``entries``: ``content``, one entry per token with its bytes and the
    most likely tokens at its place."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        name, raw = token_name(tokenizer, token)
        return {"token": name, "logprob": logprob, "bytes": raw}

    content = [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}


def usage_chunk(request_id: str, model: str, created: int, kind: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, only the counts."""
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [], "usage": use}


TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt"})
"""The chat template's variables the server sets itself."""


def template_kwargs(body: ChatBody | TokenizeBody) -> dict[str, Any] | None:
    """A chat's ``chat_template_kwargs``, each key a name a template can read and none of the server's own
    (`TEMPLATE_OWN`), after what its ``reasoning_effort`` gives the template (`ChatBody.reasoning_effort`)."""
    given = body.chat_template_kwargs
    for key in given or {}:
        field = f"chat_template_kwargs.{key}"
        if not key.isidentifier() or key.startswith("_"):
            raise ApiError(400, f"`{field}`: a template variable is a name (letters, digits and `_`)", field)
        if key in TEMPLATE_OWN:
            raise ApiError(400, f"`{field}` is set by the server (give `{key}` as its own field)", field)
    effort = body.reasoning_effort if isinstance(body, ChatBody) else None
    if effort is None:
        return given or None
    implied: dict[str, Any] = {"reasoning_effort": effort}
    if effort in NO_THINKING_EFFORTS:
        implied["enable_thinking"] = False
    return implied | (given or {})
