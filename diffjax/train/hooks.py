"""What runs after a training step: hooks, each every N steps (Levanter's
``add_hook(fn, every=N)``). The loop of one model (:mod:`.loop`) adds the evaluation, the
checkpoint, the caller's ``after_step`` and the preemption stop, in that order; the profiler
and the divergence handling wrap the step itself."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

HookFn = Callable[[int, Any], None]  # (the step just trained, the state after it)


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(step, state)`` after every ``every``-th step, and after any step ``also(step)``
    says (e.g. the run's last)."""

    name: str
    fn: HookFn
    every: int = 1
    also: Callable[[int], bool] | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or (self.also is not None and self.also(step))


@dataclasses.dataclass
class Hooks:
    """The hooks of a run, run in the order they were added."""

    hooks: list[Hook] = dataclasses.field(default_factory=list)

    def add(
        self,
        fn: HookFn,
        *,
        every: int = 1,
        also: Callable[[int], bool] | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"a hook runs every N >= 1 steps, got every={every!r}")
        self.hooks.append(Hook(name or getattr(fn, "__name__", "hook"), fn, every, also))

    def run(self, step: int, state: Any) -> None:
        for hook in self.hooks:
            if hook.due(step):
                hook.fn(step, state)
