"""`python -m strata_runtime generate --plan plan.json`: one request, printed as text or JSON.

Text mode streams the reply to stdout as it is accepted, and ends with a summary line on stderr (windows,
proposals accepted). ``--json`` prints one object with ``token_ids``, ``text`` and ``accepted_proposals``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from strata_cfg.schema.plan_file import read_plan
from strata_cfg.schema.sampling_options import (
    add_generate_arguments,
    generation_problem,
    json_schema_of,
    logprobs_problem,
    options_problem,
    sampling_options,
    shape_problem,
)

from ..api import Request, SamplingParams, Tokenizer, TokenLogprob, token_name
from ..structured import choice_grammar, json_grammar, regex_grammar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, type=Path, help="a resolved plan (strata plan --json)")
    add_generate_arguments(parser, "Hello", "print one JSON object")


def grammar_of_options(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The grammar the shape options ask every reply to follow (`add_json_arguments`: a JSON schema's file,
    any JSON object, a regex or choices), or why they cannot (None, None: free text)."""
    if args.json_schema is not None:
        schema, problem = json_schema_of(args.json_schema)
        return (None, problem) if problem else (json_grammar(schema), None)
    if args.json_object:
        return json_grammar(None), None
    if args.regex is not None:
        return regex_grammar(args.regex), None
    if args.choice:
        return choice_grammar(args.choice), None
    return None, None


def parse_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise SystemExit(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from ..api import PlanMismatch
    from ..engine import Engine
    from ..weights.progress import stderr_progress

    problem = (
        generation_problem(args.max_tokens, args.seed, args.stop, args.bad_word)
        or options_problem(args)
        or logprobs_problem(args.logprobs)
        or shape_problem(args)
    )
    grammar, problem = (None, problem) if problem else grammar_of_options(args)
    if problem:
        raise SystemExit(f"strata_runtime generate: {problem}")
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        engine = Engine(read_plan(args.plan), progress=None if args.quiet else stderr_progress)
    except (PlanMismatch, OSError, ValueError, RuntimeError) as exc:
        print(f"strata_runtime generate: {exc}", file=sys.stderr)
        return 1
    tok = engine.tokenizer
    if args.prompt_ids is not None:
        prompt = parse_ids(args.prompt_ids)
    elif args.chat:
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
    else:
        prompt = tuple(tok.encode(args.prompt))
    options = sampling_options(args)
    sampling = SamplingParams(
        **options, seed=args.seed, logprobs=args.logprobs, grammar=grammar, bad_words=tuple(args.bad_word)
    )
    request = Request(
        prompt, args.max_tokens, sampling, stop_strings=tuple(args.stop), ignore_eos=args.ignore_eos
    )
    handle = engine.submit(request)
    t0 = time.perf_counter()
    ids: list[int] = []
    lps: list[TokenLogprob] = []
    text, finish, error = "", None, None
    while finish is None:
        engine.step()
        while not handle.events.empty():
            ev = handle.events.get()
            ids += ev.token_ids
            lps += ev.logprobs
            text += ev.text
            if not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            finish, error = ev.finished or finish, ev.error or error
    seconds = time.perf_counter() - t0
    if args.json:
        out = {
            "token_ids": ids,
            "text": text,
            "accepted_proposals": handle.accepted_proposals,
            "proposals": handle.proposals,
            "prompt_tokens": len(prompt),
            "finish_reason": finish,
            "error": error,
            "seconds": round(seconds, 4),
            "summary": engine.summary(),
        }
        if args.logprobs is not None:
            out["logprobs"] = [_logprob_json(tok, lp) for lp in lps]
        print(json.dumps(out))
    else:
        print()
        for lp in lps:
            print(_logprob_line(tok, lp))
        if not args.quiet:
            rate = len(ids) / seconds if seconds else 0.0
            print(
                f"{engine.summary()}; {len(ids)} tokens in {seconds:.2f} s ({rate:.1f} tok/s)",
                file=sys.stderr,
            )
    if error:
        print(f"strata_runtime generate: {error}", file=sys.stderr)
        return 1
    return 0


def _logprob_json(tok: Tokenizer, lp: TokenLogprob) -> dict[str, object]:
    """One token's log-probabilities in ``--json``: its id, text, figure and the likeliest tokens'."""

    def entry(token: int, logprob: float) -> dict[str, object]:
        return {"token": token, "text": token_name(tok, token)[0], "logprob": logprob}

    return {**entry(lp.token, lp.logprob), "top": [entry(t, v) for t, v in lp.top]}


def _logprob_line(tok: Tokenizer, lp: TokenLogprob) -> str:
    """One token's log-probabilities as a line after the reply: the figure, the token, the likeliest."""
    top = ", ".join(f"{token_name(tok, t)[0]!r} {v:.4f}" for t, v in lp.top)
    return f"{lp.logprob:9.4f}  {token_name(tok, lp.token)[0]!r}" + (f"  (likeliest: {top})" if top else "")
