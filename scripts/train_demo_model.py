"""Train the demo profile's model: a few-MB byte-level Qwen3-MoE with a Qwen3-Next style MTP head, on Austen.

The model is 4 sparse layers (8 experts, top 2) of width 256 plus one MTP layer, about 2.8 M parameters and
5.6 MB in float16. Its vocabulary is the runtime's byte tokenizer's (ids 0-255 are UTF-8 bytes, 256
``<|endoftext|>``, 257 ``<|im_start|>``, 258 ``<|im_end|>``), padded to 384 rows like the ``tiny`` preset.
Training has two phases. First the main model learns the next byte (cross-entropy plus a small
load-balancing term for the routers). Then, with the main model frozen, the MTP head learns the byte after
next as the runtime drafts with it: one step from the main model's hidden state and ``--mtp-steps - 1``
chained steps from its own output (see ``scripts/demo_torch_model.py``), each against the main model's own
distribution over that byte, since a greedy draft is accepted when it matches the main model's choice.

Corpus: five of Jane Austen's novels from Debian's ``r-cran-janeaustenr`` (``scripts/demo_corpus.py`` says
how to get it with one command); *Persuasion* is held out for evaluation. Nothing is fetched here.

Run (the checkpoint in ``strata_cfg/data/models/austen`` was made by this, on a CPU, written to a scratch
folder and copied there with its README)::

    python scripts/train_demo_model.py --corpus /tmp/austen --out strata_cfg/data/models/austen

It is seeded (weights, batches); on a CPU the result is reproducible on the same machine and torch build.
``--device cuda`` trains on a GPU: the design target there is well under 10 minutes for the default steps
(not measured). Progress goes to stdout; ``--work`` (default: a folder in the system's temporary directory,
never the package) keeps a resumable checkpoint every ``--save-every`` steps, and the model directory is
rewritten at each evaluation, so a stopped run leaves a usable model.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import demo_corpus
import torch
import torch.nn.functional as F
from demo_torch_model import Model, Shape, config_json, export_tensors
from safetensors.torch import save_file

EOS_ID = 256  # the runtime's ByteTokenizer: "<|endoftext|>"
SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}


def encode(text: str) -> torch.Tensor:
    """Byte ids with each ``<|endoftext|>`` as its special id, as the runtime's ByteTokenizer encodes."""
    ids: list[int] = []
    for j, part in enumerate(text.split(demo_corpus.EOS)):
        if j:
            ids.append(EOS_ID)
        ids.extend(part.encode("utf-8"))
    return torch.tensor(ids, dtype=torch.long)


def batch(data: torch.Tensor, size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``size`` random windows of ``length`` ids [B, T]."""
    starts = torch.randint(0, len(data) - length, (size,), generator=gen)
    return torch.stack([data[s : s + length] for s in starts.tolist()])


def main_loss(model: Model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next-byte cross-entropy, the balance loss, and the post-norm hidden states [B, T, H]."""
    hidden, logits, balance = model(tokens)
    v = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1))
    return loss, balance, hidden


def draft_losses(
    model: Model, tokens: torch.Tensor, steps: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per MTP step: the cross-entropy against the main model's own distribution over token q+2 (which
    greedy drafting must match), against the text's token q+2, and top-1 agreement with the main model's
    argmax; then the balance loss. The main model is frozen here: it runs without gradients."""
    with torch.no_grad():
        hidden, logits, _ = model(tokens)
        teacher = logits[:, 1:-1].float().softmax(-1)  # [B, T-2, V]: the main model at q+1, for token q+2
    drafts, balance = model.draft(tokens, hidden, steps)
    v = logits.shape[-1]
    distill, text, agree = [], [], []
    for k, step in enumerate(drafts):
        rows = step[:, k:-1]  # [B, T-2-k, V]: rows from q = k-1 (earlier rows lack a previous step)
        distill.append(-(teacher[:, k:] * rows.float().log_softmax(-1)).sum(-1).mean())
        text.append(F.cross_entropy(rows.reshape(-1, v), tokens[:, k + 2 :].reshape(-1)))
        agree.append((rows.argmax(-1) == teacher[:, k:].argmax(-1)).float().mean())
    return distill, text, agree, balance


@torch.no_grad()
def evaluate(model: Model, data: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """On fixed held-out windows: the main loss, and each MTP step's loss against the text and its top-1
    agreement with the main model (the greedy acceptance of that draft when the ones before it held)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    sums: dict[str, float] = {}
    for _ in range(args.eval_batches):
        tokens = batch(data, args.batch, args.seq, gen).to(args.device)
        parts = {"loss": main_loss(model, tokens)[0]}
        _, text, agree, _ = draft_losses(model, tokens, args.mtp_steps)
        parts |= {f"mtp{k + 1}_loss": m for k, m in enumerate(text)}
        parts |= {f"mtp{k + 1}_agree": a for k, a in enumerate(agree)}
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + float(value) / args.eval_batches
    model.train()
    sums["bits_per_byte"] = sums["loss"] / math.log(2)
    return sums


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth, over one phase of ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def write_model(model: Model, out: Path, meta: dict[str, object]) -> None:
    """``model.safetensors`` (float16), ``config.json``, and the byte tokenizer's description."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(model)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(model.shape, EOS_ID), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": EOS_ID, "do_sample": False}, indent=2) + "\n"
    )
    tokenizer = {
        "tokenizer": "bytes",
        "comment": "ids 0-255 are UTF-8 bytes; the runtime's ByteTokenizer (strata_runtime/tokenizer.py)",
        "special_tokens": SPECIALS,
        "eos_token": "<|endoftext|>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def optimizer(model: Model, mtp: bool, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW over the main model's parameters, or the MTP head's; matrices decay, norms and embedding not."""
    params = [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.") == mtp]
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("mtp.") == mtp)
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in params if p.ndim < 2 or "embed" in n]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def _rounded(values: list[torch.Tensor]) -> list[float]:
    return [round(v.item(), 3) for v in values]


def train_step(
    model: Model, opt: torch.optim.Optimizer, tokens: torch.Tensor, drafting: bool, args: argparse.Namespace
) -> str:
    """One optimizer step of the main model, or (``drafting``) of the MTP head; returns a progress line."""
    if drafting:
        distill, text, agree, balance = draft_losses(model, tokens, args.mtp_steps)
        loss = torch.stack(distill).mean() + args.balance_weight * balance
        line = f"draft distill {_rounded(distill)} agree {_rounded(agree)}"
    else:
        main, balance, _ = main_loss(model, tokens)
        loss = main + args.balance_weight * balance
        line = f"loss {main.item():.3f}"
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    return f"{line} balance {balance.item():.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="the extracted r-cran-janeaustenr package")
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "train_demo_model",
        help="where to keep the resumable checkpoint",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=900, help="steps of the main model")
    parser.add_argument("--draft-steps", type=int, default=200, help="steps of the MTP head, main frozen")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--mtp-steps", type=int, default=3, help="MTP steps trained: 1 plus chained drafts")
    parser.add_argument("--balance-weight", type=float, default=0.01)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=50)
    # On a CPU that other work shares, one thread is several times faster than two that wait on each other.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "train_state.pt"

    train_text, held_text = demo_corpus.split(args.corpus)
    train, held = encode(train_text), encode(held_text)
    print(f"corpus: {len(train):,} training bytes, {len(held):,} held-out bytes ({demo_corpus.HELD_OUT})")
    model = Model(Shape()).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({2 * n_params / 1e6:.1f} MB in float16)")
    gen = torch.Generator().manual_seed(args.seed)
    step, history = 0, []
    state = torch.load(state_path, weights_only=False) if state_path.is_file() else None
    if state is not None:
        model.load_state_dict(state["model"])
        gen.set_state(state["gen"])
        step, history = state["step"], state["history"]
        print(f"resumed at step {step}")
    total = args.steps + args.draft_steps
    opt, drafting = None, None
    start, start_step = time.monotonic(), step
    while step < total:
        if drafting != (step >= args.steps):  # a new phase: a fresh optimizer over its parameters
            drafting = step >= args.steps
            opt = optimizer(model, drafting, args)
            if state is not None and state.get("drafting") == drafting:
                opt.load_state_dict(state["opt"])
        assert opt is not None
        phase_step, phase_steps = (step - args.steps, args.draft_steps) if drafting else (step, args.steps)
        for group in opt.param_groups:
            group["lr"] = learning_rate(phase_step, phase_steps, args.lr, args.warmup)
        tokens = batch(train, args.batch, args.seq, gen).to(args.device)
        line = train_step(model, opt, tokens, drafting, args)
        step += 1
        if step % 10 == 0:
            rate = (step - start_step) / max(time.monotonic() - start, 1e-9)
            print(f"step {step} {line} ({rate:.2f} steps/s)", flush=True)
        if step % args.save_every == 0 or step in (args.steps, total):
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "gen": gen.get_state(),
                    "step": step,
                    "history": history,
                    "drafting": drafting,
                },
                state_path,
            )
        if step % args.eval_every == 0 or step in (args.steps, total):
            history.append({"step": step, **evaluate(model, held, args)})
            print("eval", json.dumps({k: round(v, 4) for k, v in history[-1].items()}), flush=True)
            meta = {
                "corpus": "Jane Austen's novels, Debian package r-cran-janeaustenr",
                "held_out": demo_corpus.HELD_OUT,
                "parameters": n_params,
                "args": {k: str(v) for k, v in vars(args).items() if k not in ("out", "work", "corpus")},
                "evaluations": history,
            }
            write_model(model, args.out, meta)


if __name__ == "__main__":
    main()
