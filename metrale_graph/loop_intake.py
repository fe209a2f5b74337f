"""Request intake: what other threads call on the engine loop (loop.py), and what they read of it.

    loop.submit(requests)      # they join the running batch at the next step
    loop.abort(requests)       # freed at the next step
    loop.run_job(fn)           # fn runs in the loop between two steps (warmup)
    loop.drain(wait_s); loop.close(error)
    loop.stats()               # an EngineStats

Everything is handed in under the loop's lock (`_cond`) and taken by the loop thread at its next iteration, so
requests submitted together join together; an abort takes no lock in the loop thread (a stream the garbage
collector finalizes there may abort while the loop holds it). When the loop ends, `_finish_outstanding` ends
every request still handed in or scheduled with the closing error, and every job waiting for it.

`LoopIntake` is EngineLoop's base class: its state is EngineLoop's, made in EngineLoop.__init__ (`_cond`,
`_inbox`, `_aborts`, `_jobs`, `_closing`, `_draining`, `_thread`, `_scheduled_waiting` and `_free_slots`,
which the loop thread publishes under the lock, and the counters `stats()` reads).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from .handle import EngineClosedError, EngineFullError, Failure, wait_for
from .scheduler import Request


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine loop (Engine.stats())."""
    running: int  # requests holding a slot
    waiting: int  # requests submitted, not yet admitted
    num_slots: int
    used_blocks: int  # KV blocks held by running requests
    num_blocks: int
    steps: int  # steps run so far
    prompt_tokens: int  # prompt tokens fed so far
    generated_tokens: int  # new tokens sampled so far
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead (prefix caching)
    prefix: dict | None = None  # the cache's prefix-caching counters (HybridCache.prefix_stats), or None
    mask_rows: int = 0  # structured output: token masks filled (a plain step: one a grammar request; a verify: one a position)
    mask_fill_s: float = 0.0  # host seconds spent filling them
    speculative: dict | None = None  # speculative decoding: method, num_tokens, proposed, accepted, drafts, steps


class Job:
    """fn handed to the loop by run_job: run in the loop thread between two steps, its result or error kept."""

    def __init__(self, fn: Callable[[], object], warmup: bool):
        self.fn, self.warmup = fn, warmup
        self.done, self.finished = threading.Condition(threading.Lock()), False
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:
            self.error = e
        finally:
            self.end()

    def end(self, error: BaseException | None = None) -> None:
        with self.done:
            self.error = self.error or error
            self.finished = True
            self.done.notify_all()


class LoopIntake:
    """EngineLoop's calls from other threads (the module docstring)."""

    @property
    def closed(self) -> bool:
        return self._closing is not None

    def submit(self, requests: list[Request], max_waiting: int | None = None) -> None:
        """Hand `requests` to the loop, all in one iteration, in order. EngineClosedError once closed (or
        shutting down); with max_waiting, EngineFullError if they would make more than that many wait (requests
        not in a slot yet, beyond the slots free now)."""
        with self._cond:
            if self._closing is not None or self._draining is not None:
                raise EngineClosedError(f"{self._closing or self._draining}: build a new Engine")
            # what would wait: the requests not yet in a slot, less the slots free for them
            if (max_waiting is not None
                    and len(self._inbox) + self._scheduled_waiting + len(requests) - self._free_slots > max_waiting):
                raise EngineFullError(f"the engine's waiting queue is full ({max_waiting} requests wait for a "
                                      "slot): try again later")
            now = time.perf_counter()
            for r in requests:
                r.submit_time = now
            self._inbox.extend(requests)
            self._start()
            self._cond.notify()

    def abort(self, requests: list[Request]) -> None:
        """End `requests` at the next iteration. Takes no lock in the loop thread: a stream the garbage
        collector finalizes there aborts its requests while the loop may hold its lock."""
        self._aborts.extend(requests)  # atomic
        if not self.is_loop_thread():
            with self._cond:
                self._cond.notify()

    def run_job(self, fn: Callable[[], object], warmup: bool = False):
        """Run fn() in the loop thread between two steps and return its result (or raise its error).
        warmup: fn compiles / captures the runner's buckets, which followers of a plan broadcast mirror."""
        job = Job(fn, warmup)
        with self._cond:
            if self._closing is not None:
                raise EngineClosedError(f"{self._closing}: build a new Engine")
            self._jobs.append(job)
            self._start()
            self._cond.notify()
        with job.done:
            wait_for(job.done, lambda: job.finished, None)
        if job.error is not None:
            raise job.error
        return job.result

    def check_open(self) -> None:
        """EngineClosedError once close() was called: a long job (the warmup) ends between two of its pieces
        instead of holding close() for the rest of it."""
        if self._closing is not None:
            raise EngineClosedError(f"{self._closing}: build a new Engine")

    def drain(self, wait_s: float) -> None:
        """Refuse new requests (EngineClosedError) and wait up to `wait_s` seconds for the outstanding ones
        to end."""
        with self._cond:
            if self._draining is None:
                self._draining = EngineClosedError("the engine is shutting down")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            with self._cond:
                if not (self._inbox or self._scheduled_waiting or self.scheduler.running):
                    return
            time.sleep(0.01)

    def close(self, error: BaseException | None = None, timeout: float | None = None) -> bool:
        """Stop the loop: requests still outstanding end with `error` (default EngineClosedError), the thread
        ends after the step it is running and releases the cache. Waits up to `timeout` seconds for it
        (None: until it ends); returns whether it has ended."""
        error = error or EngineClosedError("the engine was shut down")
        if self.is_loop_thread():  # the engine collected by the garbage collector in this thread, which may
            self._closing = self._closing or error  # hold the lock: the next iteration sees it
            return False
        with self._cond:
            self._closing = self._closing or error
            thread = self._thread
            self._cond.notify()
        if thread is None:  # never started: nothing was handed in
            self.cache.release(self._token)
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def stats(self) -> EngineStats:
        with self._cond:
            s, cache = self.scheduler, self.cache
            masks = self.masks
            return EngineStats(len(s.running), len(self._inbox) + self._scheduled_waiting, cache.num_slots,
                               cache.num_blocks - cache.free_blocks, cache.num_blocks, self._steps,
                               self._prompt_tokens, self._generated, self._cached,
                               cache.prefix_stats() if cache.prefix_caching else None,
                               masks.filled if masks else 0, masks.fill_s if masks else 0.0,
                               self.spec.stats() if self.spec is not None else None)

    def _publish_queue(self) -> None:
        """What submit() reads of the scheduler, copied for other threads (the caller holds the lock)."""
        self._scheduled_waiting = len(self.scheduler.waiting)
        self._free_slots = len(self.scheduler.free_slots)

    def _released(self, slot: int) -> None:
        """The scheduler gave `slot` back (its request ended, failed or was aborted), before the request's last output
        goes to its consumer: journalled under a plan broadcast, and published, so that a consumer that saw the end
        and submits again finds the slot free (max_waiting; an idle loop publishes nothing else)."""
        if self.journal is not None:
            self.journal.reset(slot)
        with self._cond:
            self._publish_queue()

    def is_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _start(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrale-engine-loop", daemon=True)
            self._thread.start()

    def _finish_outstanding(self, requests: list[Request]) -> None:
        """End every request handed in or scheduled and not ended yet with the closing error (after the last outputs of
        a step the loop died in, LoopReadBack._flush_undelivered)."""
        self._flush_undelivered()
        with self._cond:
            requests = requests + self._inbox
            self._inbox, jobs, self._jobs = [], self._jobs, []
            error = self._closing
        for r in requests:
            if not r.ended:
                r.error = error
                r.channel.put(Failure(r.index, error))
        for job in jobs:
            job.end(error)
