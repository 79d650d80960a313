"""Which workers serve a pair: keys that each worker refreshes while it lives.

A worker that has loaded and warmed its pair announces itself, and a small thread keeps
the announcement alive for as long as the process lives, busy or not. Readers (`specq
submit`, `specq status`, the tests and benches waiting for a worker) read the keys: one
Redis round trip, true under load. A broadcast to the workers cannot be that: a solo worker
busy with a chunk does not answer it.

In Redis, namespaced by the queue prefix:

- ``PREFIX:workers:PAIR``: a set of the hostnames that announced themselves for PAIR;
- ``PREFIX:worker:PAIR:HOSTNAME``: one key per live worker naming its process id, expiring
  ttl(settings) seconds after its last refresh (a worker killed with SIGKILL vanishes then;
  one that shuts down deletes its key at once). Expiry is Redis's own clock, so hosts whose
  clocks disagree still agree on who is alive. The key lapses before a dead worker's chunk
  lease can run out, so a takeover knows that run's process is gone (alive, below);
- ``PREFIX:start-failed:PAIR``: why the last worker that tried to start for PAIR could not
  (cleared by the next one that starts), so a job nobody serves says why.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import redis

from specq.configs.settings import Settings

log = logging.getLogger(__name__)

PRESENCE_TTL = 15  # seconds a worker's key outlives its last refresh, at most
START_FAILURE_TTL = 7 * 24 * 3600  # how long a failed start is remembered


def ttl(settings: Settings) -> float:
    """Seconds a worker's key outlives its last refresh: PRESENCE_TTL, or half a lease if
    that is shorter. A killed worker's lease runs out two thirds of a lease after its death
    at the soonest (renewed every third), so its key is gone by then."""
    return min(PRESENCE_TTL, settings.lease_seconds / 2)


def members_key(settings: Settings, pair: str) -> str:
    return f"{settings.queue_prefix}:workers:{pair}"


def worker_key(settings: Settings, pair: str, hostname: str) -> str:
    return f"{settings.queue_prefix}:worker:{pair}:{hostname}"


def start_failure_key(settings: Settings, pair: str) -> str:
    return f"{settings.queue_prefix}:start-failed:{pair}"


def announce(client: redis.Redis, settings: Settings, pair: str, hostname: str) -> None:
    """Say that ``hostname`` serves ``pair`` for the next ttl(settings) seconds."""
    value = json.dumps({"pid": os.getpid(), "at": time.time()})
    with client.pipeline() as pipe:
        pipe.sadd(members_key(settings, pair), hostname)
        pipe.set(worker_key(settings, pair, hostname), value,
                 px=max(1, int(ttl(settings) * 1000)))
        pipe.execute()


def withdraw(client: redis.Redis, settings: Settings, pair: str, hostname: str) -> None:
    with client.pipeline() as pipe:
        pipe.delete(worker_key(settings, pair, hostname))
        pipe.srem(members_key(settings, pair), hostname)
        pipe.execute()


def present(client: redis.Redis, settings: Settings, pair: str) -> list[str]:
    """Hostnames of the live workers serving ``pair``, sorted; the set forgets the dead."""
    names = sorted(n.decode() if isinstance(n, bytes) else n
                   for n in client.smembers(members_key(settings, pair)))
    if not names:
        return []
    alive = client.mget([worker_key(settings, pair, n) for n in names])
    dead = [n for n, v in zip(names, alive) if v is None]
    if dead:
        client.srem(members_key(settings, pair), *dead)
    return [n for n, v in zip(names, alive) if v is not None]


def alive(client: redis.Redis, settings: Settings, pair: str, owners: list[str]) -> set[str]:
    """Those of ``owners`` (chunk lease owners, HOSTNAME/PID/TOKEN: worker/run.py) whose
    process is still announced: its hostname's key is live and names its pid. A worker
    restarted under the same hostname announces another pid, so its dead run is not."""
    named = {}
    for owner in owners:
        parts = owner.rsplit("/", 2)
        if len(parts) == 3 and parts[1].isdigit():
            named[owner] = (parts[0], int(parts[1]))
    if not named:
        return set()
    found = client.mget([worker_key(settings, pair, host) for host, _ in named.values()])
    out = set()
    for (owner, (_, pid)), raw in zip(named.items(), found):
        try:
            if raw is not None and json.loads(raw).get("pid") == pid:
                out.add(owner)
        except (ValueError, AttributeError):
            continue
    return out


def record_start_failure(client: redis.Redis, settings: Settings, pair: str, hostname: str,
                         error: str) -> None:
    value = json.dumps({"hostname": hostname, "at": time.time(), "error": error[:2000]})
    client.set(start_failure_key(settings, pair), value, ex=START_FAILURE_TTL)


def clear_start_failure(client: redis.Redis, settings: Settings, pair: str) -> None:
    client.delete(start_failure_key(settings, pair))


def start_failure(client: redis.Redis, settings: Settings, pair: str) -> str | None:
    """'worker HOST could not start at HH:MM:SS UTC: ERROR', or None."""
    raw = client.get(start_failure_key(settings, pair))
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(d["at"]))
        return f"worker {d['hostname']} could not start at {at}: {d['error']}"
    except (ValueError, KeyError, TypeError):
        return None


class Heartbeat:
    """Keeps one worker's announcement alive from a daemon thread; stop() withdraws it."""

    def __init__(self, settings: Settings, pair: str, hostname: str) -> None:
        from specq.broker.connection import broker_client

        self.settings, self.pair, self.hostname = settings, pair, hostname
        self.client = broker_client(settings)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="presence", daemon=True)

    def start(self) -> Heartbeat:
        """Announce now, then keep refreshing (a broker that cannot be reached yet is
        retried by the thread, as Celery retries its own connection)."""
        try:
            announce(self.client, self.settings, self.pair, self.hostname)
        except redis.RedisError as exc:
            log.warning("presence: broker unreachable (%s); retrying", exc)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=self.settings.broker_timeout + 1)
        try:
            withdraw(self.client, self.settings, self.pair, self.hostname)
        except redis.RedisError as exc:  # it expires by itself
            log.info("presence: not withdrawn (%s); it expires in %.0f s", exc,
                     ttl(self.settings))
        finally:
            self.client.close()

    def _run(self) -> None:
        failing = False
        while not self.stopped.wait(ttl(self.settings) / 3):
            try:
                announce(self.client, self.settings, self.pair, self.hostname)
            except redis.RedisError as exc:
                if not failing:  # once per outage, not every few seconds
                    log.warning("presence: broker unreachable (%s); retrying", exc)
                failing = True
            else:
                if failing:
                    log.info("presence: announced again")
                failing = False


# -- runs that gave their lease up alive (worker/keeper.py) ----------------------------
#
# A run whose database stops answering gives its chunk's lease up before the lease runs
# out, and says so here, on the broker, which it still reaches. The run that takes the
# chunk over finds the give-up and releases the items the stalled run had in flight
# instead of charging them a crash: their worker never died.

GIVE_UP_TTL = 24 * 3600  # seconds a give-up is kept (a takeover comes within minutes)


def give_up_key(settings: Settings, owner: str) -> str:
    return f"{settings.queue_prefix}:gave-up:{owner[-200:]}"


def record_give_up(client: redis.Redis, settings: Settings, owner: str) -> None:
    """Say that the run ``owner`` (a chunk lease's owner) gave its lease up, alive."""
    client.set(give_up_key(settings, owner), json.dumps({"pid": os.getpid(), "at": time.time()}),
               ex=GIVE_UP_TTL)


def gave_up(client: redis.Redis, settings: Settings, owners: list[str]) -> set[str]:
    """Those of ``owners`` that gave their leases up alive (record_give_up)."""
    if not owners:
        return set()
    found = client.mget([give_up_key(settings, o) for o in owners])
    return {o for o, v in zip(owners, found) if v is not None}
