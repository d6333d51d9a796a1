"""lightning-elche: data-parallel training that keeps fast GPUs busy on mixed hardware.

``Trainer(strategy="elche")`` after ``import lightning_elche``, or
``Trainer(strategy=ElCheStrategy(...))``. See README.md and docs/.
"""

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_elche.callback import BoundaryRecord, ElCheCallback
from lightning_elche.guards import ConvergenceGuard, DivergenceReport, MsfGuard, NoGuard, TrendGuard, Verdict
from lightning_elche.outer import OuterNesterov
from lightning_elche.strategy import ElCheStrategy

__version__ = "0.1.0"

ElCheStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    """``Slowdown`` loads on first use, so ``python -m lightning_elche.simulate`` runs that module once."""
    if name == "Slowdown":
        from lightning_elche.simulate import Slowdown

        return Slowdown
    raise AttributeError(f"module 'lightning_elche' has no attribute {name!r}")

__all__ = [
    "BoundaryRecord",
    "ConvergenceGuard",
    "DivergenceReport",
    "ElCheCallback",
    "ElCheStrategy",
    "MsfGuard",
    "NoGuard",
    "OuterNesterov",
    "Slowdown",
    "TrendGuard",
    "Verdict",
    "__version__",
]
