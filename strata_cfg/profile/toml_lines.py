"""Where each key of a TOML document is written: dotted key -> 1-based line.

`tomllib` returns values without positions, and error messages must name the line a key is on. This is a
small scanner over the same text that records, for every key, the line where it is written: table headers
(``[a.b]``), arrays of tables (``[[a.b]]`` -> ``a.b.0``, ``a.b.1``), dotted keys (``a.b = 1``), quoted keys,
arrays (``layers = [1, 2]`` -> ``layers.0``) and inline tables (``gpus = [{ name = "x" }]`` ->
``gpus.0.name``). It only has to be right for documents `tomllib` accepts; on anything else it stops
quietly, since `tomllib`'s own error then names the line.

It also finds the line where arrays and inline tables nest deeper than a limit, before `tomllib` (which
recurses once per level) reads them: a profile nests a few levels, and text nested thousands deep is
refused at its line instead of exhausting the stack.
"""

from __future__ import annotations

_BARE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SCALAR_END = set(",]}#\n\r")


SCAN_DEPTH = 64
"""The scanner stops at this nesting of arrays and inline tables (it recurses once per level)."""


class _Stop(Exception):
    """The text is not TOML this scanner understands; keep what was indexed so far."""


class _TooDeep(_Stop):
    """Arrays or inline tables nest deeper than the scanner's limit, at ``line``."""

    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


class _Scanner:
    def __init__(self, text: str, max_depth: int = SCAN_DEPTH) -> None:
        self.s = text
        self.i = 0
        self.line = 1
        self.lines: dict[str, int] = {}
        self.aot_count: dict[str, int] = {}
        self.depth = 0
        self.max_depth = max_depth

    # ---- characters -------------------------------------------------------------------------------

    def peek(self, n: int = 0) -> str:
        j = self.i + n
        return self.s[j] if j < len(self.s) else ""

    def advance(self, n: int = 1) -> None:
        for _ in range(n):
            if self.i < len(self.s):
                if self.s[self.i] == "\n":
                    self.line += 1
                self.i += 1

    def skip_ws(self) -> None:
        while self.peek() in (" ", "\t"):
            self.advance()

    def skip_comment(self) -> None:
        if self.peek() == "#":
            while self.peek() not in ("\n", ""):
                self.advance()

    def skip_ws_newlines_comments(self) -> None:
        while True:
            c = self.peek()
            if c in (" ", "\t", "\r", "\n"):
                self.advance()
            elif c == "#":
                self.skip_comment()
            else:
                return

    # ---- keys -------------------------------------------------------------------------------------

    def simple_key(self) -> str:
        c = self.peek()
        if c == '"':
            return self.basic_string()
        if c == "'":
            return self.literal_string()
        start = self.i
        while self.peek() in _BARE and self.peek():
            self.advance()
        if self.i == start:
            raise _Stop
        return self.s[start : self.i]

    def dotted_key(self) -> list[str]:
        parts = [self.simple_key()]
        self.skip_ws()
        while self.peek() == ".":
            self.advance()
            self.skip_ws()
            parts.append(self.simple_key())
            self.skip_ws()
        return parts

    # ---- strings ----------------------------------------------------------------------------------

    def basic_string(self) -> str:
        if self.s.startswith('"""', self.i):
            self.advance(3)
            end = self.s.find('"""', self.i)
            while end != -1 and self._escaped(end):
                end = self.s.find('"""', end + 1)
            if end == -1:
                raise _Stop
            # A closing run may hold up to two extra quotes that belong to the string.
            while self.s.startswith('"', end + 3):
                end += 1
            text = self.s[self.i : end]
            self.advance(end + 3 - self.i)
            return text
        self.advance()
        chars: list[str] = []
        while True:
            c = self.peek()
            if c in ("", "\n"):
                raise _Stop
            if c == "\\":
                chars.append(self.s[self.i : self.i + 2])
                self.advance(2)
                continue
            self.advance()
            if c == '"':
                return "".join(chars)
            chars.append(c)

    def _escaped(self, j: int) -> bool:
        n = 0
        while j - 1 - n >= 0 and self.s[j - 1 - n] == "\\":
            n += 1
        return n % 2 == 1

    def literal_string(self) -> str:
        if self.s.startswith("'''", self.i):
            self.advance(3)
            end = self.s.find("'''", self.i)
            if end == -1:
                raise _Stop
            while self.s.startswith("'", end + 3):
                end += 1
            out = self.s[self.i : end]
            self.advance(end + 3 - self.i)
            return out
        self.advance()
        end = self.s.find("'", self.i)
        if end == -1 or "\n" in self.s[self.i : end]:
            raise _Stop
        out = self.s[self.i : end]
        self.advance(end + 1 - self.i)
        return out

    # ---- values -----------------------------------------------------------------------------------

    def record(self, path: list[str], line: int) -> None:
        self.lines.setdefault(".".join(path), line)

    def value(self, path: list[str]) -> None:
        c = self.peek()
        if c == '"':
            self.basic_string()
        elif c == "'":
            self.literal_string()
        elif c in "[{":
            self.depth += 1
            if self.depth > self.max_depth:
                raise _TooDeep(self.line)
            if c == "[":
                self.array(path)
            else:
                self.inline_table(path)
            self.depth -= 1
        else:
            start = self.i
            while self.peek() and self.peek() not in _SCALAR_END:
                self.advance()
            if self.i == start:
                raise _Stop

    def array(self, path: list[str]) -> None:
        self.advance()  # [
        index = 0
        while True:
            self.skip_ws_newlines_comments()
            if self.peek() == "]":
                self.advance()
                return
            if not self.peek():
                raise _Stop
            self.record([*path, str(index)], self.line)
            self.value([*path, str(index)])
            index += 1
            self.skip_ws_newlines_comments()
            if self.peek() == ",":
                self.advance()
            elif self.peek() != "]":
                raise _Stop

    def inline_table(self, path: list[str]) -> None:
        self.advance()  # {
        while True:
            self.skip_ws_newlines_comments()
            if self.peek() == "}":
                self.advance()
                return
            self.key_value(path)
            self.skip_ws_newlines_comments()
            if self.peek() == ",":
                self.advance()
            elif self.peek() != "}":
                raise _Stop

    def key_value(self, prefix: list[str]) -> None:
        line = self.line
        key = self.dotted_key()
        if self.peek() != "=":
            raise _Stop
        self.advance()
        self.skip_ws()
        full = [*prefix, *key]
        for n in range(len(prefix) + 1, len(full) + 1):
            self.record(full[:n], line)
        self.value(full)

    # ---- document ---------------------------------------------------------------------------------

    def header(self) -> list[str]:
        line = self.line
        aot = self.s.startswith("[[", self.i)
        self.advance(2 if aot else 1)
        self.skip_ws()
        key = self.dotted_key()
        if not self.s.startswith("]]" if aot else "]", self.i):
            raise _Stop
        self.advance(2 if aot else 1)
        for n in range(1, len(key)):
            self.record(key[:n], line)
        if aot:
            name = ".".join(key)
            index = self.aot_count.get(name, 0)
            self.aot_count[name] = index + 1
            self.record(key, line)
            key = [*key, str(index)]
        self.record(key, line)
        return key

    def document(self) -> None:
        prefix: list[str] = []
        while True:
            self.skip_ws_newlines_comments()
            if not self.peek():
                return
            if self.peek() == "[":
                prefix = self.header()
            else:
                self.key_value(prefix)
            self.skip_ws()
            self.skip_comment()


def key_lines(text: str) -> dict[str, int]:
    """Map every dotted key written in ``text`` (tables, keys, array elements) to its 1-based line."""
    return index_keys(text, SCAN_DEPTH)[0]


def index_keys(text: str, limit: int) -> tuple[dict[str, int], int | None]:
    """`key_lines` in the same pass as the line where arrays or inline tables first nest deeper than
    ``limit`` (None if they never do; then the lines are complete)."""
    scanner = _Scanner(text, max_depth=limit)
    try:
        scanner.document()
    except _TooDeep as exc:
        return scanner.lines, exc.line
    except _Stop:
        pass
    return scanner.lines, None
