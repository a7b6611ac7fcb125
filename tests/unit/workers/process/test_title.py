"""Process titles: how a title fits the command line's room."""

from __future__ import annotations

from workers.process._title import fit, server_title, short_name, worker_title


def test_a_title_degrades_to_its_most_useful_part() -> None:
    title = worker_title(3, 41327)
    assert fit(title, 200) == "dali-loader-worker-3 (trainer 41327)"
    assert fit(title, 30) == "dali-loader-worker-3"
    assert fit(title, 16) == "dali-loader-w3"
    assert fit(title, 6) == "dali-l"
    assert fit(server_title(1), 17) == "dali-loader-srv"
    assert short_name(worker_title(12, 1)) == "dali-loader-w12"
    assert short_name(worker_title(123, 1)) == "dali-loader-w12"  # (the kernel's 15 bytes)
