"""Incremental detokenization: the text a request streams equals a whole decode of its tokens, and each
window decodes only a bounded number of tokens however long the generation has run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata_runtime.api import Request, RequestHandle
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.slot import Slot
from strata_runtime.weights.tokenizer import ByteTokenizer, HFTokenizer


class Counting:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def decode(self, ids):
        self.calls.append(len(ids))
        return self.inner.decode(ids)


def _slot(tokenizer, max_tokens: int) -> Slot:
    req = Request((1, 2), max_tokens)
    return Slot(0, RequestHandle(req), Sampler(req.sampling, 0), frozenset(), tokenizer, admitted_at=0)


def _stream(slot: Slot, ids: list[int], g: np.random.Generator) -> str:
    """Emit ``ids`` in random windows of 1 to 5 tokens; the text the client receives."""
    sent, a = "", 0
    while a < len(ids):
        b = min(len(ids), a + int(g.integers(1, 6)))
        sent += slot.emit(ids[a:b], int(g.integers(0, 3))).text
        a = b
    return sent


def _mixed_text(g: np.random.Generator, n: int) -> str:
    """ASCII, 2-, 3- and 4-byte UTF-8 characters, and spaces, in random order."""
    pieces = ["a", "z", " ", "é", "ß", "中", "文", "🙂", "🚀", "\n", "Q", "7"]
    return "".join(pieces[i] for i in g.integers(0, len(pieces), n))


def test_streamed_text_equals_a_whole_decode_with_byte_tokens():
    g = np.random.default_rng(101)
    tok = ByteTokenizer(384)
    text = _mixed_text(g, int(g.integers(300, 600)))
    ids = tok.encode(text)
    specials = list(ByteTokenizer.SPECIALS.values())
    for at in g.integers(0, len(ids), 3):  # special tokens between characters render as their names
        while at < len(ids) and 0x80 <= ids[at] < 0xC0:  # not inside a UTF-8 sequence
            at += 1
        ids.insert(int(at), specials[int(g.integers(0, 2))])
    slot = _slot(Counting(tok), max_tokens=len(ids))
    assert _stream(slot, ids, g) == tok.decode(ids)
    assert slot.finished == "length"


def test_each_window_decodes_a_bounded_number_of_tokens():
    g = np.random.default_rng(102)
    tok = Counting(ByteTokenizer(384))
    ids = ByteTokenizer(384).encode(_mixed_text(g, 3000))
    slot = _slot(tok, max_tokens=len(ids))
    assert _stream(slot, ids, g) == ByteTokenizer(384).decode(ids)
    # Windows of at most 5 tokens, characters of at most 4 bytes: the stretch kept last time (a window and
    # an incomplete character's 3 bytes) as context, the 3 bytes held since, and this window. A whole decode
    # per window would reach every token.
    assert max(tok.calls) <= (5 + 3) + 3 + 5
    assert sum(tok.calls) < 6 * len(ids)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small BPE tokenizer with a Metaspace pre-tokenizer: pieces render their leading space only in the
    middle of a text, the case that needs decoding context."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<|eos|>", *byte_tokens])
    corpus = ["the quick brown fox jumps over the lazy dog", "streaming text token by token", "naïve café"]
    tok.train_from_iterator(corpus * 50, trainer)
    d = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    return d


def test_streamed_text_equals_a_whole_decode_with_a_metaspace_bpe(hf_dir):
    g = np.random.default_rng(103)
    tok = HFTokenizer(hf_dir, {})
    words = ["the", "quick", "fox", "token", "streaming", "café", "naïve", "中文", "🙂", "dog"]
    text = " ".join(words[i] for i in g.integers(0, len(words), 200))
    ids = tok.encode(text)
    assert len(ids) > 200
    counting = Counting(tok)
    slot = _slot(counting, max_tokens=len(ids))
    assert _stream(slot, ids, g) == tok.decode(ids)
    assert max(counting.calls) < 40
