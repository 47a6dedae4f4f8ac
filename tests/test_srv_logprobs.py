"""Log-probabilities on the wire: each token's name and bytes, the legacy completions object and the chat one,
and the bytes each tokenizer gives a token (a piece of a UTF-8 character included)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata_cfg.schema.sampling_options import MAX_TOP_LOGPROBS as CLI_MAX
from strata_runtime.api import MAX_TOP_LOGPROBS, TokenLogprob, token_name
from strata_runtime.engine.logprobs import token_logprobs
from strata_runtime.server import protocol as p
from strata_runtime.weights.tokenizer import ByteTokenizer, HFTokenizer

BYTES = ByteTokenizer(300)


def test_the_command_line_and_the_api_take_the_same_number_of_alternatives():
    assert CLI_MAX == MAX_TOP_LOGPROBS


def test_a_token_holding_part_of_a_character_is_named_by_its_bytes():
    e_acute = "é".encode()  # two bytes, two tokens of the byte tokenizer
    assert token_name(BYTES, e_acute[0]) == ("bytes:\\xc3", [0xC3])
    assert token_name(BYTES, ord("a")) == ("a", [97])
    assert token_name(BYTES, 258) == ("<|im_end|>", list(b"<|im_end|>"))
    assert token_name(BYTES, 290) == ("", [])  # an unused id stands for nothing


def test_completion_logprobs_offsets_and_top_with_the_token_itself():
    entries = [
        TokenLogprob(ord("H"), -0.5, ((ord("H"), -0.5), (ord("h"), -1.5))),
        TokenLogprob(ord("i"), -2.0, ((ord("o"), -0.3),)),  # sampled: not among the top one
        TokenLogprob(ord("!"), -0.1, ()),
    ]
    got = p.completion_logprobs(BYTES, entries, offset=4)
    assert got["tokens"] == ["H", "i", "!"]
    assert got["token_logprobs"] == [-0.5, -2.0, -0.1]
    assert got["text_offset"] == [4, 5, 6]
    assert got["top_logprobs"] == [{"H": -0.5, "h": -1.5}, {"o": -0.3, "i": -2.0}, {"!": -0.1}]
    json.dumps(got)  # plain JSON


def test_chat_logprobs_give_each_tokens_bytes_and_alternatives():
    entries = [TokenLogprob(0xC3, -0.25, ((0xC3, -0.25), (ord("e"), -1.75))), TokenLogprob(0xA9, -0.01, ())]
    got = p.chat_logprobs(BYTES, entries)
    assert got["refusal"] is None
    first, second = got["content"]
    assert first == {
        "token": "bytes:\\xc3",
        "logprob": -0.25,
        "bytes": [0xC3],
        "top_logprobs": [
            {"token": "bytes:\\xc3", "logprob": -0.25, "bytes": [0xC3]},
            {"token": "e", "logprob": -1.75, "bytes": [101]},
        ],
    }
    assert bytes(first["bytes"] + second["bytes"]).decode() == "é"
    assert second["top_logprobs"] == []


def test_token_logprobs_are_the_log_softmax_of_each_row():
    g = np.random.default_rng(11)
    raw = g.normal(0.0, 3.0, (4, 50)).astype(np.float32) + 0.25
    tokens = [int(g.integers(0, 50)) for _ in range(3)]  # three tokens: the fourth row is not read
    got = token_logprobs(raw, tokens, top=5)
    rows = raw[:3].astype(np.float64)
    log_softmax = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
    for j, lp in enumerate(got):
        assert lp.token == tokens[j]
        assert lp.logprob == pytest.approx(log_softmax[j, tokens[j]], abs=1e-12)
        best = np.argsort(-log_softmax[j], kind="stable")[:5]
        assert [t for t, _ in lp.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], log_softmax[j, best], atol=1e-12)
    assert all(lp.top == () for lp in token_logprobs(raw, tokens, top=0))


def _trained(pre_tokenizer, decoder, tmp_path, byte_fallback=False):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, trainers

    tok = tokenizers.Tokenizer(
        models.BPE(unk_token="<unk>" if byte_fallback else None, byte_fallback=byte_fallback)
    )
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    specials = ["<unk>", *(f"<0x{b:02X}>" for b in range(256))] if byte_fallback else []
    kwargs = {} if byte_fallback else {"initial_alphabet": tokenizers.pre_tokenizers.ByteLevel.alphabet()}
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, **kwargs)
    tok.train_from_iterator(["the quick brown fox", "naïve café", "a line of text"] * 30, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path, {})


TEXT = "the naïve fox 中文 🙂 café"


def test_a_byte_level_bpe_tokens_bytes_add_up_to_the_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = _trained(
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), tokenizers.decoders.ByteLevel(), tmp_path
    )
    ids = tok.encode(TEXT)
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == TEXT.encode()
    assert any(len(part) == 1 and part[0] >= 0x80 for part in parts), "some token holds part of a character"


def test_a_sentencepiece_style_tokens_bytes_add_up_to_the_text(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import decoders, pre_tokenizers

    decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok = _trained(pre_tokenizers.Metaspace(), decoder, tmp_path, byte_fallback=True)
    ids = tok.encode(TEXT)
    joined = b"".join(tok.token_bytes(i) for i in ids)
    assert joined == b" " + TEXT.encode()  # the first word's ▁ is a space too


def test_a_checkpoints_chat_template_is_its_own_or_chatml(tmp_path):
    """``/tokenizer_info``'s template renders the chat as `apply_chat_template` lays it out: ChatML where the
    checkpoint has no template, its own where it has one."""
    tokenizers = pytest.importorskip("tokenizers")
    jinja2 = pytest.importorskip("jinja2")
    from strata_runtime.weights.tokenizer import chatml

    tok = _trained(
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), tokenizers.decoders.ByteLevel(), tmp_path
    )
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "naïve café"}]
    rendered = jinja2.Template(tok.chat_template).render(messages=messages, add_generation_prompt=True)
    assert rendered == chatml(messages)
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": own}))
    tok = HFTokenizer(tmp_path, {})
    assert tok.chat_template == own
    assert tok.decode(tok.apply_chat_template(messages)) == jinja2.Template(own).render(messages=messages)
