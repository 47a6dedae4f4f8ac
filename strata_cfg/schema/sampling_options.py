"""The sampling options of the command line: `strata bench`, `strata loadtest` and `strata generate`, and the
runtime's own bench and generate, check them and name them the same way.

An option a user got wrong is refused naming it (``--top-p must be in (0, 1], not 1.5``) before anything
loads; the names in a request are OpenAI's (``top_p``, ``presence_penalty``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PENALTY_BOUND = 2.0
"""OpenAI's bound on a presence or frequency penalty: each lies in [-2, 2]."""

TEMPERATURE_MOST = 2.0
"""OpenAI's bound on a temperature: it lies in [0, 2]. The server's request schema and these options share
both bounds; the engine's own check (`strata_runtime.api.sampling_problem`) takes any finite temperature and
penalty a float32 logit can hold, for callers of its Python API."""


REPETITION_BOUNDS = (1e-3, 1e3)
"""The repetition penalties a command, the engine and the server take (1 is none): a logit divided or
multiplied by one stays well inside float32's range, and nothing outside it is a penalty anyone asks for
(vLLM takes any above 0)."""


def sampling_problem(
    temperature: float,
    top_p: float,
    top_k: int,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> str | None:
    """Why sampling options are not valid: a bench's or a load test's (every request draws with them), or a
    generate command's."""
    if not 0 <= temperature <= TEMPERATURE_MOST:  # also refuses nan
        return f"--temperature must be at least 0 and at most 2, as OpenAI defines it, not {temperature}"
    if not 0 < top_p <= 1:
        return f"--top-p must be in (0, 1], not {top_p}"
    if top_k < 0:
        return f"--top-k must be at least 0 (0: no cut), not {top_k}"
    if not 0 <= min_p <= 1:  # also refuses nan
        return f"--min-p must be in [0, 1] (0: no cut), not {min_p}"
    for flag, value in (("--presence-penalty", presence_penalty), ("--frequency-penalty", frequency_penalty)):
        if not -PENALTY_BOUND <= value <= PENALTY_BOUND:  # also refuses nan
            return f"{flag} must be in [-2, 2], as OpenAI defines it, not {value}"
    low, high = REPETITION_BOUNDS
    if not low <= repetition_penalty <= high:  # also refuses nan
        return f"--repetition-penalty must be in [{low:g}, {high:g}] (1: none), not {repetition_penalty}"
    return None


SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
)
"""The sampling options, by their names in a request (OpenAI's, and `SamplingParams`')."""


def sampling_options(args: Any) -> dict[str, Any]:
    """The sampling options from a command's parsed arguments, by `SAMPLING_KEYS` (``--top-p``: ``top_p``):
    a request's fields, and `SamplingParams`' keyword arguments."""
    return {key: getattr(args, key) for key in SAMPLING_KEYS}


def describe_sampling(options: dict[str, Any]) -> str:
    """The options that differ from greedy decoding, in words (``greedy`` when none does): what a report
    says its requests were sampled with."""
    parts = []
    if options.get("temperature", 0.0) > 0:
        parts.append(f"temperature {options['temperature']:g}")
        if options.get("top_k", 0):
            parts.append(f"top-k {options['top_k']}")
        if options.get("top_p", 1.0) < 1:
            parts.append(f"top-p {options['top_p']:g}")
        if options.get("min_p", 0.0) > 0:
            parts.append(f"min-p {options['min_p']:g}")
    for key in ("presence_penalty", "frequency_penalty"):
        if options.get(key, 0.0):
            parts.append(f"{key.replace('_', ' ')} {options[key]:g}")
    if options.get("repetition_penalty", 1.0) != 1.0:
        parts.append(f"repetition penalty {options['repetition_penalty']:g}")
    if not parts:
        return "greedy"
    return ("sampled at " if options.get("temperature", 0.0) > 0 else "greedy, ") + ", ".join(parts)


def options_problem(args: Any) -> str | None:
    """`sampling_problem` of a command's parsed sampling options."""
    return sampling_problem(**sampling_options(args))


def generation_problem(
    max_tokens: int, seed: int, stops: Sequence[str] = (), bad_words: Sequence[str] = ()
) -> str | None:
    """Why ``--max-tokens``, ``--seed``, a ``--stop`` or a ``--bad-word`` of a generate command is not
    valid."""
    if max_tokens < 1:
        return f"--max-tokens must be at least 1, not {max_tokens}"
    if not 0 <= seed < 2**63:
        return f"--seed must be in [0, 2^63), not {seed}"
    if any(not stop for stop in stops):
        return "--stop must not be empty"
    if any(not word.strip() for word in bad_words):
        return "--bad-word must not be blank"
    return None


def add_bad_word_argument(parser: Any) -> None:
    """``--bad-word WORD`` (repeatable) on a generate command's parser."""
    parser.add_argument(
        "--bad-word",
        action="append",
        default=[],
        metavar="WORD",
        help="a word the reply may not generate, as vLLM's bad_words bans it: at the text's start and after "
        "a space (repeatable)",
    )


MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask the log-probabilities of, at each place (vLLM's default bound):
``--logprobs`` here, and a request's in the engine and the server."""


def logprobs_problem(logprobs: int | None) -> str | None:
    """Why ``--logprobs`` of a generate command is not valid (None: not asked)."""
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        return f"--logprobs must be in [0, {MAX_TOP_LOGPROBS}] (alternatives at each place), not {logprobs}"
    return None


def add_logprobs_argument(parser: Any) -> None:
    """``--logprobs N`` on a generate command's parser."""
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="also print each generated token's log-probability and those of the N most likely tokens at "
        f"its place (0 to {MAX_TOP_LOGPROBS}; the model's own, before bias, penalties and temperature)",
    )


def add_sampling_arguments(parser: Any, seeded: str) -> None:
    """``--temperature``, ``--top-p``, ``--top-k`` and the penalties on the parser of a command that sends
    many requests (a bench, a load test), each sampled request ``seeded`` as that says."""
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help=f"every request samples at this temperature, seeded by {seeded} (default 0: greedy)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (default 0: none)")
    add_penalty_arguments(parser)


def add_penalty_arguments(parser: Any) -> None:
    """``--min-p`` and the penalties (``--presence-penalty``, ``--frequency-penalty``,
    ``--repetition-penalty``) on a command's parser."""
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="with --temperature: cut tokens less likely than this times the most likely one (default 0)",
    )
    for name, what in (
        ("presence", "once it has been generated"),
        ("frequency", "each time it was generated"),
    ):
        parser.add_argument(
            f"--{name}-penalty",
            type=float,
            default=0.0,
            help=f"{name} penalty in [-2, 2], as OpenAI defines it: a token's logit loses it {what} "
            "(default 0)",
        )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="as vLLM defines it: a token of the prompt or the reply has its logit divided by it where "
        "positive, multiplied where not (default 1: none)",
    )


def add_json_arguments(parser: Any) -> None:
    """``--json-schema FILE``, ``--json-object``, ``--regex PATTERN`` and ``--choice TEXT`` on a generate
    command's parser: a reply held to a shape (structured output), one of them."""
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        help="reply with JSON that follows the JSON schema in FILE (structured output)",
    )
    shape.add_argument("--json-object", action="store_true", help="reply with any JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="reply with text that matches PATTERN whole")
    shape.add_argument(
        "--choice", action="append", metavar="TEXT", help="reply with exactly one of the --choice texts"
    )


def shaped(args: Any) -> bool:
    """Whether the shape options (`add_json_arguments`) hold the replies to anything."""
    return args.json_schema is not None or args.json_object or args.regex is not None or bool(args.choice)


def structured_outputs(args: Any) -> dict[str, Any] | None:
    """The shape options as a request's ``structured_outputs`` field (the extension strata and vLLM take),
    None where they ask for nothing; a schema file must have been checked (`json_schema_of`)."""
    if args.json_schema is not None:
        return {"json": json_schema_of(args.json_schema)[0]}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": list(args.choice)}
    return None


def shape_words(args: Any) -> str:
    """What the shape options hold the replies to, in words (for a bench's table)."""
    if args.json_schema is not None:
        return f"the JSON schema in {args.json_schema}"
    if args.json_object:
        return "a JSON object"
    if args.regex is not None:
        return f"the regex {args.regex!r}"
    return "one of " + ", ".join(repr(c) for c in args.choice or [])


def shape_problem(args: Any) -> str | None:
    """Why a generate command's ``--regex`` or ``--choice`` is not valid (a schema file: `json_schema_of`)."""
    if args.regex is not None and not args.regex:
        return "--regex must not be empty"
    if args.choice is not None and not all(args.choice):
        return "--choice must not be empty"
    return None


def json_schema_of(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON schema in the file at ``path``, or why it cannot be one (naming the file, and the line and
    column where it is not JSON)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as exc:
        return None, f"--json-schema {path}: cannot read it ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return None, f"--json-schema {path}: not UTF-8 text"
    except json.JSONDecodeError as exc:
        return None, f"--json-schema {path}: not JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    if not isinstance(value, dict):
        return None, f"--json-schema {path}: a JSON schema is an object, not a {type(value).__name__}"
    return value, None


def add_generate_arguments(parser: Any, prompt_default: str | None, json_help: str) -> None:
    """A one-request command's options (`strata generate` and the runtime's ``generate``): the prompt as
    text or ids, the sampling, the stops, the shape of the reply, and the output (``--json`` as
    ``json_help`` says)."""
    what = parser.add_mutually_exclusive_group()
    prompt_help = "prompt text" if prompt_default is None else f"prompt text (default: {prompt_default})"
    what.add_argument("--prompt", default=prompt_default, help=prompt_help)
    what.add_argument("--prompt-ids", help="prompt token ids, comma-separated (1,2,3)")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (default 0: none)")
    add_penalty_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    add_bad_word_argument(parser)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate past the model's end-of-text tokens, to --max-tokens or a stop string",
    )
    add_logprobs_argument(parser)
    add_json_arguments(parser)
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument("--quiet", action="store_true", help="no progress bar, start-up log or summary")


def add_chat_arguments(parser: Any) -> None:
    """A terminal chat's options (`strata chat` and the runtime's ``chat``): the system message, the
    sampling (by default as Qwen3's model cards recommend without reasoning), the seed, and the output."""
    parser.add_argument("--system", help="a system message that starts the conversation")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens a reply may generate (512)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    parser.add_argument("--top-p", type=float, default=0.8, help="top-p (default 0.8)")
    parser.add_argument("--top-k", type=int, default=20, help="top-k (default 20; 0: none)")
    add_penalty_arguments(parser)
    parser.add_argument("--seed", type=int, help="seed of the first reply, the next ones +1 each")
    parser.add_argument(
        "--no-think",
        action="store_true",
        help="a model that reasons (Qwen3) answers without reasoning (its template's enable_thinking off)",
    )
    parser.add_argument(
        "--thinking-budget",
        type=int,
        metavar="N",
        help="a model that reasons reasons for at most N tokens a reply, then answers",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per turn instead of the text")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, start-up log or turn lines")


def chat_problem(args: Any) -> str | None:
    """Why a terminal chat's options (`add_chat_arguments`) are not valid."""
    if args.max_tokens < 1:
        return f"--max-tokens must be at least 1, not {args.max_tokens}"
    if args.seed is not None and not 0 <= args.seed < 2**63:
        return f"--seed must be in [0, 2^63), not {args.seed}"
    if args.thinking_budget is not None and args.thinking_budget < 1:
        return f"--thinking-budget must be at least 1, not {args.thinking_budget}"
    if args.thinking_budget is not None and args.no_think:
        return "--thinking-budget bounds the reasoning that --no-think turns off: give one of them"
    return options_problem(args)
