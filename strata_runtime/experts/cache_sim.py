"""What an expert-cache policy costs on routing traces, without a GPU.

A decode window at one row reads each expert its row routes to once, from wherever the cache holds it; an
expert in host memory crosses the host link, and so does each swap into a slot. So a policy's cost on a
stream of requests is the experts it moves over the host link per generated token: misses plus swaps. This
module replays requests' routing through `Residency` (the cache's own bookkeeping, unchanged) the way the
GPU path hands it over:

* a request's prompt is one chunk: its counts reach the cache at once, marked as a prompt;
* each decode window routes one row per stream; the counts of ``policy.every`` windows reach the cache
  together (the device counters are read that often, and every window while a rebalance stopped at
  ``max_swaps`` has more to do), and a rebalance is decided when one is due;
* a window is served by what the cache held ``lag`` windows before it (default 0: swaps take effect at
  once). On a GPU a rebalance lands later: the counters are read behind the window that filled them and
  handed over once that read has landed, while windows queued ahead run on, so the newcomers a rebalance
  brings are read from host memory by the windows in between (one stream on the 24 GiB profile: about one
  more read a swapped-in expert, docs/PERFORMANCE_LOG.md, "a twenty-second lease"). A cache that keeps its
  misses has no copies to land, but its new queue of victims lands as late: the windows in between take
  from the queue before it, and once that is used up they keep nothing (two streams use up a queue of 512
  in about five windows).

Requests run ``streams`` at a time, their decode windows together (a window of several rows then reads an
expert its rows share once, as the GPU's grouped decode kernels do). The first ``warm`` requests settle the
cache and are not counted. `scripts/cache_policy_sim.py` prints a table of policies over routing models.

Letters: L sparse layers, E experts, k experts per row, T positions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..reference.keep import Victims
from .cache import Policy, Residency
from .routing import RoutingModel


@dataclass(frozen=True)
class RequestTrace:
    """One request's routing: its prompt's counts [L, E] and each decode position's experts [T, L, k]."""

    prompt: np.ndarray
    decode: np.ndarray


@dataclass(frozen=True)
class Outcome:
    """What a policy moved over the host link, per generated token, once the cache had settled."""

    hit_rate: float
    """Share of decode assignments (row and chosen expert pairs) served from VRAM."""
    misses: float
    """Experts read from host memory per generated token (an expert a window's rows share counts once)."""
    swaps: float
    """Experts copied into slots per generated token (prompt rebalances included)."""
    largest: int = 0
    """The most experts one rebalance moved: the windows queued after it wait for their copies, so this
    sets the longest pause between a stream's tokens."""

    @property
    def link(self) -> float:
        """Experts over the host link per generated token."""
        return self.misses + self.swaps


def counts(rows: np.ndarray, n_experts: int) -> np.ndarray:
    """Routing counts [L, E] of rows [R, L, k]."""
    n_layers = rows.shape[1]
    out = np.zeros((n_layers, n_experts))
    layer = np.broadcast_to(np.arange(n_layers)[None, :, None], rows.shape)
    np.add.at(out, (layer.ravel(), rows.ravel()), 1)
    return out


def window_rows(group: Sequence[RequestTrace]) -> Iterator[np.ndarray]:
    """The decode windows of requests decoding together, one position each: the rows [R, L, k] of those still
    decoding."""
    for t in range(max(len(r.decode) for r in group)):
        yield np.concatenate([r.decode[t : t + 1] for r in group if t < len(r.decode)])


def distinct(rows: np.ndarray, n_experts: int) -> np.ndarray:
    """A window's distinct experts, as layer * E + expert, from its rows [R, L, k]."""
    return np.unique(rows + np.arange(rows.shape[1])[None, :, None] * n_experts)


def calibrated_requests(
    model: RoutingModel, prompts: Sequence[Sequence[int]], tokens: int
) -> list[RequestTrace]:
    """Each prompt's routing under the calibrated model: the prompt's positions, then ``tokens`` more."""
    out = []
    for prompt in prompts:
        seed, cdf = model.request(prompt)
        positions = np.arange(len(prompt) + tokens)
        rows = np.stack([model.intended(seed, cdf, j, positions) for j in range(model.n_layers)], axis=1)
        out.append(RequestTrace(counts(rows[: len(prompt)], model.n_experts), rows[len(prompt) :]))
    return out


def uniform_requests(
    rng: np.random.Generator, prompt_lengths: Sequence[int], tokens: int, layers: int, experts: int, k: int
) -> list[RequestTrace]:
    """Random routing, k distinct experts uniformly at every position (a random router's worst case)."""
    out = []
    for n in prompt_lengths:
        rows = np.argsort(rng.random((n + tokens, layers, experts)), axis=2)[:, :, :k]
        out.append(RequestTrace(counts(rows[:n], experts), rows[n:]))
    return out


def simulate(
    requests: Sequence[RequestTrace],
    slots: int,
    policy: Policy,
    *,
    streams: int = 1,
    warm: int = 0,
    lag: int = 0,
    prompt_lag: int | None = None,
) -> Outcome:
    """Replay ``requests``, ``streams`` at a time, through a cache of ``slots`` slots under ``policy``, each
    rebalance landing ``lag`` decode windows after it is decided, one a prompt brings ``prompt_lag``
    windows after (default: ``lag``; 0 as a GPU stage lands it, before the first window after the prompt,
    `strata_runtime.cuda.experts.CudaExperts.before_window`)."""
    late_prompt = lag if prompt_lag is None else prompt_lag
    if lag < 0 or late_prompt < 0:
        raise ValueError(
            f"a rebalance lands 0 or more windows after it is decided, not {min(lag, late_prompt)}"
        )
    n_layers, n_experts = requests[0].prompt.shape
    cache = Residency(n_layers, n_experts, slots, 1, policy)
    pending, windows = np.zeros((n_layers, n_experts)), 0
    hits = total = misses = swaps = tokens = 0.0
    largest = 0
    clock = 0  # decode windows so far
    landing: deque[tuple[int, np.ndarray]] = deque()  # (the window it lands at, what VRAM holds then)
    queues: deque[tuple[int, Victims]] = deque()  # keeping misses: (the window it lands at, a new queue)
    held = cache.slot_of >= 0  # what the windows read from now

    def hand_over(c: np.ndarray, w: int, prompt: bool = False) -> int:
        queue = cache.queue
        cache.observe(c, w, prompt=prompt)
        moved = len(cache.rebalance()) if cache.due() else 0
        at = clock + (late_prompt if prompt else lag)
        if moved:
            landing.append((at, cache.slot_of >= 0))
        if cache.queue is not queue and at > clock:  # the windows before it take from the queue they hold
            queues.append((at, cache.queue))
            cache.queue = queue
        return moved

    for start in range(0, len(requests), streams):
        group = requests[start : start + streams]
        counted = start >= warm
        for r in group:
            moved = hand_over(r.prompt, 1, prompt=True)
            swaps += moved if counted else 0
            largest = max(largest, moved if counted else 0)
        for rows in window_rows(group):
            c = counts(rows, n_experts)
            while landing and landing[0][0] <= clock:
                held = landing.popleft()[1]
            while queues and queues[0][0] <= clock:
                cache.queue = queues.popleft()[1]
            resident = cache.slot_of >= 0 if policy.keep_misses else held
            clock += 1
            if counted:
                total += c.sum()
                hits += c[resident].sum()
                misses += np.count_nonzero((c > 0) & ~resident)
                tokens += rows.shape[0]
            if policy.keep_misses:  # the window's reads keep what they miss, layer by layer
                for j in range(n_layers):
                    cache.admit(j, rows[:, j].ravel())
            pending += c
            windows += 1
            if windows >= policy.every or cache.backlog:
                moved = hand_over(pending, windows)
                swaps += moved if counted else 0
                largest = max(largest, moved if counted else 0)
                pending, windows = np.zeros_like(pending), 0
    if not tokens:
        raise ValueError(f"no request after the {warm} warm-up ones to measure")
    return Outcome(hits / total, misses / tokens, swaps / tokens, largest)


def foresight(requests: Sequence[RequestTrace], slots: int, *, streams: int = 1, warm: int = 0) -> Outcome:
    """The fewest experts any cache of ``slots`` slots moves over the host link per generated token on
    ``requests`` (decode windows grouped as `simulate` groups them): a cache that knows every window to
    come. An expert a window needs that is in no slot crosses the link once, whether it is then kept in a
    slot or only read; after each window the cache keeps, of what it held and what the window read, the
    experts needed again soonest. For experts of one size, each crossing at one cost, that is optimal
    (Belady's rule, applied a window at a time, the newcomers among the candidates), so a policy's misses
    plus swaps (`Outcome.link`) can come no lower. Prompts are not counted, as in `simulate`, and teach it
    nothing it does not know. ``misses`` counts every crossing, ``swaps`` is 0, and ``hit_rate`` is the
    share of the windows' distinct experts found in a slot.

    The cache starts empty; the first ``warm`` requests fill it and are not counted."""
    n_experts = requests[0].prompt.shape[1]
    windows: list[np.ndarray] = []  # each window's distinct experts, as layer * E + expert
    counted: list[bool] = []
    tokens = 0
    for start in range(0, len(requests), streams):
        group = requests[start : start + streams]
        for rows in window_rows(group):
            windows.append(distinct(rows, n_experts))
            counted.append(start >= warm)
            tokens += rows.shape[0] if start >= warm else 0
    if not tokens:
        raise ValueError(f"no request after the {warm} warm-up ones to measure")
    size = requests[0].prompt.size
    upcoming = np.full(size, len(windows))  # each expert's next window from the one at hand
    next_use: list[np.ndarray] = [np.empty(0, np.int64)] * len(windows)
    for w in range(len(windows) - 1, -1, -1):  # each need's next window, from the end
        next_use[w] = upcoming[windows[w]]
        upcoming[windows[w]] = w
    held = np.empty(0, np.int64)  # experts in a slot
    due = np.zeros(size, np.int64)  # each expert's next window, as known at its last use
    hits = crossings = 0
    for w, need in enumerate(windows):
        found = int(np.isin(need, held, assume_unique=True).sum())
        if counted[w]:
            hits += found
            crossings += len(need) - found
        due[need] = next_use[w]
        pool = np.union1d(held, need)
        held = pool[np.argsort(due[pool], kind="stable")[:slots]] if len(pool) > slots else pool
    return Outcome(hits / (hits + crossings), crossings / tokens, 0.0)


def filled_on_miss(
    requests: Sequence[RequestTrace], slots: int, decay: float, *, streams: int = 1, warm: int = 0
) -> Outcome:
    """A cache whose expert kernels keep what they read: an expert a window reads from host memory is written
    into a slot on its way, so keeping it costs no copy over the link, only the read it took anyway. It is
    kept over the expert held with the lowest score, where its own score is higher; a score is an
    exponential count of the windows that used the expert (each window multiplies every score by
    ``decay``, then adds one for each expert it reads), with a prompt's routing counts added as it is read.
    Decode windows grouped as `simulate` groups them; ``misses`` is every read from host memory, ``swaps``
    is 0 (nothing is copied). The cache starts empty; the first ``warm`` requests fill it and are not
    counted. An engine does not work this way: it is the policy a fill-on-miss design could run, for
    comparison with `simulate`'s and the `foresight` bound."""
    n_layers, n_experts = requests[0].prompt.shape
    score = np.zeros(n_layers * n_experts)
    held = np.zeros(n_layers * n_experts, bool)
    hits = reads = tokens = 0
    for start in range(0, len(requests), streams):
        group = requests[start : start + streams]
        counted = start >= warm
        for r in group:
            score += r.prompt.ravel()
        for rows in window_rows(group):
            need = distinct(rows, n_experts)
            score *= decay
            score[need] += 1
            miss = need[~held[need]]
            if counted:
                hits += len(need) - len(miss)
                reads += len(miss)
                tokens += rows.shape[0]
            room = slots - int(held.sum())
            held[miss[:room]] = True  # free slots first
            for x in miss[max(room, 0) :]:
                kept = np.flatnonzero(held & (score < score[x]))
                if len(kept):
                    held[kept[np.argmin(score[kept])]] = False
                    held[x] = True
    if not tokens:
        raise ValueError(f"no request after the {warm} warm-up ones to measure")
    return Outcome(hits / (hits + reads), reads / tokens, 0.0)
