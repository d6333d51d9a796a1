"""What ElChe adds to a Lightning checkpoint, and what a resumed run may take from it.

ElChe checkpoints are taken at boundaries only, so the weights are the consensus and the
epoch's coverage is exact: the samples trained so far are the closed windows' pieces. The state
is stored under the controller callback's key as tensors, numbers, lists and dicts only, which
``torch.load(weights_only=True)`` (ElChe's default when it loads a checkpoint) accepts.

Schema 2 records the coverage as spans of positions in the epoch's order (``coverage.py``): a
few pairs of integers whatever the dataset's size. Schema 1 (lightning-elche 0.1) recorded a bit
per sample over dataset indices; those checkpoints still resume. Schema 3 is schema 2 without the
per-rank states: every rank writes its own optimizer and averager state into a part of its own
(``lightning/checkpoint_parts.py``), which the checkpoint names under ``parts``. A release that
reads schema 2 only refuses it instead of resuming every rank from rank 0's optimizer state. A
schema 2 state (every rank's states gathered into the one file, as earlier versions wrote it) still
resumes.

A checksum over the coverage record, the counters and the controller state travels with them: a
checkpoint that still loads but whose ElChe state changed after it was written (a flipped bit, a
conversion script that rewrote the coverage) is refused instead of training some samples twice
and others never. It guards against accidents, not against someone who also rewrites the
checksum. The key is optional, so schema 1 stays one schema: checkpoints written before it
existed load as they did, and older releases ignore it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from lightning_elche.cohort.controller import controller_state_for
from lightning_elche.cohort.coverage import Spans

if TYPE_CHECKING:
    from lightning_elche.cohort.train_data import TrainData

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)
CHECKSUMMED = ("epoch", "num_samples", "covered", "seed", "world_size", "cohort_steps_total", "logged_steps_total",
               "controller")
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as uint8 bytes, eight samples a byte (1 M samples: 125 kB)."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8)
    padded[: mask.numel()] = mask.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    bits = packed.to(torch.uint8).view(-1, 1).bitwise_and(_BIT_WEIGHTS).ne(0)
    return bits.view(-1)[:count].clone()


def checksum(state: dict[str, Any]) -> str:
    """SHA-256 of the state's coverage, counters and controller state, in a canonical form."""
    h = hashlib.sha256()
    for key in CHECKSUMMED:
        value = state[key]
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True, default=_plain).encode())
        h.update(b"|")
    return "sha256:" + h.hexdigest()


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else repr(value)


OptimizerStates = list[list[dict[str, Any]]]  # every rank's optimizers' state dicts: per rank, per optimizer


@dataclasses.dataclass
class ResumePoint:
    """The cohort's state at one boundary, as a resumed run needs it."""

    epoch: int
    num_samples: int
    covered: Union[Spans, torch.Tensor]  # positions of ``epoch``'s order trained so far (schema 1: a bool mask)
    seed: int
    world_size: int
    cohort_steps_total: int  # all ranks' optimizer steps
    logged_steps_total: int  # all ranks' batches that stepped (the loggers' axis)
    controller: dict[str, Any]
    optimizer_states: Optional[OptimizerStates] = None  # schema 2 only: every rank's, gathered into the one file
    outer: Optional[dict[str, Any]] = None  # the outer optimizer's momentum (replicated)
    governor: Optional[dict[str, Any]] = None  # the convergence guard's history
    averager_states: Optional[list[dict[str, Any]]] = None  # schema 2 only, per rank: compressed boundaries' error feedback
    epoch_start_step: Optional[int] = None  # the cohort step at which ``epoch`` began (where its validations count from)
    order_digest: Optional[str] = None  # a custom sampler's draw of ``epoch`` (hex), which a resume must draw again

    @property
    def cohort_step(self) -> int:
        return self.cohort_steps_total // self.world_size

    def epoch_start(self, samples_per_step: int) -> int:
        """The cohort step at which ``epoch`` began (a checkpoint before 0.3 does not say: its covered
        samples were whole steps of ``samples_per_step`` samples on each of its ranks)."""
        if self.epoch_start_step is not None:
            return self.epoch_start_step
        trained = self.covered.size if isinstance(self.covered, Spans) else int(self.covered.sum())
        return self.cohort_step - trained // (samples_per_step * self.world_size)

    def for_members(self, sources: Sequence[Optional[int]]) -> "ResumePoint":
        """This point for a cohort whose rank r was rank ``sources[r]`` here (None: it joined): the
        controller's per-rank counts and speeds follow their members (``controller_state_for``)."""
        return dataclasses.replace(self, controller=controller_state_for(self.controller, sources))

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "schema_version": self._schema(),
            "epoch": self.epoch,
            "num_samples": self.num_samples,
            "covered": self.covered.to_tensor() if isinstance(self.covered, Spans) else pack_bits(self.covered),
            "seed": self.seed,
            "world_size": self.world_size,
            "cohort_steps_total": self.cohort_steps_total,
            "logged_steps_total": self.logged_steps_total,
            "controller": self.controller,
        }
        if self.optimizer_states is not None:
            state["optimizer_states"] = self.optimizer_states
        if self.outer is not None:
            state["outer"] = self.outer
        if self.governor is not None:
            state["governor"] = self.governor
        if self.averager_states is not None:
            state["averager_states"] = self.averager_states
        if self.epoch_start_step is not None:
            state["epoch_start_step"] = self.epoch_start_step
        if self.order_digest is not None:
            state["order_digest"] = self.order_digest
        state["checksum"] = checksum(state)
        return state

    def _schema(self) -> int:
        """1 for a bit mask of covered samples; 2 with every rank's states inside (gathered); else 3."""
        if not isinstance(self.covered, Spans):
            return 1
        return 2 if self.optimizer_states is not None or self.averager_states is not None else SCHEMA_VERSION

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ResumePoint":
        version = state.get("schema_version")
        if version not in READABLE_SCHEMAS:
            raise ValueError(
                f"this checkpoint's ElChe state has schema version {version!r}; lightning-elche "
                f"reads versions {list(READABLE_SCHEMAS)}. Resume it with the lightning-elche release that wrote it."
            )
        missing = [
            key
            for key in ("epoch", "num_samples", "covered", "seed", "world_size", "cohort_steps_total",
                        "logged_steps_total", "controller")
            if key not in state
        ]
        if missing:
            raise ValueError(f"this checkpoint's ElChe state is incomplete (missing {missing}); it cannot be resumed")
        num_samples, stored = int(state["num_samples"]), state["covered"]
        expected = _malformed_coverage(version, stored, num_samples)
        if expected:
            raise ValueError(
                f"this checkpoint's ElChe coverage is malformed (expected {expected}); it is corrupted. Resume from "
                "another checkpoint, or load only the weights (`LightningModule.load_from_checkpoint`) and start a new fit."
            )
        if "checksum" in state and state["checksum"] != checksum(state):  # absent: written before the checksum
            raise ValueError(
                "this checkpoint's ElChe state (coverage, step counters or controller state) does not match its "
                "checksum: it changed after it was written (a corrupted file, or a script that rewrote it), and "
                "resuming from it would train some samples of the epoch twice and others never. Resume from another "
                "checkpoint, or load only the weights (`LightningModule.load_from_checkpoint`) and start a new fit."
            )
        covered = unpack_bits(stored, num_samples) if version == 1 else Spans.from_tensor(stored)
        return cls(
            epoch=int(state["epoch"]),
            num_samples=num_samples,
            covered=covered,
            seed=int(state["seed"]),
            world_size=int(state["world_size"]),
            cohort_steps_total=int(state["cohort_steps_total"]),
            logged_steps_total=int(state["logged_steps_total"]),
            controller=dict(state["controller"]),
            optimizer_states=state.get("optimizer_states"),
            outer=state.get("outer"),
            governor=state.get("governor"),
            averager_states=state.get("averager_states"),
            epoch_start_step=state.get("epoch_start_step"),
            order_digest=state.get("order_digest"),
        )

    def covered_samples(self, shuffle: bool = True, data: Optional["TrainData"] = None) -> torch.Tensor:
        """The dataset indices of ``epoch`` this checkpoint marks trained, for a sampler that did (not)
        ``shuffle``, or in the order ``data`` describes (a streaming dataset's chunks): what a resume
        will not train again."""
        if not isinstance(self.covered, Spans):
            return self.covered.nonzero().flatten()
        from lightning_elche.cohort.train_data import TrainData

        if data is None:
            data = TrainData(self.num_samples, self.seed, shuffle, batch_size=1, samples_per_step=1, drop_last=False)
        return dataclasses.replace(data, seed=self.seed).samples_at(self.epoch, self.covered)

    def check_fits(self, data: "TrainData", checkpoint_path: Optional[str], warn: Callable[[str], None]) -> None:
        """Before the first resumed epoch is planned: the checkpoint must fit this training set."""
        if self.num_samples != data.num_samples:
            raise ValueError(
                f"the checkpoint {checkpoint_path} was written while training on {self.num_samples} samples, "
                f"but this train DataLoader has {data.num_samples}: ElChe cannot tell which samples of epoch "
                f"{self.epoch} are left. Resume with the training set the checkpoint was made with, or load only "
                "the weights (`LightningModule.load_from_checkpoint`) and start a new fit."
            )
        self._check_drawn_again(data, checkpoint_path)
        if self.seed != data.seed:
            warn(
                f"ElChe: the checkpoint was written with sampler seed {self.seed}, this run uses {data.seed}: "
                f"the samples of epoch {self.epoch} not trained yet are trained once, in seed {data.seed}'s order, "
                "and later epochs follow the new seed."
            )

    def _check_drawn_again(self, data: "TrainData", checkpoint_path: Optional[str]) -> None:
        """A custom sampler must draw the resumed epoch as it did before the checkpoint (its coverage
        names positions of that draw)."""
        if self.order_digest is not None and data.drawn_digest(self.epoch) != self.order_digest:
            raise ValueError(
                f"the checkpoint {checkpoint_path} was written in epoch {self.epoch} of a custom train sampler's "
                "draw, and this run's sampler draws that epoch differently, so ElChe cannot tell which samples "
                "are left. ElChe seeds each epoch's draw (torch's and Python's global generators and the "
                "sampler's `generator` attribute, with the seed plus the epoch, and calls its `set_epoch`); a "
                "sampler drawn from other state (NumPy, a counter of its own) cannot be replayed: derive its "
                "randomness from one of those, or resume from an epoch's end"
            )

    def totals_for(self, world_size: int) -> tuple[int, int]:
        """Cohort and logger step totals for ``world_size`` ranks, keeping the DDP-equivalent steps."""
        if world_size == self.world_size:
            return self.cohort_steps_total, self.logged_steps_total
        logged_step = self.logged_steps_total // self.world_size
        return self.cohort_step * world_size, logged_step * world_size

    def optimizer_states_for(self, rank: int) -> Optional[list[dict[str, Any]]]:
        """This rank's own optimizer states (schema 2, where the file holds every rank's); with another
        world size, those of rank ``rank % saved``."""
        if not self.optimizer_states:
            return None
        return self.optimizer_states[rank % len(self.optimizer_states)]


def _malformed_coverage(version: int, stored: Any, num_samples: int) -> str:
    """What a coverage record of ``version`` should have been, if ``stored`` is not it; else ""."""
    if version == 1:
        nbytes = -(-num_samples // 8)
        ok = isinstance(stored, torch.Tensor) and stored.dtype == torch.uint8 and stored.numel() == nbytes
        return "" if ok else f"{nbytes} uint8 bytes for {num_samples} samples"
    ok = isinstance(stored, torch.Tensor) and stored.dtype == torch.int64 and stored.dim() == 2 and stored.shape[1] == 2
    if ok and stored.numel():
        starts, ends = stored[:, 0], stored[:, 1]
        ok = bool((starts >= 0).all() and (ends > starts).all() and (starts[1:] > ends[:-1]).all() and ends[-1] <= num_samples)
    return "" if ok else f"sorted, disjoint int64 [start, end) pairs within {num_samples} positions"
