"""Training loop for the toy GPT on the text or recall task: seeded, resumable, with metrics.

Every batch is drawn from a generator seeded by ``(seed, step)``, so a run resumed from a
checkpoint sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attn.distributed import ContextParallel
from attn.nn import opt_field
from attn.timing import peak_bytes
from attn.models.config import AttentionConfig, GPTConfig
from attn.models.data import RecallTask, TextCorpus, recall_accuracy
from attn.models.gpt import GPT, load_checkpoint, save_checkpoint

TASKS = ("text", "recall")

# Per-task defaults, applied to every TrainConfig field left as None. The recall preset reaches
# >= 99% accuracy in about a minute on 2 CPU cores (README, "Training"): its first layer is
# local with a window of 1 (as in the local/global layer patterns of Gemma 2/3 and gpt-oss),
# which hands each value position its key; the second, global layer must still find the
# queried key by content. With two global layers the same model sat on the "guess a value
# from the context" plateau for thousands of steps before the induction circuit formed.
_PRESETS: dict[str, dict[str, Any]] = {
    "text": dict(steps=2000, batch_size=32, block_size=128, n_layer=4, dim=128, heads=4,
                 lr=3e-3, warmup=100, eval_every=250, eval_batches=20),
    "recall": dict(steps=1500, batch_size=64, n_layer=2, dim=64, heads=4,
                   window=1, window_layers=[0], lr=3e-3, warmup=50, eval_every=100,
                   eval_batches=8, threads=1),
}


@dataclass
class TrainConfig(AttentionConfig):
    """A training run. The model's attention options are inherited from
    :class:`attn.models.config.AttentionConfig` (so from :class:`attn.nn.AttentionOptions`): they
    are fields of this config, flags of ``scripts/train.py`` and entries of the checkpoint
    without being listed here. ``temperature="learned"`` is kept as the older spelling of
    ``learn_temperature=True`` starting at 1."""

    task: str = opt_field("recall", "recall (associative recall) or text (character LM)",
                          choices=TASKS)
    steps: int | None = opt_field(None, "total optimizer steps (none = the task's preset)")
    batch_size: int | None = None
    block_size: int | None = opt_field(None, "text: context length; recall: set by the task")
    n_layer: int | None = None
    dim: int | None = opt_field(None, "model width")
    lr: float | None = None
    min_lr_ratio: float = opt_field(0.1, "cosine decay ends at lr * min_lr_ratio")
    warmup: int | None = opt_field(None, "linear warm-up steps")
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int | None = None
    eval_batches: int | None = None
    save_every: int = 500
    stop_accuracy: float | None = opt_field(
        None, "recall: stop at the first evaluation reaching this accuracy")
    threads: int | None = opt_field(
        None, "torch intra-op threads for the run (none = the task's preset, else torch's)")
    pack: bool = opt_field(
        False, "text: rows of whole documents (top-level defs of the stdlib files) laid end "
        "to end, each attending only to itself (attn.varlen_attention), instead of random "
        "windows")
    seed: int = 0
    context_parallel: int | None = opt_field(
        None, "shard every sequence across P processes (ring attention, zigzag layout); "
              "spawns P gloo processes on this machine unless started by torchrun")
    dtype: str = opt_field("float32", "parameter dtype", choices=("float32", "float64",
                                                                  "bfloat16", "float16"))
    recall: RecallTask = field(default_factory=RecallTask)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if isinstance(self.recall, dict):
            self.recall = RecallTask(**self.recall)
        for name, value in _PRESETS[self.task].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.task == "recall":
            self.block_size = self.recall.seq_len
            if self.pack:
                raise ValueError("pack applies to the text task (recall sequences have a "
                                 "fixed length)")
        if self.pack and self.context_parallel is not None:
            raise ValueError("pack and context_parallel do not combine: packed documents "
                             "run through varlen attention, which is not sharded")
        if isinstance(self.temperature, str):
            if self.temperature != "learned":
                raise ValueError(f"temperature must be a float or 'learned', "
                                 f"got {self.temperature!r}")
            self.temperature, self.learn_temperature = 1.0, True
        super().__post_init__()  # the attention options' checks, presets applied

    def model_config(self, vocab_size: int) -> GPTConfig:
        att = AttentionConfig(**{f.name: getattr(self, f.name) for f in fields(AttentionConfig)})
        return GPTConfig(vocab_size=vocab_size, block_size=self.block_size,
                         n_layer=self.n_layer, dim=self.dim, attention=att)


def _generator(seed: int, stream: int, step: int) -> torch.Generator:
    """An independent generator per (seed, stream, step): batches need no saved RNG state."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + stream) * 1_000_003 + step)
                                         % (2**63))


class _Task:
    """The data side of a run: batches, evaluation, the vocabulary."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        if cfg.task == "text":
            self.corpus = TextCorpus.load()
            from attn.models.data import VOCAB_SIZE
            self.vocab_size = VOCAB_SIZE
        else:
            self.vocab_size = cfg.recall.vocab_size

    def batch(self, split: str, step: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x (B, T), y (B, T), and document ids (B, T) when packing (else None)."""
        cfg = self.cfg
        g = _generator(cfg.seed, 0 if split == "train" else 1, step)
        if cfg.task == "text" and cfg.pack:
            return self.corpus.packed_batch(split, cfg.batch_size, cfg.block_size, g)
        if cfg.task == "text":
            return (*self.corpus.batch(split, cfg.batch_size, cfg.block_size, g), None)
        return (*cfg.recall.batch(cfg.batch_size, g), None)

    @torch.no_grad()
    def evaluate(self, model: GPT, cp: ContextParallel | None = None
                 ) -> tuple[float, float | None]:
        """Mean validation loss over a fixed set of batches; recall also its accuracy."""
        was_training = model.training
        model.eval()
        losses, accs = [], []
        for i in range(self.cfg.eval_batches):
            x, y, doc = self.batch("val", i)
            if cp is None:
                logits, loss = model(x, y, doc_ids=doc)
            else:  # every rank its shard, then the full logits everywhere: the same numbers
                logits = cp.gather(model(cp.shard(x, dim=1))[0], dim=1)
                loss = _cross_entropy(logits, y, "mean")
            losses.append(loss.item())
            if self.cfg.task == "recall":
                accs.append(recall_accuracy(logits, y))
        model.train(was_training)
        return sum(losses) / len(losses), (sum(accs) / len(accs) if accs else None)


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    """GPT.forward's loss (float32 logits, -100 ignored) with a choice of reduction."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                           reduction=reduction)


def _sharded_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, cp: ContextParallel
                  ) -> torch.Tensor:
    """This rank's share of the mean loss: its tokens' summed loss over all ranks' target
    count (y is the full batch on every rank), so the group's sum is the unsharded mean."""
    logits, _ = model(cp.shard(x, dim=1))
    return _cross_entropy(logits, cp.shard(y, dim=1), "sum") / (y != -100).sum().clamp(min=1)


def _sum_over_group(model: GPT, loss: torch.Tensor) -> torch.Tensor:
    """All-reduce every gradient and the loss in one buffer: each rank's gradient is its
    tokens' contribution (as DDP's all-reduce assumes), the sum is the full gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads]
                     + [loss.detach().reshape(1).to(torch.float64)])
    dist.all_reduce(flat)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
    return flat[-1]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``lr · min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    # weight decay only on matrices; norm gains, QK-norm g, log τ and sinks are left free
    decay = [p for p in model.parameters() if p.dim() >= 2]
    free = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": free, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def peak_memory_bytes() -> int:
    """CUDA: peak bytes allocated by torch. CPU: the process's peak resident set size (Linux
    reports KiB), which includes Python, torch and the data — an upper bound on the model's."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _progress(total: int, initial: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: train silently without a bar
        return None
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True,
                file=sys.stderr)


def train(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          stop_at: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Train, writing ``out_dir/ckpt.pt`` and ``out_dir/metrics.json``; return the metrics.

    ``resume`` continues from ``out_dir/ckpt.pt`` when it exists. ``stop_at`` ends the run
    early after that many steps, as an interruption would (a checkpoint is written first).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    in_group = dist.is_available() and dist.is_initialized()
    if cfg.context_parallel is not None and not in_group:
        return _launch_context_parallel(cfg, out_dir, resume, stop_at, progress)
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, out_dir, resume, stop_at, progress)
    finally:
        torch.set_num_threads(threads)


def _launch_context_parallel(cfg: TrainConfig, out_dir: Path, resume: bool,
                             stop_at: int | None, progress: bool) -> dict[str, Any]:
    """Join torchrun's group (WORLD_SIZE set), or spawn ``cfg.context_parallel`` processes
    on 127.0.0.1; every rank trains, rank 0 writes the checkpoint and the metrics."""
    P = cfg.context_parallel
    if not isinstance(P, int) or P < 1:
        raise ValueError(f"context_parallel must be a positive int, got {P!r}")
    if "WORLD_SIZE" in os.environ:  # torchrun: MASTER_ADDR/PORT, RANK, WORLD_SIZE are set
        dist.init_process_group("gloo")  # the toy trains on CPU
        try:
            if dist.get_world_size() != P:
                raise ValueError(f"--context-parallel {P}, but torchrun started "
                                 f"{dist.get_world_size()} processes (--nproc-per-node x nodes)")
            return train(cfg, out_dir, resume=resume, stop_at=stop_at,
                         progress=progress and dist.get_rank() == 0)
        finally:
            dist.destroy_process_group()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_context_parallel_worker, args=(P, port, cfg, out_dir, resume, stop_at, progress),
             nprocs=P, join=True)
    return json.loads((out_dir / "metrics.json").read_text())


def _context_parallel_worker(rank: int, P: int, port: int, cfg: TrainConfig, out_dir: Path,
                             resume: bool, stop_at: int | None, progress: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=P)
    try:
        train(cfg, out_dir, resume=resume, stop_at=stop_at, progress=progress and rank == 0)
    finally:
        dist.destroy_process_group()


def _train(cfg: TrainConfig, out_dir: Path, resume: bool, stop_at: int | None,
           progress: bool) -> dict[str, Any]:
    ckpt_path = out_dir / "ckpt.pt"
    torch.manual_seed(cfg.seed)
    task = _Task(cfg)
    model = GPT(cfg.model_config(task.vocab_size)).to(getattr(torch, cfg.dtype))
    cp, rank = None, 0
    if cfg.context_parallel is not None and dist.is_available() and dist.is_initialized():
        cp = ContextParallel(layout="zigzag")
        cp.apply_to(model)
        rank = dist.get_rank()
    opt = make_optimizer(model, cfg)
    start, losses, elapsed, tokens = 0, [], 0.0, 0
    if resume and ckpt_path.exists():
        state = load_checkpoint(ckpt_path)
        if state["train_config"]["task"] != cfg.task:
            raise ValueError(f"{ckpt_path} is a {state['train_config']['task']!r} run, "
                             f"not {cfg.task!r}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])  # dropout draws from torch's default generator
        start, losses = state["step"], list(state["losses"])
        elapsed, tokens = state["elapsed_s"], state["tokens"]

    def checkpoint(step: int) -> None:
        if rank != 0:  # every rank holds the same model and optimizer state
            return
        save_checkpoint(ckpt_path, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "losses": losses, "torch_rng": torch.get_rng_state(), "elapsed_s": elapsed,
            "tokens": tokens, "model_config": model.cfg.to_dict(),
            "train_config": asdict(cfg)})

    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    bar = _progress(cfg.steps, start, progress)
    val_loss, acc, evaluated_at = float("nan"), None, -1
    step_peak = None
    model.train()
    for step in range(start, end):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        x, y, doc = task.batch("train", step)
        opt.zero_grad(set_to_none=True)
        if cp is None:
            _, loss = model(x, y, doc_ids=doc)
            loss.backward()
        else:
            def fwd_bwd() -> None:
                nonlocal loss
                loss = _sharded_loss(model, x, y, cp)
                loss.backward()

            loss = None
            if step == start:  # this rank's peak bytes above the model, one whole step
                step_peak = peak_bytes(fwd_bwd)
            else:
                fwd_bwd()
            loss = _sum_over_group(model, loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        elapsed += time.perf_counter() - t0
        tokens += x.numel()
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            val_loss, acc = task.evaluate(model, cp)
            evaluated_at = done
            if cfg.stop_accuracy is not None and acc is not None and acc >= cfg.stop_accuracy:
                end = done
                break
        if done % cfg.save_every == 0:
            checkpoint(done)
        if bar is not None:
            post = {"loss": f"{losses[-1]:.3f}", "val": f"{val_loss:.3f}"}
            if acc is not None:
                post["acc"] = f"{acc:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    done = max(start, end)
    if evaluated_at != done:
        val_loss, acc = task.evaluate(model, cp)
    checkpoint(done)

    tail = losses[-min(20, len(losses)):] if losses else [float("nan")]
    metrics = {
        "task": cfg.task, "steps": done, "final_train_loss": sum(tail) / len(tail),
        "val_loss": val_loss, "accuracy": acc,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "peak_memory_bytes": peak_memory_bytes(),
        "peak_memory_method": ("torch.cuda.max_memory_allocated"
                               if torch.cuda.is_available() and torch.cuda.is_initialized()
                               else "process peak RSS (getrusage ru_maxrss)"),
        "train_time_s": elapsed, "num_params": model.num_params(),
        "backend": cfg.backend, "losses": losses, "config": asdict(cfg),
    }
    if cp is not None:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (step_peak,
                                          metrics["peak_memory_bytes"]))
        metrics.update(context_parallel=dist.get_world_size(),
                       step_peak_bytes_per_rank=[r[0] for r in per_rank],
                       step_peak_method="attn.timing.peak_bytes of the first step "
                                        "(forward + backward) on each rank",
                       peak_memory_bytes_per_rank=[r[1] for r in per_rank])
    if rank == 0:
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
