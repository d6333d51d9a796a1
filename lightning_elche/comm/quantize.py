"""Codecs for a boundary's pseudo-gradient: flat float values in, bytes on the wire out, and back.

A codec turns ``n`` float values into one uint8 payload of ``payload_bytes(n)`` bytes, so that
every collective moves plain bytes (gloo and NCCL reduce no int8 or fp8 sums, and the sum of
values quantized on different scales would be meaningless anyway). What the codec rounds away is
returned by :meth:`Codec.encode` as the error the caller feeds back into the next window
(``compressed.py``), so nothing is lost, only sent later.

- ``"bf16"``: bfloat16, 2 bytes a value, no scales (float32's range, 8 bits of mantissa).
- ``"int8"``: 1 byte a value plus one float32 scale per block of :data:`BLOCK` values (``absmax / 127``,
  round to nearest): 1.016 bytes a value; the row-wise int8 of INTELLECT-1 and torchft's DiLoCo.
- ``"fp8"``: float8 e4m3 with the same block scales (``absmax / 448``): 1.016 bytes a value, a
  relative rather than absolute rounding error, so small values inside a block keep more digits.

Blocks are what the two-stage reduce splits the payload on, so a chunk of whole blocks encodes to
a contiguous slice of the payload (``payload_bytes(n)`` is additive over whole blocks).
"""

from __future__ import annotations

from typing import Optional

import torch

BLOCK = 256  # values per scale: 4 bytes of scale per 256 bytes of int8 or fp8 codes
COMPRESSIONS = ("bf16", "int8", "fp8")
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn


class Codec:
    """One compression setting: how many bytes ``n`` values take, and the two directions."""

    def __init__(self, name: str) -> None:
        if name not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS} or None, got {name!r}")
        self.name = name
        self.scaled = name != "bf16"
        self.code_bytes = 2 if name == "bf16" else 1

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"

    @property
    def block(self) -> int:
        """The values a chunk of the payload must be a multiple of (1 without scales)."""
        return BLOCK if self.scaled else 1

    def payload_bytes(self, n: int) -> int:
        """The bytes ``n`` values encode to (``n`` a multiple of :attr:`block`)."""
        return n * self.code_bytes + (n // BLOCK) * 4 if self.scaled else n * self.code_bytes

    @torch.no_grad()
    def encode(self, values: torch.Tensor, payload: torch.Tensor, error: Optional[torch.Tensor] = None) -> None:
        """Encode ``values`` (flat, float) into ``payload`` (uint8, :meth:`payload_bytes` long); with
        ``error``, write there what the encoding lost (``values - decode(payload)``)."""
        n = values.numel()
        if not self.scaled:
            payload.view(torch.bfloat16).copy_(values)
        else:
            blocks = values.view(-1, BLOCK)
            scales = blocks.abs().amax(dim=1, keepdim=True).float()
            scales.div_(127.0 if self.name == "int8" else _FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
            codes = payload[: n * self.code_bytes]
            scaled = blocks / scales
            if self.name == "int8":
                codes.view(torch.int8).view(-1, BLOCK).copy_(scaled.round_().clamp_(-127, 127))
            else:
                codes.view(torch.float8_e4m3fn).view(-1, BLOCK).copy_(scaled)
            payload[n * self.code_bytes :].view(torch.float32).copy_(scales.view(-1))
        if error is not None:
            self.decode(payload, error)
            torch.sub(values, error, out=error)

    @torch.no_grad()
    def decode(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0, accumulate: bool = False) -> None:
        """``out = weight * decode(payload)``, or ``out += ...`` with ``accumulate``."""
        n = out.numel()
        if not self.scaled:
            values = payload.view(torch.bfloat16).to(out.dtype)
        else:
            codes = payload[: n * self.code_bytes]
            dtype = torch.int8 if self.name == "int8" else torch.float8_e4m3fn
            scales = payload[n * self.code_bytes :].view(torch.float32).to(out.dtype)
            values = codes.view(dtype).to(out.dtype).view(-1, BLOCK).mul_(scales.view(-1, 1)).view(-1)
        if accumulate:
            out.add_(values, alpha=weight)
        elif weight == 1.0:
            out.copy_(values)
        else:
            torch.mul(values, weight, out=out)
