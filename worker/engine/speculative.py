"""Batched speculative decoding: the step and the generate loop with continuous refill."""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specq.schema.generation import (
    Request,
    RequestError,
    check_length,
    check_size,
    context_length,
    longest_token,
)
from specq.worker.engine import calibration
from specq.worker.engine.batch import KVRows, Row, fill_holes, upload
from specq.worker.engine.drafters import Drafter, DraftInputs, NoDraft
from specq.worker.engine.drafting import drafting_for
from specq.worker.engine.grammar import ForcedDrafts, GrammarError, Grammars, Shaping
from specq.worker.engine.logits import Logits
from specq.worker.engine.prefix import (
    PrefixStore,
    prefill,
    remember,
    seeded,
    shared,
    stored,
)
from specq.worker.engine.profile import Profile
from specq.worker.engine.rejection import accept_matching, rejection_sample
from specq.worker.engine.result import Result
from specq.worker.engine.sampling import (
    ACCEPT,
    SAMPLE,
    keyed_race,
    keyed_uniform,
    logits_to_probs,
    sample,
)
from specq.worker.engine.step import Step

log = logging.getLogger(__name__)
ADMIT_SHARE = 4  # refills wait for 1 / ADMIT_SHARE of the batch: one prefill, not a stall a row
REFILL_HOLD = 2  # a lone refill waits up to max_batch_size / REFILL_HOLD steps for a second
ONE_TOKEN_TOKENS = 256  # prompt tokens of one-token rows past a batch, per place of the batch
# rows that join a running pass (_join): its rows x their widest prompt x the cache's columns
# after it at most (the attention mask's cells, a byte each per query head of a key head);
# longer prompts are prefilled in a pass of their own
JOIN_CELLS = 1 << 24


def _takes_place(request: Request) -> bool:
    """Whether the request stays in the batch after its prefill: one of a single new token
    ends at the token the prefill yields."""
    return request.max_new_tokens is None or request.max_new_tokens > 1


def model_context(model: PreTrainedModel) -> int:
    return context_length(model.config.get_text_config().to_dict())


def encode_prompt(tokenizer: PreTrainedTokenizerBase, request: Request, context: int) -> list[int]:
    """Token ids of the request's prompt; raises RequestError when it cannot fit."""
    ids = encode_prompts(tokenizer, [request], context)[0]
    if isinstance(ids, RequestError):
        raise ids
    return ids


def encode_prompts(tokenizer: PreTrainedTokenizerBase, requests: list[Request], context: int,
                   vocab: int | None = None) -> list[list[int] | RequestError]:
    """Token ids of each request's prompt, or the RequestError that refuses it (one far too
    long for the context by its size alone, untokenized: check_size; token ids of its own
    past the model's ``vocab``). Plain prompts go through the tokenizer in one call (a call
    costs more than a short prompt)."""
    longest = _longest_token(tokenizer)
    refused: dict[int, RequestError] = {}
    for b, request in enumerate(requests):
        try:
            check_size(request, longest, context)
        except RequestError as exc:
            refused[b] = exc
    plain = [b for b, r in enumerate(requests)
             if r.prompt_token_ids is None and r.messages is None and b not in refused]
    batched = dict(zip(plain, tokenizer([requests[b].prompt for b in plain]).input_ids
                       if plain else []))
    out: list[list[int] | RequestError] = []
    for b, request in enumerate(requests):
        try:
            if b in refused:
                raise refused[b]
            ids = list(batched[b]) if b in batched else _encode_one(tokenizer, request, vocab)
            check_length(len(ids), request.max_new_tokens, context)
            out.append(ids)
        except RequestError as exc:
            out.append(exc)
    return out


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _longest_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """Bytes, at most, of the text one of the tokenizer's tokens covers (read once per
    tokenizer)."""
    if tokenizer not in _LONGEST:
        _LONGEST[tokenizer] = longest_token(tokenizer.get_vocab())
    return _LONGEST[tokenizer]


def _encode_one(tokenizer: PreTrainedTokenizerBase, request: Request,
                vocab: int | None = None) -> list[int]:
    """The ids of a request that is not a plain prompt: its own (each below ``vocab``), or
    its chat messages through the model's template."""
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        if vocab is not None and max(ids) >= vocab:
            at = next(k for k, t in enumerate(ids) if t >= vocab)
            raise RequestError("prompt_token_ids", f"token id {ids[at]} at position {at} is "
                               f"past the model's vocabulary of {vocab} tokens")
        return ids
    if not tokenizer.chat_template:
        raise RequestError("messages", "this model's tokenizer has no chat template")
    msgs = [m.model_dump() for m in request.messages or []]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 (a model's own Jinja template: anything)
        raise RequestError("messages", f"the model's chat template refused them: "
                           f"{type(exc).__name__}: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@dataclass
class Draft:
    """A step's proposal as the target judges it: cut where a grammar refuses it and to its
    widest row, on the device."""

    g: int  # draft length asked of the drafter; 0: a plain step
    ids: torch.Tensor  # [B, n] int64
    num: torch.Tensor  # [B] int64: draft tokens per row (<= n)
    probs: torch.Tensor | None  # [B, n, V] draft probabilities; None: point masses
    num_draft: list[int]  # ``num`` on the host
    forced: list[list[int]]  # per row: the positions of the grammar's forced tokens

    @property
    def verify_tokens(self) -> int:
        """Tokens per row in the target's pass: the last token and n drafts."""
        return self.ids.shape[1] + 1


class SpeculativeEngine:
    """Generates for many requests at once with a target model and a drafter.

    Greedy output equals the target's own greedy decoding; sampled output follows the
    target's distribution (rejection.py). At most ``max_batch_size`` requests run at
    once; a finished row is refilled from the waiting requests at the next step.
    ``on_step``, when set, sees every Step after the engine applied it. With
    ``share_prefixes`` a prompt prefix shared by rows is prefilled once (prefix.py). With
    ``join_refills`` (the default) a refill joins the running pass where it can (``_join``);
    without, every refill group is prefilled in a pass of its own.

    Seeded sampling does not depend on g. Every token the target emits for a sampled row
    is its own draw at that position, keyed by (seed, position) only (``_sample``), and a
    draft token is accepted while it equals that draw (rejection.accept_matching): the
    text is the one the target alone would sample, whatever the policy drafts, at any
    batch size. For prompt lookup (a point mass) this is Algorithm 1 exactly; a draft
    model races with the target's noise (sampling.keyed_race) and is accepted with
    probability at least (1 - TV) / (1 + TV) instead of Algorithm 1's 1 - TV, so batches
    without a seeded sampled row keep Algorithm 1 (rejection_sample).

    A request with a ``response_format`` is decoded under its grammar (grammar.py): every
    logit the target and the draft model give for its row is masked, and the output is
    what constrained decoding without speculation gives. With ``grammar_drafts`` (by
    default unless the drafter is none) what the grammar forces is drafted for free.
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
        on_step: Callable[[Step], None] | None = None,
        share_prefixes: bool = True,
        admit_group: int | None = None,
        grammar_drafts: bool | None = None,
        join_refills: bool = True,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafting = drafting_for(drafter or NoDraft(), default=draft_length,
                                     max_g=max_draft_length, adaptive=adaptive)
        self.drafter, self.policy = self.drafting.drafter, self.drafting.policy
        if grammar_drafts is None:
            grammar_drafts = self.drafter.name != NoDraft.name
        self.vocab = vocab = target.config.get_text_config().vocab_size
        self.grammars = Grammars(tokenizer, vocab)  # the library loads at the first grammar
        if grammar_drafts:
            self.drafting.grammar = ForcedDrafts.for_drafter(self.drafter, self.grammars)
        self._admit_group = admit_group  # None: a quarter of the batch (ADMIT_SHARE)
        self.join_refills = join_refills
        self.max_batch_size = max_batch_size  # the property sets admit_group too
        self.on_step = on_step
        self.profile = Profile()  # where generate's time goes (profile.py)
        self.context = model_context(target)
        eos = target.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._ends_job: Hashable = None  # the job whose rows' ends are counted
        self._ends = {True: 0, False: 0}  # its rows ended at their limit (True) or before
        self._ends_all = {True: 0, False: 0}  # the same over every job this engine ran
        self.prefill_seconds = 0.0  # spent prefilling prompts, over the engine's life
        self.admissions = 0  # prefills that admitted rows (each of one or a few passes)
        self.joins = 0  # rows that joined a running pass instead (_join)
        # shared prefixes' keys and values: they depend on the tokens alone, so they
        # outlive a failed generation
        self.prefixes = PrefixStore() if share_prefixes else None
        self.reset()  # no rows, empty caches

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, rows: int) -> None:
        """Rows at most; the refill group follows (worker/attempts.py halves the batch after
        an out-of-memory error: a group fixed at the old size would wait for an empty batch,
        and continuous batching would quietly turn static)."""
        self._max_batch_size = rows
        self.admit_group = min(self._admit_group or -(-rows // ADMIT_SHARE), rows)

    # -- the loop -------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, requests: Iterable[Request], on_result: Callable[[Result], None] | None = None,
        *, job: Hashable = None, on_admit: Callable[[list[int | str]], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> list[Result]:
        """Run every request to completion; results come back in request order.

        A request that cannot be served (too long for the context, ...) gets a Result
        with ``error`` set; the others go on. ``on_result`` sees each result as it ends.
        ``job`` names the job the requests belong to: a drafter that learns from a job's
        finished rows (suffix.py) keeps what it learnt for the job's next generation.
        ``on_admit`` sees the ids of the requests about to join the batch, before any of
        their work starts: a worker records them, so that if its process dies the next
        run knows which requests were in flight (worker/attempts.py). ``check`` is called
        before each step; what it raises ends the generation there (a worker's run that
        gave its lease up, or whose job is being cancelled, stops within a step).
        """
        waiting = deque(enumerate(requests))
        results: dict[int, Result] = {}

        def hand_back(i: int, res: Result) -> None:
            results[i] = res
            if on_result:
                with self.profile.phase("results"):
                    on_result(res)

        self.reset()
        self.drafter.use_job(job)
        if job is None or job != self._ends_job:  # how the job's rows end, from its first
            self._ends_job, self._ends = job, {True: 0, False: 0}
        phase = self.profile.phase
        with self.profile.loop():  # every second in one phase: the rest is the host's
            while waiting or self.rows:
                if waiting and self._room_for(len(waiting)):
                    with phase("admit"):
                        if self._joins():
                            self._join(waiting, hand_back, on_admit)
                        else:
                            self._admit(waiting, hand_back, on_admit)
                    with phase("upkeep"):
                        self._retire(hand_back)  # max_new_tokens = 1, or EOS first
                if self.rows:
                    if check is not None:
                        check()
                    self.draining = not waiting and self._limits_end_rows()
                    self._apply(self.step())  # the step books its own phases
                    with phase("upkeep"):
                        self._retire(hand_back)
        self.reset()  # both caches' buffers go back now, not when the next job starts
        return [results[i] for i in sorted(results)]

    def _limits_end_rows(self) -> bool:
        """Most of the job's rows so far ran to their ``max_new_tokens``: a row's limit
        says when it ends, and a draining batch's budget (budget.drain) can tell which
        row ends last. Rows that end at their EOS first (a JSON object closed, an answer
        given) end where nobody knows: the budget keeps to tokens per second.

        Until a row of the job has ended, the rows the engine ran before (other jobs') say
        it: a job whose rows all start together (64 prompts at batch 64) drains from its
        first step, and priced as if refills waited its budget kept 26-74 drafts a step
        where a row that ends a step sooner saves less than they cost (json at 0.94x no
        speculation, docs/benchmarks.md, "a drafter at rest"). With no row ended
        anywhere, tokens per second."""
        ends = self._ends if any(self._ends.values()) else self._ends_all
        return ends[True] > 0 and ends[True] >= ends[False]

    def _room_for(self, waiting: int) -> bool:
        """Admit now? Once ``admit_group`` rows are free (or all the waiting fit, or the
        batch is empty): one prefill pass serves several refills instead of one pass per
        finished row, and the batch stays at least max - admit_group + 1 rows full.

        A refill of one row (a small batch's group) waits for a second place while a row
        is sure to end within max_batch_size / REFILL_HOLD steps (its max_new_tokens: a
        step emits a token a row at least): a prefill pass of a few tokens costs about a
        step, its weights read for them, and one place left empty for those steps costs
        less. Speculation staggers the ends of rows that would end together (at batch 4
        one prefill a row cost the chat workload 1.2 s of 30, docs/benchmarks.md); the
        batch then stays at least max - 1 rows full. A larger group's prefill is mostly
        its tokens' work: it goes at once.

        Where refills join the running pass (``_joins``) they still go in groups: on a CPU
        a pass's tokens cost less each the more of them it carries (16 rows' pass plus a
        lone 37-token prompt cost about what a prefill pass of its own did, four such
        prompts less), and on a GPU a joining prompt widens every row's attention call.
        But a lone refill waits for no second place: it costs its tokens, not a pass."""
        if not self.rows:
            return True
        free = self.max_batch_size - len(self.rows)
        if free < min(self.admit_group, waiting):
            return False
        if free == 1 and waiting > 1 and not self._joins():  # a lone refill prefilled
            hold = self.max_batch_size // REFILL_HOLD
            return not any(row.limit - len(row.generated) <= hold
                           for row in self.rows)
        return True

    def calibrate(self, batch_sizes: Iterable[int] | None = None,
                  budget: float | None = None, warm: bool = False) -> list[int]:
        """Measure step costs before the first request, within ``budget`` seconds
        (calibration.py); returns the batch sizes measured. ``warm``: an engine that does
        not adapt g runs the same passes all the same (a benchmark's engines warm alike)."""
        return calibration.calibrate(self, batch_sizes, budget=budget, warm=warm)

    def reset(self) -> None:
        """Drop every row and both caches' contents: the state a failed generation left
        (a half-made step, a drafter's pending tokens) cannot reach the next one."""
        self.kv = KVRows(self.target)
        self.drafter.reset()
        self.drafting.reset()
        self.rows: list[Row] = []
        self.order: list[int] = []  # request index of each row
        self.joining: list[int | str] = []  # ids of requests being prefilled
        self.draining = False  # no request waits for a place: the job ends with these rows
        self.last = torch.zeros(0, dtype=torch.long)  # [B] token the target has not seen yet

    def active_ids(self) -> list[int | str]:
        """Ids of the requests in the batch (and joining it) right now: after an
        exception, the requests that were being generated when it struck."""
        return [r.request.id for r in self.rows] + list(self.joining)

    def _take(self, waiting: deque, hand_back: Callable[[int, Result], None]
              ) -> list[tuple[int, Row]]:
        """Rows for the batch's free places from the waiting requests, as (request index,
        row); a request that cannot be served (too long, a grammar refused) is handed back
        failed and the next one takes its place.

        A request of one new token ends at the first token, which the prefill yields: it
        takes no place, so past a batch's worth of rows more of them join the same prefill
        while the rows past it hold ONE_TOKEN_TOKENS prompt tokens per place of the batch
        (classification and scoring jobs: one pass for many rows; a batch halved after an
        out-of-memory error halves these rows too)."""
        new: list[tuple[int, Row]] = []
        places = self.max_batch_size - len(self.rows)
        spare = ONE_TOKEN_TOKENS * self.max_batch_size
        while waiting and places > 0 and spare > 0:
            taken: list[tuple[int, Request]] = []
            while waiting and places > 0 and len(taken) < self.max_batch_size:
                taken.append(waiting.popleft())
                places -= _takes_place(taken[-1][1])
            encoded = encode_prompts(self.tokenizer, [req for _, req in taken], self.context,
                                     self.vocab)
            for k, ((i, req), ids) in enumerate(zip(taken, encoded)):
                if len(new) >= self.max_batch_size and isinstance(ids, list):
                    spare -= len(ids)  # rows past a batch's worth: one-token ones, mostly
                    if spare < 0:
                        waiting.extendleft(reversed(taken[k:]))
                        places += sum(_takes_place(r) for _, r in taken[k:])
                        break
                try:
                    if isinstance(ids, RequestError):
                        raise ids
                    matcher = self.grammars.matcher(req.response_format)
                except (RequestError, GrammarError) as exc:
                    hand_back(i, Result(id=req.id, error=str(exc)))
                    places += _takes_place(req)
                    continue
                row = Row(req, ids, self.eos_ids, self.tokenizer, self.context)
                row.matcher = matcher
                new.append((i, row))
        return new

    def _joins(self) -> bool:
        """Refills join the next step's pass (``_join``): rows are running and rows may join
        a pass (``_may_join``)."""
        return bool(self.rows) and self._may_join()

    def _may_join(self) -> bool:
        """A row may join a step's pass: the engine lets it, the target's pass costs the
        tokens it carries (batch.KVRows.packed) and the drafter admits a row before its
        first token (a draft model prefills its own cache from it)."""
        return self.join_refills and self.kv.packed and self.drafter.admits_unseen

    def _forces_start(self, row: Row) -> bool:
        """The row's grammar forces its first tokens (``{"name": "``) and the grammar
        drafts: joining a pass, the row has them judged in the pass that reads its prompt
        (drafting.Drafting.draft). Not a row of one new token (it takes no place)."""
        grammar = self.drafting.grammar
        return (grammar is not None and row.matcher is not None
                and _takes_place(row.request) and bool(grammar.forced(row.matcher)))

    def _join(self, waiting: deque, hand_back: Callable[[int, Result], None],
              on_admit: Callable[[list[int | str]], None] | None = None) -> None:
        """Refill free places with waiting requests that join the next step's pass: each
        new row carries its prompt (less the columns of its stored prefix, prefix.seeded)
        beside the other rows' last tokens and drafts, and the pass yields its first token
        (it drafts from its next step, but for what its grammar forces at its start:
        drafting.Drafting.draft, judged in that pass). A prefill pass of its own
        reads every weight for a few tokens: at batch 4 on a CPU a lone refill's pass cost
        about a step, and rows that accept drafts end apart and refill one at a time.
        Joining, a refill costs its tokens. Refills are prefilled as before (``_prefill``)
        where their prompts are too long for one pass's attention mask (JOIN_CELLS), or
        share a prefix the store lacks: a prefill computes it once, joining rows each
        (the first of a template that joins is stored for the next: prefix.remember)."""
        new = self._take(waiting, hand_back)
        if new:
            self._join_rows(new, hand_back, on_admit)

    def _join_rows(self, new: list[tuple[int, Row]], hand_back: Callable[[int, Result], None],
                   on_admit: Callable[[list[int | str]], None] | None = None) -> None:
        """New rows (request index, row) join the next step's pass (``_join``), or are
        prefilled where they cannot."""
        rows = [r for _, r in new]
        prompts = [r.tokens for r in rows]
        bases = stored(self.prefixes, prompts)
        widest = max(len(p) - n for p, (_, n) in zip(prompts, bases))
        if ((len(self.rows) + len(rows)) * widest * (self.kv.length + widest) > JOIN_CELLS
                or (self.prefixes is not None and shared(prompts, bases))):
            self._prefill(new, hand_back, on_admit)
            return
        self.joining = [r.request.id for r in rows]
        if on_admit:
            on_admit(list(self.joining))
        kv = seeded(self.target, bases, self.prefixes)
        if kv.cache is None:  # no prefix served: the pass writes every column
            if self.kv.cache is not None:  # (an empty batch's: its pass makes the cache)
                self.kv.add_rows(len(rows))
        else:
            self.kv.extend(kv)
        for row, (_, n) in zip(rows, bases):
            row.unseen = row.tokens[n:]
        self.drafter.admit([r.tokens for r in rows], [])
        self.rows += rows
        self.joining = []
        self.order += [i for i, _ in new]
        last = torch.tensor([r.tokens[-1] for r in rows])  # not read: the pass takes unseen
        self.last = torch.cat([self.last, last.to(self.last.device)])
        self.joins += len(rows)

    def _admit(self, waiting: deque, hand_back: Callable[[int, Result], None],
               on_admit: Callable[[list[int | str]], None] | None = None) -> None:
        """Prefill waiting requests into free rows; the prefill yields each first token.
        Rows whose grammar forces their first tokens (``_forces_start``) join the next
        step's pass instead where rows may (``_may_join``): that pass reads their prompts
        and judges those tokens, where a prefill pass would yield only the first of them
        and the next step's pass judge the rest (one pass a row saved, of the dozen a short
        JSON answer takes)."""
        new = self._take(waiting, hand_back)
        joins = self._may_join()
        ahead: list[tuple[int, Row]] = []
        rest: list[tuple[int, Row]] = []
        for item in new:
            (ahead if joins and self._forces_start(item[1]) else rest).append(item)
        if rest:
            self._prefill(rest, hand_back, on_admit)
        if ahead:
            self._join_rows(ahead, hand_back, on_admit)

    def _prefill(self, new: list[tuple[int, Row]], hand_back: Callable[[int, Result], None],
                 on_admit: Callable[[list[int | str]], None] | None = None) -> None:
        """Prefill new rows (request index, row) in a pass of their own, which yields each
        first token, and add them to the batch."""
        rows = [r for _, r in new]
        self.joining = [r.request.id for r in rows]
        if on_admit:
            on_admit(list(self.joining))
        t0 = time.perf_counter()
        prompts = [r.tokens for r in rows]
        kv, logits = prefill(self.target, prompts, self.pad_id, self.prefixes)  # [n, 1, V]
        self.admissions += 1
        seeds, *params = self._params(rows)
        shaping = self.grammars.shaping([r.matcher for r in rows], self.profile)
        block = Logits.block(logits)
        shaping.mask(block)  # each row's first token under its grammar
        logits = block.padded()  # [n, 1, V]
        pos = upload(torch.tensor([[len(p)] for p in prompts]), logits.device)
        first = self._sample(logits_to_probs(logits, *params), upload(seeds, logits.device),
                             pos)[:, 0]
        first_list = first.tolist()
        shaping.after_accept(rows, [[t] for t in first_list])
        for row, tok in zip(rows, first_list):
            row.emit([tok])
        # a row that its first token ended (max_new_tokens 1, EOS) leaves at once: it takes
        # no place in the batch's cache and the drafter never sees it
        live = [b for b, row in enumerate(rows) if not row.ended]
        if len(live) < len(rows):
            first = first[upload(torch.tensor(live, dtype=torch.long), first.device)]
        if live:
            if len(live) < len(rows):
                kv.select(live)
            self.drafter.admit([rows[b].tokens[:rows[b].prompt_len] for b in live],
                               [first_list[b] for b in live])
            self.kv.extend(kv)
        self.prefill_seconds += time.perf_counter() - t0
        share = (time.perf_counter() - t0) / len(rows)
        for (i, row) in new:
            row.result.counters.target_passes += 1
            row.result.counters.verify_time += share
            if row.ended:
                self._leave(i, row, hand_back)
        self.rows += [rows[b] for b in live]
        self.joining = []
        self.order += [new[b][0] for b in live]
        self.last = torch.cat([self.last.to(first.device), first])

    def _leave(self, i: int, row: Row, hand_back: Callable[[int, Result], None]) -> None:
        """Hand back the finished row of request ``i``; its text teaches the drafter."""
        if row.result.error is None:  # a failed row teaches the drafter nothing
            self.drafter.finish(row.tokens)
            self._ends[row.result.finish_reason == "length"] += 1
            self._ends_all[row.result.finish_reason == "length"] += 1
        hand_back(i, row.finish())

    def _retire(self, hand_back: Callable[[int, Result], None]) -> None:
        """Hand back finished rows and drop them from the batch and both caches."""
        finished = [r.ended for r in self.rows]
        if not any(finished):
            return
        for b, row in enumerate(self.rows):
            if row.ended:
                self._leave(self.order[b], row, hand_back)
        keep = fill_holes(finished)  # rows from the end take the leavers' places
        idx = torch.tensor(keep, dtype=torch.long)
        self.kv.select(idx)
        self.drafter.select(idx)
        self.rows = [self.rows[b] for b in keep]
        self.order = [self.order[b] for b in keep]
        self.last = self.last[idx.to(self.last.device)]

    @staticmethod
    def _params(rows: list[Row]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row seeds [B] int64, temperature [B], top_k [B], top_p [B], on the host."""
        reqs = [r.request for r in rows]
        return (
            torch.tensor([r.seed for r in rows], dtype=torch.long),
            torch.tensor([q.temperature for q in reqs], dtype=torch.float32),
            torch.tensor([q.top_k for q in reqs], dtype=torch.long),
            torch.tensor([q.top_p for q in reqs], dtype=torch.float32),
        )

    # -- the step ---------------------------------------------------------------------

    def step(self) -> Step:
        """Draft g tokens -> one target pass -> accept or reject -> commit the tokens.

        Returns what the step did; ``_apply`` hands it to the rows. The host waits for the
        device once, in ``_accept`` (and, now and then, when a draft model's cache counts
        its own waste: batch.py). Timings wait for nothing (StepClock).
        """
        phase = self.profile.phase
        shaping = self.grammars.shaping([r.matcher for r in self.rows], self.profile)
        inputs = self._inputs(shaping)
        clock = StepClock(self.target.device)
        joined = [len(r.unseen) for r in self.rows]  # rows joining this pass (_join)
        with phase("propose"):
            draft = self._propose(inputs, shaping)
            clock.mark()
        with phase("verify"):
            logits, start, seen = self._verify(draft, shaping)  # a [B, n + 1] block
            clock.mark()
        with phase("accept"):
            accepted, tokens, waste = self._accept(logits, draft, start, seen, inputs)
        with phase("upkeep"):
            if self.prefixes is not None and any(joined):  # prompts no stored prefix served
                remember(self.prefixes, self.kv, [(b, r.tokens[: r.prompt_len]) for b, (r, n)
                                                  in enumerate(zip(self.rows, joined))
                                                  if n == r.prompt_len])
            self._commit(accepted, tokens, waste, shaping)
        t_draft, t_verify = clock.phases()
        return Step(draft.g, draft.num_draft, accepted, t_draft, t_verify, draft.verify_tokens,
                    tokens, clock.elapsed(), forced=draft.forced, t_mask=shaping.seconds(),
                    joined=joined if any(joined) else [])

    def _inputs(self, shaping: Shaping) -> DraftInputs:
        """What the drafter may read of the batch: its tokens and sampling parameters."""
        params = self._params(self.rows)  # seeds, temperature, top_k, top_p
        return DraftInputs([r.tokens for r in self.rows], *params,
                           greedy=bool((params[1] <= 0).all()), grammar=shaping.draft_masks)

    def _propose(self, inputs: DraftInputs, shaping: Shaping) -> Draft:
        """This step's g and proposal, cut where a grammar refuses it, on the device. Prompt
        lookup may find less than g anywhere, a grammar's forced tokens be more."""
        try:
            g, prop, forced = self.drafting.draft(inputs, self.rows, self.kv.packed,
                                                  self.draining)
        finally:  # a draft model advanced the matchers as it drafted, or failed half-way
            shaping.rewind()
        forced = shaping.before_verify(prop, forced)
        n = int(prop.num_draft.max()) if prop.token_ids.shape[1] else 0
        dev = self.target.device
        return Draft(g, upload(prop.token_ids[:, :n], dev), upload(prop.num_draft, dev),
                     None if prop.probs is None else prop.probs[:, :n],
                     prop.num_draft.tolist(), forced)

    def _verify(self, draft: Draft, shaping: Shaping
                ) -> tuple[Logits, int | torch.Tensor, int | torch.Tensor]:
        """One target pass over each row's last token and its drafts, every position masked
        by its row's grammar; a row that joins the pass (``_join``) carries its prompt's
        unseen tokens where the others carry their last one. -> (logits of a [B, n + 1]
        block from each row's last token on (logits.py); where the pass's columns went,
        the cache's marker before it; the tokens each row carried before its drafts: 1,
        or [B])"""
        (B, n), dev = draft.ids.shape, self.target.device
        start = self.kv.marker()
        seen: int | torch.Tensor
        if any(r.unseen for r in self.rows):
            ids, valid, seen = self._joined(draft)
            logits = self.kv.logits(ids, valid, first=[max(len(r.unseen), 1) - 1
                                                       for r in self.rows])
        else:
            seen = 1
            ids = torch.cat([self.last[:, None].to(dev), draft.ids], 1)  # [B, n + 1]
            valid = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev),
                               torch.arange(n, device=dev)[None] < draft.num[:, None]], 1)
            logits = self.kv.logits(ids, valid)  # a [B, n + 1] block
        shaping.mask(logits)  # each verified position under the grammar state it follows
        return logits, start, seen

    def _joined(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A pass's input where rows join it: per row, its unseen prompt tokens (a joining
        row) or its last token, then its drafts. -> (ids [B, P + n], valid [B, P + n], the
        tokens each row carries before its drafts [B]), P the most of them"""
        (B, n), dev = draft.ids.shape, self.target.device
        seen = [max(len(r.unseen), 1) for r in self.rows]
        head = torch.zeros(B, max(seen), dtype=torch.long)
        for b, r in enumerate(self.rows):
            if r.unseen:
                head[b, : len(r.unseen)] = torch.tensor(r.unseen)
        joining = upload(torch.tensor([bool(r.unseen) for r in self.rows]), dev)
        head = upload(head, dev)
        head[:, 0] = torch.where(joining, head[:, 0], self.last.to(dev))
        P = upload(torch.tensor(seen), dev)
        ids = torch.cat([head, head.new_zeros(B, n)], 1)  # [B, max(seen) + n]
        if n:
            ids.scatter_(1, P[:, None] + torch.arange(n, device=dev)[None], draft.ids)
        cols = torch.arange(ids.shape[1], device=dev)[None]
        return ids, cols < (P + draft.num)[:, None], P

    def _accept(self, logits: Logits, draft: Draft, start: int | torch.Tensor,
                seen: int | torch.Tensor, inputs: DraftInputs
                ) -> tuple[list[int], list[list[int]], int]:
        """Accept or reject each row's drafts (``_judge``) and keep the accepted in the
        target's cache; then the step's one sync. -> (accepted per row, tokens per row: the
        accepted drafts then the recovered or bonus token, the cache's waste). ``seen``:
        the tokens each row carried before its drafts (``_verify``)."""
        out, accepted = self._judge(logits, draft, inputs)  # [B, n + 1], [B]
        self.kv.keep(start, accepted + seen)  # the last (or unseen) tokens and the accepted
        for row in self.rows:
            row.unseen = []
        self.last = out.gather(1, accepted[:, None])[:, 0]  # [B] recovered or bonus token
        waste = self.kv.waste_on_device().expand(len(self.rows))  # compaction's cue
        host = torch.cat([accepted[:, None], waste[:, None], out], 1).tolist()  # the one sync
        accepted_l = [row[0] for row in host]
        tokens = [row[2 : k + 3] for row, k in zip(host, accepted_l)]
        return accepted_l, tokens, host[0][1]

    def _commit(self, accepted: list[int], tokens: list[list[int]], waste: int,
                shaping: Shaping) -> None:
        """The step's tokens advance the rows' grammars and the drafter; both caches compact
        only when enough holes piled up."""
        shaping.after_accept(self.rows, tokens)
        self.drafter.update(accepted, tokens)
        self.kv.compact(waste=waste)
        self.drafter.compact()

    def _judge(self, logits: Logits, draft: Draft, inputs: DraftInputs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's verdict on each row's drafts (rejection.py): (out [B, n + 1],
        accepted [B]). logits: a [B, n + 1] block. The target's tokens and probabilities
        are found where the pass computed them; only Algorithm 1 reads a padded block."""
        if inputs.greedy:
            return accept_matching(draft.ids, draft.num, logits.argmax())
        target_probs, at, pos = self._target_probs(logits, inputs)  # [N, 1, V], [N], [N]
        seeds = upload(inputs.seeds[at], target_probs.device)
        pos = upload(pos, target_probs.device)[:, None]  # [N, 1]
        seeded = any(r.request.seed is not None and r.request.temperature > 0
                     for r in self.rows)
        if draft.probs is not None and not seeded:  # Algorithm 1: the best acceptance
            accept_u, sample_u = (logits.spread(keyed_uniform(seeds, pos, stream)[:, 0])
                                  for stream in (ACCEPT, SAMPLE))  # [B, n + 1] each
            return rejection_sample(draft.ids, draft.num, draft.probs,
                                    logits.spread(target_probs[:, 0]),  # [B, n + 1, V]
                                    accept_u[:, :-1], sample_u)
        draws = self._sample(target_probs, seeds, pos)[:, 0]  # [N]
        return accept_matching(draft.ids, draft.num, logits.spread(draws))

    def _target_probs(self, logits: Logits, inputs: DraftInputs
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's filtered distribution at each position the pass carried, under its
        row's temperature, top-k and top-p. -> (probs [N, 1, V], each position's row [N]
        and its token's position in the row [N], on the host)"""
        rows, cols = logits.positions()  # [N] each
        at = torch.tensor(rows)
        target_probs = logits_to_probs(logits.values[:, None], inputs.temperature[at],
                                       inputs.top_k[at], inputs.top_p[at])  # [N, 1, V]
        pos = torch.tensor([len(self.rows[b].tokens) + j for b, j in zip(rows, cols)])
        return target_probs, at, pos

    def _sample(self, probs: torch.Tensor, seeds: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        """The target's own draw at each position, keyed by (seed, position) only: raced
        when the drafter races (its drafts then match the draws as often as they can),
        else inverse-CDF. probs: [B, T, V]; seeds: [B]; pos: [B, T] -> tokens [B, T]"""
        if self.drafter.races:
            return keyed_race(probs, seeds, pos)
        return sample(probs, keyed_uniform(seeds, pos, SAMPLE))

    def _apply(self, step: Step) -> None:
        """Hand a step's tokens to the rows and count it: the rows' counters, the drafting
        (its policy learns from the step: drafting.py), and ``on_step``.

        A row whose grammar the step's tokens completed (``Grammars.endings``: a JSON
        object closed by the target's own last token) takes the end of sequence now, the
        one token its grammar allows: constrained decoding would emit it whatever the
        logits, and a pass of its own would compute nothing it needs (no token follows
        it). It is counted as a forced draft the step accepted (new_tokens = accepted +
        one token a pass holds). A joining row's pass was its prefill, not a step, but
        where it judged what the row's grammar forces at its start; it ends the usual
        way."""
        B = len(self.rows)
        emitted = []
        forced = step.forced or [[] for _ in range(B)]
        joined = step.joined or [0] * B
        shaped = sum(r.matcher is not None for r in self.rows)
        ends = self.grammars.endings([
            r.matcher if not j and not r.ended and r.eos_ids.isdisjoint(toks) else None
            for r, j, toks in zip(self.rows, joined, step.tokens)]) if shaped else [None] * B
        for row, toks, n_draft, k, f, j, end in zip(self.rows, step.tokens, step.num_draft,
                                                    step.accepted, forced, joined, ends):
            kept = row.emit(toks)
            emitted.append(toks[:kept])
            c = row.result.counters
            if end in row.eos_ids and kept == len(toks) and not row.ended:
                row.emit([end])  # counted as a forced draft the step accepted
                n_draft, k, kept = n_draft + 1, k + 1, kept + 1
                c.forced_proposed += 1
                c.forced_accepted += 1
            if not j or n_draft:  # a joining row's pass: its prefill, and a step if it
                c.observe_step(n_draft, min(k, kept), step.g)  # judged drafts
            c.target_passes += 1
            c.draft_time += step.t_draft / B
            c.verify_time += (step.t_step - step.t_draft) / B
            c.forced_proposed += len(f)
            c.forced_accepted += sum(1 for p in f if p < min(k, kept))
            if row.matcher is not None:
                c.mask_time += step.t_mask / shaped
        self.drafting.observe(step, self.rows, emitted)
        if self.on_step:
            self.on_step(step)


class StepClock:
    """Times a step's phases without making the host wait for the device.

    On a CPU, perf_counter marks. On CUDA, a perf_counter after torch.cuda.synchronize
    would be one more sync per mark: the marks are CUDA events on the device's timeline
    instead, read by ``phases`` once the step's one sync has passed them.
    """

    def __init__(self, device: torch.device) -> None:
        self.start = time.perf_counter()
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.stream is None:
            self.marks.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self.marks.append(event)

    def phases(self) -> list[float]:
        """Seconds between consecutive marks (on CUDA: after a sync past the last one)."""
        pairs = zip(self.marks, self.marks[1:])
        if self.stream is None:
            return [b - a for a, b in pairs]
        return [a.elapsed_time(b) / 1e3 for a, b in pairs]

    def elapsed(self) -> float:
        """Wall seconds since the clock started."""
        return time.perf_counter() - self.start
