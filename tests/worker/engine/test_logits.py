"""A pass's logits where the pass computed them (logits.py): spread to the padded block,
judged and masked at the carried positions only, the same as on the block."""

import torch

from specq.worker.engine.logits import Logits


def _carried(B: int, W: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded block [B, W, V] of random logits, zeros off ``valid`` [B, W] (each row
    carries 1..W positions, row 0 one, row 1 all)."""
    gen = torch.Generator().manual_seed(seed)
    carried = torch.randint(1, W + 1, (B,), generator=gen)
    carried[0], carried[1] = 1, W
    valid = torch.arange(W)[None] < carried[:, None]  # [B, W]
    block = torch.randn(B, W, V, generator=gen) * valid[..., None]
    return block, valid


def _packed(block: torch.Tensor, valid: torch.Tensor) -> Logits:
    B, W = valid.shape
    places = valid.reshape(-1).nonzero()[:, 0]  # [N] row-major, as a pass lays them
    return Logits(block[valid], (B, W), places, places.tolist())


def test_packed_logits_spread_judge_and_mask_as_their_block():
    for seed in range(5):
        block, valid = _carried(6, 4, 5, seed)
        logits = _packed(block, valid)
        assert torch.equal(logits.padded(), block)
        assert torch.equal(logits.argmax(), torch.where(valid, block.argmax(-1), 0))
        per_place = torch.arange(24).view(6, 4, 1).expand(6, 4, 3)  # [B, W, 3]
        assert torch.equal(logits.carried(per_place), per_place[valid])
        # a mask of the block, applied where the logits are, masks the block the same
        off = torch.rand(6, 4, 5, generator=torch.Generator().manual_seed(seed)) < 0.5
        logits.values.masked_fill_(logits.carried(off), float("-inf"))
        assert torch.equal(logits.padded()[valid], block.masked_fill(off, float("-inf"))[valid])


def test_a_full_block_is_kept_as_it_is():
    block = torch.randn(3, 2, 5)
    logits = Logits.block(block)
    assert logits.slots is None and logits.width == 2
    assert torch.equal(logits.padded(), block) and torch.equal(logits.argmax(), block.argmax(-1))
    assert torch.equal(logits.carried(block), block.reshape(6, 5))
