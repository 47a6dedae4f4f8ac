"""A chat body made the engine's request: its prompt through the model's chat template (with the tools it
offers), its grammar (structured output, held tool calls, a think block before them) checked over the
model's vocabulary, and the reasoning the model's tags allow. Every API served over the chat path
(`app.Server.prepare_chat`, the Messages and Responses endpoints through it) prepares its requests here."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from ..api import Reasoning, Tokenizer
from ..chat import ChatTemplateError, call_ids
from ..structured import GrammarError, grammars_for, json_grammar, reasoning_grammar
from ..thinking import think_ids, thinking_at_end
from ..xml_calls import call_layout
from . import protocol as p
from .tools import ToolUse, tool_use


async def prepare_chat(
    raw: Any, tokenizer: Tokenizer, model_name: str, context: int, vocab_size: int
) -> tuple[p.ChatBody, p.Prepared]:
    """A chat body checked (400s naming the field at fault) and made the engine's request, for a server of
    ``model_name`` whose model has this tokenizer, ``context`` positions a slot and ``vocab_size`` ids."""
    body = p.parse_chat(raw)
    p.check_model(body.model, model_name)
    tools = tool_use(body.model_extra or {}, p.grammar_of(body), call_ids(tokenizer), call_layout(tokenizer))
    ids = chat_prompt(tokenizer, body, tools)
    prepared = p.prepare(
        body, ids, context=context, vocab_size=vocab_size, default_max_tokens=None, tools=tools
    )
    tags = think_ids(tokenizer)
    ends = thinking_at_end(tokenizer, ids) if tags is not None else None
    if tags is not None:
        prepared = replace(prepared, thinking=ends == "open", think_tags=tags)
    field = "tool_choice" if tools is not None and tools.grammar is not None else p.grammar_field(body)
    if tools is not None and tools.grammar is not None:
        if tools.reply_format is not None:  # "auto": the format's reply or calls; the format named first
            await check_grammar(tools.reply_format, p.grammar_field(body), tokenizer, vocab_size)
        await _check_tools(tools, tokenizer, vocab_size)
    else:
        await check_grammar(prepared.request.sampling.grammar, field, tokenizer, vocab_size)
    sampling = prepared.request.sampling
    budget = body.thinking_token_budget
    if tags is not None and ends != "closed" and (sampling.grammar is not None or budget is not None):
        # The reply reasons before its grammar holds it, or within a budget (a prompt whose template
        # closed the block, as Qwen3's does with `enable_thinking: false`, does not reason).
        reasoning = Reasoning(*tags, opened=ends == "open", budget=budget)
        if sampling.grammar is not None:  # a budget alone the engine keeps without a grammar
            try:
                whole = reasoning_grammar(sampling.grammar, reasoning)
            except GrammarError as exc:
                raise p.ApiError(400, f"`{field}` cannot be followed: {exc}", field) from None
            await check_grammar(whole, field, tokenizer, vocab_size)
        request = replace(prepared.request, sampling=replace(sampling, reasoning=reasoning))
        prepared = replace(prepared, request=request)
    return body, prepared


async def check_grammar(grammar: str | None, field: str, tokenizer: Tokenizer, vocab_size: int) -> None:
    """A 400 naming ``field`` where a request's grammar does not compile over the model's vocabulary
    (checked on a worker thread: the first check reads the vocabulary)."""
    if grammar is None:
        return
    grammars = grammars_for(tokenizer, vocab_size)
    try:
        await asyncio.to_thread(grammars.check, grammar)
    except GrammarError as exc:
        raise p.ApiError(400, f"`{field}` cannot be followed: {exc}", field) from None


async def _check_tools(tools: ToolUse, tokenizer: Tokenizer, vocab_size: int) -> None:
    """A 400 naming the tool whose ``parameters`` a held call cannot follow, or ``tool_choice`` where the
    calls' grammar does not compile as a whole."""
    assert tools.grammar is not None
    for i in tools.held:
        params = tools.tools[i]["function"].get("parameters")
        if params is not None:
            await check_grammar(json_grammar(params), f"tools.{i}.function.parameters", tokenizer, vocab_size)
    await check_grammar(tools.grammar, "tool_choice", tokenizer, vocab_size)


def chat_prompt(tokenizer: Tokenizer, body: p.ChatBody | p.TokenizeBody, tools: ToolUse | None) -> list[int]:
    """A chat body's prompt ids (`_chat_ids`); with ``continue_final_message``, the template's prompt for
    the messages before the last, followed by the last (the assistant's start of the reply)."""
    messages, prefill = p.chat_messages(body), ""
    if body.continue_final_message:
        last = messages[-1]
        if last["role"] != "assistant" or last.get("tool_calls"):
            raise p.ApiError(
                400,
                "`continue_final_message` goes on with the last message: it must be the assistant's "
                "text (no tool calls)",
                "continue_final_message",
            )
        messages, prefill = messages[:-1], str(last["content"])
    ids = _chat_ids(tokenizer, messages, tools, p.template_kwargs(body))
    return ids + (tokenizer.encode(prefill) if prefill else [])


def _chat_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: ToolUse | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A chat's prompt ids through the model's chat template, offering ``tools`` (unless ``tool_choice`` is
    ``"none"``); a 400 naming ``messages`` where the template refuses them."""
    try:
        offered = tools.offered if tools is not None else None
        return tokenizer.apply_chat_template(messages, offered, template_kwargs)
    except ChatTemplateError as exc:
        raise p.ApiError(400, str(exc), "messages") from None
