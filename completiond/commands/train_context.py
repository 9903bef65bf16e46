"""Repository-context stage of the bundled model's training (issue 29).

The base run's fill-in-the-middle samples never had anything from other files in front of the code, so
the model barely reads the context block the daemon retrieves for it. This stage continues from the
exported model on samples built by the daemon's own code path: a training package's sources become a
Workspace, a cursor is placed as the base run's FIM split places it, the Workspace retrieves chunks for
that cursor exactly as at completion time, and PromptBuilder lays out the prompt; the sample is that
prompt followed by the missing middle and <|endoftext|>. Train and serve therefore share one prompt
format by construction. Samples without context and plain windows are mixed in so that what the model
did well before (no context, the held-out loss) is kept; the LayerSkip exit losses and the draft exits'
distillation stay as in the base recipe (`Trainer.train_step`).

Data: the training packages of `train_packages.lock` (never the held-out ones; the evaluation projects
of issue 29 are not in the list either), and for the context-free samples also the stdlib's training
split (corpus.training_files: held-out files excluded). It is a command, not part of models/,
because its samples come from the completion layer. Usage, with RUN outside the checkout:

    nice -n 19 completiond train-context --run-dir RUN --steps 800 --minutes 60
    completiond train-context --export --run-dir RUN [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from completiond.models import default_model_dir
from completiond.models.training import data_prep
from completiond.models.training.train_default import (
    Trainer,
    fim_split,
    load_tokenizer,
    run_dir_problem,
    save_model,
    to_batch,
)

SHARES = {"retrieval": 0.5, "none": 0.2, "plain": 0.3}  # sample kinds per batch, on average


def extract(
    archives: dict[str, Path], listed: list[tuple[str, str]], out: Path, heldout=data_prep.HELDOUT_PACKAGES, log=print
) -> list[Path]:
    """The listed packages' files, filtered as the base run filtered them, one directory per package
    under out. Held-out packages and those whose licence is not admitted are skipped."""
    skip = {data_prep.normalise(h) for h in heldout}
    roots = []
    for name, expected in listed:
        if data_prep.normalise(name) in skip:
            continue
        root = out / data_prep.normalise(name)
        if not (root / ".complete").is_file():
            pkg = data_prep.load_package(archives[name], expected)
            if pkg.licence_family is None:
                log(f"skip {name}: licence not admitted ({pkg.licence})")
                continue
            for rel, text in pkg.files:
                p = root / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text, encoding="utf-8")
            (root / ".complete").write_text("")  # a package cut short by a crash is extracted again
        roots.append(root)
    return roots


class ContextSampler:
    """Batches of (prompt + middle) samples built by the daemon's retrieval and prompt code."""

    def __init__(
        self,
        roots: list[Path],
        model_dir: Path,
        seq_len: int,
        seed: int,
        shares=SHARES,
        workspaces: int = 64,
        extra_files: Sequence[tuple[Path, Path]] = (),
    ):
        import numpy as np
        from transformers import AutoTokenizer

        from completiond.completion.prompt import PromptBuilder
        from completiond.config import Config
        from completiond.engine.model_info import ModelInfo

        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.builder = PromptBuilder.for_model(self.tok, Config(), max_context=seq_len, info=ModelInfo.read(model_dir))
        self.seq_len = seq_len
        self.eot = self.tok.convert_tokens_to_ids("<|endoftext|>")
        self.pad = self.tok.convert_tokens_to_ids("<|fim_pad|>")
        self.sep = self.tok.convert_tokens_to_ids("<|file_sep|>")
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.files: list[tuple[Path, Path]] = []  # (package root, file)
        for root in roots:
            self.files += [(root, p) for p in sorted(root.rglob("*.py")) if p.stat().st_size > 200]
        if not self.files:
            raise ValueError("no training files: run the extraction first")
        # Context-free samples also come from these (the stdlib's training split): without them the
        # stage drifts from what the base run mostly saw, and context-free quality drops.
        self.any_files = self.files + [(r, p) for r, p in extra_files if p.stat().st_size > 200]
        self.shares = dict(shares)
        self._ws: dict[Path, object] = {}
        self._ws_max = workspaces
        self.counts = {k: 0 for k in shares}
        self.context_share: collections.deque[float] = collections.deque(
            maxlen=80
        )  # context / prompt tokens of recent retrieval samples (logged)

    def _workspace(self, root: Path):
        from completiond.completion.workspace import Workspace

        ws = self._ws.pop(root, None)
        if ws is None:
            if len(self._ws) >= self._ws_max:
                old = next(iter(self._ws))
                self._ws.pop(old)
            ws = Workspace([root], scan=False)
            ws.scan()
        self._ws[root] = ws  # most recently used last
        return ws

    def _fim(self, with_context: bool):
        pool = self.files if with_context else self.any_files  # retrieval needs a package around the file
        root, path = pool[self.rng.randrange(len(pool))]
        text = path.read_text(encoding="utf-8")
        prefix, middle, suffix = fim_split(text, self.np_rng, 0.1)
        doc, cursor = prefix + suffix, len(prefix)
        context = []
        b = self.builder
        if with_context:
            ws = self._workspace(root)
            ws.did_open(path, doc, "python")  # as the editor: the open file is the text as typed
            count = lambda s: len(b.template.encode(s))  # noqa: E731
            pb, sb, _ = b.budgets(True)
            context = ws.context(
                path,
                "python",
                b.context_tokens,
                count,
                text=doc,
                offset=cursor,
                mode="retrieval",
                window_tokens=(pb, sb),
            )
            ws.forget(path)
        prompt = b.build(doc, cursor, context=context, path=str(path.relative_to(root)), language="python", heal=False)
        if prompt.skip_reason is not None:
            return None
        mid = self.tok.encode(middle, add_special_tokens=False) if middle else []
        seq = list(prompt.ids) + mid + [self.eot]
        if len(seq) > self.seq_len + 1:
            return None  # the middle does not fit after the prompt: draw another sample, never cut it
        if with_context:
            self.context_share.append(len(prompt.context_ids) / max(1, len(prompt.ids)))
        return seq

    def _plain(self):
        # A window of one package's files joined as the base run joined them.
        root, path = self.any_files[self.rng.randrange(len(self.any_files))]
        ids = self.tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False) + [self.sep]
        start = self.rng.randrange(max(1, len(ids) - 64))
        return ids[start : start + self.seq_len + 1]

    def sample(self):
        while True:
            kind = self.rng.choices(list(self.shares), list(self.shares.values()))[0]
            seq = self._plain() if kind == "plain" else self._fim(kind == "retrieval")
            if seq and len(seq) >= 2:
                self.counts[kind] += 1
                return seq

    def batch(self, bsz: int):
        seqs = [self.sample() for _ in range(bsz)]
        width = self.seq_len + 1
        return to_batch(
            [s + [self.pad] * (width - len(s)) for s in seqs], [[1] * len(s) + [0] * (width - len(s)) for s in seqs]
        )

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "np_rng": self.np_rng.bit_generator.state}

    def load_state(self, st: dict) -> None:
        self.rng.setstate(st["rng"])
        self.np_rng.bit_generator.state = st["np_rng"]


def _base_cfg(model_dir: Path, lr: float, steps: int, seq_len: int, batch: int) -> dict:
    summary = json.loads((model_dir / "training_summary.json").read_text())
    return {
        "arch": {k: summary[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")},
        "seq_len": seq_len,
        "batch_size": batch,
        "lr": lr,
        "min_lr_ratio": 0.1,
        "warmup": 20,
        "weight_decay": summary["weight_decay"],
        "layer_dropout": summary["layer_dropout_max"],
        "exit_scale": summary["exit_scale"],
        "exit_frac": summary["exit_frac"],
        "distill": summary["distill"],
        "distill_other": summary["distill_other"],
        "draft_exits": [4, 5],
        "rotating_exits": summary["rotating_exits"],
        "fim_rate": 0.0,
        "spm_rate": 0.0,
        "empty_middle": 0.0,
        "seed": 7,
        "total_tokens": steps * batch * seq_len,
        "precision": "fp32",
    }


def train(a) -> int:
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(a.threads)
    a.run_dir.mkdir(parents=True, exist_ok=True)
    listed = data_prep.read_package_list(a.packages)
    archives = data_prep.download(listed, a.downloads, data_prep.read_lock(data_prep.LOCK_FILE))
    roots = extract(archives, listed, a.run_dir / "src")
    steps = a.steps
    cfg = _base_cfg(a.model, a.lr, steps, a.seq_len, a.batch_size)
    tok, ids = load_tokenizer(a.model)
    ckpt = a.run_dir / "ckpt.pt"
    extra = []
    if a.stdlib:
        from completiond.models import corpus

        extra = [(corpus.stdlib_root(), f.path) for f in corpus.training_files()]  # held-out files excluded
    sampler = ContextSampler(roots, a.model, a.seq_len, cfg["seed"], shares=a.shares, extra_files=extra)
    trainer = Trainer(cfg, None, tok, ids, "cpu", precision="fp32", sampler=sampler)
    if ckpt.is_file():
        st = torch.load(ckpt, map_location="cpu", weights_only=True)
        trainer.model.load_state_dict(st["model"])
        trainer.opt.load_state_dict(st["opt"])
        trainer.step, trainer.tokens, trainer.seconds = st["step"], st["tokens"], st["seconds"]
        sampler.load_state(st["sampler"])
    else:
        weights = load_file(str(a.model / "model.safetensors"))
        missing, unexpected = trainer.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise SystemExit(
                f"{a.model}: weights do not fit the recorded architecture (missing {missing}, unexpected {unexpected})"
            )
        trainer.model.tie_weights()
    log = (a.run_dir / "log.jsonl").open("a")
    deadline = time.time() + 60 * a.minutes
    t_save = time.time()

    def save():
        # plain containers and tensors only, so that it loads with weights_only=True (no unpickling of code)
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "model": trainer.model.state_dict(),
                "opt": trainer.opt.state_dict(),
                "step": trainer.step,
                "tokens": trainer.tokens,
                "seconds": trainer.seconds,
                "sampler": sampler.state(),
                "cfg": cfg,
                "shares": sampler.shares,
                "stdlib": bool(extra),
            },
            tmp,
        )
        tmp.replace(ckpt)

    while trainer.step < steps and time.time() < deadline:
        t0 = time.time()
        r = trainer.train_step()
        trainer.seconds += time.time() - t0
        if trainer.step % 10 == 0:
            share = sampler.context_share
            rec = {
                "step": trainer.step,
                "tokens": trainer.tokens,
                "loss": round(r["loss"], 4),
                "kl": round(r["kl"], 4),
                "lr": r["lr"],
                "s_per_step": round(trainer.seconds / max(1, trainer.step), 2),
                "kinds": dict(sampler.counts),
                "context_share": round(sum(share) / max(1, len(share)), 3),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if time.time() - t_save > 300:
            save()
            t_save = time.time()
    save()
    print(f"stopped at step {trainer.step} of {steps} ({trainer.tokens} tokens)")
    return 0


def export(a) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    st = torch.load(a.run_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(a.model), torch_dtype=torch.float32)
    model.load_state_dict(st["model"])
    out = a.out or a.model
    meta = json.loads((a.model / "completiond.json").read_text())
    summary = json.loads((a.model / "training_summary.json").read_text())
    summary["context_stage"] = {
        "steps": st["step"],
        "tokens": st["tokens"],
        "seconds": round(st["seconds"], 1),
        "lr": st["cfg"]["lr"],
        "batch_size": st["cfg"]["batch_size"],
        "shares": st.get("shares", SHARES),
        "stdlib": st.get("stdlib", True),
        "recipe": "completiond/commands/train_context.py",
    }
    save_model(model, out, a.model, meta, summary)
    print(f"exported to {out}")
    return 0


def _shares(text: str) -> dict[str, float]:
    try:
        out = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shares {text!r}: expected kind=weight pairs separated by commas") from None
    if set(out) - set(SHARES) or not out or min(out.values()) < 0 or sum(out.values()) <= 0:
        raise argparse.ArgumentTypeError(f"--shares {text!r}: kinds are {', '.join(SHARES)}, weights >= 0, not all 0")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run-dir", type=Path, required=True, help="checkpoint, log and extracted sources (outside the checkout)"
    )
    p.add_argument("--downloads", type=Path, default=None, help="package archives (default RUN/downloads)")
    p.add_argument("--packages", type=Path, default=data_prep.PACKAGES_FILE, help="the package list")
    p.add_argument("--model", type=Path, default=None, help="the model to continue from (default: the bundled one)")
    p.add_argument("--steps", type=int, default=1000, help="planned steps (the learning rate's cosine spans them)")
    p.add_argument("--minutes", type=float, default=60.0, help="stop (and save) after this long")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument(
        "--shares", type=_shares, default=dict(SHARES), help="sample kinds, e.g. retrieval=0.5,none=0.2,plain=0.3"
    )
    p.add_argument(
        "--no-stdlib",
        dest="stdlib",
        action="store_false",
        help="context-free samples from the training packages only (not the stdlib's training split)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--export", action="store_true", help="write the model from RUN's checkpoint")
    p.add_argument("--out", type=Path, default=None, help="export here instead of over --model")


def run(a: argparse.Namespace) -> int:
    problem = run_dir_problem(a.run_dir, False)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    a.model = a.model or default_model_dir()
    a.downloads = a.downloads or a.run_dir / "downloads"
    return export(a) if a.export else train(a)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="completiond train-context", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
