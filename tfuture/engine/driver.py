"""Who drives an :class:`tfuture.engine.engine.Engine`'s runtime: :class:`RunDriver`.

One thread at a time runs the runtime: the caller of ``generate`` on an idle engine (the
foreground, :meth:`RunDriver._drive`), else a background thread started when requests arrive
(:meth:`RunDriver._ensure_driver`) that runs while there is work and then ends. A run that fails
finishes every live request with reason ``"error"`` (the scheduler's ``fail``); the engine stays
usable. Once the engine is closed and no thread drives a run, a Hugging Face model it wrapped gets
its mode and attention back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tfuture.core.future_map import FutureMap
from tfuture.engine.inputs import _merge, _run_context
from tfuture.runtime import OverlapRuntime
from tfuture.scheduler.serving import ServingScheduler
from tfuture.streams.stats import RunStats

__all__ = ["RunDriver"]


class RunDriver:
    """The driving half of :class:`tfuture.engine.engine.Engine` (see the module docstring), over
    the engine's state below, which the engine sets up and owns (``_cond`` wraps the scheduler's
    lock)."""

    fmap: FutureMap
    runtime: OverlapRuntime
    scheduler: ServingScheduler
    last_stats: RunStats | None
    last_error: BaseException | None
    _cond: threading.Condition
    _driver: str | None
    _thread: threading.Thread | None
    _driver_thread: threading.Thread | None
    _closed: bool
    _give_back: Callable[[], None] | None

    @property
    def busy(self) -> bool:
        """True while a thread drives the runtime."""
        with self._cond:
            return self._driver is not None

    def _ensure_driver(self) -> None:
        """Under the lock: start the background thread unless a thread drives the runtime."""
        if self._driver is None and self.scheduler.has_work():
            self._driver = "background"
            self._thread = threading.Thread(target=self._serve, name="tfuture-engine", daemon=True)
            self._driver_thread = self._thread
            self._thread.start()

    def _check_not_driving(self, what: str) -> None:
        """Raise on the thread that drives the runtime (a callback): waiting there would wait
        for itself."""
        if threading.current_thread() is self._driver_thread:
            raise RuntimeError(
                f"{what} waits for the engine's run, and this thread drives that run (a callback): "
                "submit() requests here instead, and read their results elsewhere"
            )

    def _serve(self) -> None:
        """The background thread: run while there is work, then end."""
        while True:
            with self._cond:
                if not self.scheduler.has_work():
                    self._driver, self._thread, self._driver_thread = None, None, None
                    self._give_back_if_done()
                    self._cond.notify_all()
                    return
            self._run(raise_error=False)

    def _drive(self) -> RunStats | None:
        """The foreground: run on this thread until the engine is idle."""
        stats: RunStats | None = None
        try:
            while True:
                stats = _merge(stats, self._run(raise_error=True))
                with self._cond:
                    if not self.scheduler.has_work():
                        self._driver, self._driver_thread = None, None
                        self._give_back_if_done()
                        self._cond.notify_all()
                        return stats
        except BaseException:
            with self._cond:
                self._driver, self._driver_thread = None, None
                self._ensure_driver()  # requests added by a callback while failing
                self._give_back_if_done()
            raise

    def _give_back_if_done(self) -> None:
        """Under the lock: once closed and no thread drives a run, give a Hugging Face model
        this engine wrapped its mode and attention back (once)."""
        if self._closed and self._driver is None and self._give_back is not None:
            give_back, self._give_back = self._give_back, None
            give_back()

    def _run(self, raise_error: bool) -> RunStats | None:
        try:
            with _run_context(self.fmap.device):
                stats = self.runtime.run(self.scheduler)
        except BaseException as e:
            self.last_error = e
            self.scheduler.fail(e)
            if raise_error:
                raise
            return None
        self.scheduler.end_run()
        self.last_stats = stats
        return stats
