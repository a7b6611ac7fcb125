"""The Parquet anchors' verdicts: whether a save and a resume held every sample once, and this
loader against the best anchor (bench/_anchor_parquet.py)."""

from __future__ import annotations

from bench._anchor_parquet import exactness, targets
from bench.anchors import Outcome


def test_exactness_counts_samples_given_twice_and_never() -> None:
    assert exactness([0, 1, 2], [3, 4, 5], 6) == "exact"
    # a resume that replays a row group the save had delivered, and loses another sample
    assert exactness([0, 1, 2], [1, 2, 3, 4], 6) == "2 twice, 1 missing"
    assert exactness([0, 1], [], 3) == "0 twice, 1 missing"


def _run(first: float, epoch_s: float | None, resume: float | None) -> tuple[Outcome, Outcome]:
    return (
        Outcome(first_s=first, epoch_s=epoch_s, epoch_samples=1000),
        Outcome(first_s=resume, error="" if resume is not None else "IndexError"),
    )


def test_targets_compare_with_the_best_anchor_of_each_measure() -> None:
    runs = {
        "pq-loader": [_run(2.0, 1.0, 1.0)],
        "pq-loader-summary": [_run(1.0, 2.0, 0.5)],
        "pq-datasets": [_run(4.0, 0.5, None)],  # fastest epoch, no resume
        "pq-litdata": [_run(1.0, 4.0, 2.0)],  # fastest start
    }
    lines = targets(runs).splitlines()
    assert "loader first batch: 2.00 / best anchor (LitData) 1.00 = 2.00x" in lines[1]
    assert any("loader resume: 1.00 / best anchor (LitData) 2.00 = 0.50x" in ln for ln in lines)
    assert any(
        "loader+summary epoch samples/s: 500.00 / best anchor (datasets (files)) 2000.00 = 0.25x"
        in ln
        for ln in lines
    )


def test_targets_without_anchors_is_empty() -> None:
    assert targets({"pq-loader": [_run(1.0, 1.0, 1.0)]}) == ""


def test_targets_also_compare_like_for_like_by_order() -> None:
    """An unshuffled anchor's start is the best overall, but a shuffled loader is also set
    beside the best shuffled anchor, and the unshuffled loader beside the best unshuffled one."""
    runs = {
        "pq-loader": [_run(0.2, 1.0, 0.2)],
        "pq-loader-ordered": [_run(0.12, 1.0, 0.12)],
        "pq-datasets": [_run(0.3, 1.0, 0.4)],
        "pq-datasets-ordered": [_run(0.1, 1.0, 0.15)],
    }
    text = targets(runs)
    overall, alike = text.split("like for like")
    assert "loader first batch: 0.20 / best anchor (datasets, unshuffled) 0.10 = 2.00x" in overall
    assert "  loader first batch: 0.20 / best anchor (datasets (files)) 0.30 = 0.67x" in alike
    assert "loader, unshuffled first batch: 0.12 / best anchor (datasets, unshuffled) 0.10" in alike
    assert "loader resume: 0.20 / best anchor (datasets (files)) 0.40 = 0.50x" in alike
