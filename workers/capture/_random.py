"""The worker's DALI random generators: what each batch carries, what a resume restores.

Runs in the worker, on its main thread (where ``step`` runs and DALI's capture loop lives).

DALI's random operators draw from an ``ndd.random.RNG``: the thread's default one (seeded by
:func:`~._sources.build_sources` from the loader's seed, the shard and the epoch) or one the
user's code made (``rng=``). With a fixed draw pattern (DALI's capture-mode rule: the same draws in
the same order on every step) a captured loop and an eager one draw the same values and leave each
generator in the same state, across epochs. So the states right after step *k* are exactly what
step *k + 1* needs: every batch carries them (:data:`ipc.wire.RandomStates`), the trainer keeps
those of the last batch it delivered per worker, and a resumed or replacing worker puts its
generators back in them between loops -- the one moment DALI allows it -- before its first step.

Which generators: the default one, and every other RNG alive in this process that has drawn
(noted at its first draw, in that order; one made afresh in every step is gone by the end of it
and is not kept). A restored state is matched to a generator by its key (the seed it was made
with, :func:`~workers.dali.generator_key`): a generator that exists already is set at once, one
that the step makes later (on its first call, say) is set at its first draw, before DALI's
capture layer anchors its schedule there.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

from ipc import wire

from .. import dali


class _Nobody:
    """What ``RandomGenerators._last`` refers to before any draw."""


_NOBODY_OBJECT = _Nobody()
_NOBODY: weakref.ref[Any] = weakref.ref(_NOBODY_OBJECT)


class RandomGenerators:
    """The states of the worker's generators after each step, and their restoration.

    Lifecycle: made once per worker process (it watches every draw from then on); after each build
    of the sources :meth:`rebuilt` (with the states to start from, if any); after each step
    :meth:`after_step`; :meth:`close` at exit.
    """

    def __init__(self) -> None:
        #: generators other than the default one, in the order of their first draw
        self._generators: list[weakref.ref[Any]] = []
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        #: restored states whose generator has not drawn yet, by key, in their saved order
        self._pending: dict[str, deque[str]] = {}
        self._drawn = False  # anything drew since the sources were built
        #: the generator that drew last, since the sources were built (an operator draws several
        #: words in a row: the next ones cost one comparison)
        self._last: weakref.ref[Any] = _NOBODY
        self._stop = dali.watch_draws(self._on_draw)

    def rebuilt(self, states: wire.RandomStates = b"") -> None:
        """The sources were just built (the default generator seeded): start from ``states``
        (the default generator's and others'), or, when empty, from the seeding as it is."""
        self._pending.clear()
        if states:
            default, *others = wire.split_states(states)
            dali.set_generator_state(dali.default_generator(), default)
            for state in others:
                self._pending.setdefault(dali.generator_key(state), deque()).append(state)
            for generator in self._alive():
                self._restore(generator)
        self._drawn = False
        self._last = _NOBODY

    def after_step(self) -> wire.RandomStates:
        """The states after the step that just ran (those of the next one); empty when nothing
        drew since the sources were built."""
        if not self._drawn:
            return b""
        states = [dali.generator_state(dali.default_generator())]
        if self._generators:
            states += [dali.generator_state(generator) for generator in self._alive()]
        for waiting in self._pending.values():  # restored, not drawn from yet: still theirs
            states += waiting
        return " ".join(states).encode("ascii")  # (wire.join_states, DALI's words unchecked)

    def close(self) -> None:
        self._stop()

    def _on_draw(self, generator: Any) -> None:
        if self._last() is generator:
            return
        self._last = weakref.ref(generator)
        self._drawn = True
        if generator in self._seen:
            return
        self._seen.add(generator)
        if generator is dali.default_generator():
            return
        self._restore(generator)
        self._generators.append(weakref.ref(generator))

    def _restore(self, generator: Any) -> None:
        waiting = self._pending.get(dali.generator_key(dali.generator_state(generator)))
        if waiting:
            dali.set_generator_state(generator, waiting.popleft())

    def _alive(self) -> list[Any]:
        alive = [generator for ref in self._generators if (generator := ref()) is not None]
        if len(alive) != len(self._generators):
            self._generators = [weakref.ref(generator) for generator in alive]
        return alive
