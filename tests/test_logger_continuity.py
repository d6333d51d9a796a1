"""One run per logger across an elastic rank-0 change: TensorBoard's and CSV's version folder, W&B's and
MLflow's run id.

Rank 0 resolves each logger's run at the fit's start and every rank pins it
(``_lightning.logger_versions`` / ``pin_logger_versions``), so that the rank that becomes rank 0 when
the first is lost writes on in the same run. W&B runs offline and MLflow on a file store, both in the
test's folder: nothing leaves the machine. First each logger's mechanics in this process (one logger
object as the first rank 0, a second as the rank that takes over), then a real elastic fit under
``python -m lightning_elche.launch`` whose rank 0 is SIGKILLed mid-epoch.
"""

from __future__ import annotations

import csv
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_results
from test_elastic import run_elastic

from lightning_elche.lightning._lightning import ContinuingCSVWriter, logger_versions, pin_logger_versions


def wandb_offline_runs(folder: Path) -> dict[str, list[dict[str, str]]]:
    """Every offline run W&B wrote under ``folder``: run id -> its history rows (key -> JSON value), in
    the order written. A run resumed in another process is a second ``offline-run-*`` folder with the
    same id (``wandb sync`` uploads both into one run)."""
    from wandb.proto import wandb_internal_pb2

    runs: dict[str, list[dict[str, str]]] = {}
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        rows = runs.setdefault(path.stem.removeprefix("run-"), [])
        for payload in _leveldb_log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return runs


def _leveldb_log_records(data: bytes):
    """The records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks of 7-byte-headed fragments)
    after W&B's 7-byte header; the reader W&B ships is in its Go core, not in Python."""
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:  # zero padding up to the block's end
            position += block - position % block
            continue
        payload, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind == 1:  # whole
            yield payload
        elif kind in (2, 3):  # first, middle
            pending += payload
        else:  # last
            yield pending + payload
            pending = b""


def mlflow_runs(folder: Path, key: str) -> dict[str, list[int]]:
    """MLflow's runs in the file store under ``folder``: run id -> the steps ``key`` was logged at."""
    runs = {}
    for metric in folder.glob("mlruns/*/*/metrics/" + key):
        run = metric.parents[len(Path(key).parts)]
        runs[run.name] = [int(line.split()[2]) for line in metric.read_text().splitlines()]
    return runs


def csv_rows(folder: Path) -> dict[str, list[dict[str, str]]]:
    """Each CSV version folder in ``folder``: its rows."""
    versions = {}
    for path in sorted(folder.glob("version_*/metrics.csv")):
        with open(path, newline="") as file:
            versions[path.parent.name] = list(csv.DictReader(file))
    return versions


def test_csv_a_new_rank_0_appends_to_the_metrics_the_first_wrote(tmp_path):
    """Lightning's own writer would delete ``metrics.csv`` on creation; the continuing one keeps the rows
    and every column, also when it logs keys the first did not."""
    from lightning.pytorch.loggers import CSVLogger

    first = CSVLogger(tmp_path, name="", flush_logs_every_n_steps=1)
    first.log_metrics({"loss": 1.0, "elche/anchor": 4.0}, step=1)
    taking_over = CSVLogger(tmp_path, name="", flush_logs_every_n_steps=1)
    pin_logger_versions(SimpleNamespace(loggers=[taking_over], global_rank=1), [first.version])
    assert isinstance(taking_over._experiment, ContinuingCSVWriter)
    taking_over.log_metrics({"loss": 0.5, "elche/rank1/share": 0.25}, step=2)
    assert list(csv_rows(tmp_path)) == ["version_0"]
    rows = csv_rows(tmp_path)["version_0"]
    assert [(row["step"], row["loss"], row["elche/anchor"], row["elche/rank1/share"]) for row in rows] == [
        ("1", "1.0", "4.0", ""), ("2", "0.5", "", "0.25")
    ]


def test_wandb_and_mlflow_a_new_rank_0_resumes_the_run_id_rank_0_started(tmp_path, monkeypatch):
    """W&B has no run id before ``wandb.init``: rank 0 starts its run when the versions are taken."""
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")  # restored after the test (WandbLogger sets it)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True)

    def loggers():
        return [WandbLogger(offline=True, save_dir=str(tmp_path), project="elche", settings=settings),
                MLFlowLogger(experiment_name="elche", tracking_uri=(tmp_path / "mlruns").as_uri())]

    try:
        first = loggers()
        versions = logger_versions(SimpleNamespace(loggers=first))
        assert all(isinstance(version, str) and version for version in versions), versions
        for logger in first:
            logger.log_metrics({"elche/anchor": 4.0}, step=1)
        wandb.finish()  # the first rank 0 is gone
        taking_over = loggers()
        pin_logger_versions(SimpleNamespace(loggers=taking_over, global_rank=1), versions)
        for logger in taking_over:
            logger.log_metrics({"elche/anchor": 8.0}, step=2)
        wandb.finish()
    finally:
        wandb.teardown()
    runs = wandb_offline_runs(tmp_path)
    assert list(runs) == [versions[0]], runs
    assert [row["trainer/global_step"] for row in runs[versions[0]]] == ["1", "2"]
    assert mlflow_runs(tmp_path, "elche/anchor") == {versions[1]: [1, 2]}


@pytest.mark.timeout(260)
def test_a_new_rank_0_continues_every_loggers_run_after_the_first_is_killed(tmp_path):
    """Three ranks, rank 0 SIGKILLed at its fifth batch; the survivors' new rank 0 logs the rest of the fit.
    Every boundary is logged (``log_every_n_steps=1``); each logger holds one run, and that run holds the
    points of the boundaries before the loss (the first rank 0's) and after it (the new one's), but for
    what a killed process had not written yet (W&B's)."""
    proc, _ = run_elastic(
        tmp_path, slow={"1": 2.0}, kill_at={"rank": 0, "epoch": 0, "batch": 4}, log_every_n_steps=1,
        tensorboard=True, tensorboard_version=None, run_loggers=["csv", "wandb", "mlflow"],
    )
    survivors = load_results(tmp_path, 2, proc.stderr)
    history = survivors[0]["boundaries"]
    [change] = [i for i, b in enumerate(history) if b["level"].startswith("membership")]
    # the telemetry's rule: a boundary that moved the cohort step (every step is a multiple of 1)
    logged = [b["cohort_step"] for i, b in enumerate(history)
              if not b["level"].startswith("membership") and b["cohort_step"] > (history[i - 1]["cohort_step"] if i else 0)]
    before = [b["cohort_step"] for b in history[:change]]
    assert before and logged[-1] > history[change]["cohort_step"], "the loss was not mid-fit"
    out = tmp_path / "out"
    assert sorted(path.name for path in (out / "tb").iterdir()) == ["version_0"]
    [csv_run] = csv_rows(out / "csv").values()
    assert [int(row["step"]) for row in csv_run if row.get("elche/anchor")] == logged
    [mlflow_steps] = mlflow_runs(out, "elche/anchor").values()
    assert mlflow_steps == logged
    [(run_id, rows)] = wandb_offline_runs(out).items()
    assert len(list((out / "wandb").glob(f"offline-run-*-{run_id}"))) == 2  # the first rank 0's, the new one's
    steps = [int(row["trainer/global_step"]) for row in rows if "elche/anchor" in row]
    after = [step for step in logged if step > history[change]["cohort_step"]]
    # W&B's service buffers its writes: what the killed rank 0 logged is lost with it (here its file held
    # only its header), what the new rank 0 logged is in the same run
    assert steps[-len(after):] == after and set(steps[: -len(after)]) <= set(before), (steps, logged)
