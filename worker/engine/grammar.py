"""Constrained decoding: each shaped row's grammar masks the target's and the draft's logits,
and what the grammar fixes is drafted for free.

A row with a ``response_format`` (schema/grammar.py) holds a matcher of the llguidance
library, advanced through every token the row emits. In a step:

1. the draft model's logits are masked by the row's grammar state at each draft position
   (``DraftMasks``: the matcher advanced through the draft tokens, then rolled back);
2. ``ForcedDrafts``, the grammar drafter, puts the forced continuation first in the row's
   proposal (``compute_ff_tokens``: the bytes the grammar fixes, tokenized as the model
   writes them), then the drafter's continuation of it;
3. the proposal is cut at the first draft token the grammar refuses (``cut``), and the
   mask of every verified position is computed (``masks``: the state after each draft
   prefix) and applied to the target's logits (``apply``) before the accept test;
4. the tokens the row emits advance its matcher (``advance``).

A step does 3 and 4 through a ``Shaping`` (``Grammars.shaping``): ``before_verify``,
``mask`` and ``after_accept``, and a step with no shaped row gets one that does nothing.

Masked logits are -inf off the grammar, so the target's distribution at each position is
its constrained (masked, renormalised) one, and the accept tests keep the output exactly
what constrained decoding without speculation gives: greedy token for token, sampled in
law (rejection.py, with p masked; a draft model's q masked too). Temperature, top-k and
top-p apply after the mask.

A row whose grammar allows no token (an error state) ends alone, with an error naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specq.schema.generation import RequestError
from specq.schema.grammar import ResponseFormat, grammar, one_line
from specq.worker.engine.batch import Row
from specq.worker.engine.drafters import Drafter, DraftInputs, PromptLookup, Proposal
from specq.worker.engine.logits import Logits
from specq.worker.engine.profile import Profile, Stopwatch

log = logging.getLogger(__name__)
MAX_TEMPLATES = 256  # compiled grammars kept per worker (one per job and schema, in practice)
MAX_FORCED = 16  # forced tokens drafted at most per row and step
# The text lookup (ForcedDrafts.text): the longest end of a row's text, TEXT_MIN to TEXT_MAX
# bytes, found earlier in its last TEXT_CONTEXT tokens; TEXT_AHEAD bytes after it proposed
TEXT_MIN, TEXT_MAX, TEXT_AHEAD, TEXT_CONTEXT = 3, 24, 48, 1024
WORD_TRIES = 32  # occurrences of a value's first bytes looked at for a word's start (_word)
# bytes at which a value copied from the text likely ends: the lookup stops there and
# proposes the string's closing quote, then what the grammar forces after it
VALUE_ENDS = frozenset(b',.;:!?()[]{}"\n')
# threads computing a step's masks: a row's is too small to pay for a pool's hand-offs
MASK_THREADS = 1  # figures: docs/benchmarks.md#2026-12-01-grammar-mask-threads


class GrammarError(RuntimeError):
    """The grammar library cannot serve this model (its tokenizer) or this row."""


class Grammars:
    """The worker's grammar library: the model's tokenizer read once, and a compiled matcher
    per grammar text, copied for each row (compiling costs a job once, not once per row).
    Wall seconds of the grammar's work (masks, cuts, advances, forced drafts) add up in
    ``masking``."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width
        self._lltok: Any = None  # llguidance's LLTokenizer, made on first use
        self._templates: dict[str, Any] = {}  # grammar text -> a compiled LLMatcher
        self._executor: Any = None  # llguidance's LLExecutor
        self.masking = Stopwatch()

    @property
    def mask_seconds(self) -> float:
        return self.masking.seconds

    def library_tokenizer(self):
        if self._lltok is None:
            import llguidance
            import llguidance.hf

            n_vocab = max(self.vocab_size, len(self.tokenizer))
            try:
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab)
            except Exception as exc:  # noqa: BLE001 (the library's word on any tokenizer)
                raise GrammarError(f"response_format: the grammar library cannot read this "
                                   f"model's tokenizer ({type(exc).__name__}: {exc})") from None
            self._executor = llguidance.LLExecutor(MASK_THREADS)
        return self._lltok

    def matcher(self, response_format: ResponseFormat | None):
        """A fresh matcher for a row, or None for a row without a constraint.
        RequestError when the grammar does not compile against this tokenizer."""
        try:
            text = grammar(response_format)
        except ValueError as exc:  # a request built without validation (model_construct)
            raise RequestError("response_format", str(exc)) from None
        if text is None:
            return None
        template = self._templates.get(text)
        if template is None:
            from llguidance import LLMatcher

            template = LLMatcher(self.library_tokenizer(), text, log_level=0)
            if template.is_error():
                raise RequestError("response_format", f"the grammar does not compile for "
                                   f"this model: {template.get_error()}")
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.pop(next(iter(self._templates)))
            self._templates[text] = template
        return template.deep_copy()

    # -- masks ----------------------------------------------------------------------

    def masks(self, matchers: list, drafts: list[list[int]], width: int) -> torch.Tensor:
        """The bitmask of every verified position of every row: row b's position j is its
        grammar state after drafts[b][:j]; unconstrained rows and positions past a row's
        drafts allow everything. -> [B, width, words] int32 on the host"""
        import llguidance.torch as llt

        with self.masking:
            words = (self.vocab_size + 31) // 32
            bitmask = torch.full((len(matchers) * width, words), -1, dtype=torch.int32)
            rows = [(m, b * width, d) for b, (m, d) in enumerate(zip(matchers, drafts))
                    if m is not None]
            # the library wants drafts only where there are
            drafting = [r for r in rows if r[2]]
            if drafting:
                llt.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting,
                                                                  bitmask)
            plain = [(m, i) for m, i, d in rows if not d]
            if plain:
                llt.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        return bitmask.view(len(matchers), width, words)

    def mask_now(self, matchers: list) -> torch.Tensor:
        """Each row's bitmask at its current state. -> [B, words] int32 on the host"""
        return self.masks(matchers, [[] for _ in matchers], 1)[:, 0]

    def endings(self, matchers: list) -> list[int | None]:
        """Per row, the one token its grammar still allows where the grammar is complete
        (the library's matcher stopped: a JSON object closed, a choice made), else None: the
        end of sequence that constrained decoding emits whatever the logits say. The mask
        is read only for the stopped rows (a row's one time)."""
        out: list[int | None] = [None] * len(matchers)
        done = [b for b, m in enumerate(matchers) if m is not None and m.is_stopped()]
        if not done:
            return out
        ok = allowed(self.mask_now([matchers[b] for b in done]), self.vocab_size)
        for b, row in zip(done, ok):
            ids = row.nonzero().flatten().tolist()
            if len(ids) == 1:
                out[b] = ids[0]
        return out

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """-inf off the grammar, in place (a bitmask row of all ones leaves its logits be).
        logits: [..., V]; bitmask: [..., words] int32 on the host -> logits"""
        with self.masking:
            ok = allowed(bitmask, logits.shape[-1]).to(logits.device, non_blocking=True)
            logits.masked_fill_(~ok, float("-inf"))
        return logits

    def shaping(self, matchers: list, profile: Profile) -> Shaping:
        """A step's grammar work for these rows' matchers (None: an unshaped row); one that
        does nothing when no row is shaped."""
        if all(m is None for m in matchers):
            return Shaping()
        return Shaped(self, matchers, profile)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack 32-bit word masks (bit i of word w: token 32 w + i) to booleans.
    bitmask: [..., words] int32 on the host -> [..., vocab_size] bool"""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1,
                         bitorder="little")  # [..., 32 words]: words are little-endian
    return torch.from_numpy(bits[..., :vocab_size].view(np.bool_))


def cut(matchers: list, drafts: list[list[int]]) -> list[int]:
    """Per row, how many of its draft tokens the grammar accepts in a row (all of an
    unconstrained row's): a proposal is cut at the first token it refuses."""
    return [len(d) if m is None or not d else m.validate_tokens(d)
            for m, d in zip(matchers, drafts)]


def advance(matchers: list, tokens: list[list[int]]) -> list[str | None]:
    """Feed each row the tokens it emitted, up to its end (EOS: the row keeps nothing after
    it); per row, None or why its grammar refused them (an error state: the row cannot go
    on)."""
    problems: list[str | None] = []
    for m, toks in zip(matchers, tokens):
        problem = None
        for t in toks if m is not None else ():
            if m.is_stopped():
                break
            if not m.consume_token(t):
                problem = one_line(m.get_error() or "the grammar refused the token")
                break
        problems.append(problem)
    return problems


def dead_ends(matchers: list, bitmask: torch.Tensor) -> list[int]:
    """Rows whose grammar allows no token at all now (bitmask [B, words] or [B, T, words]:
    position 0 is the current state)."""
    now = bitmask if bitmask.dim() == 2 else bitmask[:, 0]
    return [b for b, m in enumerate(matchers)
            if m is not None and (m.is_error() or not bool(now[b].any()))]


class DraftMasks:
    """Masks a draft model's logits with each row's grammar state as it drafts: the draft
    model's q is the constrained one, as the accept test requires (rejection.py), and it
    drafts no token the grammar refuses. ``rewind`` undoes the drafts' advance."""

    def __init__(self, grammars: Grammars, matchers: list) -> None:
        self.grammars, self.matchers = grammars, matchers
        self.rows = [b for b, m in enumerate(matchers) if m is not None]
        self.fed = [0] * len(matchers)
        self.off = [False] * len(matchers)  # drafted past its grammar: unmasked from here

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, 1, V] at the rows' current draft positions -> masked in place"""
        live = [m if not off else None for m, off in zip(self.matchers, self.off)]
        if all(m is None for m in live):
            return logits
        bitmask = self.grammars.mask_now(live)[:, None]  # [B, 1, words]
        for b in dead_ends(live, bitmask):  # nothing allowed: leave unmasked
            bitmask[b] = -1
        return self.grammars.apply(logits, bitmask)

    def advance(self, tokens: list[int]) -> None:
        for b in self.rows:
            m = self.matchers[b]
            # a refused token would leave the matcher in an error state for good: test first
            if self.off[b] or m.is_stopped() or m.validate_tokens([tokens[b]]) != 1:
                self.off[b] = True  # the engine cuts the draft there (``cut``)
            else:
                m.consume_token(tokens[b])
                self.fed[b] += 1

    def rewind(self) -> None:
        for b in self.rows:
            if self.fed[b]:
                self.matchers[b].rollback(self.fed[b])
            self.fed[b] = 0


class Shaping:
    """A step's grammar work, in the step's order. ``draft_masks`` mask a draft model's
    logits as it drafts; ``rewind`` undoes their advance of the matchers. ``before_verify``
    cuts the proposal where a grammar refuses it. ``mask`` masks the target's logits at
    every verified position. ``after_accept`` advances the matchers through the emitted
    tokens.

    This one does nothing: no row of the step is shaped (the null object). ``Shaped`` does
    the work.
    """

    draft_masks: DraftMasks | None = None

    def rewind(self) -> None: ...

    def before_verify(self, prop: Proposal, forced: list[list[int]]) -> list[list[int]]:
        return forced

    def mask(self, logits: Logits) -> None: ...

    def after_accept(self, rows: list[Row], tokens: list[list[int]]) -> None: ...

    def seconds(self) -> float:
        """Seconds of grammar work since the step began (the drafting's included)."""
        return 0.0


class Shaped(Shaping):
    """The grammar work of a step with shaped rows, timed in one place (``_working``): the
    profile's "mask" phase, and the grammar's ``masking`` (which counts a draft model's
    masks and the forced drafts too)."""

    def __init__(self, grammars: Grammars, matchers: list, profile: Profile) -> None:
        self.grammars, self.matchers, self.profile = grammars, matchers, profile
        self.draft_masks: DraftMasks = DraftMasks(grammars, matchers)
        self.drafts: list[list[int]] = [[] for _ in matchers]  # per row: the verified drafts
        self.dead: list[int] = []  # rows whose grammar allows no token (``mask``)
        self._start = grammars.mask_seconds

    @contextmanager
    def _working(self) -> Iterator[None]:
        with self.profile.phase("mask"), self.grammars.masking:
            yield

    def rewind(self) -> None:
        self.draft_masks.rewind()

    def before_verify(self, prop: Proposal, forced: list[list[int]]) -> list[list[int]]:
        """Cut each row's draft at the first token its grammar refuses (prop.num_draft, in
        place). Returns the positions of the forced tokens per row that are left."""
        with self._working():
            drafts = [d[:k] for d, k in zip(prop.token_ids.tolist(), prop.num_draft.tolist())]
            kept = cut(self.matchers, drafts)
            prop.num_draft = torch.minimum(prop.num_draft, torch.tensor(kept, dtype=torch.long))
            self.drafts = [d[:k] for d, k in zip(drafts, kept)]
        return [[p for p in at if p < k] for at, k in zip(forced, kept)]

    def mask(self, logits: Logits) -> None:
        """Mask the logits of a [B, width] block in place, where the pass computed them:
        row b's position j under its grammar state after its first j verified drafts. Rows
        whose grammar allows nothing are left unmasked; they fail once the step is done
        (``after_accept``)."""
        with self._working():
            bitmask = self.grammars.masks(self.matchers, self.drafts, logits.width)
            self.dead = dead_ends(self.matchers, bitmask)  # bitmask: [B, width, words]
            # a position that allows nothing: past a draft's EOS (the row ends before it),
            # or a dead end (the row fails after the step); all allowed keeps logits finite
            bitmask[~bitmask.any(-1)] = -1
            self.grammars.apply(logits.values, logits.carried(bitmask))  # [N, V], [N, words]

    def after_accept(self, rows: list[Row], tokens: list[list[int]]) -> None:
        """Feed each shaped row's matcher the tokens it emitted; a row whose grammar had
        nothing to allow, or refused them, fails alone."""
        with self._working():
            problems = advance(self.matchers, tokens)
            for b in self.dead:
                problems[b] = one_line(self.matchers[b].get_error() or "no token is allowed")
            for row, problem in zip(rows, problems):
                if problem:
                    row.fail(f"response_format: the grammar reached a dead end after "
                             f"{len(row.generated)} generated tokens ({problem})")

    def seconds(self) -> float:
        return self.grammars.mask_seconds - self._start


@dataclass
class ForcedDrafts:
    """The grammar as a drafter: the string it forces, tokenized as the model writes it,
    then ``follow``'s continuation of it (a drafter that reads only the tokens: the pair's
    prompt lookup or suffix drafter, else prompt lookup), g tokens at most. Free to
    propose; judged by the target like any draft.

    The library's forced tokens (``compute_ff_tokens``) stop where the tokenization of the
    forced bytes is ambiguous (``{"name":`` of ``{"name": "``: the quote could merge with
    the value's first letters); the rest of the forced bytes, tokenized alone, is usually
    what the model writes too (`` "``), and the target judges it anyway."""

    grammars: Grammars
    follow: Drafter = field(default_factory=PromptLookup)
    following: Stopwatch = field(default_factory=Stopwatch, init=False)  # its proposing
    # per row of the latest merge: how many of the drafter's own tokens lead its chain,
    # where other tokens took the place of the rest (a value's end: ``chain``); None
    # where the chain kept them all or only cut them short (the grammar refused one)
    kept: list[int | None] = field(default_factory=list, init=False)
    # where the latest chain guessed a closing quote (None: it did not); per row of the
    # latest merge, the same (the policy prices and learns such guesses apart)
    quote_at: int | None = field(default=None, init=False)
    quotes: list[int | None] = field(default_factory=list, init=False)
    name = "grammar"

    @classmethod
    def for_drafter(cls, drafter: Drafter, grammars: Grammars) -> ForcedDrafts:
        return cls(grammars, drafter if drafter.free or drafter.scored else PromptLookup())

    def forced(self, matcher) -> list[int]:
        """The tokens of the string the grammar forces now (at most MAX_FORCED)."""
        lltok = self.grammars.library_tokenizer()
        tokens = matcher.compute_ff_tokens()
        done, forced = lltok.decode_bytes(tokens), matcher.compute_ff_bytes()
        if len(forced) > len(done) and forced.startswith(done):
            more = lltok.tokenize_bytes(forced[len(done):])
            tokens += more[: matcher.validate_tokens(tokens + more) - len(tokens)]
        return tokens[:MAX_FORCED]

    def text(self, context: list[int], budget: int, value: bool = False) -> list[int]:
        """The row's text looked up in itself by bytes, not tokens: the tokens of what
        followed the longest end of the text found earlier (``budget`` at most). A value
        a schema copies from the prompt starts after a quote where the prompt has a space
        (" Madrid" is one token in the prompt, "Mad" + "rid" in ``"city": "Madrid"``), so
        token lookup misses its rest; the bytes match. ``value``: the row is in a string;
        where the longest end reaches back past its opening quote, the value's own first
        bytes are looked up as a word instead (``_word``): ``"city": "L`` found ``"Lucas``,
        a value the row wrote before, where the text says "in Lyon" (no such word: the
        longest end all the same)."""
        if budget <= 0:
            return []
        lltok = self.grammars.library_tokenizer()
        text = lltok.decode_bytes(context[-TEXT_CONTEXT:])
        low = text.lower()  # "Law" finds "lawyer": a copied value may start a capital
        found = None  # (where, length) of the longest end found earlier, its latest place
        for n in range(TEXT_MIN, min(TEXT_MAX, len(text) - 1) + 1):
            at = low.rfind(low[-n:], 0, len(low) - 1)
            if at < 0:
                break  # an end n bytes long found nowhere: no longer one is either
            found = at, n
        if value:
            start = text.rfind(b'"') + 1  # where the string the row is in began
            prefix = len(text) - start  # the value's bytes so far
            if prefix and (found is None or found[1] > prefix):
                found = _word(low, low[start:], start - 1) or found
        if found is None:
            return []
        at, n = found
        return lltok.tokenize_bytes(text[at + n: at + n + TEXT_AHEAD])[:budget]

    def value(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Tokens proposed in a string, cut before the first that holds a byte where a
        value copied from the text likely ends (VALUE_ENDS: a comma, a full stop, a
        bracket, a quote, a line's end), and whether one came: ``chain`` then proposes the
        closing quote. (A sentence's full stop copied in before the quote was tried: the
        model went on past it as often: docs/benchmarks.md.)"""
        lltok = self.grammars.library_tokenizer()
        for i, t in enumerate(tokens):
            if not VALUE_ENDS.isdisjoint(lltok.decode_bytes([t])):
                return tokens[:i], True
        return tokens, False

    def closing(self, matcher) -> list[int]:
        """The token that closes the string the matcher is in, as the model writes it with
        what the grammar forces after the quote (``",`` where a comma must follow), or none
        where the grammar allows no quote now. The matcher is left as it was."""
        lltok = self.grammars.library_tokenizer()
        quote = lltok.tokenize_bytes(b'"')
        if not self._may_close(matcher, quote):
            return []
        matcher.consume_tokens(quote)
        try:
            after = matcher.compute_ff_bytes()
        finally:
            matcher.rollback(1)
        first = lltok.tokenize_bytes(b'"' + after)[:1]
        return first if matcher.validate_tokens(first) == 1 else quote

    def _may_close(self, matcher, quote: list[int] | None = None) -> bool:
        """The matcher is in a string that may end now: its grammar allows a quote."""
        if quote is None:
            quote = self.grammars.library_tokenizer().tokenize_bytes(b'"')
        return len(quote) == 1 and matcher.validate_tokens(quote) == 1

    def chain(self, matcher, context: list[int], own: list[int], budget: int,
              text_budget: int = 0, sampled: bool = False) -> tuple[list[int], list[int]]:
        """One row's proposal: what the grammar forces now, else the drafter's own tokens
        (none: the row's text lookup's, ``text``, ``text_budget`` at most); then, in turn,
        what the grammar forces after them and the follower's continuation (``budget``
        follower tokens in all, own ones included), till neither adds a token. A value
        copied from the prompt (``"Ada Lovelace",``) is followed by the next key, quoted
        and with its colon, in the same proposal: in a string, the tokens proposed are cut
        where the value likely ends (``value``) and the closing quote proposed there (a
        guess, judged like the tokens before it), then what the grammar forces after it
        (``"Madrid. She`` -> ``"Madrid", "job": "``); not a draft model's ``sampled``
        tokens (a cut that follows the token drawn would make the proposal at the cut
        neither its q nor a point mass, and rejection sampling needs one). The matcher goes
        through the tokens to read what is forced after them, and is rolled back.
        -> (tokens, positions of the forced ones)"""
        seq = self.forced(matcher)
        at = list(range(len(seq)))
        self.quote_at = None
        ends = False  # the proposal was cut where a value likely ends: its quote follows
        if not seq and (own or text_budget > 0):
            # in a string (a draft model's sampled tokens read it only for a text lookup)
            string = (not own or not sampled) and self._may_close(matcher)
            if not own:
                with self.grammars.masking.paused(), self.following:  # drafting
                    own = self.text(context, text_budget, string)
                budget, sampled = max(budget, len(own)), False
            if own and not sampled and string:  # in a string
                cut, ends = self.value(own)
                if ends and not cut:  # the value ends where the row's text is now
                    own, ends, self.quote_at = self.closing(matcher), False, 0
                elif ends:
                    own = cut
        cap = budget + MAX_FORCED
        if not seq:
            seq, budget = list(own), budget - len(own)
        fed = 0
        try:
            while seq and len(seq) < cap and not matcher.is_stopped():
                ok = matcher.validate_tokens(seq[fed:])
                matcher.consume_tokens(seq[fed: fed + ok])
                fed += ok
                if fed < len(seq):  # the grammar refuses a token: the proposal ends there
                    seq = seq[:fed]
                    break
                more = self.forced(matcher)[: cap - len(seq)]
                if more:
                    at += range(len(seq), len(seq) + len(more))
                    seq += more
                    continue
                if ends:  # after the copied value, its closing quote
                    ends, close = False, self.closing(matcher)
                    if close:
                        self.quote_at = len(seq)
                        seq += close
                        continue
                if budget <= 0 or not at or at[-1] != len(seq) - 1:
                    break  # the follower continues what the grammar forced, nothing else
                ext = DraftInputs([context + seq], *(torch.zeros(1),) * 4, greedy=True)
                # the follower's proposing is drafting, not the grammar's work
                with self.grammars.masking.paused(), self.following:
                    nxt = self.follow.propose(ext, min(budget, cap - len(seq)))
                follow = nxt.token_ids[0, : int(nxt.num_draft[0])].tolist()
                if not follow:
                    break
                seq += follow
                budget -= len(follow)
        finally:
            if fed:
                matcher.rollback(fed)
        if self.quote_at is not None and self.quote_at >= len(seq):
            self.quote_at = None  # (the grammar refused it)
        return seq, [p for p in at if p < len(seq)]

    def merge(self, prop: Proposal, matchers: list, tokens: list[list[int]], g: int,
              max_g: int, text: int = 0) -> tuple[Proposal, list[list[int]], list[bool]]:
        """The proposal with each shaped row's chain (``chain``: forced tokens and the
        follower's, in turn; ``text`` tokens at most of a row's text lookup where the
        drafter's are none, and of the follower's where forced tokens lead: the step's g
        limits the drafter's own tokens, and the budget judges every other as it judges a
        lookup's, ``spend``); unshaped rows keep their own. A draft model's tokens keep
        their q where they lead a row's chain; every other token is a point mass (what the
        grammar forces, or the follower proposes, is fixed by the tokens before it).
        -> (proposal, positions of the forced tokens per row, per row: a text lookup's
        tokens lead it)"""
        owns = [d[:n] for d, n in zip(prop.token_ids.tolist(), prop.num_draft.tolist())]
        rows: list[list[int]] = []
        forced: list[list[int]] = []
        lead: list[int] = []
        looked = [False] * len(owns)
        self.quotes, self.kept = [None] * len(owns), [None] * len(owns)
        with self.grammars.masking:  # the grammar's own work (the follower's is paused)
            for b, (m, own) in enumerate(zip(matchers, owns)):
                if m is None:
                    rows.append(own)
                    forced.append([])
                    lead.append(len(own))
                    continue
                seq, at = self.chain(m, tokens[b], own, max(min(g, max_g), text), text,
                                     sampled=prop.probs is not None)
                self.quotes[b] = self.quote_at
                rows.append(seq)
                forced.append(at)
                looked[b] = bool(seq) and not own and not (at and at[0] == 0)
                common = _common(own, seq)
                lead.append(0 if at and at[0] == 0 else common)
                # (a refusal only shortens the row: None)
                self.kept[b] = common if common < len(own) and common < len(seq) else None
        if rows == owns and not any(forced):
            return prop, forced, looked
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        probs = None
        if prop.probs is not None:  # a draft model's tokens keep q; the rest: point masses
            B, G, V = prop.probs.shape
            probs = prop.probs.new_zeros(B, width, V)
            probs.scatter_(-1, ids[:, :, None].to(probs.device), 1.0)
            for b, k in enumerate(lead):
                probs[b, :k] = prop.probs[b, :k]
        num = torch.tensor([len(r) for r in rows], dtype=torch.long)
        # the chained tokens' confidences are not the scoring drafter's: none is given
        return Proposal(ids, num, probs, None), forced, looked


def _word(low: bytes, prefix: bytes, end: int) -> tuple[int, int] | None:
    """(where, length) of the latest word of ``low`` before ``end`` that starts with
    ``prefix``: after a byte that is no letter, digit or quote (a quoted word is a key or
    a value written before, not the text's), or None; WORD_TRIES occurrences looked at."""
    at = end
    for _ in range(WORD_TRIES):
        at = low.rfind(prefix, 0, at)
        if at < 0:
            return None
        before = low[at - 1: at]
        if not before or not (before.isalnum() or before == b'"'):
            return at, len(prefix)
    return None


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
