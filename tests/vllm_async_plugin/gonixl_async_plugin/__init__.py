"""Async scheduling on vLLM's CPU platform, for gonixl's end-to-end tests.

vLLM 0.32 resolves ``scheduler_config.async_scheduling`` in
``VllmConfig.__post_init__``: unset, it becomes True when the executor
supports it (the CPU build's ``mp`` and ``uni`` executors both do). Then it
calls the platform's ``check_and_update_config``, and the CPU platform's sets
it False ("async scheduling is not required on CPU"). On GPUs it stays on:
the engine core runs ``step_with_batch_queue`` with a queue of two batches and
the ``AsyncScheduler``, so step N+1 is scheduled before step N's output has
been processed. That ordering is what a KV connector meets in production, and
the end-to-end tests must run it.

With ``GONIXL_TEST_ASYNC_SCHEDULING=1`` in the environment, this plugin (a
``vllm.general_plugins`` entry point: vLLM runs it in the API server before it
builds the engine's config, and again in the engine core and in every worker
process) does three things; without it, nothing.

1. It wraps ``CpuPlatform.check_and_update_config``: when async scheduling
   was on before the platform's hook (vLLM's default, or
   ``--async-scheduling``) and the hook turned it off, it is turned back on.
   ``--no-async-scheduling`` is honoured. One INFO line in the API server:
   ``gonixl-test: async scheduling kept on ...``.
2. In the engine core, when the scheduler is created, one INFO line that the
   tests grep for in each instance's log (vLLM itself logs nothing at INFO
   about it; only "Batch queue is enabled with size 2" at debug level)::

       gonixl-test: async scheduling on: AsyncScheduler, batch queue 2

3. It counts the steps the scheduler scheduled while the output of an
   earlier step that ran tokens was still unprocessed -- the overlap that
   makes scheduling asynchronous -- and logs the count when it reaches 1, 2,
   4, 8, ...::

       gonixl-test: async scheduling: 16 steps scheduled before an earlier step's output was processed

Every patch is applied at most once per process (vLLM loads general plugins
once per process, and a forked child inherits the parent's patches).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "GONIXL_TEST_ASYNC_SCHEDULING"
#: The marker the end-to-end tests grep for (see the module docstring).
ON_LINE = "gonixl-test: async scheduling on"

_installed = False


def register() -> None:
    """The entry point: install the patches when ENV is "1"."""
    global _installed
    if os.environ.get(ENV, "") != "1" or _installed:
        return
    _installed = True
    from vllm.logger import init_logger

    logger = init_logger("vllm.gonixl_async_plugin")
    _keep_async_on_cpu(logger)
    _count_overlapping_steps(logger)


def _keep_async_on_cpu(logger: Any) -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        sched = vllm_config.scheduler_config
        before = sched.async_scheduling
        original(cls, vllm_config)
        if before and not sched.async_scheduling:
            sched.async_scheduling = True
            logger.info(
                "gonixl-test: async scheduling kept on (%s=1; vLLM's CPU platform turns it off)", ENV
            )
        elif not before:
            logger.info("gonixl-test: async scheduling off before the CPU platform's hook (--no-async-scheduling?); left off")

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def _count_overlapping_steps(logger: Any) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    init = AsyncScheduler.__init__
    schedule = AsyncScheduler.schedule
    update_from_output = AsyncScheduler.update_from_output

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._gonixl_in_flight: set[int] = set()  # ids of scheduled, unprocessed outputs that ran tokens
        self._gonixl_overlaps = 0
        logger.info(
            "%s: %s, batch queue %d", ON_LINE, type(self).__name__, self.vllm_config.max_concurrent_batches
        )

    def schedule_(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = schedule(self, *args, **kwargs)
        if out.total_num_scheduled_tokens > 0:
            if self._gonixl_in_flight:
                self._gonixl_overlaps += 1
                n = self._gonixl_overlaps
                if n & (n - 1) == 0:
                    logger.info(
                        "gonixl-test: async scheduling: %d steps scheduled before an earlier step's output was processed", n
                    )
            self._gonixl_in_flight.add(id(out))
        return out

    def update_from_output_(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._gonixl_in_flight.discard(id(scheduler_output))
        return update_from_output(self, scheduler_output, *args, **kwargs)

    AsyncScheduler.__init__ = __init__  # type: ignore[method-assign]
    AsyncScheduler.schedule = schedule_  # type: ignore[method-assign]
    AsyncScheduler.update_from_output = update_from_output_  # type: ignore[method-assign]
