"""Background workers that pull work from the store and process a bounded number of items at once.

The judge worker (``clawrl.orchestration.judging.JudgeWorker``), the OPD teacher worker
(``clawrl.methods.opd.teacher.TeacherWorker``) and the OPD teacher gate share this loop: poll the
store every ``poll_s`` seconds, or sooner after ``notify()`` (thread-safe, so the gateway can wake a
worker when a turn closes), and keep at most ``concurrency`` items in flight. Serving never waits on
them: they only read turns that are already stored. ``drain()`` processes everything outstanding
now and returns, for tests and shutdown; a failure to *record* a result is raised from ``drain()``.
In the background the item stays outstanding and is retried, and every failure (reading work or
recording a result) backs off: the next poll waits 1 s, 2 s, ... up to a minute, logged once per
stretch (``clawrl.backoff``), so a full disk or a bug never makes the worker spin.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Optional

from clawrl.backoff import Backoff

log = logging.getLogger(__name__)


class PollingWorker:
    """Subclasses implement ``_next_work`` and may override ``_prepare`` and ``_started_message``."""

    name = "clawrl-worker"  # the asyncio task's name, and the prefix of this worker's log lines
    item_label = "item"  # how log lines name one unit of work, e.g. "sample"

    def __init__(self, concurrency: int, poll_s: float):
        self.concurrency, self.poll_s = concurrency, poll_s
        self._in_flight: dict[int, asyncio.Task] = {}
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._errors: list[BaseException] = []  # failures while draining, raised by drain()
        self._draining = False
        self.backoff = Backoff(self.name, f"it records no {self.item_label} outcome and takes no new work")
        self.finished = 0  # items this worker finished, whatever their outcome

    async def _next_work(self, free: int, busy: list[int]) -> list[tuple[int, Awaitable[None]]]:
        """Up to ``free`` new items that are not in ``busy``, each as (key, coroutine to run)."""
        raise NotImplementedError

    async def _prepare(self) -> None:
        """Runs before every poll, even when no slot is free."""

    def _started_message(self) -> str:
        return f"{self.name} started"

    def notify(self) -> None:
        """Wake the worker now. Safe from any thread."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name=self.name)
        return self._task

    async def stop(self) -> None:
        """Cancel the loop and in-flight work; unfinished items are picked up by the next run."""
        tasks = ([self._task] if self._task else []) + list(self._in_flight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        log.info(self._started_message())
        while True:
            self._wake.clear()
            try:
                await self._fill()
            except Exception as e:  # a store hiccup must not end the worker; a later poll retries
                self.backoff.failed(e)
            else:
                if not self._in_flight:  # nothing outstanding failed
                    self.backoff.succeeded()
            delay = self.backoff.delay_s()
            if delay:  # backing off: new turns do not wake it
                await asyncio.sleep(delay)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def drain(self) -> int:
        """Process every item outstanding now (and any that appear meanwhile); returns how many finished."""
        self._loop = asyncio.get_running_loop()
        self._wake = self._wake or asyncio.Event()
        before = self.finished
        self._errors.clear()
        self._draining = True
        try:
            while True:
                if self._errors:
                    raise self._errors[0]
                await self._fill()
                if not self._in_flight:
                    return self.finished - before
                await asyncio.wait(list(self._in_flight.values()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._draining = False

    async def _fill(self) -> None:
        await self._prepare()
        free = self.concurrency - len(self._in_flight)
        if free <= 0:
            return
        for key, work in await self._next_work(free, list(self._in_flight)):
            task = asyncio.get_running_loop().create_task(work)
            self._in_flight[key] = task
            task.add_done_callback(lambda t, key=key: self._done(key, t))

    def _done(self, key: int, task: asyncio.Task) -> None:
        self._in_flight.pop(key, None)
        if task.cancelled():
            pass
        elif task.exception() is None:
            self.backoff.succeeded()
        elif self._draining:
            self._errors.append(task.exception())
        else:
            self.backoff.failed(task.exception())
        if self._wake is not None:
            self._wake.set()
