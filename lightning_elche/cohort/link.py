"""How long a boundary's reduce takes on a link of known bandwidth and latency.

The controller uses it to size the anchor for a slow link before it has measured a boundary
(a first reading carries warm-up costs and is never trusted to grow the anchor), and the cohort
simulator uses the same function to charge its simulated boundaries and DDP's per-step
all-reduce, so that the simulator predicts the anchor the controller will choose.

The bandwidth is the link's line rate (Ethernet's 100 Mbit/s, 1 Gbit/s), which is not what gloo's
TCP gets of it: each 1448 bytes of a tensor travel in a frame of 1538 bytes on the line (IPv4 and TCP
headers with timestamps, Ethernet's header, checksum, preamble and gap), and since every rank of a
collective sends and receives at once, each direction also carries the other direction's ACKs (one
minimum frame, 84 bytes on the line, per two segments): 9.1 % more than the tensor's bytes. Without
them the model put an all-reduce of two ranks across a 100 Mbit/s link short by about that much
(checked on two hosts made of network namespaces, ``tc tbf`` limiting the link, which counts frames
without checksum, preamble and gap: one TCP transfer there gets 1448 / 1514 = 95.6 % of the rate;
``benchmarks/slow_link.py --real-link`` sets the model beside the real link).
"""

from __future__ import annotations

BITS_PER_BYTE = 8
BITS_PER_MS_PER_MBIT_S = 1000.0  # 1 Mbit/s moves 1000 bits per millisecond
SEGMENT_PAYLOAD_BYTES = 1500 - 20 - 32  # a 1500-byte IP packet less the IPv4 and TCP (timestamps) headers
FRAME_ON_LINE_BYTES = 1500 + 14 + 4 + 8 + 12  # Ethernet header, checksum, preamble, inter-frame gap
ACK_ON_LINE_BYTES = 64 + 8 + 12  # a minimum frame, its preamble and gap
SEGMENTS_PER_ACK = 2  # TCP's delayed ACK
WIRE_BYTES_PER_PAYLOAD_BYTE = (FRAME_ON_LINE_BYTES + ACK_ON_LINE_BYTES / SEGMENTS_PER_ACK) / SEGMENT_PAYLOAD_BYTES


def transfer_ms(sent_bytes: float, mbit_s: float, latency_ms: float) -> float:
    """Milliseconds ``sent_bytes`` of a collective take on a link of ``mbit_s`` (line rate) and
    ``latency_ms``, TCP's framing and the other direction's ACKs included (also what
    :class:`~lightning_elche.SlowLink` holds a collective for, so the two models agree)."""
    wire_bits = sent_bytes * WIRE_BYTES_PER_PAYLOAD_BYTE * BITS_PER_BYTE
    return latency_ms + wire_bits / (mbit_s * BITS_PER_MS_PER_MBIT_S)


def link_ms(payload_bytes: int, world_size: int, mbit_s: float, latency_ms: float) -> float:
    """Milliseconds a ring all-reduce of ``payload_bytes`` takes among ``world_size`` ranks.

    A ring all-reduce is a reduce-scatter followed by an all-gather: each rank sends (and
    receives) ``2 * (W - 1) / W`` times the payload, which is what bounds the time on the slowest
    link; the latency is paid once per reduce. A single rank reduces nothing and pays nothing.
    """
    if world_size <= 1:
        return 0.0
    return transfer_ms(2.0 * (world_size - 1) / world_size * payload_bytes, mbit_s, latency_ms)
