"""What the strategy's mixins use of DDPStrategy, of each other and of ElCheStrategy, for the type checker.

:class:`~lightning_elche.ElCheStrategy` is DDPStrategy with four mixins (``checkpoints.py``,
``collectives.py``, ``dispatch.py``, ``elastic.py``), each calling members that DDPStrategy, another
mixin or the strategy define. At run time a mixin's base is ``object``, so the method resolution
order is the strategy's alone; to mypy it is :class:`StrategyHost`, a DDPStrategy that declares
those members, so that every call across the mixins is checked against one list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from abc import abstractmethod
    from contextlib import AbstractContextManager
    from datetime import timedelta
    from typing import Optional, Sequence

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_elche.cohort.core import Cohort
    from lightning_elche.cohort.resume import ResumePoint
    from lightning_elche.comm.claims import TicketCounter
    from lightning_elche.comm.interface import Averager
    from lightning_elche.comm.liveness import CohortFailure, Liveness
    from lightning_elche.comm.membership import Membership
    from lightning_elche.comm.outer import OuterNesterov
    from lightning_elche.lightning.callback import ElCheCallback
    from lightning_elche.lightning.settings import ElCheSettings

    class StrategyHost(DDPStrategy):
        settings: ElCheSettings
        cohort: Optional[Cohort]
        averager: Optional[Averager]
        liveness: Optional[Liveness]
        membership: Optional[Membership]  # an elastic fit's (ElasticCohort)
        _timeout: timedelta  # DDPStrategy's, which ElCheStrategy always sets (the checked ``timeout``)
        _claims: Optional[TicketCounter]
        _resume: Optional[ResumePoint]
        _fitting_trainer: Optional[pl.Trainer]
        _joining: bool  # ElasticCohort's
        _dump_outdated: bool  # CohortCheckpoints'

        # ElCheStrategy's checked arguments (properties over its settings)
        seed: Optional[int]
        gamma: float
        reduce_on: str
        strict_collectives: bool
        outer_optimizer: Optional[OuterNesterov]

        @property
        @abstractmethod
        def callback(self) -> ElCheCallback: ...

        @abstractmethod
        def _start_cohort(
            self, trainer: pl.Trainer, resume: Optional[ResumePoint], previous: Optional[Cohort] = None
        ) -> Cohort: ...

        @abstractmethod
        def follow_schedules(self, cohort_step: int) -> None: ...

        # CohortCollectives'
        @abstractmethod
        def _check_collective(self, what: str) -> None: ...

        @abstractmethod
        def naming_lost_ranks(self, during: Optional[str] = None) -> AbstractContextManager[None]: ...

        @abstractmethod
        def claiming(self) -> AbstractContextManager[None]: ...

        # ElasticCohort's
        @abstractmethod
        def continues_at_boundary(self, failure: CohortFailure) -> bool: ...

        @abstractmethod
        def continue_at_boundary(self, lost: Sequence[int]) -> None: ...

        # CohortDispatch's
        @abstractmethod
        def rebind_sampler(self, cohort: Cohort) -> None: ...

else:
    StrategyHost = object
