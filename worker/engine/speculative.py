"""Batched speculative decoding: the step and the generate loop with continuous refill."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from statistics import median

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specq.configs.generation import Request, RequestError, check_length, context_length
from specq.worker.engine import shadow
from specq.worker.engine.batch import KVRows, Row, left_pad
from specq.worker.engine.drafters import Drafter, DraftInputs, NoDraft
from specq.worker.engine.policy import DraftLengthPolicy
from specq.worker.engine.rejection import greedy_accept, rejection_sample
from specq.worker.engine.result import Result
from specq.worker.engine.sampling import ACCEPT, SAMPLE, keyed_uniform, logits_to_probs, sample

log = logging.getLogger(__name__)
_NO_DRAFT = NoDraft()  # the proposal of a step that does not draft
# calibration's synthetic prompt: ordinary text, so that prompt lookup finds n-grams to copy
_CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. "
)


def model_context(model: PreTrainedModel) -> int:
    return context_length(model.config.get_text_config().to_dict())


def encode_prompt(tokenizer: PreTrainedTokenizerBase, request: Request, context: int) -> list[int]:
    """Token ids of the request's prompt; raises RequestError when it cannot fit."""
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
    elif request.messages is not None:
        if not tokenizer.chat_template:
            raise RequestError("messages", "this model's tokenizer has no chat template")
        msgs = [m.model_dump() for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 (a model's own Jinja template: anything)
            raise RequestError("messages", f"the model's chat template refused them: "
                               f"{type(exc).__name__}: {exc}") from None
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(request.prompt).input_ids
    check_length(len(ids), request.max_new_tokens, context)
    return ids


class SpeculativeEngine:
    """Generates for many requests at once with a target model and a drafter.

    Greedy output equals the target's own greedy decoding; sampled output follows the
    target's distribution (rejection.py). At most ``max_batch_size`` requests run at
    once; a finished row is refilled from the waiting requests at the next step.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter | None = None,
        *,
        max_batch_size: int = 16,
        draft_length: int = 4,
        adaptive: bool = True,
        max_draft_length: int = 8,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDraft()
        self.max_batch_size = max_batch_size
        default = 0 if self.drafter.name == "none" else draft_length
        # a drafter that costs nothing is scored while the engine does not draft (shadow.py)
        self.shadowing = adaptive and default > 0 and getattr(self.drafter, "free", False)
        self.policy = DraftLengthPolicy(default=default, max_g=max_draft_length,
                                        adaptive=adaptive and default > 0,
                                        idle_acceptance=self.shadowing)
        self.context = model_context(target)
        eos = target.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.prefill_seconds = 0.0  # spent prefilling prompts, over the engine's life

    # -- the loop -------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, requests: Iterable[Request], on_result: Callable[[Result], None] | None = None
    ) -> list[Result]:
        """Run every request to completion; results come back in request order.

        A request that cannot be served (too long for the context, ...) gets a Result
        with ``error`` set; the others go on. ``on_result`` sees each result as it ends.
        """
        waiting = deque(enumerate(requests))
        results: dict[int, Result] = {}

        def done(i: int, res: Result) -> None:
            results[i] = res
            if on_result:
                on_result(res)

        self.reset()
        while waiting or self.rows:
            if waiting and len(self.rows) < self.max_batch_size:
                self._admit(waiting, done)
                self._retire(done)  # max_new_tokens = 1, or EOS first
            if self.rows:
                self.step()
                self._retire(done)
        return [results[i] for i in sorted(results)]

    @torch.inference_mode()
    def calibrate(self, batch_sizes: Iterable[int] | None = None, prompt_tokens: int = 128,
                  repeats: int = 3) -> None:
        """Measure what a step costs before the first request, so the adaptive policy
        chooses g from measured costs at once: a target pass over 1, 2, g + 1 and
        max_g + 1 tokens per row, and a draft step, at each batch size (by default 1, 4,
        16, ... below max_batch_size, and that), on a synthetic prompt. Acceptance is not
        learnt here: it depends on the data. Each cost is the median of ``repeats`` timed
        runs, so one stall cannot skew it. A no-op for an engine that does not adapt g.
        """
        policy = self.policy
        if not policy.adaptive:
            return
        t0 = time.perf_counter()
        if batch_sizes is None:
            batch_sizes = {4**i for i in range(8) if 4**i < self.max_batch_size}
            batch_sizes = sorted(batch_sizes | {self.max_batch_size})
        widths = sorted({1, 2, policy.default + 1, policy.max_g + 1})
        L = min(prompt_tokens, self.context - (repeats + 1) * sum(widths) - 1)
        if L < widths[-1]:
            log.warning("context of %d tokens too short to calibrate in", self.context)
            return
        text = self.tokenizer(_CALIBRATION_TEXT, add_special_tokens=False).input_ids or [1, 2, 3]
        prompt = (text * (L // len(text) + 1))[:L]
        dev = self.target.device
        for B in batch_sizes:
            kv = KVRows(self.target)
            ids, valid = left_pad([prompt] * B, self.pad_id, dev)  # [B, L]
            kv.forward(ids, valid, last_only=True)
            times: dict[int, list[float]] = {n: [] for n in widths}
            for rep in range(repeats + 1):  # round 0 warms each shape up, untimed
                for n in widths:
                    start, t = kv.length, _clock(dev)
                    kv.forward(ids[:, :n], valid[:, :n])
                    if rep:
                        times[n].append(_clock(dev) - t)
                    kv.keep(start, torch.zeros(B, dtype=torch.long, device=dev))
            drafts = self._draft_step_times(B, prompt, repeats)
            policy.record_costs(B, {n: [median(t)] * repeats for n, t in times.items()},
                                [median(drafts)] * repeats)
        policy.forget_data()
        log.info("calibrated at batch sizes %s in %.1f s: %s", list(batch_sizes),
                 time.perf_counter() - t0, policy.snapshot()["t_verify"])

    def _draft_step_times(self, B: int, prompt: list[int], repeats: int) -> list[float]:
        """Seconds per draft token of g = default proposals for B rows of this prompt."""
        g = self.policy.default
        rows = [list(prompt) for _ in range(B)]
        self.drafter.admit(rows, [prompt[0]] * B)
        zeros = torch.zeros(B, dtype=torch.long)
        inputs = DraftInputs([r + [prompt[0]] for r in rows], zeros, zeros.float(), zeros,
                             torch.ones(B), greedy=True)
        out = []
        for rep in range(repeats + 1):
            t0 = _clock(self.target.device)
            self.drafter.propose(inputs, g)
            if rep:
                out.append((_clock(self.target.device) - t0) / g)
            self.drafter.update(zeros, torch.full((B,), prompt[0], dtype=torch.long))
        self.drafter.select(torch.zeros(0, dtype=torch.long))
        return out

    def reset(self) -> None:
        """Drop every row and both caches' contents: the state a failed generation left
        (a half-made step, a drafter's pending tokens) cannot reach the next one."""
        self.kv = KVRows(self.target)
        self.drafter.reset()
        self.rows: list[Row] = []
        self.order: list[int] = []  # request index of each row
        self.joining: list[int | str] = []  # ids of requests being prefilled
        self.last = torch.zeros(0, dtype=torch.long)  # [B] token the target has not seen yet

    def active_ids(self) -> list[int | str]:
        """Ids of the requests in the batch (and joining it) right now: after an
        exception, the requests that were being generated when it struck."""
        return [r.request.id for r in getattr(self, "rows", [])] + list(
            getattr(self, "joining", []))

    def _admit(self, waiting: deque, done: Callable[[int, Result], None]) -> None:
        """Prefill waiting requests into free rows; the prefill yields each first token."""
        new: list[tuple[int, Row]] = []
        while waiting and len(self.rows) + len(new) < self.max_batch_size:
            i, req = waiting.popleft()
            try:
                ids = encode_prompt(self.tokenizer, req, self.context)
            except RequestError as exc:
                done(i, Result(id=req.id, error=str(exc)))
                continue
            new.append((i, Row(req, ids, self.eos_ids, self.tokenizer)))
        if not new:
            return
        t0 = time.perf_counter()
        rows = [r for _, r in new]
        self.joining = [r.request.id for r in rows]
        prompts = [r.tokens for r in rows]
        kv = KVRows(self.target)
        logits = kv.forward(*left_pad(prompts, self.pad_id, self.target.device), last_only=True)
        params = self._params(rows)
        pos = torch.tensor([[len(p)] for p in prompts], device=logits.device)
        u = keyed_uniform(params[0].to(logits.device), pos, SAMPLE)[:, 0]
        first = sample(logits_to_probs(logits, *[p.to(logits.device) for p in params[1:]])[:, 0], u)
        first_list = first.tolist()
        self.drafter.admit([list(p) for p in prompts], first_list)
        self.kv.extend(kv)
        self.prefill_seconds += time.perf_counter() - t0
        share = (time.perf_counter() - t0) / len(rows)
        for row, tok in zip(rows, first_list):
            row.result.counters.target_passes += 1
            row.result.counters.verify_time += share
            row.emit([tok])
        self.rows += rows
        self.joining = []
        self.order += [i for i, _ in new]
        self.last = torch.cat([self.last.to(first.device), first])

    def _retire(self, done: Callable[[int, Result], None]) -> None:
        """Hand back finished rows and drop them from the batch and both caches."""
        keep = [b for b, r in enumerate(self.rows) if not r.done]
        if len(keep) == len(self.rows):
            return
        for b, row in enumerate(self.rows):
            if row.done:
                done(self.order[b], row.finish())
        idx = torch.tensor(keep, dtype=torch.long)
        self.kv.select(idx.to(self.kv.device))
        self.drafter.select(idx)
        self.rows = [self.rows[b] for b in keep]
        self.order = [self.order[b] for b in keep]
        self.last = self.last[idx.to(self.last.device)]

    @staticmethod
    def _params(rows: list[Row]) -> tuple[torch.Tensor, ...]:
        """Per-row seeds [B] int64, temperature [B], top_k [B], top_p [B]."""
        reqs = [r.request for r in rows]
        return (
            torch.tensor([r.seed for r in rows], dtype=torch.long),
            torch.tensor([q.temperature for q in reqs], dtype=torch.float32),
            torch.tensor([q.top_k for q in reqs], dtype=torch.long),
            torch.tensor([q.top_p for q in reqs], dtype=torch.float32),
        )

    # -- the step ---------------------------------------------------------------------

    def step(self) -> None:
        """Draft g tokens -> one target pass -> accept or reject -> fix caches -> emit."""
        B, dev = len(self.rows), self.target.device
        seeds, temperature, top_k, top_p = (p.to(dev) for p in self._params(self.rows))
        # a seeded sampled row must see the same g whatever its neighbours: no adapting then
        g = self.policy.choose(pinned=any(r.request.seed is not None and r.request.temperature > 0
                                          for r in self.rows), batch=B)
        inputs = DraftInputs([r.tokens for r in self.rows], seeds, temperature, top_k, top_p,
                             greedy=bool((temperature <= 0).all()))
        if self.shadowing and g:
            shadow.drop(self.rows)
        elif self.shadowing:  # while g = 0 the free drafter's proposals are scored instead
            shadow.hold(self.drafter, self.rows, self.policy.default)
        t0 = _clock(dev)
        prop = self.drafter.propose(inputs, g) if g else _NO_DRAFT.propose(inputs, 0)
        draft_ids, num_draft = prop.token_ids.to(dev), prop.num_draft.to(dev)
        t1 = _clock(dev)
        n = int(num_draft.max()) if g else 0  # prompt lookup may find less than g anywhere
        draft_ids, probs = draft_ids[:, :n], None if prop.probs is None else prop.probs[:, :n]

        ids = torch.cat([self.last[:, None].to(dev), draft_ids], 1)  # [B, n + 1]
        valid = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev),
                           torch.arange(n, device=dev)[None] < num_draft[:, None]], 1)
        start = self.kv.length
        logits = self.kv.forward(ids, valid)  # [B, n + 1, V]
        t_verify = _clock(dev) - t1
        if inputs.greedy:
            out, accepted = greedy_accept(draft_ids, num_draft, logits.argmax(-1))
        else:
            target_probs = logits_to_probs(logits, temperature, top_k, top_p)
            pos = torch.tensor([len(r.tokens) for r in self.rows], device=dev)[:, None]
            pos = pos + torch.arange(n + 1, device=dev)  # [B, n + 1] position of each slot
            out, accepted = rejection_sample(
                draft_ids, num_draft, probs, target_probs,
                keyed_uniform(seeds, pos[:, :n], ACCEPT), keyed_uniform(seeds, pos, SAMPLE),
            )
        self.kv.keep(start, accepted + 1)  # the last token and the accepted drafts stay
        final = out.gather(1, accepted[:, None])[:, 0]  # [B] recovered or bonus token
        self.drafter.update(accepted, final)
        self.last = final
        self.kv.compact()  # both compact only when enough rejected columns piled up
        self.drafter.compact()
        t2 = time.perf_counter()

        num_draft_l, accepted_l = num_draft.tolist(), accepted.tolist()
        self.policy.observe(g, num_draft_l, accepted_l, t1 - t0, t_verify, n + 1)
        emitted = []
        for row, toks, n_draft, k in zip(self.rows, out.tolist(), num_draft_l, accepted_l):
            kept = row.emit(toks[: k + 1])
            emitted.append(toks[:kept])
            c = row.result.counters
            c.observe_step(n_draft, min(k, kept), g)
            c.target_passes += 1
            c.draft_time += (t1 - t0) / B
            c.verify_time += (t2 - t1) / B
        if self.shadowing and not g:
            self.policy.observe_acceptance(*shadow.score(self.rows, emitted))


def _clock(device: torch.device) -> float:
    """perf_counter once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
