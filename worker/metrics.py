"""A worker's Prometheus metrics: what it generated, how its drafts fared, what went wrong.

A worker started with SPECQ_METRICS_PORT (0, the default, turns them off; `specq run` never
serves them) serves ``/metrics`` on that port. Every series carries three labels, pair,
drafter and worker (the Celery hostname), and never a job or item id: a fleet's series stay
a few per worker, whatever it runs. Position and draft-length labels are bounded by the
pair's largest draft length (draft tokens verified by a row: that and a grammar's forced
tokens, grammar.MAX_FORCED at most).

The token and draft counters are counted from the outcomes this worker wrote to the
database (ChunkKeeper), the moment they were written: an outcome another worker stored
first is not counted twice, so for the same jobs each counter equals the database's sum
(docs/metrics.md lists which column each one equals). Names and meanings follow vLLM's
where vLLM has the figure (its ``vllm:spec_decode_*`` counters are ours ``specq_spec_decode_*``);
rates are derived by the query, never exported.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

log = logging.getLogger(__name__)

LABELS = ("pair", "drafter", "worker")
# seconds per engine step: a tiny CPU pair's few milliseconds to a large GPU batch's second
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class WorkerMetrics:
    """The counters and histograms of one worker process, in a registry of their own."""

    def __init__(self, pair: str, drafter: str, worker: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"pair": pair, "drafter": drafter, "worker": worker}
        self._lock = threading.Lock()  # the keeper's thread and the engine's both count

        def counter(name: str, doc: str, *extra: str) -> Any:
            c = Counter(name, doc, LABELS + extra, registry=self.registry)
            return c if extra else c.labels(**self.labels)

        # what the database stores per item, counted as outcomes are written
        self.prompt_tokens = counter("specq_prompt_tokens", "Prompt tokens of the items written")
        self.generation_tokens = counter("specq_generation_tokens",
                                         "Tokens generated (items' new_tokens)")
        self.target_passes = counter("specq_target_passes",
                                     "Target forward passes, prefill included (target_passes)")
        self.num_drafts = counter("specq_spec_decode_num_drafts",
                                  "Request steps with at least one draft token (draft_steps)")
        self.draft_tokens = counter("specq_spec_decode_num_draft_tokens",
                                    "Draft tokens proposed (proposed)")
        self.accepted_tokens = counter("specq_spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted (accepted)")
        self.forced_draft_tokens = counter(
            "specq_spec_decode_num_forced_draft_tokens",
            "Draft tokens a grammar forced, of those proposed (forced_proposed)")
        self.forced_accepted_tokens = counter(
            "specq_spec_decode_num_forced_accepted_tokens",
            "Forced draft tokens accepted, of those accepted (forced_accepted)")
        self._accepted_per_pos = counter(
            "specq_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position, 0 the first (accepted_by_position)",
            "position")
        self._request_steps = counter(
            "specq_request_steps",
            "A request's steps at draft length g, summed over requests (steps_by_draft_length)",
            "draft_length")
        self._row_steps = counter(
            "specq_request_steps_by_drafts_verified",
            "A request's steps by the draft tokens it verified in them (the drafter's and a "
            "grammar's), summed over requests (steps_by_drafts_verified)", "drafts_verified")
        self.draft_seconds = counter("specq_draft_seconds",
                                     "Seconds of drafting, the items' shares (draft_time)")
        self.verify_seconds = counter("specq_verify_seconds",
                                      "Seconds outside drafting, the items' shares (verify_time)")
        self.items_completed = counter("specq_items_completed", "Items completed")
        self.items_failed = counter("specq_items_failed", "Items failed for good")
        # faults
        self.items_retried = counter(
            "specq_items_retried", "Items a fault struck that run again (an engine exception, "
            "or a worker that died with them in flight)")
        self.oom_halvings = counter("specq_oom_halvings",
                                    "Out-of-memory errors answered by halving the batch")
        self.engine_restarts = counter("specq_engine_restarts",
                                       "Engine exceptions after which the engine was reset")
        self.chunks_resumed = counter(
            "specq_chunks_resumed", "Chunks taken with items still pending after an earlier "
            "run (a lost lease, a killed worker)")
        self.lease_renewals_failed = counter(
            "specq_lease_renewals_failed", "Lease renewals that failed (database away) or "
            "found the lease taken over")
        self.leases_given_up = counter(
            "specq_leases_given_up", "Chunk runs that stopped themselves because no lease "
            "renewal succeeded for two thirds of the lease (their items released, not charged)")
        self.writes_refused = counter(
            "specq_writes_refused", "Writes (outcomes, fault records, launch marks) refused "
            "because another run held the chunk's lease")
        self.chunks_run = counter("specq_chunks_run", "Chunk runs finished by this worker")
        # the engine's steps, as they run
        self._batch_steps = counter("specq_batch_steps",
                                    "Engine steps (whole batches) by the draft length chosen",
                                    "draft_length")
        self.step_seconds = Histogram("specq_step_seconds", "Seconds per engine step", LABELS,
                                      buckets=STEP_BUCKETS, registry=self.registry
                                      ).labels(**self.labels)
        self.batch_size = Histogram("specq_batch_size", "Rows per engine step", LABELS,
                                    buckets=BATCH_BUCKETS, registry=self.registry
                                    ).labels(**self.labels)
        self.server: Any = None

    # -- what the worker reports ------------------------------------------------------

    def written(self, outcomes: Iterable[Any]) -> None:
        """Outcomes (db/outcomes.py) this worker just stored: their status and counters."""
        with self._lock:
            for o in outcomes:
                status = getattr(o.status, "value", o.status)
                if status == "completed":
                    self.items_completed.inc()
                elif status == "failed":
                    self.items_failed.inc()
                c = o.counters
                if c is None:  # it never reached the engine (the chunk sums skip it too)
                    continue
                self.prompt_tokens.inc(o.prompt_tokens or 0)
                self.generation_tokens.inc(c.new_tokens)
                self.target_passes.inc(c.target_passes)
                self.num_drafts.inc(c.draft_steps)
                self.draft_tokens.inc(c.proposed)
                self.accepted_tokens.inc(c.accepted)
                self.forced_draft_tokens.inc(c.forced_proposed)
                self.forced_accepted_tokens.inc(c.forced_accepted)
                self.draft_seconds.inc(c.draft_time)
                self.verify_seconds.inc(c.verify_time)
                for i, n in enumerate(c.accepted_by_position):
                    if n:
                        self._accepted_per_pos.labels(**self.labels, position=str(i)).inc(n)
                for g, n in enumerate(c.steps_by_draft_length):
                    if n:
                        self._request_steps.labels(**self.labels, draft_length=str(g)).inc(n)
                for k, n in enumerate(c.steps_by_drafts_verified):
                    if n:
                        self._row_steps.labels(**self.labels, drafts_verified=str(k)).inc(n)

    def step(self, step: Any) -> None:
        """One engine step (worker/engine/step.py: Step), as the engine's on_step."""
        self.step_seconds.observe(step.t_step)
        self.batch_size.observe(len(step.num_draft))
        self._batch_steps.labels(**self.labels, draft_length=str(step.g)).inc()

    # -- serving ----------------------------------------------------------------------

    def serve(self, port: int, host: str) -> WorkerMetrics:
        """Serve /metrics on host:port from a daemon thread."""
        self.server = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)
        return self

    def stop(self) -> None:
        if isinstance(self.server, tuple):  # prometheus_client >= 0.20: (server, thread)
            server, thread = self.server
            server.shutdown()
            server.server_close()
            thread.join(5)
        self.server = None


class _Off:
    """The metrics of a process that serves none: every report is a no-op."""

    def __getattr__(self, name: str) -> Any:
        return _NOTHING


class _Nothing:
    """A counter, a histogram or a report that counts nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return self


_NOTHING = _Nothing()
OFF: Any = _Off()
_active: Any = OFF


def active() -> Any:
    """This process's WorkerMetrics, or OFF (a null object) when it serves none."""
    return _active


def start(pair: str, drafter: str, worker: str, port: int, host: str) -> WorkerMetrics:
    """Make this process's metrics and serve them on host:port; active() returns them."""
    global _active
    disable_created_metrics()  # no *_created series: half the scrape, nothing a query uses
    _active = WorkerMetrics(pair, drafter, worker).serve(port, host)
    return _active


def stop() -> None:
    """Stop serving; active() is OFF again."""
    global _active
    if isinstance(_active, WorkerMetrics):
        _active.stop()
    _active = OFF
