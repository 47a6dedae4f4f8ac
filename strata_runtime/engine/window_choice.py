"""What the engine has measured of its decode windows, and the choices it makes from it (`WindowChoice`):
how deep a request alone drafts (each request's `DraftGauge`), and whether slots decoding together take
batch-MTP or serial windows.

Both follow ``spec.adaptive_depth``: the windows' measured times by row count and what earlier requests'
proposals did, kept per kind of request (`request_kind`) or of window (`window_kind`), since a sampled or
penalised window takes longer to decide and its drafts hold less often than a greedy one's. A seeded
sampled request never follows measured times (`keeps_windows`).
"""

from __future__ import annotations

import copy

from strata_cfg.schema.plan import LaunchPlan

from .depth import PRIOR_WEIGHT, Holds, WindowCosts, batch_mtp_pays
from .sampling import Sampler
from .slot import Slot
from .speculative import DraftGauge, drafting_pays


def request_kind(sampler: Sampler) -> str:
    """``greedy`` or ``sampled``, with ``, penalised`` for a logit bias or a penalty, or stop tokens held off
    by ``min_tokens`` (`Sampler.adjusts`), and ``, grammar`` for windows the host decides
    (`Sampler.host_only`: a grammar or bad words of several tokens, and the window of a spent think budget's
    close): requests whose solo
    windows take different times to decide, and whose drafts hold differently often."""
    kind = ("greedy" if sampler.greedy else "sampled") + (", penalised" if sampler.adjusts else "")
    return kind + (", grammar" if sampler.host_only else "")


def window_kind(kind: str, samplers: list[Sampler]) -> str:
    """A batch window's kind (``serial``, ``batch-mtp``) and what deciding it takes: sampled if any of its
    requests samples, penalised if any adjusts, grammar if any follows one (``batch-mtp, sampled``)."""
    sampled = any(not s.greedy for s in samplers)
    adjusts = any(s.adjusts for s in samplers)
    grammar = any(s.host_only for s in samplers)
    out = f"{kind}, {'sampled' if sampled else 'greedy'}" + (", penalised" if adjusts else "")
    return out + (", grammar" if grammar else "")


def keeps_windows(sampler: Sampler) -> bool:
    """A seeded sampled request: which tokens it draws depends on which of its windows carry proposals, and
    its seed promises the same text on every run, so its windows never follow measured times (which differ
    from run to run)."""
    return not sampler.greedy and sampler.params.seed is not None


class WindowChoice:
    """The plan's drafting settings with what the windows measured, and the choices made from them."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.depth = plan.windows.solo_rows - 1
        """Proposals a solo window drafts at most after its token (0: the plan does not draft)."""
        self.adaptive = plan.spec.adaptive_depth and self.depth > 0
        """Whether a request alone drafts as many proposals as pay (`strata_runtime.engine.depth`); else every
        drafting solo window drafts ``depth``."""
        self.adaptive_batch = plan.spec.adaptive_depth and plan.batch.mtp and plan.batch.mode == "serial"
        """Whether slots decoding together take batch-MTP or serial windows by their measured times."""
        self.floor = plan.spec.draft_floor
        self.lookup = plan.spec.ngram
        """Drafting by n-gram lookup: every request probes silently (a lookup costs the host, no window)."""
        self.slots_per_window = plan.batch.slots_per_window
        self.solo: dict[str, tuple[WindowCosts, Holds]] = {}
        """For each kind of request (`request_kind`), its solo windows' measured times by row count and what
        its earlier requests' proposals did."""
        self.batch: dict[str, WindowCosts] = {}
        """Serial and batch-MTP windows' measured times by row count, per `window_kind`."""
        self.batch_mtp_last = True
        """Whether the last batch decode window was a batch-MTP one (the kind a switch must beat)."""

    # ---- a request alone ---------------------------------------------------------------------------

    def gauge(self, sampler: Sampler) -> DraftGauge:
        """A request's draft gauge. Its solo depth is chosen from the window times and from what earlier
        requests of its kind measured, except for a seeded sampled request, which drafts the full depth
        whenever it drafts (`keeps_windows`)."""
        silent = self.lookup or not sampler.needs_logits
        if not self.adaptive or keeps_windows(sampler):
            return DraftGauge(self.floor, None, self.depth, silent=silent)
        costs, prior = self._solo(sampler)
        return DraftGauge(self.floor, costs, self.depth, prior, silent=silent)

    def observe_solo(self, sampler: Sampler, rows: int, ms: float) -> None:
        """A solo window of ``rows`` rows of this request took ``ms`` (it replayed its shape: the time the
        shape takes)."""
        if self.adaptive:
            self._solo(sampler)[0].observe(rows, ms)

    def _solo(self, sampler: Sampler) -> tuple[WindowCosts, Holds]:
        return self.solo.setdefault(request_kind(sampler), (WindowCosts(), Holds(PRIOR_WEIGHT)))

    # ---- slots decoding together -------------------------------------------------------------------

    def batch_timed(self, slots: list[Slot]) -> bool:
        """Whether a batch window of these decoding slots is chosen by, and measured into, `batch`: with
        ``spec.adaptive_depth``, in serial mode, when one batch-MTP window holds them all and none is a
        seeded sampled request (`keeps_windows`)."""
        return (
            self.adaptive_batch
            and len(slots) <= self.slots_per_window
            and not any(keeps_windows(s.sampler) for s in slots)
        )

    def batch_drafts(self, slots: list[Slot], probe: bool = True, now_batch_mtp: bool | None = None) -> bool:
        """Whether the next window of these decoding slots carries a proposal for each (batch MTP): drafting
        pays by the floor (`drafting_pays`, a probe with ``probe``) and, where `batch_timed`, a batch-MTP
        window gives more tokens per second than a serial one by their measured times (`batch_mtp_pays`;
        serial windows of as many slots run until their time is measured). ``now_batch_mtp``: the kind in
        use (default: the last batch window's)."""
        gauges = [s.gauge for s in slots]
        if not drafting_pays(gauges, probe):
            return False
        return (probe and any(g.probe_due for g in gauges)) or not self.serial_wins(slots, now_batch_mtp)

    def serial_wins(self, slots: list[Slot], now_batch_mtp: bool | None = None) -> bool:
        """Where `batch_timed`: whether serial windows of these slots give more tokens per second than
        batch-MTP ones by their measured times (`batch_mtp_pays`), or are not measured yet (so they run)."""
        if not self.batch_timed(slots):
            return False
        now = self.batch_mtp_last if now_batch_mtp is None else now_batch_mtp
        chances = [s.gauge.estimate for s in slots]
        serial, batch = self._batch(slots, "serial"), self._batch(slots, "batch-mtp")
        return not batch_mtp_pays(chances, serial, batch, now)  # None: serial windows not measured yet

    def observe_batch(self, kind: str, slots: list[Slot], rows: int, ms: float | None) -> None:
        """A ``serial`` or ``batch-mtp`` window of these slots finished, taking ``ms`` where it replayed its
        shape (None: it ran something for the first time). Where `batch_timed`, its time counts; and after a
        batch-MTP window whose drafting pays by the floor while serial windows still give more, its slots
        probe half as often (and as usual again once batch MTP wins)."""
        if kind not in ("serial", "batch-mtp") or not self.batch_timed(slots):
            return
        if ms is not None:
            self._batch(slots, kind).observe(rows, ms)
        if kind == "batch-mtp" and drafting_pays([s.gauge for s in slots], probe=False):
            serial = self.serial_wins(slots)
            for s in slots:
                if serial:
                    s.gauge.wait_longer()
                else:
                    s.gauge.wait_as_usual()

    def lookup_costs(self, slots: list[Slot]) -> WindowCosts | None:
        """Under n-gram lookup with ``spec.adaptive_depth``: the measured times, by row count, of serial
        windows of these slots' kind, by which they take looked-up proposals (None: they take every spare
        row)."""
        return self._batch(slots, "serial") if self.lookup and self.adaptive else None

    def observe_lookup(self, kind: str, slots: list[Slot], rows: int, ms: float | None) -> None:
        """A window finished: under n-gram lookup, a serial window's time counts in `lookup_costs` (where it
        replayed its shape: ``ms`` is not None)."""
        if kind != "serial" or ms is None:
            return
        costs = self.lookup_costs(slots)
        if costs is not None:
            costs.observe(rows, ms)

    def _batch(self, slots: list[Slot], kind: str) -> WindowCosts:
        return self.batch.setdefault(window_kind(kind, [s.sampler for s in slots]), WindowCosts())

    # ---- between requests and benchmark repeats ----------------------------------------------------

    def forget_requests(self) -> None:
        """Forget what proposals did (each request kind's acceptance); keep the measured window times."""
        self.solo = {kind: (costs, Holds(PRIOR_WEIGHT)) for kind, (costs, _) in self.solo.items()}

    def holds(self) -> dict[str, Holds]:
        """What earlier requests' proposals taught each request kind: the chance that a proposal at each
        position holds, from which a new request's drafting depth starts. A copy."""
        return {kind: copy.deepcopy(prior) for kind, (_, prior) in self.solo.items()}

    def restore_holds(self, state: dict[str, Holds]) -> None:
        """Each request kind's acceptance back to ``state`` (from `holds`); a kind not in it starts afresh.
        The measured window times are kept."""
        kinds = dict.fromkeys([*self.solo, *state])
        self.solo = {
            kind: (
                self.solo[kind][0] if kind in self.solo else WindowCosts(),
                copy.deepcopy(state[kind]) if kind in state else Holds(PRIOR_WEIGHT),
            )
            for kind in kinds
        }
