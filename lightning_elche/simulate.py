"""``python -m lightning_elche.simulate``: the cohort simulator's command line (see :mod:`lightning_elche.sim.cli`)."""

import sys

from lightning_elche.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
