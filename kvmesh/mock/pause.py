"""Pausing and sleeping the mock engine between RL rollouts, as vLLM 0.33 and SGLang 0.5.23 do it
(the HTTP side is :mod:`kvmesh.mock.control`).

vLLM pauses its scheduler in one of three modes, for ``/pause`` and ``/sleep`` alike:

- ``abort``: every request in the engine is aborted (its client is answered with the abort), then
  nothing waiting is taken in;
- ``wait``: the running requests go on to their end, nothing waiting is taken in (a request still
  queued when the pause began stays queued until the resume); the pause is complete once they have
  drained;
- ``keep``: nothing runs; the running requests keep their blocks and their place. Complete at the
  end of the step under way.

Once complete, a pause that clears the cache (``/pause``'s ``clear_cache``, true unless told
otherwise, and any ``/sleep`` of level 1 or 2) sends the requests it froze back to the queue, their
blocks freed, and empties the prefix cache (``AllBlocksCleared``): vLLM's engine resets its cache
with its running requests, whatever the mode, although its route's description says ``keep``
ignores the flag. The frozen requests then recompute their tokens so far when they run again.

``/pause`` in ``abort`` or ``wait`` mode also refuses every new request (a 503, retryable) until
``/resume``; a ``keep`` pause and a sleep take new requests and queue them. ``/resume`` and a
``/wake_up`` that leaves nothing asleep lift the pause. A sleep of level 1 or 2 also puts the
model's ``weights`` and ``kv_cache`` to sleep; ``/wake_up?tags=...`` wakes those it names, and the
scheduler resumes once none sleeps (``scheduling`` names the scheduler alone).

SGLang's ``/pause_generation`` holds every new request until ``/continue_generation`` (they wait,
none is refused): ``abort`` aborts every request first, ``in_place`` freezes the running ones as
``keep`` does, ``retract`` also sends them back to the queue with their blocks freed (the cache
is kept, so a flush can follow). It never clears the cache itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.errors import RequestError
from kvmesh.mock.scheduler import Pause

if TYPE_CHECKING:
    from kvmesh.mock.engine import MockEngine

PAUSE_MODES = ("abort", "wait", "keep")
"""vLLM's ways of pausing (``/pause`` and ``/sleep``)."""
SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")
SLEEP_LEVELS = (0, 1, 2)
_ASLEEP_AT_LEVEL_1 = frozenset({"weights", "kv_cache"})
"""What vLLM's level 1 and 2 put to sleep (level 0 only pauses the scheduler)."""
_SCHEDULER_TAG = "scheduling"


class GenerationPaused(RequestError):
    """A new request while ``/pause`` (abort or wait) holds the engine: vLLM's retryable 503."""

    status = 503

    def __init__(self) -> None:
        super().__init__("generation is paused until /resume: try the request again then")


class EngineControl:
    """The pause and sleep state of one :class:`~kvmesh.mock.engine.MockEngine` (its ``control``)."""

    def __init__(self, engine: MockEngine) -> None:
        self._engine = engine
        self.refuses_new = False
        """``/pause`` in abort or wait mode: :meth:`MockEngine.submit` refuses until resumed."""
        self.asleep: set[str] = set()
        """What a sleep of level 1 or 2 put to sleep and no ``/wake_up`` woke yet."""
        self.generation_paused = False
        """SGLang's pause (``/pause_generation`` until ``/continue_generation``): its ``/ready``
        answers 503 meanwhile. vLLM's ``/pause`` is not it (vLLM's API server has no ``/ready``)."""

    @property
    def paused(self) -> bool:
        """vLLM's ``/is_paused``: the scheduler holds something back."""
        return self._engine.scheduler.pause is not Pause.NONE

    @property
    def sleeping(self) -> bool:
        """vLLM's ``/is_sleeping``: paused, or something still asleep."""
        return self.paused or bool(self.asleep)

    async def pause(self, mode: str, *, clear_cache: bool) -> bool:
        """vLLM's ``/pause``. False if the cache was to be emptied and pins or sessions held
        blocks of it (the engine stays paused; vLLM fails the pause when its reset fails)."""
        # (refused from this moment, before the drain: vLLM sets it when the pause begins)
        self.refuses_new = mode != "keep"
        return await self._pause_scheduler(mode, clear_cache)

    async def sleep(self, level: int, mode: str) -> bool:
        """vLLM's ``/sleep``: new requests are taken and queue. False as for :meth:`pause`."""
        cleared = await self._pause_scheduler(mode, clear_cache=level >= 1)
        if level >= 1:
            self.asleep |= _ASLEEP_AT_LEVEL_1
        return cleared

    def resume(self) -> None:
        """vLLM's ``/resume`` (and SGLang's ``/continue_generation``): the frozen requests run on,
        the queued ones are taken in, new ones are taken. What sleeps stays asleep."""
        self.refuses_new = False
        self.generation_paused = False
        self._engine.set_pause(Pause.NONE)

    def wake_up(self, tags: list[str] | None) -> bool:
        """vLLM's ``/wake_up``: wake what ``tags`` name (None: everything). A tag that is not
        asleep makes it wake nothing. True (and the scheduler resumed) once nothing sleeps."""
        if tags is None:
            self.asleep.clear()
        else:
            named = {tag for tag in tags if tag != _SCHEDULER_TAG}
            if named and named <= self.asleep:
                self.asleep -= named
        if self.asleep:
            return False
        self.resume()
        return True

    async def pause_generation(self, mode: str) -> None:
        """SGLang's ``/pause_generation``, answered once the step under way has ended."""
        engine = self._engine
        self.generation_paused = True
        if mode == "abort":
            engine.abort_all(requested=True)
        engine.set_pause(Pause.ALL)  # (new requests wait in the queue until continued)
        await engine.until_idle()
        if mode == "retract" and self.paused:
            self._retract()

    async def _pause_scheduler(self, mode: str, clear_cache: bool) -> bool:
        engine = self._engine
        if mode == "abort":
            engine.abort_all(requested=True)
        engine.set_pause(Pause.ALL if mode == "keep" else Pause.NEW)
        await engine.until_idle()
        if not clear_cache or not self.paused:  # (a resume overtook the pause: nothing was held)
            return True
        self._retract()
        return engine.reset_prefix_cache()

    def _retract(self) -> None:
        engine = self._engine
        retracted = engine.scheduler.retract_running()
        if retracted:  # (vLLM counts a request its cache reset sends back as a preemption)
            engine.metrics.preemptions.inc(len(retracted))
