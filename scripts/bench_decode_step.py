"""One decode step of a qwen3-30b-a3b-shaped model straight from the CUDA kernels, against the byte roofline.

Random fp16 weights with the preset's shapes (48 layers by default; the first argument changes it), random
routing, 300 positions of KV, on one GPU. For 1, 2, 4 and 8 rows it times the whole step eagerly and as a
replayed CUDA graph, and prints the roofline (weights of the attention and router, the distinct experts the
rows route to, the LM head, and the KV read, over the measured copy bandwidth); then the time per layer of
each kernel in a graph. Usage: ``python scripts/bench_decode_step.py [LAYERS]`` (needs CuPy and a GPU).
"""

import sys
import time

import cupy as cp
import numpy as np

from strata_runtime.cuda.ops import attention_scratch_size, kernels_for

H, NQ, NKV, D, E, TK, INTER, V, L = (
    2048,
    32,
    4,
    128,
    128,
    8,
    768,
    151936,
    int(sys.argv[1]) if len(sys.argv) > 1 else 48,
)
S, T = 8, 4096
kern = kernels_for(0)


def rnd(shape, scale=0.02):
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(cp.float16)


t0 = time.time()
layers = []
for _l in range(L):
    layers.append(
        dict(
            ln1=rnd((H,), 1.0),
            ln2=rnd((H,), 1.0),
            qkv=rnd(((NQ + 2 * NKV) * D, H)),
            o=rnd((H, NQ * D)),
            qn=rnd((D,), 1.0),
            kn=rnd((D,), 1.0),
            router=rnd((E, H)),
            gu=rnd((E, 2 * INTER, H)),
            dn=rnd((E, H, INTER)),
            kc=cp.zeros((S, NKV, T, D), cp.float16),
            vc=cp.zeros((S, NKV, T, D), cp.float16),
        )
    )
emb, head, fnorm = rnd((V, H)), rnd((V, H)), rnd((H,), 1.0)
cp.cuda.Device().synchronize()
print(
    f"weights generated in {time.time() - t0:.1f}s; "
    f"used {cp.get_default_memory_pool().used_bytes() / 2**30:.1f} GiB"
)


def buffers(R):
    return dict(
        ids=cp.zeros(R, cp.int32),
        pos=cp.zeros(R, cp.int32),
        slot=cp.arange(R, dtype=cp.int32) % S,
        resid=cp.zeros((R, H), cp.float32),
        xn=cp.zeros((R, H), cp.float32),
        qkv=cp.zeros((R, (NQ + 2 * NKV) * D), cp.float32),
        q=cp.zeros((R, NQ, D), cp.float32),
        attn=cp.zeros((R, NQ * D), cp.float32),
        rl=cp.zeros((R, E), cp.float32),
        idx=cp.zeros((R, TK), cp.int32),
        wts=cp.zeros((R, TK), cp.float32),
        hb=cp.zeros((R * TK, INTER), cp.float32),
        inv=cp.zeros(R, cp.float32),
        logits=cp.zeros((R, V), cp.float32),
        out=cp.zeros(R, cp.int32),
        scratch=cp.zeros(attention_scratch_size(R, NQ, NKV, D, T), cp.float32),
    )


OPS = {
    "qkv+norm": lambda b, ly: kern.gemv(ly["qkv"], b["resid"], b["qkv"], norm=ly["ln1"]),
    "qknorm_rope": lambda b, ly: kern.qk_norm_rope_kv(
        b["qkv"], ly["qn"], ly["kn"], b["pos"], b["slot"], b["q"], ly["kc"], ly["vc"], 1e6, 1e-6
    ),
    "attention": lambda b, ly: kern.attention(
        b["q"], ly["kc"], ly["vc"], b["pos"], b["slot"], b["attn"], b["scratch"]
    ),
    "o_proj": lambda b, ly: kern.gemv(ly["o"], b["attn"], b["resid"], True),
    "router+norm": lambda b, ly: kern.gemv(ly["router"], b["resid"], b["rl"], norm=ly["ln2"]),
    "moe": lambda b, ly: kern.moe(
        b["resid"],
        ly["ln2"],
        b["rl"],
        True,
        1e-6,
        ly["gu"],
        ly["dn"],
        b["resid"],
        b["idx"],
        b["wts"],
        b["hb"],
    ),
}


def layer(b, ly):
    """One decoder layer: the kernels of OPS in order."""
    for op in OPS.values():
        op(b, ly)


def step(b):
    kern.embed(emb, b["ids"], b["resid"])
    for ly in layers:
        layer(b, ly)
    kern.gemv(head, b["resid"], b["logits"], norm=fnorm)
    kern.argmax(b["logits"], b["out"])


a = cp.empty(1 << 29, cp.float32)
b_ = cp.empty_like(a)
b_[...] = a
s0, s1 = cp.cuda.Event(), cp.cuda.Event()
s0.record()
for _ in range(10):
    b_[...] = a
s1.record()
s1.synchronize()
copy_bw = 10 * 2 * a.nbytes / (cp.cuda.get_elapsed_time(s0, s1) / 1e3)
print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
del a, b_


def graph_seconds(body, repeats):
    """Capture ``body()`` as a CUDA graph, run it once; the median seconds of ``repeats`` replays."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        body()
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g.launch(s)
        s.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def window(R):
    """Buffers of an R-row window at position 300, run once eagerly (compiles the kernels)."""
    b = buffers(R)
    b["ids"][:] = cp.asarray(np.random.default_rng(R).integers(0, V, R).astype(np.int32))
    b["pos"][:] = 300
    step(b)
    cp.cuda.Device().synchronize()
    return b


for R in (1, 2, 4, 8):
    b = window(R)
    # eager timing
    t0 = time.perf_counter()
    for _ in range(3):
        step(b)
    cp.cuda.Device().synchronize()
    te = (time.perf_counter() - t0) / 3
    tg = graph_seconds(lambda b=b: step(b), 20)
    # bytes: attention+router per layer, distinct experts (use the last layer's routing as a proxy), head
    att = L * (((NQ + 2 * NKV) * D * H + H * NQ * D + E * H) * 2)
    nuniq = len(set(b["idx"].get().ravel().tolist()))
    exp_b = L * nuniq * 3 * H * INTER * 2
    kv = L * R * 2 * NKV * 301 * D * 2
    total = att + exp_b + kv + V * H * 2
    roof = total / copy_bw
    print(
        f"R={R}: eager {te * 1e3:.2f} ms, graph {tg * 1e3:.2f} ms/step; roofline {roof * 1e3:.2f} ms "
        f"({nuniq} distinct experts in last layer) -> {roof / tg * 100:.0f}% of roofline; {R / tg:.0f} rows/s"
    )

for R in (1, 2, 4):
    b = window(R)
    parts = []
    for name, op in OPS.items():
        t = graph_seconds(lambda op=op, b=b: [op(b, ly) for ly in layers], 10)
        parts.append(f"{name} {t / len(layers) * 1e6:.1f}")
    print(f"R={R} per-layer us (in graph): " + ", ".join(parts))
