"""The plan view: what the profile in the editor resolves to, redrawn after every edit.

From the top: problems (when the profile is refused, above the last plan that resolved, which is dimmed), the
summary with the batch line (and a host-memory line when experts live in host memory), the decisions, the
stage table, and one VRAM bar per GPU. A feature the profile asked for that a rule turned off is marked ``!``
in red, in the batch line and first among the decisions.

After an edit, the summary lines and decisions it changed are highlighted, and the view scrolls to the first
thing that changed (stages and VRAM too), so a small terminal does not hide the effect of an edit. Each of
those lines is a widget of its own, so the view can scroll to exactly that line.

The text of each part is made by a small pure function of the plan, so tests can read it and the widgets
only place it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import OverflowMethod, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from ...report.plan_text import floor_text, holds_text, proposals_text
from ...schema.errors import Problem
from ...schema.plan import MIB, Budget, Decision, GpuPlan, LaunchPlan

TERMS: tuple[tuple[str, str], ...] = (
    # (budget term, colour)
    ("weights", "#5f87d7"),
    ("kv", "#af5fd7"),
    ("drafters", "#ffaf00"),
    ("workspace", "#00afaf"),
    ("reserve", "#8a8a8a"),
    ("experts", "#5faf5f"),
    ("free", "#444444"),
)
"""The VRAM terms in bar order, as the plan's `Budget` names them."""
SEVERITY_STYLE = {
    "error": "bold #ff5f5f",
    "off": "bold #ff8700",
    "clamp": "#ffd75f",
    "warn": "#ffd75f",
    "note": "#87afd7",
}
REQUESTED_STYLE = "bold #ffffff on #af0000"
"""How an asked-for setting that a rule turned off is marked."""
ON_STYLE = "bold #5fd75f"


def _mib(n: int) -> str:
    v = n / MIB
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


# ---- pure text ------------------------------------------------------------------------------------


def bar_cells(budget: Budget, width: int) -> list[int]:
    """Cells per term (in `TERMS` order) for a bar of ``width``: proportional to the bytes, every
    non-zero term at least one cell (so the drafters' few MiB still show), adding up to ``width``."""
    values = [max(getattr(budget, name), 0) for name, _ in TERMS]
    total = sum(values)
    if total == 0 or width <= 0:
        return [0] * len(values)
    nonzero = [i for i, v in enumerate(values) if v > 0]
    floor = 1 if len(nonzero) <= width else 0
    cells = [floor if v > 0 else 0 for v in values]
    spare = width - sum(cells)
    shares = [v / total * spare for v in values]
    for i in range(len(values)):
        cells[i] += int(shares[i])
    # Largest remainders take the cells that rounding down left over.
    left = width - sum(cells)
    for i in sorted(range(len(values)), key=lambda i: shares[i] - int(shares[i]), reverse=True)[:left]:
        cells[i] += 1
    return cells


def vram_bar(budget: Budget, width: int) -> Text:
    text = Text(no_wrap=True)
    for (name, colour), n in zip(TERMS, bar_cells(budget, width), strict=True):
        text.append(("░" if name == "free" else "█") * n, style=colour)
    return text


def vram_numbers(gpu: GpuPlan) -> Text:
    """``weights 1433  kv 368  drafters 25 ...`` in MiB, each name in its bar colour (zero terms left out)."""
    text = Text()
    b = gpu.budget
    for name, colour in TERMS:
        value = getattr(b, name)
        if value == 0 and name != "free":
            continue
        if text:
            text.append("  ")
        text.append(name, style=f"bold {colour}" if name != "free" else "bold")
        text.append(f" {_mib(value)}")
        if name == "experts" and gpu.experts_total:
            text.append(f" ({gpu.experts_resident}/{gpu.experts_total})", style="dim")
    return text


def vram_text(plan: LaunchPlan, width: int) -> Text:
    """Every GPU: a heading, a bar of ``width`` cells split by purpose, and the numbers."""
    text = Text()
    for g in plan.gpus:
        role = "" if g.role == "stage" else f" ({'expert helper' if g.role == 'helper' else 'idle'})"
        if text:
            text.append("\n")
        text.append(f"GPU {g.index}", style="bold")
        text.append(f" {g.name}{role}, {_mib(g.budget.total)} MiB\n", style="dim")
        text.append_text(vram_bar(g.budget, width))
        text.append("\n")
        text.append_text(vram_numbers(g))
    return text


def batch_mtp_forced_off(plan: LaunchPlan) -> Decision | None:
    """The decision that turned off batch MTP the profile asked for, if one did."""
    for d in plan.decisions:
        if d.key == "batch.mtp" and d.requested and d.severity in ("off", "error"):
            return d
    return None


def batch_text(plan: LaunchPlan) -> Text:
    """Slots, groups, mode, and batch MTP: on, off, or ``! off`` when the profile asked for it."""
    b = plan.batch
    text = Text(
        f"{b.slots} slot{'s' * (b.slots != 1)} · {b.groups} group{'s' * (b.groups != 1)} · {b.mode} · "
    )
    if b.mtp_in_groups:
        text.append(f"batch MTP inside {b.groups} pipelined groups", style=ON_STYLE)
    elif b.mtp:
        text.append("batch MTP on", style=ON_STYLE)
    elif batch_mtp_forced_off(plan) is not None:
        text.append("! batch MTP off", style=REQUESTED_STYLE)
        text.append(" although asked for", style=SEVERITY_STYLE["off"])
    else:
        text.append("batch MTP off", style="dim")
    return text


def host_text(plan: LaunchPlan) -> Text | None:
    """The host-memory budget in a few words, or None when neither experts nor a prefix store live in host
    memory."""
    h = plan.host
    if not h.total:
        return None
    parts = [f"{_mib(h.experts)} MiB experts pinned"] if h.experts else []
    if h.prefix_store:
        parts.append(f"{_mib(h.prefix_store)} MiB prefix store")
    text = Text(", ".join(parts) + "; ")
    if h.ram is None:
        text.append("RAM unknown", style="dim")
    else:
        text.append(f"RAM {_mib(h.ram)}, {_mib(h.free or 0)} free")
    return text


def summary_rows(plan: LaunchPlan) -> list[tuple[str, Text]]:
    """(label, text) lines: the model, the batch line, spec, memory, and host memory when experts or a
    prefix store live there."""
    f = plan.model.facts
    model = plan.model.label()
    s = plan.spec
    spec = proposals_text(plan) if s.drafts else "no drafting"
    if s.pipeline_windows:
        spec += f", {s.pipeline_windows} pipeline windows"
    floor = floor_text(plan)
    if floor is not None:
        spec += f", {floor}"
    m = plan.memory
    rows = [
        ("model", Text(f"{model}, {f.dtype}, {f.num_hidden_layers} layers")),
        ("batch", batch_text(plan)),
        ("spec", Text(spec)),
        ("memory", Text(f"{m.context} tokens per slot, KV {m.kv_dtype}")),
    ]
    host = host_text(plan)
    return rows if host is None else [*rows, ("host", host)]


def labelled_row(
    label: Text, body: Text, label_width: int, label_style: str = "", overflow: OverflowMethod = "ellipsis"
) -> Table:
    """One line of the summary or the decisions: ``label`` in a column of ``label_width``, then ``body``,
    wrapping under itself (each line is its own widget, so the columns line up by their fixed width)."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, width=label_width, style=label_style)
    table.add_column(ratio=1, overflow=overflow)
    table.add_row(label, body)
    return table


def summary_lines(plan: LaunchPlan) -> list[tuple[Text, Text]]:
    """(label, text) of the summary."""
    return [(Text(label), text) for label, text in summary_rows(plan)]


def stages_table(plan: LaunchPlan) -> Table:
    """GPU, layers, and what each stage holds (the drafters, with their slots, on the last one)."""
    table = Table(box=None, padding=(0, 1, 0, 0), show_edge=False, header_style="bold", expand=False)
    table.add_column("GPU", no_wrap=True)
    table.add_column("layers", no_wrap=True)
    table.add_column("holds", ratio=1)
    for s in plan.stages:
        a, b = s.layers
        holds = Text(holds_text(s))
        holds.highlight_regex(r"drafters \([^)]*\)", ON_STYLE if plan.batch.mtp else "#ffaf00")
        table.add_row(f"{s.gpu} {s.device}", f"{a}-{b - 1} ({b - a})", holds)
    for g in plan.gpus:
        if g.role != "stage":
            table.add_row(f"{g.index} {g.device}", "-", "expert helper" if g.role == "helper" else "idle")
    return table


def decision_row(d: Decision) -> tuple[Text, Text]:
    """(mark, body) of one decision: ``! OFF`` on red for an asked-for setting a rule turned off."""
    label = d.severity.upper() if d.severity != "note" else "note"
    mark = (
        Text(f"! {label}", style=REQUESTED_STYLE) if d.requested else Text(label, SEVERITY_STYLE[d.severity])
    )
    body = Text(d.rule, style=SEVERITY_STYLE[d.severity])
    body.append(f"  {d.message}", style="bold" if d.requested else "")
    if d.requested and d.origin:
        body.append(f" (asked at {d.origin})", style="dim")
    return mark, body


def decision_lines(decisions: Sequence[Decision]) -> list[tuple[Text, Text]]:
    """(mark, body) of every decision; the asked-for settings that were turned off first, as they are what
    the user must see."""
    return [decision_row(d) for d in sorted(decisions, key=lambda d: not d.requested)]


def changed_lines(before: Sequence[tuple[Text, Text]] | None, now: Sequence[tuple[Text, Text]]) -> list[bool]:
    """For each line of ``now``, whether ``before`` (the previous plan's lines) had no line like it; all
    False when there is no previous plan to compare with."""
    if before is None:
        return [False] * len(now)
    seen = {(a.plain, b.plain) for a, b in before}
    return [(a.plain, b.plain) not in seen for a, b in now]


def problems_text(problems: Sequence[Problem], path: str | None) -> Text:
    """``line 18  batch.slot: unknown key ...`` for this file; other files are named in full."""
    n = len(problems)
    text = Text(f"refused: {n} problem{'s' * (n != 1)}", style="bold #ff5f5f")
    for p in problems:
        same = p.file is not None and path is not None and p.file == path
        where = f"line {p.line}" if same and p.line else str(p.file or "") + (f":{p.line}" if p.line else "")
        text.append(f"\n{where}  ", style="bold")
        text.append(f"{p.key}: {p.message}" if p.key else p.message)
        if p.rule:
            text.append(f" [{p.rule}]", style="dim")
    return text


# ---- widgets --------------------------------------------------------------------------------------


class VramBars(Widget):
    """One bar per GPU, as wide as the view."""

    DEFAULT_CSS = "VramBars { height: auto; }"

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.plan: LaunchPlan | None = None

    def show(self, plan: LaunchPlan | None) -> None:
        self.plan = plan
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        if self.plan is None:
            return Text("")
        return vram_text(self.plan, max(self.content_size.width, 10))


class PlanLines(Widget):
    """A column of lines, one `Static` each, so that a line can be highlighted and scrolled to."""

    DEFAULT_CSS = "PlanLines { height: auto; layout: vertical; }"

    def fill(self, lines: Sequence[RenderableType], changed: Sequence[bool]) -> list[Static]:
        """Show ``lines`` (reusing the line widgets there are), marking the ``changed`` ones."""
        have = [c for c in self.children if isinstance(c, Static)]
        for static, line in zip(have, lines, strict=False):
            static.update(line)
        extra = [Static(line, classes="plan-line") for line in lines[len(have) :]]
        if extra:
            self.mount_all(extra)
        for static in have[len(lines) :]:
            static.remove()
        shown = have[: len(lines)] + extra
        for static, mark in zip(shown, changed, strict=True):
            static.set_class(mark, "-changed")
        return shown


class PlanView(VerticalScroll, can_focus=True):
    """The resolved plan, or the problems that refuse it above the last plan that resolved."""

    def compose(self) -> ComposeResult:
        yield Static(id="plan-problems", classes="plan-part")
        yield PlanLines(id="plan-summary", classes="plan-part")
        yield Static("[b]decisions[/b]", classes="plan-heading plan-part")
        yield PlanLines(id="plan-decisions", classes="plan-part")
        yield Static("[b]stages[/b]", classes="plan-heading plan-part")
        yield Static(id="plan-stages", classes="plan-part")
        yield Static("[b]VRAM by purpose[/b] (MiB)", classes="plan-heading plan-part")
        yield VramBars(id="plan-vram", classes="plan-part")

    def show(
        self,
        plan: LaunchPlan | None,
        problems: Sequence[Problem] = (),
        path: str | None = None,
        before: LaunchPlan | None = None,
    ) -> None:
        """Show ``plan``; with ``problems``, show them on top and ``plan`` (the last good one) dimmed.

        ``before`` is the plan the same file resolved to before this edit: what differs from it is
        highlighted and scrolled to. Without it (a profile just opened) the view starts at the top.
        """
        refused = self.query_one("#plan-problems", Static)
        refused.update(problems_text(problems, path) if problems else "")
        refused.display = bool(problems)
        self.set_class(bool(problems), "-stale")
        for part in self.query(".plan-part"):
            if part.id != "plan-problems":
                part.display = plan is not None
        if plan is None or problems or before is None:
            self.scroll_home(animate=False)
        if plan is None:
            self.border_title = "plan"
            return
        self.border_title = f"plan: {plan.profile}" + (" (last that resolved)" if problems else "")
        compare = before if before is not None and not problems else None
        changes = self._show_lines(
            "#plan-summary", summary_lines(plan), summary_lines(compare) if compare else None, "bold"
        ) + self._show_lines(
            "#plan-decisions",
            decision_lines(plan.decisions),
            decision_lines(compare.decisions) if compare else None,
            overflow="fold",  # a long path folds rather than ending in "..."
        )
        stages = self.query_one("#plan-stages", Static)
        stages.update(stages_table(plan))
        vram = self.query_one("#plan-vram", VramBars)
        vram.show(plan)
        if compare is not None:
            changes += [stages] * (compare.stages != plan.stages) + [vram] * (compare.gpus != plan.gpus)
        if changes:
            self.call_after_refresh(self._bring_into_view, changes[0])

    def _show_lines(
        self,
        part: str,
        now: list[tuple[Text, Text]],
        before: list[tuple[Text, Text]] | None,
        label_style: str = "",
        overflow: OverflowMethod = "ellipsis",
    ) -> list[Widget]:
        """Fill ``part`` with the lines ``now``; return the widgets of those not in ``before``."""
        if not now:
            self.query_one(part, PlanLines).fill([Text("no rule changed anything", style="dim")], [False])
            return []
        changed = changed_lines(before, now)
        width = max(label.cell_len for label, _ in now)
        lines = [labelled_row(label, body, width, label_style, overflow) for label, body in now]
        shown = self.query_one(part, PlanLines).fill(lines, changed)
        return [w for w, c in zip(shown, changed, strict=True) if c]

    def _bring_into_view(self, widget: Widget) -> None:
        if widget.is_mounted:
            self.scroll_to_widget(widget, animate=False)
