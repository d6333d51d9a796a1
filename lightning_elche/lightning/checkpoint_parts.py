"""A sharded checkpoint's per-rank parts: each rank's own optimizer and averager state, in a file of its own.

Rank 0 writes the checkpoint itself (``epoch=0-step=8.ckpt``): an ordinary Lightning checkpoint with
the weights, the replicated ElChe state and rank 0's own states (Lightning's ``optimizer_states``,
ElChe's ``averager_state``), which ``strategy="ddp"`` and ``load_from_checkpoint`` read as any other.
Every other rank r writes ``epoch=0-step=8.ckpt.parts/rank{r}-{token}.pt``, all at once, before rank 0
writes the checkpoint; the token is drawn for each save and the checkpoint records it with the world
size (:class:`PartsRecord`), so a checkpoint is never resumed with the parts of another save of that
name, and a save that failed or was cut short leaves the previous checkpoint of that name whole.

ElChe's ranks each hold a whole replica's optimizer state, not a shard of one tensor, so the parts are
plain ``torch.save`` files, one per rank, rather than ``torch.distributed.checkpoint``'s layout (why:
docs/resume.md). They go through fsspec like Lightning's own checkpoint writes (local or remote paths)
but not through the strategy's ``CheckpointIO``, which writes one rank's whole checkpoint and may write
it later (``AsyncCheckpointIO``), while a part must be on disk before rank 0 writes the checkpoint.
Every rank must see the checkpoint's folder (a shared filesystem), as every rank does to resume.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import posixpath
from typing import Any, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_elche.comm.store import first_line

PART_FORMAT = 1
FOLDER_SUFFIX = ".parts"
_TO_RESUME = (
    "Resume from another checkpoint, or load only the weights (`LightningModule.load_from_checkpoint`) and start a "
    "new fit."
)


def parts_folder(checkpoint_path: str) -> str:
    """Where the parts of the checkpoint written at ``checkpoint_path`` go: a folder beside it."""
    return checkpoint_path + FOLDER_SUFFIX


@dataclasses.dataclass(frozen=True)
class PartsRecord:
    """What a checkpoint records of its parts: saved ranks 1 .. ``world_size`` - 1 each wrote
    ``rank{r}-{token}.pt`` in ``folder`` (a name beside the checkpoint); rank 0's part is the checkpoint."""

    world_size: int
    token: str
    folder: str

    def file_name(self, rank: int) -> str:
        return f"rank{rank}-{self.token}.pt"

    def to_state(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "token": self.token, "folder": self.folder}

    @classmethod
    def from_state(cls, state: Any) -> "PartsRecord":
        fields = ("world_size", "token", "folder")
        if not isinstance(state, dict) or any(name not in state for name in fields):
            raise ValueError(f"its record of the per-rank parts is malformed (expected {list(fields)}, got {state!r})")
        return cls(int(state["world_size"]), str(state["token"]), str(state["folder"]))


def write_part(folder: str, record: PartsRecord, rank: int, optimizer_states: Any, averager_state: dict[str, Any]) -> None:
    """This rank's part: written under a temporary name and renamed, so a part by its name is whole."""
    fs = get_filesystem(folder)
    fs.makedirs(folder, exist_ok=True)
    path = posixpath.join(folder, record.file_name(rank))
    part = {"format": PART_FORMAT, "token": record.token, "rank": rank, "world_size": record.world_size,
            "optimizer_states": optimizer_states, "averager_state": averager_state}  # fmt: skip
    unfinished = path + ".unfinished"
    if isinstance(fs, LocalFileSystem):
        torch.save(part, unfinished)  # straight to the file, without a serialised copy in memory
    else:
        with fs.open(unfinished, "wb") as file:
            torch.save(part, file)
    fs.mv(unfinished, path)


def keep_only(folder: str, record: Optional[PartsRecord]) -> None:
    """Remove what ``folder`` holds besides ``record``'s parts (those of an earlier save of that name, of a save
    that failed, of ranks the cohort no longer has), and the folder once nothing is left (``record`` None: all)."""
    fs = get_filesystem(folder)
    if not fs.isdir(folder):
        return
    keep = set() if record is None else {record.file_name(rank) for rank in range(1, record.world_size)}
    for entry in fs.ls(folder, detail=False):
        if posixpath.basename(entry) not in keep:
            fs.rm(entry, recursive=True)
    if not keep:
        fs.rmdir(folder)


def discard(folder: str, record: PartsRecord) -> None:
    """Remove the parts a failed save wrote (``record``'s, finished or not); the other saves' parts stay."""
    fs = get_filesystem(folder)
    if not fs.isdir(folder):
        return
    for entry in fs.ls(folder, detail=False):
        if posixpath.basename(entry).endswith((f"-{record.token}.pt", f"-{record.token}.pt.unfinished")):
            fs.rm(entry)
    if not fs.ls(folder, detail=False):
        fs.rmdir(folder)


def remove_parts(checkpoint_path: str) -> None:
    """Remove the parts folder of the checkpoint at ``checkpoint_path`` (a ModelCheckpoint dropping it from its top k)."""
    folder = parts_folder(checkpoint_path)
    fs = get_filesystem(folder)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


class SavedParts:
    """The parts of the sharded checkpoint at ``checkpoint_path`` that a fit resumes from.

    Local parts are memory-mapped: reading one costs its header until its tensors are used, so
    every rank can check every part, and the averager reads only the errors it takes.
    """

    def __init__(
        self, checkpoint_path: str, record: PartsRecord, leader_averager_state: Optional[dict[str, Any]], weights_only: bool
    ) -> None:
        self.checkpoint_path, self.record = checkpoint_path, record
        self.leader_averager_state = leader_averager_state  # saved rank 0's, in the checkpoint itself
        self.weights_only = weights_only
        fs = get_filesystem(checkpoint_path)
        self._local = isinstance(fs, LocalFileSystem)
        # a ModelCheckpoint(save_last="link") symlink: the parts are beside the file it points to
        where = os.path.realpath(checkpoint_path) if self._local else checkpoint_path
        self.folder = posixpath.join(posixpath.dirname(where), record.folder)

    def check(self) -> None:
        """Every saved rank's part is there, readable and of this save; otherwise a ValueError that names
        the part and what to do. Every rank reads the same files, so every rank raises alike."""
        for rank in range(1, self.record.world_size):
            self.part(rank)

    def optimizer_states(self, rank: int) -> Any:
        """Saved rank ``rank``'s optimizer states (``rank`` >= 1), copied out of the mapped file: an optimizer
        updates them in place, and the file may be replaced by the next save."""
        states = self.part(rank)["optimizer_states"]
        return apply_to_collection(states, torch.Tensor, torch.Tensor.clone) if self._local else states

    def averager_states(self) -> Optional[list[dict[str, Any]]]:
        """Every saved rank's averager state, for ``Averager.load_state_dicts`` (None where the averager keeps none)."""
        if self.leader_averager_state is None:
            return None
        return [self.leader_averager_state, *(self.part(rank)["averager_state"] for rank in range(1, self.record.world_size))]

    def part(self, rank: int) -> dict[str, Any]:
        record = self.record
        path = posixpath.join(self.folder, record.file_name(rank))
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise ValueError(self._missing(rank, path, fs))
        try:
            if self._local:
                part = torch.load(path, map_location="cpu", weights_only=self.weights_only, mmap=True)
            else:
                with fs.open(path, "rb") as file:
                    part = torch.load(file, map_location="cpu", weights_only=self.weights_only)
        except Exception as error:  # noqa: BLE001 - any unreadable part is the same advice
            raise ValueError(self._unreadable(path, error)) from error
        expected = {"format": PART_FORMAT, "token": record.token, "rank": rank, "world_size": record.world_size}
        found = {key: part.get(key) for key in expected} if isinstance(part, dict) else {}
        if found != expected or "optimizer_states" not in part:
            raise ValueError(
                f"its part {path} is not the part it records ({found or type(part).__name__} where the checkpoint "
                f"expects {expected}): the file was renamed or copied over. {_TO_RESUME}"
            )
        return part

    def _missing(self, rank: int, path: str, fs: Any) -> str:
        record = self.record
        others = sorted(posixpath.basename(p) for p in fs.ls(self.folder, detail=False)) if fs.isdir(self.folder) else []
        where = (
            f"{self.folder} holds {others}: parts of another save of this name, which was cut short or overwritten"
            if others else f"{self.folder} does not exist"
        )  # fmt: skip
        return (
            f"its part of saved rank {rank}, {path}, is missing ({where}). The checkpoint was saved by "
            f"{record.world_size} ranks, each writing its own optimizer state beside it: a checkpoint is the file "
            f"and its folder {record.folder}, to be copied together. {_TO_RESUME}"
        )

    def _unreadable(self, path: str, error: Exception) -> str:
        if self.weights_only and isinstance(error, pickle.UnpicklingError):
            return (
                f"its part {path} holds more than tensors and plain containers, which a weights-only load refuses "
                f"({first_line(error)}). If you trust the file, load everything with "
                "`trainer.fit(model, ckpt_path=..., weights_only=False)`."
            )
        return f"its part {path} cannot be read ({first_line(error)}): it is truncated or corrupted. {_TO_RESUME}"
