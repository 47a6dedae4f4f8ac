"""The decode launchers, and the step workload, refuse what the kernels cannot take, before anything runs.

`strata_runtime.cuda.ops.Kernels` runs here on the NumPy stand-in for CuPy (`fake_cupy`), with no GPU: a
refusal is a `ValueError` naming the limit, raised before the launcher asks for a compiled kernel (which
the stand-in cannot give).
"""

from __future__ import annotations

import pytest
from fake_cupy import installed


@pytest.fixture(scope="module")
def kern_cp():
    with installed():
        import cupy as cp

        from strata_runtime.cuda import ops

        yield ops.Kernels(), cp, ops


def _moe_args(cp, rows: int, topk: int, experts: int, h: int = 256, inter: int = 256) -> tuple:
    from strata_runtime.cuda.experts import resident_experts

    gate_up = cp.zeros((experts, 2 * inter, h), cp.float16)
    down = cp.zeros((experts, h, inter), cp.float16)
    f32, i32 = cp.float32, cp.int32
    return (
        cp.zeros((rows, h), f32),  # x
        cp.zeros(h, cp.float16),  # norm
        cp.zeros((rows, experts), f32),  # router logits
        True,
        1e-6,
        resident_experts(gate_up, down, cp),
        cp.zeros((rows, h), f32),  # resid
        cp.zeros((rows, topk), i32),  # idx
        cp.zeros((rows, topk), f32),  # wts
        cp.zeros((rows * topk, inter), f32),  # h_buf
    )


def test_the_expert_kernels_refuse_more_than_256_assignments(kern_cp) -> None:
    kern, cp, ops = kern_cp
    with pytest.raises(ValueError, match=f"at most {ops.THREADS} assignments a window, not 264"):
        kern.moe(*_moe_args(cp, rows=33, topk=8, experts=16))


def test_the_expert_kernels_refuse_more_than_256_experts(kern_cp) -> None:
    kern, cp, _ = kern_cp
    with pytest.raises(ValueError, match="at most 256 experts, not 257"):
        kern.moe(*_moe_args(cp, rows=1, topk=2, experts=257, h=64, inter=64))


def test_the_argmax_refuses_scratch_of_another_shape(kern_cp) -> None:
    kern, cp, ops = kern_cp
    logits, out = cp.zeros((3, 151_936), cp.float32), cp.zeros(3, cp.int32)
    slices = ops.argmax_slices(151_936)
    with pytest.raises(ValueError, match=rf"\(3, {slices}\) wanted"):
        kern.argmax(logits, out, ops.argmax_scratch(cp, 2, 151_936))
    with pytest.raises(ValueError, match="wanted"):
        kern.argmax(logits, out, ops.argmax_scratch(cp, 3, 5_000))


def test_the_distribution_refuses_an_output_it_would_write_past(kern_cp) -> None:
    """``distribution_rows`` writes a float64 row of the vocabulary per row of logits: an output of another
    shape or type is refused, not written past its end."""
    kern, cp, _ = kern_cp
    logits = cp.zeros((3, 5_000), cp.float32)
    for out in (cp.zeros((2, 5_000), cp.float64), cp.zeros((3, 5_000), cp.float32)):
        with pytest.raises(ValueError, match=r"float64 \(3, 5000\) wanted"):
            kern.distribution(logits, 1.0, 20, 0.8, out)


def test_the_split_choice_refuses_scratch_of_another_shape(kern_cp) -> None:
    """A split choice writes each row's slices and its record into the scratch it is given: scratch made for
    fewer rows or another vocabulary is refused, not written past its end."""
    kern, cp, ops = kern_cp
    logits = cp.zeros((3, 151_936), cp.float32)
    settings = [cp.zeros(3, dt) for dt in (cp.float32, cp.float32, cp.int32, cp.float32)]
    out = cp.zeros(3, cp.int64)
    slices = ops.argmax_slices(151_936)
    for scratch in (ops.choose_scratch(cp, 2, 151_936), ops.choose_scratch(cp, 3, 5_000)):
        with pytest.raises(ValueError, match=rf"choose scratch .*: \(3, {slices}\) wanted"):
            kern.choose(logits, *settings, out, scratch=scratch)
        with pytest.raises(ValueError, match="choose scratch"):
            kern.distribution(logits, 1.0, 20, 0.8, cp.zeros((3, 151_936), cp.float64), scratch=scratch)


def test_the_draw_and_the_acceptance_refuse_arrays_they_would_misread(kern_cp) -> None:
    """``inverse_cdf_rows`` and ``verify_sampled_rows`` read float64 rows and write int64 tokens: arrays of
    another type or shape, or too few uniforms, are refused with what is wanted."""
    kern, cp, _ = kern_cp
    w, u, out = cp.zeros((2, 100)), cp.zeros(2), cp.zeros(2, cp.int64)
    wanted = r"w \[2, 100\] float64 \(contiguous\), u \[2\] float64 and out \[2\] int64 are wanted"
    for args in ((w.astype(cp.float32), u, out), (w, u[:1], out), (w, u, out.astype(cp.int32))):
        with pytest.raises(ValueError, match=wanted):
            kern.inverse_cdf(*args)
    p, q, tokens = cp.zeros((4, 100)), cp.zeros((3, 100)), cp.zeros(4, cp.int64)
    acc, first = cp.zeros(1, cp.int64), cp.zeros(1, cp.int64)
    with pytest.raises(ValueError, match=r"\(4, 100\) float32 where \(3, 100\) float64 is wanted"):
        kern.verify_sampled(p, cp.zeros((4, 100), cp.float32), tokens, cp.zeros((1, 7)), acc, first)
    with pytest.raises(ValueError, match=r"uniforms \(1, 3\) float64: \[1, >= 4\] float64"):
        kern.verify_sampled(p, q, tokens, cp.zeros((1, 3)), acc, first)


def test_the_step_workload_refuses_a_gpu_the_kernels_cannot_run_on(kern_cp, monkeypatch) -> None:
    """`strata bench --workload step` times the kernels themselves: on a GPU older than Ampere it refuses
    in one line (a ValueError the command prints) instead of failing in NVRTC."""
    from rt_plans import float16_profile_text

    from strata_cfg.plan.from_profile import resolve_text
    from strata_runtime.bench.step import run_step

    _, cp, _ = kern_cp
    text = float16_profile_text(backend="cuda", preset="tiny", slots=2, context=256)
    plan = resolve_text(text, "step.toml").plan
    monkeypatch.setattr(type(cp.cuda.Device()), "compute_capability", "75")
    with pytest.raises(ValueError, match=r"cannot run here: cuda:0 has compute capability 7\.5"):
        run_step(plan, 0)


def test_the_down_products_warm_l2_only_as_the_policy_in_force_says(kern_cp, monkeypatch) -> None:
    """`Kernels.moe` launches the ``moe_down`` instantiation that warms L2 (after its loads, or early), with
    the next weights' address and their 128-byte lines, only in windows the policy in force covers;
    otherwise the plain instantiation with a null address. The kernels that take any shape are launched as
    before."""
    from strata_runtime.cuda.choices import L2Warm, l2_warm

    kern, cp, ops = kern_cp
    launched: list[tuple[str, tuple]] = []
    monkeypatch.setattr(kern, "fn", lambda expr: lambda grid, block, args: launched.append((expr, args)))
    warm = cp.zeros((5, 1000), cp.float16)  # 10,000 bytes: 78 whole lines

    def down(rows: int, heat=warm) -> tuple[str, bool, int]:
        launched.clear()
        kern.moe(*_moe_args(cp, rows=rows, topk=2, experts=8, h=256, inter=256), warm=heat)
        ((expr, args),) = [(expr, args) for expr, args in launched if expr.startswith("moe_down")]
        return expr, args[-2] is heat, int(args[-1])

    plain = ("moe_down<256,256,2>", False, 0)
    assert down(1) == plain  # the engine's policy: off
    with l2_warm(L2Warm(2)):
        assert down(1) == down(2) == ("moe_down<256,256,2,false,1>", True, 78)
        assert down(3) == plain and down(1, None) == plain
    with l2_warm(L2Warm(1, early=True)):
        assert down(1) == ("moe_down<256,256,2,false,2>", True, 78)
    assert down(1) == plain  # the policy ends with its block
    launched.clear()
    with l2_warm(L2Warm(8)):
        kern.moe(*_moe_args(cp, rows=1, topk=2, experts=8, h=64, inter=64), warm=warm)
    assert [expr for expr, _ in launched] == ["moe_gate_up_any", "moe_down_any"]
    assert all(a is not warm for _, args in launched for a in args)


def test_an_l2_warming_policy_is_parsed_with_clear_errors() -> None:
    from strata_runtime.cuda.choices import L2Warm

    assert L2Warm.parse("off") == L2Warm() and str(L2Warm()) == "off"
    assert L2Warm.parse("2") == L2Warm(2) and L2Warm.parse("4/early") == L2Warm(4, True)
    assert str(L2Warm(4, True)) == "4/early" and L2Warm(2).mode(2) == 1 and L2Warm(2).mode(3) == 0
    assert L2Warm(4, True).mode(4) == 2 and L2Warm().mode(1) == 0
    for bad in ("", "0", "-1", "2/late", "x", "2/early/1"):
        with pytest.raises(ValueError, match="expected off, ROWS or ROWS/early"):
            L2Warm.parse(bad)


def test_the_engines_l2_warming_comes_from_strata_l2_warm(monkeypatch) -> None:
    from strata_runtime.cuda import choices

    monkeypatch.delenv("STRATA_L2_WARM", raising=False)
    assert choices._engine_l2_warm() == choices.L2Warm()
    monkeypatch.setenv("STRATA_L2_WARM", "2/early")
    assert choices._engine_l2_warm() == choices.L2Warm(2, True)
    monkeypatch.setenv("STRATA_L2_WARM", "two")
    with pytest.raises(ValueError, match="STRATA_L2_WARM=two: L2 warming 'two': expected off, ROWS"):
        choices._engine_l2_warm()
