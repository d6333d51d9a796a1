"""Settings that would hang or silently diverge with uneven ranks are refused when ``fit()`` starts.

Each test runs the real two-process scenario (Lightning's own launcher, a gloo process group)
with one refused setting and asserts that

* the run fails (non-zero exit),
* the error is ElChe's and names the setting,
* BOTH ranks raised it (each rank writes ``rank{r}.json`` with its exception in a ``finally``
  block, and torch prefixes each rank's traceback with ``[rank{r}]:`` in the shared stderr),
* no training batch ran on either rank (refused before any collective could diverge), and
* the whole run ended within seconds: far below the scenario's 60 s process-group timeout,
  so neither rank sat in a collective waiting for the other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import run_scenario

WORLD = 2
NO_HANG_S = 45.0  # the scenario's process-group timeout is 60 s; a refusal takes ~6 s
SETUP_HEADER = "ElCheStrategy cannot train with these settings"


def run_refused(tmp_path: Path, **config: Any) -> dict[str, Any]:
    """Run a scenario that should be refused; return the process, wall time and per-rank results."""
    config = {"epochs": 1, "samples": 64, **config}
    started = time.perf_counter()
    proc = run_scenario(tmp_path, expect_failure=True, timeout=90, **config)
    elapsed = time.perf_counter() - started
    ranks = {}
    for rank in range(WORLD):
        path = tmp_path / "out" / f"rank{rank}.json"
        if path.exists():
            ranks[rank] = json.loads(path.read_text())
    return {"proc": proc, "elapsed": elapsed, "ranks": ranks, "config": config}


def assert_refused_on_every_rank(run: dict[str, Any], *needles: str, exception: str | None = None) -> None:
    proc, ranks = run["proc"], run["ranks"]
    tail = proc.stderr[-6000:]
    assert proc.returncode != 0, f"the run was not refused (exit 0) with {run['config']}:\n{tail}"
    assert run["elapsed"] < NO_HANG_S, f"refusal took {run['elapsed']:.1f} s (a rank hung?):\n{tail}"
    stderr_lines = proc.stderr.splitlines()
    for rank in range(WORLD):
        assert rank in ranks, f"rank {rank} wrote no result (killed before its finally block?):\n{tail}"
        result = ranks[rank]
        message = result["exception_message"] or ""
        assert result["exception"] is not None, f"rank {rank} did not raise:\n{tail}"
        if exception is not None:
            assert result["exception"] == exception, f"rank {rank}: {result['exception']}: {message}"
        assert "ElCheStrategy" in message, f"rank {rank} failed with someone else's error: {message}"
        for needle in needles:
            assert needle in message, f"rank {rank}: {needle!r} not named in {message!r}"
            assert any(line.startswith(f"[rank{rank}]:") and needle in line for line in stderr_lines), (
                f"rank {rank}'s traceback in stderr does not name {needle!r}:\n{tail}"
            )
        # refused before training: no batch ran, no boundary averaged anything
        assert result["step_batches"] == [], f"rank {rank} trained {len(result['step_batches'])} batches first"
        assert result["boundaries"] == []
    # one error per rank, the same on both
    assert ranks[0]["exception"] == ranks[1]["exception"]
    assert ranks[0]["exception_message"] == ranks[1]["exception_message"]


# --------------------------------------------------------------------------- refused in setup()
# Trainer / module settings, refused by ``check_fit_configuration`` with one MisconfigurationException.

SETUP_REFUSALS = [
    pytest.param({"model": "bn", "trainer": {"sync_batchnorm": True}}, "`sync_batchnorm=True`", id="sync_batchnorm"),
    pytest.param({"trainer": {"val_check_interval": 5}}, "`val_check_interval`", id="val_check_interval_int"),
    pytest.param({"trainer": {"val_check_interval": 0.5}}, "`val_check_interval`", id="val_check_interval_float"),
    pytest.param(
        {"trainer": {"val_check_interval": "00:00:00:01"}}, "`val_check_interval`", id="val_check_interval_time"
    ),
    pytest.param(
        {"trainer": {"check_val_every_n_epoch": None}}, "`check_val_every_n_epoch=None`", id="check_val_every_n_epoch_none"
    ),
    pytest.param({"trainer": {"limit_train_batches": 0.5}}, "`limit_train_batches`", id="limit_train_batches_float"),
    pytest.param({"trainer": {"limit_train_batches": 10}}, "`limit_train_batches`", id="limit_train_batches_int"),
    pytest.param({"trainer": {"overfit_batches": 2}}, "`overfit_batches`", id="overfit_batches"),
    pytest.param({"metric_sync_on_step": True}, "dist_sync_on_step", id="metric_dist_sync_on_step"),
    pytest.param({"training_step": "dataloader_iter"}, "`training_step(dataloader_iter)`", id="dataloader_iter"),
]

@pytest.mark.timeout(120)
@pytest.mark.parametrize(("config", "needle"), SETUP_REFUSALS)
def test_setting_is_refused_on_every_rank_without_hanging(tmp_path, config, needle):
    run = run_refused(tmp_path, **config)
    assert_refused_on_every_rank(run, SETUP_HEADER, needle, exception="MisconfigurationException")


@pytest.mark.timeout(120)
def test_several_problems_are_listed_in_one_error(tmp_path):
    """Trainer flags and a module-level problem together: one error per rank, one bullet per problem."""
    run = run_refused(
        tmp_path, model="bn", metric_sync_on_step=True, trainer={"sync_batchnorm": True, "overfit_batches": 2}
    )
    needles = ("`sync_batchnorm=True`", "`overfit_batches`", "dist_sync_on_step")
    assert_refused_on_every_rank(run, SETUP_HEADER, *needles, exception="MisconfigurationException")
    stderr = run["proc"].stderr
    for rank in range(WORLD):
        message = run["ranks"][rank]["exception_message"]
        assert message.count(SETUP_HEADER) == 1, message
        bullets = [line for line in message.splitlines() if line.startswith("  - ")]
        for needle in needles:
            assert sum(needle in b for b in bullets) == 1, f"{needle!r} is not exactly one bullet of {message!r}"
        # one raise per rank, not one per problem: the header appears once in each rank's traceback
        assert sum(line.startswith(f"[rank{rank}]:") and SETUP_HEADER in line for line in stderr.splitlines()) == 1


# --------------------------------------------------------------------------- refused in process_dataloader()
# Train DataLoaders ElChe cannot partition by index, refused when the train loader is set up.

DATA_REFUSALS = [
    pytest.param({"dataset": "iterable"}, "IterableDataset", id="iterable_dataset"),
    pytest.param({"sampler": "custom"}, "DistributedSampler", id="custom_sampler"),
    pytest.param({"trainer": {"use_distributed_sampler": False}}, "DistributedSampler", id="use_distributed_sampler_false"),
    # A BatchSampler subclass is re-instantiated by Lightning around the DistributedSampler; ElChe
    # cannot split it into windows. (A plain torch BatchSampler is turned by Lightning's own sampler
    # injection into a plain loader, under DDP as under ElChe, so it is not refused.)
    pytest.param({"batch_sampler": "subclass"}, "`batch_size`", id="batch_sampler_subclass"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("config", "needle"), DATA_REFUSALS)
def test_train_dataloader_is_refused_on_every_rank_without_hanging(tmp_path, config, needle):
    run = run_refused(tmp_path, **config)
    assert_refused_on_every_rank(run, needle, exception="ValueError")
