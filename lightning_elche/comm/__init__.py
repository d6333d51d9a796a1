"""Where bytes move: the only code in lightning_elche that calls ``torch.distributed`` or the rendezvous store.

The averagers (``averaging.py``: flat, with :func:`~lightning_elche.comm.averaging.make_averager`;
``composed.py``: every other combination, of the parts in ``compressed.py``, ``hierarchy.py`` and
``overlap.py``) run a boundary's exchange over one flat buffer (``buffer.py``) whose control
slots (``control.py``) carry the cohort's report; ``groups.py`` holds the process
groups and the once-per-fit collectives (set-up, module-state broadcast, checkpoint gather,
teardown); ``liveness.py`` names the ranks that stopped answering; ``outer.py`` is DiLoCo's outer
step, applied to the consensus. Every collective is written ``dist.<name>(...)`` so that tests can
trace them; nothing is imported here, so ``import lightning_elche.comm`` stays light.
"""
