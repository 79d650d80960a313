"""A pass's logits where the pass computed them, and where each sits in its padded block.

A verify pass over B rows carries each row's last token and its drafts: N tokens, laid
out in a [B, W] block whose width W is the widest row's. The packed forward computes the
N positions' logits only ([N, V]). Spreading them into the padded block [B, W, V] writes
B * W * V floats, zeros where no token was carried, and the accept test reads them all
again: at 24 rows with one row of 8 drafts that is 9 times the floats of the 32 carried
(docs/benchmarks.md, "judged where they are"). So the greedy test and the grammar's masks
work on the carried rows and spread only their [N] results, and so do the target's own
draws of a sampled row; only the rejection test of a draft model's distribution spreads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logits:
    """values [N, V]: the logits of the positions a pass carried, in row-major order.
    shape (B, W): the pass's block. slots [N]: each position's place in the flattened
    block, on the device; places: the same on the host. Both None when the values fill
    the block (N = B * W)."""

    values: torch.Tensor
    shape: tuple[int, int]
    slots: torch.Tensor | None = None
    places: list[int] | None = None

    @classmethod
    def block(cls, logits: torch.Tensor) -> Logits:
        """Logits [B, W, V] of a pass that computed every place of its block."""
        B, W, V = logits.shape
        return cls(logits.reshape(B * W, V), (B, W))

    @property
    def width(self) -> int:
        return self.shape[1]

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """Per carried position [N, ...] -> its place in the block [B, W, ...], zeros
        where nothing was carried."""
        B, W = self.shape
        if self.slots is None:
            return x.view(B, W, *x.shape[1:])
        out = x.new_zeros(B * W, *x.shape[1:])
        return out.index_copy_(0, self.slots, x).view(B, W, *x.shape[1:])

    def carried(self, x: torch.Tensor) -> torch.Tensor:
        """Per place of the block [B, W, ...] -> the carried positions' [N, ...], on x's
        device (a host tensor is indexed on the host)."""
        flat = x.reshape(-1, *x.shape[2:])  # [B * W, ...]
        if self.places is None:
            return flat
        return flat[self.places] if x.device.type == "cpu" else flat[self.slots]

    def positions(self) -> tuple[list[int], list[int]]:
        """Each carried position's row and place in it (its column of the block), on the
        host: two lists [N]."""
        B, W = self.shape
        places = range(B * W) if self.places is None else self.places
        return [p // W for p in places], [p % W for p in places]

    def padded(self) -> torch.Tensor:
        """The block [B, W, V], zeros where nothing was carried."""
        return self.spread(self.values)

    def argmax(self) -> torch.Tensor:
        """The target's greedy token at each place [B, W], 0 where nothing was carried."""
        return self.spread(self.values.argmax(-1))
