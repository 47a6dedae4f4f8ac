"""What streaming a window's text costs as a generation grows: whole decode against incremental.

A slot turns each window's tokens into text for its client. Decoding every generated token each window
costs time that grows with the generation; `Slot.emit` decodes only the tokens since its last complete text.
For 100, 1,000 and 4,000 generated tokens (byte-level tokenizer, ASCII mixed with 2-, 3- and 4-byte
characters, windows of 4 tokens) this times one window both ways, interleaved, and prints the medians.
Usage: ``python scripts/bench_detokenize.py [--repeats N]`` (CPU only).
"""

import argparse
import statistics
import time

import numpy as np

from strata_runtime.api import Request, RequestHandle
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.slot import Slot
from strata_runtime.weights.tokenizer import ByteTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=200)
args = parser.parse_args()
tok = ByteTokenizer(384)
chars = "abc é中🙂 xyz"
g = np.random.default_rng(0)
ids = tok.encode("".join(chars[i] for i in g.integers(0, len(chars), 12000)))
print("generated  whole decode µs  incremental emit µs  ratio")
for n in (100, 1000, 4000):
    req = Request((1,), n + 4 * args.repeats + 8)
    slot = Slot(0, RequestHandle(req), Sampler(req.sampling, 0), frozenset(), tok, admitted_at=0)
    for a in range(0, n, 4):
        slot.emit(ids[a : a + 4], 0)
    whole, inc = [], []
    for rep in range(args.repeats):
        window = ids[n + 4 * rep : n + 4 * rep + 4]
        t = time.perf_counter()
        tok.decode(slot.generated + window)
        whole.append(time.perf_counter() - t)
        t = time.perf_counter()
        slot.emit(window, 0)
        inc.append(time.perf_counter() - t)
    w, i = statistics.median(whole) * 1e6, statistics.median(inc) * 1e6
    print(f"{n:9d}  {w:15.1f}  {i:19.1f}  {w / i:5.1f}x")
