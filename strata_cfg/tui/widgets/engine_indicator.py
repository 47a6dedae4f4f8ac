"""The engine indicator at the right of the status line: ``engine demo :8000 ready``.

Hidden until a launch starts an engine (or Ctrl+L finds one running). From then on it looks at the engine
every half second, in a thread, and keeps the last look in `Engine.state`, which the launch page shows too;
it stops looking once the supervisor is gone, since nothing restarts the engine after that.
"""

from __future__ import annotations

import asyncio

from textual.timer import Timer
from textual.widgets import Static

from ..engine import POLL_S, Engine, indicator_text


class EngineIndicator(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.engine: Engine | None = None
        self._timer: Timer | None = None

    def watch_engine(self, engine: Engine) -> None:
        """Show ``engine`` and look at it from now on."""
        self.engine = engine
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(POLL_S, self.look)
        self.show_state()

    def show_state(self) -> None:
        self.display = self.engine is not None
        if self.engine is not None:
            self.update(indicator_text(self.engine))

    async def look(self) -> None:
        engine = self.engine
        if engine is None:
            return
        state = await asyncio.to_thread(engine.look)
        self.show_state()
        if not state.supervisor_alive and self._timer is not None:
            self._timer.stop()
            self._timer = None
