"""How long a boundary's reduce takes on a link of known bandwidth and latency.

The controller uses it to size the anchor for a slow link before it has measured a boundary
(a first reading carries warm-up costs and is never trusted to grow the anchor), and the cohort
simulator uses the same function to charge its simulated boundaries and DDP's per-step
all-reduce, so that the simulator predicts the anchor the controller will choose.
"""

from __future__ import annotations

BITS_PER_BYTE = 8
BITS_PER_MS_PER_MBIT_S = 1000.0  # 1 Mbit/s moves 1000 bits per millisecond


def transfer_ms(sent_bytes: float, mbit_s: float, latency_ms: float) -> float:
    """Milliseconds ``sent_bytes`` take on a link of ``mbit_s`` and ``latency_ms`` (also what
    :class:`~lightning_elche.SlowLink` holds a collective for, so the two models agree)."""
    return latency_ms + sent_bytes * BITS_PER_BYTE / (mbit_s * BITS_PER_MS_PER_MBIT_S)


def link_ms(payload_bytes: int, world_size: int, mbit_s: float, latency_ms: float) -> float:
    """Milliseconds a ring all-reduce of ``payload_bytes`` takes among ``world_size`` ranks.

    A ring all-reduce is a reduce-scatter followed by an all-gather: each rank sends (and
    receives) ``2 * (W - 1) / W`` times the payload, which is what bounds the time on the slowest
    link; the latency is paid once per reduce. A single rank reduces nothing and pays nothing.
    """
    if world_size <= 1:
        return 0.0
    return transfer_ms(2.0 * (world_size - 1) / world_size * payload_bytes, mbit_s, latency_ms)
