"""N-gram lookup: proposals read from the request's own text (``spec.method = "ngram"``).

Replies often repeat what came before them: code that is edited, a document that is quoted, a list that is
continued, a loop the model fell into. So the tokens that followed the last time the text read as it reads
now are a good guess at what follows next. `TextLookup` keeps a request's tokens (its prompt, then its
reply) and, for the latest ``longest`` down to ``shortest`` of them, finds where they last occurred before;
the tokens after that occurrence are proposed. The longest run that matches anywhere wins: a longer match
is a better guess.

The proposals are verified exactly like a drafter's (`strata_runtime.engine.speculative.verify`): greedy
text is the text without them, and sampled text keeps the target's distribution, each proposal read as
drawn from a distribution certain of it (accepted with the target's probability of it, otherwise the token
is drawn from the target's distribution without it). A lookup costs the host a few vectorised comparisons
over the text (tens of microseconds at 32,000 tokens) and no GPU work, and it needs no MTP weights.
"""

from __future__ import annotations

import numpy as np


class TextLookup:
    """A request's tokens so far, and the proposals they give."""

    def __init__(self, prompt: tuple[int, ...] | list[int], shortest: int, longest: int) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths {shortest}..{longest}: need 1 <= shortest <= longest")
        self.shortest, self.longest = shortest, longest
        self._tokens = np.zeros(max(64, 2 * len(prompt)), np.int64)
        self._n = 0
        self._reply = 0
        """How many of the reply's tokens ``_tokens`` holds after the prompt."""
        self.on_device = 0
        """How many of the first tokens the device's history of this request holds (windows decided on the
        device look up there, `strata_runtime.models.ops.lookup`): a window the host launches copies the
        rest first (`text`)."""
        self.device_missed = False
        """Whether the latest window decided on the device found no run for the window after it (whose
        proposals then only repeat the last token): no window is chained after that one."""
        self._extend(prompt)

    def __len__(self) -> int:
        return self._n

    def _extend(self, tokens: tuple[int, ...] | list[int]) -> None:
        need = self._n + len(tokens)
        if need > len(self._tokens):
            grown = np.zeros(max(need, 2 * len(self._tokens)), np.int64)
            grown[: self._n] = self._tokens[: self._n]
            self._tokens = grown
        self._tokens[self._n : need] = tokens
        self._n = need

    def text(self, start: int, end: int) -> np.ndarray:
        """Tokens ``start`` to ``end`` (a copy)."""
        assert 0 <= start <= end <= self._n
        return self._tokens[start:end].copy()

    def follow(self, generated: list[int]) -> None:
        """Take in the reply's tokens that are new since the last call (``generated`` is the whole reply so
        far, which only grows while the request decodes)."""
        if len(generated) > self._reply:
            self._extend(generated[self._reply :])
            self._reply = len(generated)

    def propose(self, most: int, end: int | None = None) -> list[int]:
        """Up to ``most`` tokens to follow the first ``end`` tokens (default: all of them): the tokens after
        the latest earlier occurrence of the longest run of their last tokens that occurred before, from
        ``longest`` down to ``shortest`` tokens; none where no run did.

        Where the occurrence is close behind (a loop of a few tokens), its continuation runs into the tokens
        it proposes, and reads on through them: a loop of period p proposes the loop, as far as ``most``."""
        n = self._n if end is None else end
        if most <= 0 or n < self.shortest + 1:
            return []
        text = self._tokens[:n]
        last = text[n - 1]
        # Where the last token occurred before (the end of each candidate occurrence), latest last.
        ends = np.flatnonzero(text[: n - 1] == last)
        matched = 1
        found: int | None = None
        while ends.size:
            if matched >= self.shortest:
                found = int(ends[-1])
            if matched == self.longest:
                break
            ends = ends[ends >= matched]  # room for one more token before the occurrence
            ends = ends[text[ends - matched] == text[n - 1 - matched]]
            matched += 1
        if found is None:
            return []
        out: list[int] = []
        at = found + 1
        while len(out) < most:
            out.append(int(text[at]) if at < n else out[at - n])
            at += 1
        return out
