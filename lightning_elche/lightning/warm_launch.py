"""Lightning's script launcher with its ranks forked warm.

``Trainer(strategy="elche", devices=N)`` run as ``python train.py`` starts ranks 1..N-1 the way DDP
does, by running the script again, but from the zygote forked as the script imported lightning_elche
(``warm_start.py``) rather than as fresh interpreters: a rank then skips importing torch and Lightning
(seconds of CPU each) and reaches its first batch that much sooner, where the fast rank waits for it.
Everything else is Lightning's :class:`_SubprocessScriptLauncher`: the environment a rank gets
(``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``PL_GLOBAL_SEED`` as
Lightning sets or drops it), the command (``python script args`` or ``python -m module args``, Hydra's
working directory), the process observer that ends the fit when a rank dies, and ``kill``. Where the
zygote cannot start workers (:class:`ZygoteUnusable`) the ranks start as Lightning starts them, with a
message saying why.
"""

from __future__ import annotations

import os
import subprocess
from typing import Optional

from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_elche.lightning._lightning import (
    HYDRA_AVAILABLE,
    SubprocessScriptLauncher,
    basic_subprocess_command,
    hydra_subprocess_command,
)
from lightning_elche.lightning.warm_start import WarmStarter, WorkerProcess, ZygoteUnusable


class WarmScriptLauncher(SubprocessScriptLauncher):
    """Lightning's ``_SubprocessScriptLauncher`` whose ranks are forked from ``zygote`` (the module docstring)."""

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, zygote: WarmStarter) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._zygote: Optional[WarmStarter] = zygote

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = dict(os.environ, LOCAL_RANK=str(local_rank))
            if os.environ.get("PL_GLOBAL_SEED") is None:
                env.pop("PL_GLOBAL_SEED", None)
            command, cwd = _command(local_rank)
            self.procs.append(self._start(command, env, cwd))  # type: ignore[arg-type]  # Popen's interface, as Lightning uses it

    def _start(self, command: list[str], env: dict[str, str], cwd: Optional[str]) -> WorkerProcess:
        if self._zygote is not None:
            try:
                return self._zygote.start(command[1], command[2:], env, cwd)
            except ZygoteUnusable as unusable:
                rank_zero_info(f"ElCheStrategy: starting the ranks as new interpreters: {unusable}")
                self._zygote = None
        return subprocess.Popen(command, env=env, cwd=cwd)


def _command(local_rank: int) -> tuple[list[str], Optional[str]]:
    """Lightning's command for a rank, and the working directory Hydra needs (None: this process's)."""
    if HYDRA_AVAILABLE:
        from hydra.core.hydra_config import HydraConfig  # type: ignore[import-not-found]  # optional, as for Lightning

        if HydraConfig.initialized():
            command, cwd = hydra_subprocess_command(local_rank)
            return list(command), cwd
    return list(basic_subprocess_command()), None
