"""lightning-elche: data-parallel training that keeps fast GPUs busy on mixed hardware.

``Trainer(strategy="elche")`` after ``import lightning_elche``, or
``Trainer(strategy=ElCheStrategy(...))``. See README.md and docs/.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_elche.cohort.guards import ConvergenceGuard, DivergenceReport, MsfGuard, NoGuard, TrendGuard, Verdict
from lightning_elche.cohort.records import BoundaryRecord
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.lightning.callback import ElCheCallback
from lightning_elche.lightning.settings import Averaging, Data, Faults, Links, Reporting, Window
from lightning_elche.lightning.strategy import ElCheStrategy
from lightning_elche.lightning.warm_start import fork_at_import
from lightning_elche.sim.slowdown import Slowdown, SlowLink

__version__ = "0.2.0.dev0"

ElCheStrategy.register_strategies(StrategyRegistry)
fork_at_import()  # last: the zygote for Lightning's launcher is a fork of this process as it is now (warm_start.py)


__all__ = [
    "Averaging",
    "BoundaryRecord",
    "ConvergenceGuard",
    "Data",
    "DivergenceReport",
    "ElCheCallback",
    "ElCheStrategy",
    "Faults",
    "Links",
    "MsfGuard",
    "NoGuard",
    "OuterNesterov",
    "Reporting",
    "SlowLink",
    "Slowdown",
    "TrendGuard",
    "Verdict",
    "Window",
    "__version__",
]
