"""num_workers="auto": the layout search as a policy (measurements in, decisions out) and the
checks of its arguments (no processes)."""

from __future__ import annotations

import inspect

import pytest

from loader import Loader
from loader.config._autotune import Autotuner, Layout, Measurement, combine, first_layout
from loader.config._config import LoaderConfig
from loader.config._env import memory_budget
from loader.run._layout import first_guess
from tests import timing_pipelines as T

MiB = 2**20


def _measured(
    layout: Layout,
    rate: float,
    *,
    waiting: float = 0.5,
    cpus_busy: float = 0.5,
    per_worker: int = 100 * MiB,
    cpus: int = 4,
    limit: int = 10_000 * MiB,
) -> Measurement:
    return Measurement(
        layout=layout,
        batches=int(rate * 2),
        seconds=2.0,
        waiting=waiting,
        worker_cpus=cpus_busy,
        memory=per_worker * layout.workers,
        worker_memory=per_worker,
        cpus=cpus,
        memory_limit=limit,
    )


def test_the_first_guess_splits_the_cpus_and_keeps_a_fixed_dimension() -> None:
    assert first_layout(8, None, None) == Layout(2, 4)
    assert first_layout(1, None, None) == Layout(1, 1)
    assert first_layout(8, 3, None) == Layout(3, 2)
    assert first_layout(8, None, 1) == Layout(2, 1)


def test_climbs_while_faster_then_settles_on_the_fastest() -> None:
    tuner = Autotuner(cpus=8, memory_limit=10_000 * MiB)
    assert tuner.layout == Layout(2, 4)
    decision = tuner.observe(0, _measured(Layout(2, 4), 10.0, cpus_busy=7.5, cpus=8))
    assert decision.changed and decision.layout == Layout(4, 2) and not decision.settled
    assert "trying 4 workers x 2 threads" in decision.reason
    decision = tuner.observe(1, _measured(Layout(4, 2), 20.0, cpus_busy=7.9, cpus=8))
    assert decision.layout == Layout(8, 1)
    # within the noise margin of the best: not better, and the search is over
    decision = tuner.observe(2, _measured(Layout(8, 1), 20.5, cpus_busy=7.9, cpus=8))
    assert decision.settled and decision.changed and decision.layout == Layout(4, 2)
    assert "the fastest measured" in decision.reason
    # settled: the next epochs keep it
    decision = tuner.observe(3, _measured(Layout(4, 2), 19.0, cpus=8))
    assert not decision.changed and decision.settled
    report = tuner.report()
    assert [t.layout for t in report.trials] == [Layout(2, 4), Layout(4, 2), Layout(8, 1)]


def test_not_input_bound_settles_at_once() -> None:
    tuner = Autotuner(cpus=4, memory_limit=10_000 * MiB)
    decision = tuner.observe(0, _measured(Layout(2, 2), 10.0, waiting=0.01))
    assert decision.settled and not decision.changed
    assert "not input-bound" in decision.reason


def test_cpu_saturated_workers_never_go_past_the_cpus_but_starved_ones_do() -> None:
    saturated = Autotuner(cpus=2, memory_limit=10_000 * MiB)  # starts at 2 x 1
    decision = saturated.observe(0, _measured(Layout(2, 1), 10.0, cpus_busy=1.9, cpus=2))
    assert decision.layout == Layout(1, 2)  # not 4 workers on 2 CPUs: down instead
    waiting_on_io = Autotuner(cpus=2, memory_limit=10_000 * MiB)
    decision = waiting_on_io.observe(0, _measured(Layout(2, 1), 10.0, cpus_busy=0.3, cpus=2))
    assert decision.layout == Layout(4, 1)


def test_slower_going_up_tries_one_step_down_then_settles() -> None:
    tuner = Autotuner(cpus=4, memory_limit=10_000 * MiB)
    tuner.observe(0, _measured(Layout(2, 2), 10.0))
    assert tuner.observe(1, _measured(Layout(4, 1), 9.0)).layout == Layout(1, 4)
    decision = tuner.observe(2, _measured(Layout(1, 4), 12.0))
    assert decision.settled and decision.layout == Layout(1, 4) and not decision.changed


def test_memory_budget_bounds_the_layouts_tried_and_leaves_one_over_it() -> None:
    tuner = Autotuner(cpus=8, memory_limit=500 * MiB)
    # 200 MiB per worker: 2 fit (440 with the margin), 4 would not
    decision = tuner.observe(
        0, _measured(Layout(2, 4), 10.0, per_worker=200 * MiB, cpus=8, limit=500 * MiB)
    )
    assert decision.layout == Layout(1, 8), decision.reason  # up is over: one step down
    # workers that grew over the budget are left for fewer
    grown = Autotuner(cpus=8, memory_limit=500 * MiB)
    decision = grown.observe(
        0, _measured(Layout(2, 4), 10.0, per_worker=300 * MiB, cpus=8, limit=500 * MiB)
    )
    assert decision.layout == Layout(1, 8) and decision.changed
    assert "over the memory budget" in decision.reason
    # before the first epoch: the workers as started, allowed to double, must fit
    roomy = Autotuner(cpus=8, memory_limit=500 * MiB)
    assert not roomy.fit(2 * 100 * MiB, 100 * MiB).changed
    started = Autotuner(cpus=8, memory_limit=500 * MiB)
    decision = started.fit(2 * 240 * MiB, 240 * MiB)
    assert decision.changed and decision.layout == Layout(1, 8)
    assert started.fit(2 * 100 * MiB, 100 * MiB).layout == Layout(1, 8)


def test_short_epochs_are_pooled_before_deciding() -> None:
    tuner = Autotuner(cpus=4, memory_limit=10_000 * MiB)
    short = Measurement(Layout(2, 2), 5, 0.1, 0.5, 0.5, 100, 50, 4, 10_000 * MiB)
    decision = tuner.observe(0, short)
    assert not decision.changed and "measuring" in decision.reason
    assert not tuner.trials
    tuner.observe(1, _measured(Layout(2, 2), 10.0))
    assert tuner.trials and tuner.trials[0].layout == Layout(2, 2)


def test_ranks_combine_to_the_slowest_and_the_smallest_budgets() -> None:
    fast = _measured(Layout(2, 1), 20.0, waiting=0.1, cpus=4).payload()
    slow = _measured(Layout(2, 1), 10.0, waiting=0.4, cpus=2, limit=100 * MiB).payload()
    combined = combine([fast, slow])
    assert combined.rate == pytest.approx(10.0)
    assert combined.waiting == pytest.approx(0.4)
    assert (combined.cpus, combined.memory_limit) == (2, 100 * MiB)


def test_threads_only_keeps_the_workers() -> None:
    tuner = Autotuner(cpus=8, memory_limit=10_000 * MiB, workers=2)
    assert tuner.layout == Layout(2, 4)
    assert [layout.workers for layout in tuner.ladder()] == [2, 2, 2, 2]
    assert [layout.threads for layout in tuner.ladder()] == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"num_workers": "many"}, ValueError, "positive int or 'auto'"),
        ({"num_workers": 0}, ValueError, "num_workers must be >= 1"),
        ({"num_workers": None}, TypeError, "positive int or 'auto'"),
        ({"num_threads": "all"}, ValueError, "num_threads must be a positive int or 'auto'"),
        ({"num_workers": "auto", "memory_limit": 1.5}, ValueError, "fraction"),
        ({"num_workers": "auto", "memory_limit": 0}, ValueError, "positive number of bytes"),
        ({"num_workers": "auto", "memory_limit": "8G"}, TypeError, "number of bytes"),
        ({"num_workers": 2, "memory_limit": 2**30}, ValueError, "num_workers='auto'"),
    ],
)
def test_invalid_values_say_what_to_change(
    arguments: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        Loader(T.quick_source, T.id_step, batch_size=4, **arguments)  # type: ignore[arg-type]


def test_a_fraction_is_of_the_available_memory_split_among_sharers() -> None:
    import psutil

    available = psutil.virtual_memory().available
    assert memory_budget(4096) == 4096
    half = memory_budget(0.5, local_world_size=2)
    assert 0 < half <= available / 4 * 1.2


def _config(**arguments: object) -> LoaderConfig:
    """A configuration as a Loader with these keywords (the rest as its defaults) makes it."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(Loader.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    return LoaderConfig.build(
        T.quick_source, T.id_step, **{**defaults, "batch_size": 4, **arguments}
    )


def test_what_auto_tunes_follows_the_arguments() -> None:
    both = first_guess(_config(num_workers="auto"))
    assert both is not None and both.tuning == "workers and threads"
    assert both.layout == first_layout(_config(num_workers="auto").cpus, None, None)
    # what is tuned is left to the run's layout plan: 0 until its first guess
    assert (_config(num_workers="auto").num_workers, _config(num_workers=3).num_workers) == (0, 3)
    workers = first_guess(_config(num_workers="auto", num_threads=1))
    assert workers is not None and workers.tuning == "workers"
    assert all(layout.threads == 1 for layout in workers.ladder())
    threads = first_guess(_config(num_workers=3, num_threads="auto"))
    assert threads is not None and threads.tuning == "threads"
    assert first_guess(_config()) is None
    payload = _config(num_workers="auto", num_threads="auto").agreement_payload()
    assert (payload["num_workers"], payload["num_threads"]) == ("auto", "auto")


def test_a_budget_learnt_from_the_hosts_replaces_the_first_guess_only() -> None:
    """Without LOCAL_WORLD_SIZE the ranks on a host are counted once every rank is known: the
    first guess follows the smaller budget; a search under way keeps its layout and ladder."""
    tuner = Autotuner(cpus=8, memory_limit=10_000 * MiB)
    assert tuner.layout == Layout(2, 4)
    assert tuner.rebudget(8) is False
    assert tuner.rebudget(4) is True
    assert tuner.cpus == 4 and tuner.layout == Layout(2, 2)
    assert "4 CPUs" in tuner.reason
    assert max(layout.workers for layout in tuner.ladder()) == 8  # up to 2 per CPU
    tuner.observe(0, _measured(Layout(2, 2), 10.0, cpus_busy=3.9, cpus=4))
    searching = tuner.layout
    assert tuner.rebudget(2) is False and tuner.layout == searching
