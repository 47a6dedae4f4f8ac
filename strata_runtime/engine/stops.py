"""Stop strings: where a reply ends, decided as its text arrives window by window.

This is the one place the runtime cuts text at stop strings; `strata_runtime.engine.slot` feeds it each
window's new text, whoever asked (the HTTP server or `python -m strata_runtime generate`).

The rule is the one a server that checks after every token follows (OpenAI's "stop generating further
tokens", vLLM, transformers' stop-string criterion): generation stops as soon as any stop string is
complete, and the reply is cut where that stop string begins. For the stops ``("bcd", "c")`` and the text
``"abcd"`` that is ``"ab"``: ``"c"`` is complete at the third character, before ``"bcd"`` is. A rule that
preferred the occurrence starting earliest (``"a"``) would have to read past a complete stop string to
decide, and would cut differently depending on where the windows happen to split the text.
"""

from __future__ import annotations


class StopText:
    """Cuts a reply at its first stop string, as its text arrives piece by piece.

    "First" is the stop string that is complete earliest in the text (the one generation would have
    stopped at, one character at a time), whatever the pieces are; of two complete at the same character,
    the longer. Text that could still be the beginning of a stop string is held back until the next piece
    decides it, so what was sent is always a prefix of the final, cut reply. Empty stop strings are ignored.
    """

    def __init__(self, stops: tuple[str, ...], held: bool = False, keep: bool = False) -> None:
        """``held``: no stop string counts until `arm` says from where (a reply short of its
        ``min_tokens``). ``keep``: the reply ends with the stop string it is cut at, instead of before it."""
        self.stops = tuple(s for s in stops if s)
        self.keep = keep
        self.after: int | None = None if held else 0
        """A stop string counts only where it ends past this many characters of the reply; None: none counts
        yet."""
        self.pending = ""
        self.stopped = False
        self.hit: str | None = None
        """The stop string the reply was cut at, once it was."""
        self.end = 0
        """Where in the reply's text (characters from its start) that stop string ends, once it was hit."""
        self._seen = 0

    def feed(self, text: str) -> str:
        """The part of ``pending + text`` that is safe to send now."""
        if self.stopped:
            return ""
        buf = self.pending + text
        offset = self._seen - len(self.pending)  # where ``buf`` begins in the reply's text
        self._seen += len(text)
        # (end, start) of each stop string's first occurrence: the earliest end wins, then the longest.
        hits = [(i + len(s), i) for s in self.stops if (i := self._find(buf, s, offset)) >= 0]
        if hits:
            end, start = min(hits)
            self.stopped, self.pending, self.hit = True, "", buf[start:end]
            self.end = offset + end
            return buf[: end if self.keep else start]
        hold = max((_overlap(buf, s) for s in self.stops), default=0)
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def arm(self, after: int) -> None:
        """Stop strings count from now on where they end past ``after`` characters of the reply (the text of
        its first ``min_tokens`` tokens)."""
        self.after = after

    def _find(self, buf: str, stop: str, offset: int) -> int:
        """Where ``stop`` first occurs in ``buf`` (which begins ``offset`` characters into the reply) and
        counts; -1 where it does not."""
        if self.after is None:
            return -1
        return buf.find(stop, max(0, self.after - offset - len(stop) + 1))

    def flush(self) -> str:
        """What was held back, once the reply ended without a stop string."""
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``stop``."""
    for k in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-k:]):
            return k
    return 0
