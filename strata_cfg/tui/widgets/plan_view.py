"""The plan view: what the profile in the editor resolves to, redrawn after every edit.

From the top: problems (when the profile is refused, above the last plan that resolved, which is dimmed), the
summary with the batch line, the decisions, the stage table, and one VRAM bar per GPU. A feature the profile
asked for that a rule turned off is marked ``!`` in red, in the batch line and first among the decisions.

The text of each part is made by a small pure function of the plan, so tests can read it and the widgets
only place it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from ...render import holds_text
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
    if b.mtp:
        text.append("batch MTP on", style=ON_STYLE)
    elif batch_mtp_forced_off(plan) is not None:
        text.append("! batch MTP off", style=REQUESTED_STYLE)
        text.append(" although asked for", style=SEVERITY_STYLE["off"])
    else:
        text.append("batch MTP off", style="dim")
    return text


def summary_rows(plan: LaunchPlan) -> list[tuple[str, Text]]:
    """(label, text) lines: the model, the batch line, spec and memory."""
    f = plan.model.facts
    model = plan.model.label()
    s = plan.spec
    spec = f"window {s.draft_tokens}: token + {s.draft_tokens - 1} MTP proposals" if s.mtp else "no drafting"
    if s.pipeline_windows:
        spec += f", {s.pipeline_windows} pipeline windows"
    m = plan.memory
    return [
        ("model", Text(f"{model}, {f.dtype}, {f.num_hidden_layers} layers")),
        ("batch", batch_text(plan)),
        ("spec", Text(spec)),
        ("memory", Text(f"{m.context} tokens per slot, KV {m.kv_dtype}")),
    ]


def summary_table(plan: LaunchPlan) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(ratio=1)
    for label, text in summary_rows(plan):
        table.add_row(label, text)
    return table


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


def decisions_table(decisions: Sequence[Decision]) -> RenderableType:
    if not decisions:
        return Text("no rule changed anything", style="dim")
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(ratio=1, overflow="fold")  # a long path folds rather than ending in "..."
    # Asked-for settings that were turned off come first: they are what the user must see.
    for d in sorted(decisions, key=lambda d: not d.requested):
        table.add_row(*decision_row(d))
    return table


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


class PlanView(VerticalScroll, can_focus=True):
    """The resolved plan, or the problems that refuse it above the last plan that resolved."""

    def compose(self) -> ComposeResult:
        yield Static(id="plan-problems", classes="plan-part")
        yield Static(id="plan-summary", classes="plan-part")
        yield Static("[b]decisions[/b]", classes="plan-heading plan-part")
        yield Static(id="plan-decisions", classes="plan-part")
        yield Static("[b]stages[/b]", classes="plan-heading plan-part")
        yield Static(id="plan-stages", classes="plan-part")
        yield Static("[b]VRAM by purpose[/b] (MiB)", classes="plan-heading plan-part")
        yield VramBars(id="plan-vram", classes="plan-part")

    def show(
        self, plan: LaunchPlan | None, problems: Sequence[Problem] = (), path: str | None = None
    ) -> None:
        """Show ``plan``; with ``problems``, show them on top and ``plan`` (the last good one) dimmed."""
        refused = self.query_one("#plan-problems", Static)
        refused.update(problems_text(problems, path) if problems else "")
        refused.display = bool(problems)
        self.set_class(bool(problems), "-stale")
        for part in self.query(".plan-part"):
            if part.id != "plan-problems":
                part.display = plan is not None
        if plan is None:
            self.border_title = "plan"
            return
        self.border_title = f"plan: {plan.profile}" + (" (last that resolved)" if problems else "")
        self.query_one("#plan-summary", Static).update(summary_table(plan))
        self.query_one("#plan-stages", Static).update(stages_table(plan))
        self.query_one("#plan-vram", VramBars).show(plan)
        self.query_one("#plan-decisions", Static).update(decisions_table(plan.decisions))
