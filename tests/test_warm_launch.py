"""Lightning's own launcher starts ElChe's ranks warm: forked from the zygote the script's process made
as it imported lightning_elche (``lightning_elche/warm_start.py``, ``lightning/warm_launch.py``).

The scripts here are started as fresh interpreters (``python -u``, which the tests' own zygote does
not serve), so that their process imports lightning_elche itself, as a user's does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import run_command

# A helper module of the script's own that imports lightning_elche, so the zygote is forked while it is
# half imported: the forked rank must import it afresh and see what it defines after that import.
HELPER = """
import lightning_elche
DEFINED_AFTER_THE_IMPORT = 3
"""

SCRIPT = """
import json, os, sys
TORCH_BEFORE_FIRST_LINE = "torch" in sys.modules
import torch
COMPUTE_FIRST = "--compute-first" in sys.argv
if COMPUTE_FIRST:  # OpenMP's thread pool, made before lightning_elche is imported, as some scripts do
    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)
import lightning.pytorch as pl
import helper
from lightning_elche.lightning import warm_start
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, index):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = pl.Trainer(strategy="elche", devices=2, accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=16))
    zygote = warm_start.import_zygote()
    report = {"rank": trainer.global_rank, "torch_before_first_line": TORCH_BEFORE_FIRST_LINE, "parent": os.getppid(),
              "zygote": None if zygote is None else zygote._zygote, "helper": helper.DEFINED_AFTER_THE_IMPORT,
              "cwd": os.getcwd(), "global_step": trainer.global_step, "cohort_step": trainer.strategy.cohort_step,
              "weight": trainer.lightning_module.layer.weight.tolist()}
    with open(f"rank{trainer.global_rank}.json", "w") as out:
        json.dump(report, out)
"""


def fit_twice_launched(tmp_path: Path, *options: str, module: bool = False, env: dict[str, str] | None = None) -> tuple[dict, dict, str]:
    """Run the script (``python -u train.py``, or ``python -u -m train``) in ``tmp_path``; both ranks' reports."""
    (tmp_path / "helper.py").write_text(HELPER)
    (tmp_path / "train.py").write_text(SCRIPT)
    command = [sys.executable, "-u", *(["-m", "train"] if module else [str(tmp_path / "train.py")]), *options]
    proc = run_command(command, tmp_path, 150, what="a two-rank fit under Lightning's launcher",
                       env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    for report in (rank0, rank1):  # one cohort, whichever way rank 1 started
        assert report["helper"] == 3 and report["cwd"] == str(tmp_path)
        assert report["cohort_step"] == rank0["cohort_step"] > 0 and report["global_step"] == rank0["global_step"]
    assert rank1["weight"] == rank0["weight"]
    return rank0, rank1, proc.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_lightnings_launcher_forks_the_other_ranks_from_the_import_zygote(tmp_path, module):
    """Rank 1 is a child of the zygote rank 0's process forked as it imported lightning_elche (not of
    rank 0, as Lightning's ``Popen`` makes it), had torch imported before its script's first line, and
    ran the script as Lightning's command runs it (its own helper module imported afresh though the
    zygote was forked half-way through importing it; ``python -m`` too); the fit is one cohort."""
    rank0, rank1, _ = fit_twice_launched(tmp_path, module=module)
    assert rank0["zygote"] is not None and rank1["parent"] == rank0["zygote"]
    assert rank1["torch_before_first_line"] and not rank0["torch_before_first_line"]
    assert rank1["zygote"] is None  # a rank makes no zygote of its own


@pytest.mark.timeout(200)
def test_a_script_that_computed_before_importing_lightning_elche_starts_its_ranks_cold(tmp_path):
    """OpenMP's thread pool does not survive a fork (a child computing with two threads waits forever):
    the zygote's probe finds it, and the ranks start as Lightning starts them, saying why."""
    rank0, rank1, stderr = fit_twice_launched(tmp_path, "--compute-first")
    assert "starting the ranks as new interpreters" in stderr and "OpenMP" in stderr
    assert not rank1["torch_before_first_line"] and rank1["parent"] != rank0["zygote"]


@pytest.mark.timeout(200)
def test_elche_cold_start_makes_no_zygote(tmp_path):
    rank0, rank1, _ = fit_twice_launched(tmp_path, env={"ELCHE_COLD_START": "1"})
    assert rank0["zygote"] is None and not rank1["torch_before_first_line"]


# The zygote's pipes are closed in a fork of the process that made it, and only there: the fork's own
# pipes take the freed numbers, and its children must keep them (a benchmark harness forks jobs that fork ranks).
FORKS_SCRIPT = """
import os, sys
import lightning_elche
from lightning_elche.lightning import warm_start

assert warm_start.import_zygote() is not None
job = os.fork()
if job == 0:
    assert warm_start.import_zygote() is None  # the owner's alone
    read, write = os.pipe()
    rank = os.fork()
    if rank == 0:
        os.write(write, b"kept")
        os._exit(0)
    os.close(write)
    os._exit(0 if os.read(read, 4) == b"kept" and os.waitpid(rank, 0)[1] == 0 else 1)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(job, 0)[1]))
"""


@pytest.mark.timeout(120)
def test_forks_of_the_launching_process_and_their_forks_keep_their_own_files(tmp_path):
    (tmp_path / "forks.py").write_text(FORKS_SCRIPT)
    proc = run_command([sys.executable, "-u", str(tmp_path / "forks.py")], tmp_path, 90, what="forks of the launching process",
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
