"""The whole model as the plan places it: stages on their devices, the MTP head and drafters on the last.

`Model.from_plan` loads (or generates) each stage's tensors straight onto that stage's device. `forward`
runs a window through every stage in order, moving its hidden rows from device to device; the engine's
pipelined schedule calls `Stage.forward` itself instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from strata_cfg.schema.plan import GpuPlan, LaunchPlan
from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..api import PlanMismatch, SamplingParams, Tokenizer
from ..backend import DTYPES, Array, Device, enable_peer_access, peer_access_enabled, transfer
from ..cuda.compile import first_runs, late_compile_summary
from ..experts.cache import Policy
from ..experts.helper_tier import HelperOutOfMemory
from ..experts.routing import RoutingModel, RoutingTables, routing_seed
from ..layout import Layout, Segment
from ..models.ops.adjust import Adjusts
from ..models.ops.choose import Draws
from ..models.ops.lookup import lookup_propose
from ..models.qwen3_moe import ModelArgs, Shapes, fuse_tensors, stage_shapes
from ..weights.checkpoint import Checkpoint, load_tensors
from ..weights.progress import Progress
from ..weights.synthetic import SyntheticModel
from ..weights.tokenizer import ByteTokenizer, tokenizer_for
from .adjust import TokenCounts
from .mtp import Drafter, MtpHead
from .stage import Stage, StageWeights


@dataclass
class WeightStore:
    """Weights shared by the models of one profile with the same stage layout (benchmark arms): each stage's
    tensors and expert cache by what determines them (model, device, layers, dtype, shapes, which experts
    live in host memory), so the arms hold one copy of the weights and one cache per stage. The key leaves
    out the model's routing, which changes which experts run, never the weights, and, where no expert cache
    is built over the stage, the MTP head: an arm that drafts with it beside one that does not adds the
    head's tensors to the same weights (`stage`).

    ``limits`` is the device memory all those models may hold on each GPU: the first model gets the plan's
    budget less its reserve, and each further model the KV, drafters and workspace it adds.
    """

    stages: dict[tuple[Any, ...], StageWeights] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)

    def limit(self, plan: LaunchPlan, device: Device) -> int | None:
        """The cap on ``device`` once a model of ``plan`` is built on these weights too."""
        gpu = next((g for g in plan.gpus if g.device == str(device)), None)
        if gpu is None:
            return None
        b = gpu.budget
        name = str(device)
        if name in self.limits:
            self.limits[name] += b.kv + b.drafters + b.workspace
        else:
            self.limits[name] = b.total - b.reserve
        return self.limits[name]

    def stage(
        self,
        key: tuple[Any, ...],
        shapes: Shapes,
        device: Device,
        dtype: DTypeLike,
        load: Callable[[Shapes], dict[str, Array]],
    ) -> StageWeights:
        """The stage weights stored under ``key``, loaded by ``load`` the first time. A later model that needs
        tensors the stored ones lack (the MTP head, for an arm that drafts beside one that does not) loads
        only those, into the same weights, and the device's cap grows by their size first."""
        shared = self.stages.get(key)
        if shared is None:
            shared = self.stages[key] = StageWeights(load(shapes))
            return shared
        missing = {name: shape for name, shape in shapes.items() if name not in shared.tensors}
        if missing:
            size = sum(int(np.prod(shape)) for shape in missing.values()) * np.dtype(dtype).itemsize
            if str(device) in self.limits:
                self.limits[str(device)] += size
                device.limit_memory(self.limits[str(device)])
            shared.tensors.update(load(missing))
        return shared


def plan_tokenizer(plan: LaunchPlan, ckpt: Checkpoint | None = None) -> Tokenizer:
    """The tokenizer of the plan's model, without loading it: its checkpoint's (``ckpt``, when it is open
    already), or byte-level ids for a synthetic preset."""
    vocab = plan.model.facts.vocab_size
    if plan.model.path is None:
        return ByteTokenizer(vocab)
    ckpt = ckpt if ckpt is not None else Checkpoint(plan.model.path)
    return tokenizer_for(str(ckpt.directory), vocab, ckpt.config)


def _load_fused(
    synth: SyntheticModel | None,
    ckpt: Checkpoint | None,
    device: Device,
    dtype: DTypeLike,
    progress: Progress | None,
    label: str,
    host: frozenset[str],
    wanted: Shapes,
) -> dict[str, Array]:
    """Tensors ``wanted`` on ``device`` (those named in ``host`` in host memory), generated by ``synth`` or
    read from ``ckpt``, in the CUDA path's fused layout (made once, for every model built on them)."""
    if synth is not None:
        loaded = synth.load(wanted, device, dtype, progress, label, host)
    else:
        assert ckpt is not None
        loaded = load_tensors(ckpt, wanted, device, dtype, progress, label, host)
    with device.use():
        fuse_tensors(device.xp, loaded)
    return loaded


def compute_dtypes(plan: LaunchPlan, device: Device) -> tuple[DTypeLike, DTypeLike]:
    """(weight/activation dtype, KV dtype) on ``device``: the plan's on GPUs, float32 on CPU devices."""
    if not device.is_cuda:
        return np.float32, np.float32
    out = []
    for what, name in (("model.dtype", plan.model.facts.dtype), ("memory.kv_dtype", plan.memory.kv_dtype)):
        if name not in DTYPES:
            raise PlanMismatch(
                f'{what} = {name!r}: CuPy has no {name} arrays; use "float16" (bfloat16 checkpoints are '
                "converted on load)"
            )
        out.append(DTYPES[name])
    return out[0], out[1]


def _check_facts(plan: LaunchPlan, args: ModelArgs) -> None:
    facts = plan.model.facts
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
    ):
        planned, actual = getattr(facts, name), getattr(args, name)
        if planned != actual:
            raise PlanMismatch(
                f"the plan was resolved for {name} = {planned}, but the model has {actual}; resolve again"
            )


def routing_tables(plan: LaunchPlan, args: ModelArgs, slots: int) -> RoutingTables | None:
    """Every slot's calibrated-routing tables, when the plan asks for calibrated routing."""
    if plan.model.routing != "calibrated":
        return None
    if plan.model.synthetic is None:
        raise PlanMismatch(
            'model.routing = "calibrated" is for synthetic presets; this plan names a checkpoint'
        )
    if args.num_experts == 0:
        raise PlanMismatch(
            f'model.routing = "calibrated": preset {plan.model.synthetic!r} has no routed experts'
        )
    model = RoutingModel(args.num_hidden_layers, args.num_experts, args.num_experts_per_tok, plan.model.seed)
    return RoutingTables(model, slots)


def routed_expert_names(args: ModelArgs, layers: tuple[int, int], mtp: bool) -> list[str]:
    """The stacked routed-expert tensors of main-model layers [a, b), and of the MTP head's layer."""
    prefixes = [f"model.layers.{i}." for i in range(*layers) if args.is_sparse(i)]
    if mtp and args.num_experts:
        prefixes.append("mtp.layers.0.")
    return [f"{p}mlp.experts.{part}" for p in prefixes for part in ("gate_up_proj", "down_proj")]


def gpu_of(plan: LaunchPlan, index: int) -> GpuPlan:
    """The plan's GPU of index ``index``."""
    return next(g for g in plan.gpus if g.index == index)


def expert_slots(plan: LaunchPlan) -> list[int | None]:
    """Each stage's VRAM expert slots when its GPU cannot hold all its routed experts (None: all fit).

    The plan counts a GPU's routed experts over its stages' layers and, on the last stage, the MTP head's
    layer: they all share the stage's cache. Stages on one GPU (a test split) share its slots in
    proportion to their experts.
    """
    out: list[int | None] = []
    for sp in plan.stages:
        gpu = gpu_of(plan, sp.gpu)
        if gpu.experts_resident >= gpu.experts_total:
            out.append(None)
            continue
        on_gpu = [s for s in plan.stages if s.gpu == sp.gpu]
        share = (sp.layers[1] - sp.layers[0]) / sum(s.layers[1] - s.layers[0] for s in on_gpu)
        out.append(int(gpu.experts_resident * share))
    return out


def helper_slots(plan: LaunchPlan) -> list[list[tuple[str, int]]]:
    """Each stage's share of the helper tier: (device, slots) on each helper GPU of the plan (its
    ``experts.helper_devices`` and its ``experts.peer_device``, both role "helper").

    A helper GPU holds, by the plan, ``experts_resident`` experts that the stage GPUs could not. They are
    shared among the stages whose experts overflow their VRAM cache, in proportion to what each still lacks
    (helper GPUs in the plan's order), as the resolver sized them from the stages' overflow.
    """
    slots = expert_slots(plan)
    lacking = []
    for sp, n in zip(plan.stages, slots, strict=True):
        gpu = next(g for g in plan.gpus if g.index == sp.gpu)
        on_gpu = [s for s in plan.stages if s.gpu == sp.gpu]
        share = (sp.layers[1] - sp.layers[0]) / sum(s.layers[1] - s.layers[0] for s in on_gpu)
        lacking.append(0 if n is None else max(0, int(gpu.experts_total * share) - n))
    out: list[list[tuple[str, int]]] = [[] for _ in plan.stages]
    for gpu in plan.gpus:
        if gpu.role != "helper" or gpu.experts_resident == 0 or not any(lacking):
            continue
        for i, n in enumerate(proportional(min(gpu.experts_resident, sum(lacking)), lacking)):
            if n:
                out[i].append((gpu.device, n))
                lacking[i] -= n
    return out


def proportional(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders first, ties to the earlier); no
    share exceeds its weight when ``total`` is at most their sum."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    out = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def check_helper_access(plan: LaunchPlan, stage: Device, helper: Device) -> None:
    """Refuse a helper tier the stage's GPU cannot read directly (its kernels read it over peer-to-peer)."""
    if not (stage.is_cuda and helper.is_cuda) or peer_access_enabled(stage, helper):
        return
    index = helper.index
    key = "experts.peer_device" if plan.experts.peer_device == index else "experts.helper_devices"
    value = index if key == "experts.peer_device" else list(plan.experts.helper_devices)
    raise PlanMismatch(
        f"{key} = {value}: {stage} cannot read {helper}'s memory directly (peer access is not enabled "
        f"between them), and its expert kernels read the helper tier over peer-to-peer; use GPUs that "
        f"can access each other, or leave out {key}"
    )


def out_of_memory(plan: LaunchPlan, stage: int, device: Device, exc: BaseException) -> str:
    """Why stage ``stage`` (or its helper tier) did not fit ``device``: the plan's budget for it, and what
    to change."""
    if isinstance(exc, HelperOutOfMemory):
        device = exc.device
    gpu = next((g for g in plan.gpus if g.device == str(device)), None)
    budget = "" if gpu is None else f" (its plan: {gpu.budget.mib()} MiB)"
    what = f"the helper tier of stage {stage}" if isinstance(exc, HelperOutOfMemory) else f"stage {stage}"
    return (
        f"{what} does not fit {device} within the plan's budget{budget}: {exc}. Raise "
        "memory.vram_reserve_mib if the card holds other work, or lower experts.cache or memory.context"
    )


def _until_captured(layers: Any, rows: int, run: Callable[[], object]) -> int:
    """Run windows of ``rows`` rows through ``layers`` (a `strata_runtime.cuda.decode.CudaLayers`) until its
    graph for them is captured: at most twice (once eagerly, once capturing). Returns the windows run."""
    ran = 0
    while rows not in layers.captured and ran < 2:
        run()
        ran += 1
    return ran


class Model:
    """Stages in order, plus the MTP head and one drafter per slot on the last stage's device."""

    def __init__(
        self,
        stages: list[Stage],
        args: ModelArgs,
        mtp: MtpHead | None,
        drafters: dict[int, Drafter],
        tokenizer: Tokenizer,
        routing: RoutingTables | None = None,
    ) -> None:
        self.stages, self.args, self.mtp, self.drafters = stages, args, mtp, drafters
        self.tokenizer = tokenizer
        self.routing = routing  # every slot's calibrated-routing tables, or None for the router's own
        self.peer_access: list[str] = []
        """One line per pair of stage GPUs: whether they copy to each other directly."""

    @property
    def last(self) -> Stage:
        return self.stages[-1]

    @classmethod
    def from_plan(
        cls, plan: LaunchPlan, progress: Progress | None = None, weights: WeightStore | None = None
    ) -> Model:
        """Build the plan's model. ``weights`` (optional) shares tensors between models of the same stage
        layout, so that benchmark arms of one profile hold one copy of the weights."""
        devices = [Device.parse(s.device) for s in plan.stages]
        helpers = [[(Device.parse(name), n) for name, n in parts] for parts in helper_slots(plan)]
        helper_devices = [d for parts in helpers for d, _ in parts]
        for d in dict.fromkeys(devices + helper_devices):
            d.check()
        peer_access = enable_peer_access(devices + helper_devices)
        for device, parts in zip(devices, helpers, strict=True):
            for helper, _ in parts:
                check_helper_access(plan, device, helper)
        if plan.model.synthetic is not None:
            if plan.model.layer_scale is None:
                raise PlanMismatch("a synthetic preset without model.layer_scale: resolve the plan again")
            synth = SyntheticModel(plan.model.synthetic, plan.model.seed, plan.model.layer_scale)
            config, ckpt = synth.config, None
        elif plan.model.path is not None:
            ckpt = Checkpoint(plan.model.path)
            config, synth = ckpt.config, None
        else:
            raise PlanMismatch("the plan names neither a model path nor a synthetic preset")
        args = ModelArgs.from_config(config)
        _check_facts(plan, args)
        has_mtp = plan.model.facts.mtp_layers > 0
        drafting = plan.spec.mtp or plan.batch.mtp
        if drafting and not has_mtp:
            raise PlanMismatch("the plan drafts with MTP, but the model has no MTP weights")
        slots, context = max(plan.batch.slots, 1), plan.memory.context
        routing = routing_tables(plan, args, slots)
        cache_slots = expert_slots(plan)
        store = weights if weights is not None else WeightStore()
        for d in dict.fromkeys(devices + helper_devices):
            d.limit_memory(store.limit(plan, d))
        stages: list[Stage] = []
        tensors: dict[str, Array] = {}
        for sp, device in zip(plan.stages, devices, strict=True):
            first, last = sp.index == 0, sp.index == len(plan.stages) - 1
            dtype, kv_dtype = compute_dtypes(plan, device)
            head = last and drafting
            shapes = stage_shapes(args, sp.layers, first=first, last=last, mtp=head)
            cached = cache_slots[sp.index] is not None
            host = frozenset(routed_expert_names(args, sp.layers, head) if cached else ())
            label = f"stage {sp.index} on {device}"
            # Arms with and without the MTP head share a stage's other weights where no expert cache is built
            # over them (a cache covers the head's experts too).
            main = shapes if cached else stage_shapes(args, sp.layers, first=first, last=last, mtp=False)
            key = (
                plan.model.model_dump_json(exclude={"routing"}),
                str(device),
                sp.layers,
                first,
                last,
                str(np.dtype(dtype)),
                tuple(main),
                tuple(sorted(host)),
                tuple((str(d), n) for d, n in helpers[sp.index]),
            )
            try:
                load = partial(_load_fused, synth, ckpt, device, dtype, progress, label, host)
                shared = store.stage(key, shapes, device, dtype, load)
                tensors = shared.tensors
                stages.append(
                    Stage(
                        sp.index,
                        device,
                        sp.layers,
                        args,
                        tensors,
                        first=first,
                        last=last,
                        slots=slots,
                        context=context,
                        kv_dtype=kv_dtype,
                        routing=routing,
                        expert_slots=cache_slots[sp.index],
                        head_experts_whole=head and gpu_of(plan, sp.gpu).experts_whole > 0,
                        policy=Policy.of(plan.experts),
                        shared=shared,
                        helpers=helpers[sp.index],
                        prefill_split_q=plan.model.prefill_q == "split",
                        attention_tc=plan.model.decode_attention == "tensor_cores",
                        prompt_graph_rows=plan.memory.prompt_graph_rows,
                        prefill_graph_rows=plan.memory.prefill_graph_rows,
                    )
                )
            except MemoryError as exc:  # CuPy's OutOfMemoryError is one
                raise PlanMismatch(out_of_memory(plan, sp.index, device, exc)) from exc
        mtp, drafters = None, {}
        last_stage = stages[-1]
        if drafting:
            dtype, kv_dtype = compute_dtypes(plan, last_stage.device)
            first_stage = stages[0]

            def embed(ids: Array) -> Array:
                if not isinstance(ids, np.ndarray):  # ids on the last device
                    ids = transfer(ids, last_stage.device, first_stage.device)
                return transfer(first_stage.embed(ids), first_stage.device, last_stage.device)

            mtp = MtpHead(
                tensors,
                args,
                last_stage.device,
                last_stage.rope,
                last_stage.lm_head,
                embed,
                prompt_graph_rows=plan.memory.prompt_graph_rows,
                prefill_graph_rows=plan.memory.prefill_graph_rows,
            )
            mtp.share_experts(last_stage)
            if plan.spec.draft_head == "int8":
                try:
                    mtp.quantize_head()
                except MemoryError as exc:
                    raise PlanMismatch(
                        out_of_memory(plan, plan.last_stage.index, last_stage.device, exc)
                    ) from exc
            ids = list(plan.last_stage.drafters) or list(range(slots))
            mtp_kv = None
            if last_stage.device.is_cuda:
                # One MTP KV [1, S, K, T, D] for every drafter (each keeps a view of its slot), so that one
                # CUDA graph can serve draft windows of any slots.
                shape = (1, slots, args.num_key_value_heads, context, args.head_dim)
                mtp_kv = (last_stage.device.zeros(shape, kv_dtype), last_stage.device.zeros(shape, kv_dtype))
                split_q, tc = plan.model.prefill_q == "split", plan.model.decode_attention == "tensor_cores"
                if mtp.use_cuda(*mtp_kv, split_q=split_q, attention_tc=tc) is not None:
                    mtp_kv = None
            drafters = {
                s: Drafter(
                    s,
                    last_stage.device,
                    args,
                    context,
                    dtype,
                    kv_dtype,
                    kv_arrays=(mtp_kv[0][:, s : s + 1], mtp_kv[1][:, s : s + 1]) if mtp_kv else None,
                )
                for s in ids
            }
        tokenizer = plan_tokenizer(plan, ckpt)
        model = cls(stages, args, mtp, drafters, tokenizer, routing)
        model.peer_access = peer_access
        # Loading filled the weights, the expert tables and the caches on each device's default stream, which
        # the engine's non-blocking streams do not wait for: a window queued before those copies landed
        # would read stale memory (an expert table's addresses among it).
        for d in dict.fromkeys(devices + helper_devices):
            d.wait_idle()
        return model

    # ---- running windows ---------------------------------------------------------------------------

    def forward(self, tokens: np.ndarray, layout: Layout) -> Array:
        """A window through every stage: post-final-norm hidden rows [R, H] on the last stage's device."""
        hidden = self.stages[0].embed(tokens)  # [R, H]
        prev = self.stages[0].device
        for stage in self.stages:
            hidden = stage.forward(transfer(hidden, prev, stage.device), layout)  # [R, H]
            prev = stage.device
        return self.last.final_norm(hidden)

    def logits(self, normed: Array) -> Array:
        return self.last.logits(normed)

    def capture_window_graphs(self) -> int:
        """Capture the CUDA graph of every decode window shape: 1 to `MAX_WINDOW_ROWS` rows through each
        GPU stage's layers and through the drafting head (its windows at host positions and at positions
        decided on the device run on graphs of their own). A shape not yet captured runs until it is (once
        eagerly, then captured), so that no request's window pays for either: a short prompt's last window
        and the last window of a request near its end take any row count. Returns the windows run.

        The windows read zeros as slot 0 at positions 0 to R - 1 and write those positions of its KV and of
        the drafters' KV, which a request then in the slot has written before and would lose: call this only
        while no request holds a slot, and slot 0 keeps no prefix for reuse (it refuses otherwise). A
        request's own prompt writes them again before anything reads them.
        """
        if any(self.kv_lengths(0)) or (0 in self.drafters and self.drafters[0].length):
            raise RuntimeError(
                f"capturing window graphs writes slot 0's KV, which holds {self.kv_lengths(0)} positions"
            )
        # These windows run on each device's current stream, not the engine's: they wait for what the
        # engine's streams queued (a warm-up's windows and copies), and what is queued after waits for them.
        devices = list(dict.fromkeys(stage.device for stage in self.stages))
        for device in devices:
            device.wait_idle()
        ran = 0
        for rows in range(1, MAX_WINDOW_ROWS + 1):
            layout = Layout.of([(0, rows, 0)])
            for stage in self.stages:
                if stage.cuda is not None:
                    with stage.device.use():
                        hidden = stage.device.zeros((rows, self.args.hidden_size), np.float32)
                        run = partial(stage.forward, hidden, layout, account=False)
                        ran += _until_captured(stage.cuda, rows, run)
            head = self.mtp.cuda if self.mtp is not None else None
            if head is not None:
                device = self.last.device
                with device.use():
                    zeros = device.zeros((rows, self.args.hidden_size), np.float32)
                    positions = device.upload(np.arange(rows, dtype=np.int32))
                    ran += _until_captured(head.layers, rows, partial(head.forward, zeros, zeros, layout))
                    run = partial(head.forward, zeros, zeros, layout, positions)
                    ran += _until_captured(head.device_layers, rows, run)
        for device in devices:
            device.wait_idle()
        return ran

    @staticmethod
    def compiled_at_launch() -> dict[str, object]:
        """GPU kernels compiled when a window first launched them rather than when the stages were built
        (`strata_runtime.cuda.compile.late_compile_summary`; the count is the process's)."""
        return late_compile_summary()

    @staticmethod
    def first_runs() -> int:
        """How many times this process has run something on a GPU for the first time (a kernel compiled at
        its launch, a decode window run eagerly or captured): a window during which this grew is no
        measure of its shape's time (`strata_runtime.cuda.compile.first_runs`)."""
        return first_runs()

    def argmax(self, logits: Array) -> Array:
        """Each row's argmax [R] (int64) of logits on the last stage's device."""
        return self.last.argmax(logits)

    def choose(self, logits: Array, draws: Draws) -> Array:
        """Each row's token chosen on the last stage's device (`strata_runtime.model.stage.Stage.choose`)."""
        return self.last.choose(logits, draws)

    def distribution(self, logits: Array, params: SamplingParams) -> Array:
        """Each row's next-token distribution [R, V] (float64) at a request's temperature, top-k, top-p and
        min-p, on the last stage's device (`strata_runtime.model.stage.Stage.distribution`)."""
        p = params
        return self.last.distribution(logits, p.temperature, p.top_k, p.top_p, p.min_p)

    def draw(self, probs: Array, uniforms: Array) -> Array:
        """Each row's draw [R] (int64) from probs [R, V] (float64) at uniforms [R] (float64), both on the last
        stage's device: the first token whose cumulative weight exceeds its uniform times the row's total
        (`strata_runtime.model.stage.Stage.draw`)."""
        return self.last.draw(probs, uniforms)

    def look_up(
        self, history: Array, lengths: Array, shortest: int, longest: int, most: int
    ) -> tuple[Array, Array]:
        """An n-gram lookup in each of histories [S, C] on the last stage's device, the first ``lengths``
        [S] tokens of each its text: (proposals [S, most], found [S]), by the rule of
        `strata_runtime.models.ops.lookup.lookup_propose` (one kernel on a GPU)."""
        with self.last.device.use():
            return lookup_propose(history, lengths, shortest, longest, most)

    def verify_sampled(self, p: Array, q: Array, tokens: Array, uniforms: Array) -> tuple[Array, Array]:
        """Speculative rejection sampling of one slot's window on the last stage's device: (proposals kept,
        the token after them), by the rule of `strata_runtime.models.ops.distribution.verify_sampled`
        (`strata_runtime.model.stage.Stage.verify_sampled`)."""
        return self.last.verify_sampled(p, q, tokens, uniforms)

    def mask(self, logits: Array, rows: np.ndarray, bits: np.ndarray) -> None:
        """A grammar's masks on the last stage's device: rows ``rows`` of logits [R, V] in place
        (`strata_runtime.model.stage.Stage.mask`)."""
        self.last.mask(logits, rows, bits)

    def adjust(
        self, logits: Array, adjusts: Adjusts, tokens: Array | None = None
    ) -> tuple[Array, Array] | None:
        """A window's logit bias and penalties on the last stage's device: rows of logits [R, V] adjusted in
        place (`strata_runtime.model.adjust.TokenCounts.adjust`); returns what `count_chosen` takes."""
        return self.token_counts.adjust(logits, adjusts, tokens)

    def count_chosen(self, rows: Array, slots: Array, chosen: Array) -> None:
        """Count the adjusted rows' chosen tokens [R] for their slots (after `adjust`)."""
        self.token_counts.count_chosen(rows, slots, chosen)

    @property
    def token_counts(self) -> TokenCounts:
        """Every slot's token counts and logit bias, on the last stage's device."""
        counts = self.last.token_counts
        assert counts is not None
        return counts

    def admit(self, slot: int, prompt_ids: tuple[int, ...]) -> None:
        """A request with these prompt ids now holds ``slot``: give it its routing (calibrated routing only;
        its tables follow from the prompt, so the same prompt routes the same way in any slot or mode),
        waiting for each GPU's copy. An engine queues the copies on its stages' streams instead
        (`Executor.admit`)."""
        if self.routing is None:
            return
        self.routing.admit(slot, prompt_ids)
        for stage in self.stages:
            stage.load_routing(slot)

    def routing_key(self, prompt_ids: tuple[int, ...]) -> int | None:
        """What a request's routing depends on besides its tokens: with calibrated routing the seed of its
        tables, which its whole prompt chooses (`admit`); None where the router's own weights route."""
        return None if self.routing is None else routing_seed(prompt_ids)

    def rewind(self, slot: int, length: int) -> None:
        """Forget positions [length, ...) of ``slot`` on every stage."""
        for stage in self.stages:
            stage.kv.rewind(slot, length)

    def settle(self, slot: int, base: int, rows: int, kept: int) -> None:
        """Account a window decided on the device (`strata_runtime.engine.device_spec`): it wrote ``rows``
        positions of ``slot`` from ``base`` on every stage and in the slot's drafter, and ``kept`` of them
        hold. The same checks as a window accounted at launch: it must start where the slot's KV ends."""
        written = (Segment(slot, 0, rows, base),)
        for stage in self.stages:
            stage.kv.begin(written)
            stage.kv.rewind(slot, base + kept)
        drafter = self.drafters.get(slot)
        if drafter is not None:
            drafter.rewind(min(drafter.length, base))  # host drafting may have run ahead of the slot
            drafter.kv.begin((Segment(0, 0, rows, base),))
            drafter.rewind(base + kept)

    def kv_lengths(self, slot: int) -> list[int]:
        return [int(s.kv.lengths[slot]) for s in self.stages]
