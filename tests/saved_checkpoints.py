"""What a checkpoint file and its per-rank parts hold, read as a user would read them (``torch.load``,
weights-only), not through ElChe: the tests check the layout docs/resume.md describes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

STATE_KEY = "ElCheCallback"


def elche_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint, weights_only=True)["callbacks"][STATE_KEY]


def part_paths(checkpoint: Path) -> list[Path]:
    """The parts the checkpoint names, saved rank 1's first (rank 0's part is the checkpoint itself)."""
    parts = elche_state(checkpoint)["parts"]
    folder = checkpoint.resolve().parent / parts["folder"]
    return [folder / f"rank{rank}-{parts['token']}.pt" for rank in range(1, parts["world_size"])]


def saved_optimizer_states(checkpoint: Path) -> list[list[dict[str, Any]]]:
    """Every saved rank's optimizer state dicts: rank 0's in the checkpoint (Lightning's key), the others'
    in their parts; in a single-file checkpoint (earlier versions), all in ElChe's state."""
    content = torch.load(checkpoint, weights_only=True)
    state = content["callbacks"][STATE_KEY]
    if "optimizer_states" in state:
        return state["optimizer_states"]
    return [content["optimizer_states"], *(torch.load(p, weights_only=True)["optimizer_states"] for p in part_paths(checkpoint))]
