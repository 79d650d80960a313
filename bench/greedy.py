"""Greedy outputs must agree across methods; a divergence is either a float near-tie
(the target's two best logits almost equal, so batch shape or padding may flip them)
or a real mismatch, which the bench flags."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

NEAR_TIE = 1e-4  # relative gap between the two diverging tokens' logits


class NearTieCheck:
    """Decides, with one target pass, whether a divergence is a near-tie: the two tokens'
    logits within ``tolerance`` of each other, relative to the largest logit (at least 1)."""

    def __init__(self, model: PreTrainedModel, prompts: list[list[int]],
                 tolerance: float = NEAR_TIE) -> None:
        self.model, self.prompts, self.tolerance = model, prompts, tolerance
        self._memo: dict[tuple[int, int, int, int], float] = {}

    @torch.inference_mode()
    def gap(self, i: int, prefix: list[int], a: int, b: int) -> float:
        """The relative logit gap between tokens a and b after prompt i and ``prefix``."""
        key = (i, len(prefix), min(a, b), max(a, b))
        if key not in self._memo:
            ids = torch.tensor([self.prompts[i] + prefix], device=self.model.device)
            logits = self.model(input_ids=ids).logits[0, -1].float()  # [V]
            scale = logits.abs().max().clamp_min(1.0)
            self._memo[key] = float((logits[a] - logits[b]).abs() / scale)
        return self._memo[key]

    def __call__(self, i: int, prefix: list[int], a: int, b: int) -> bool:
        return self.gap(i, prefix, a, b) <= self.tolerance


def compare(reference: list[list[int]], outputs: list[list[int]],
            near_tie: NearTieCheck) -> dict:
    """{equal, near_ties, mismatches, mismatch_ids}: prompt by prompt, at first divergence."""
    near, bad = 0, []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        if ref == out:
            continue
        j = next((k for k, (x, y) in enumerate(zip(ref, out)) if x != y), None)
        if j is None:  # one stopped earlier: only a stop decision can explain it
            bad.append(i)
        elif near_tie(i, ref[:j], ref[j], out[j]):
            near += 1
        else:
            bad.append(i)
    n_equal = sum(r == o for r, o in zip(reference, outputs))
    return {"equal": n_equal, "near_ties": near, "mismatches": len(bad), "mismatch_ids": bad}
