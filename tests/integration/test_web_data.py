"""Image-text shards as img2dataset writes them (``tests/web_pipelines.py``: 7 shards, 220 samples,
4 without a caption, one truncated JPEG, a .parquet and _stats.json beside every tar): folders
and globs, optional members, keys, no row twice in a batch, resume on another layout, the
skip-limit error, and the CLIP example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import loader
from loader import Loader, SkipLimitError, TarsDataset
from tests import web_pipelines as W

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
KEYS = {W.key_of(s, r) for s, count in enumerate(W.COUNTS) for r in range(count)}
TRUNCATED = W.key_of(*W.TRUNCATED)
NO_CAPTION = {W.key_of(*at) for at in W.NO_CAPTION}


@pytest.fixture(scope="module")
def web_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("web")
    W.write_web_shards(root)
    return root


def keys_of(batch: Any) -> list[str]:
    return loader.texts(batch["key"])


def clip_loader(urls: Any, workers: int = 2, **options: Any) -> Loader:
    dataset = TarsDataset(urls, ext=("jpg", "txt", "__key__"), optional={"txt": b""})
    settings = {"on_error": "skip", "cut_padding": True, "copy": True, **options}
    return Loader(dataset, W.clip_step, batch_size=16, num_workers=workers, **settings)


@pytest.mark.parametrize("form", ["directory", "glob", "everything", "braces"])
def test_a_directory_or_a_glob_is_its_tars_each_read_once(web_root: Path, form: str) -> None:
    urls = {
        "directory": str(web_root),
        "glob": str(web_root / "*.tar"),
        "everything": str(web_root / "*"),  # (the .parquet, _stats.json, .idx: never shards)
        "braces": str(web_root / "{00000..00006}.tar"),
    }[form]
    dataset = TarsDataset(urls, ext=("txt", "__key__", "__url__"), optional={"txt": "-"})
    with Loader(
        dataset, W.key_step, batch_size=16, num_workers=2, cut_padding=True, capture=False
    ) as run:
        keys, shards = [], set()
        for batch in run:
            keys += keys_of(batch)
            for key, url, text in zip(
                keys_of(batch), loader.texts(batch["url"]), loader.texts(batch["txt"]), strict=True
            ):
                shard = int(key) // 10000
                assert url == str(web_root / f"{shard:05d}.tar")
                assert text == ("-" if key in NO_CAPTION else W.caption_of(shard, int(key) % 10000))
                shards.add(url)
    assert sorted(keys) == sorted(KEYS)  # every sample once
    assert len(shards) == len(W.COUNTS)


def test_an_explicit_file_that_is_no_tar_is_named_so(web_root: Path) -> None:
    urls = [str(web_root / "00000.tar"), str(web_root / "00000.parquet")]
    dataset = TarsDataset(urls, ext=("txt",), optional={"txt": b""})
    with pytest.raises(Exception, match=r"00000\.parquet is not a tar file") as raised:
        with Loader(dataset, W.key_step_txt, batch_size=16, num_workers=1, capture=False) as run:
            list(run)
    assert "rewritten" not in str(raised.value)


def test_an_empty_glob_says_what_it_matched(web_root: Path) -> None:
    dataset = TarsDataset(str(web_root / "*.parquet"), ext=("txt",))
    with pytest.raises(Exception, match=r"no \*\.tar shard in the matches of .*7 other file"):
        with Loader(dataset, W.key_step_txt, batch_size=16, num_workers=1, capture=False) as run:
            list(run)


def epoch_rows(run: Loader) -> Iterator[tuple[Any, list[str], list[str]]]:
    for batch in run:
        yield batch, keys_of(batch), loader.texts(batch["txt"])


def test_clip_epochs_hold_every_pair_once_and_never_a_row_twice(web_root: Path) -> None:
    with clip_loader(str(web_root)) as run:
        for epoch in range(2):
            seen: list[str] = []
            for batch, keys, captions in epoch_rows(run):
                assert len(set(keys)) == len(keys), (keys, batch.info)  # no copy of a row
                assert batch["image"].shape[1:] == (8, 8, 3)
                assert len(batch["image"]) == len(keys)
                if batch.info.skipped:
                    assert batch.info.skipped_names == (
                        str(web_root / "00003.tar") + ":" + TRUNCATED,
                    )
                    assert batch.info.cut_rows and batch.info.replaced == ()
                for key, caption in zip(keys, captions, strict=True):
                    shard, row = divmod(int(key), 10000)
                    assert caption == ("" if key in NO_CAPTION else W.caption_of(shard, row))
                seen += keys
            assert sorted(seen) == sorted(KEYS - {TRUNCATED}), epoch  # 219 rows, each once
            assert run.stats().defaulted == {"txt": 4 * (epoch + 1)}
        assert [name for _id, name in run.stats().skipped] == [
            str(web_root / "00003.tar") + ":" + TRUNCATED
        ]


def test_by_default_a_skipped_samples_row_is_cut_and_only_padding_repeats(web_root: Path) -> None:
    """The defaults (``cut_padding=False``): the truncated JPEG's row is cut off its batch
    (``info.cut_rows``), no row of any batch is a copy of another but the last batch's padding
    (flagged in ``info.padded``), and every other sample comes once. Before, the row held a
    copy of another row of the batch (same image, same caption), flagged only."""
    with clip_loader(str(web_root), cut_padding=False) as run:
        seen: list[str] = []
        cut = 0
        for batch, keys, _captions in epoch_rows(run):
            assert batch.info.replaced == ()
            real = keys[: len(keys) - batch.info.padded]
            assert len(set(real)) == len(real), (keys, batch.info)
            assert set(keys[len(real) :]) <= set(real)  # (padding repeats a row, flagged)
            if batch.info.skipped:
                cut += 1
                assert len(keys) == 16 - 1 and len(batch.info.cut_rows) == 1
                assert batch.info.skipped_names == (str(web_root / "00003.tar") + ":" + TRUNCATED,)
            else:
                assert len(keys) == 16 and batch.info.cut == 0
            seen += real
        assert cut == 1
        assert sorted(seen) == sorted(KEYS - {TRUNCATED})


def test_with_cut_replaced_false_the_row_is_a_flagged_repeat(web_root: Path) -> None:
    """``cut_replaced=False`` keeps every batch at its size: the skipped sample's row holds a
    repeat of another row of the batch, named in ``info.replaced``."""
    with clip_loader(str(web_root), cut_padding=False, cut_replaced=False) as run:
        for batch, keys, _captions in epoch_rows(run):
            assert len(keys) == 16
            rows = set(batch.info.replaced) | set(range(16 - batch.info.padded, 16))
            kept = [key for row, key in enumerate(keys) if row not in rows]
            assert len(set(kept)) == len(kept)
            if batch.info.skipped:
                assert (
                    len(batch.info.replaced) == 1 and keys.count(keys[batch.info.replaced[0]]) == 2
                )


def test_a_resume_from_two_workers_on_three_is_exactly_once(web_root: Path) -> None:
    with clip_loader(str(web_root)) as run:
        iterator = iter(run)
        taken = [key for _ in range(5) for key in keys_of(next(iterator))]
        state = run.state_dict()
    with clip_loader(str(web_root), workers=3) as run:
        run.load_state_dict(state)
        rest = [key for batch in run for key in keys_of(batch)]
    assert sorted(taken + rest) == sorted(KEYS - {TRUNCATED})


def test_the_skip_limit_error_is_whole_and_names_what_it_counted(web_root: Path) -> None:
    dataset = TarsDataset(str(web_root), ext=("jpg", "txt", "__key__"))  # (no optional=)
    with pytest.raises(SkipLimitError) as raised:
        with Loader(
            dataset, W.clip_step, batch_size=16, num_workers=2, on_error="skip", max_skipped=2
        ) as run:
            list(run)
    text = str(raised.value)
    head, *lines = text.splitlines()
    count = int(head.split()[0])
    assert head.endswith("more than max_skipped=2:") and count > 2
    named = [
        name
        for line in lines
        if line.startswith("  ") and line[2].isdigit()
        for name in line.split(": ", 1)[1].split(", ")
    ]
    assert len(named) == count  # the count is the skips named
    for name in named:
        assert name.rsplit(":", 1)[1] in NO_CAPTION | {TRUNCATED}
    assert ("member missing" in text) and "optional={'txt': b''}" in text
    assert "pipeline bug" not in text and text.rstrip().endswith("at least 8)")


def test_the_clip_example_runs(web_root: Path, tmp_path: Path) -> None:
    script = ROOT / "examples" / "clip_web.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(web_root),
            "--steps",
            "6",
            "--state",
            str(tmp_path / "s.pt"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout and "tokens (16, 32)" in done.stdout
    assert "none twice" in done.stdout


def run_trainer(web_root: Path, tmp_path: Path, on_error: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "trainer.py"
    script.write_text(W.TRAINER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), str(web_root), on_error],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )


def native_log_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are DALI's own log lines (``[ERROR] [jpeg_parser] ...``, in
    colour or not)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr)
    return [line for line in plain.splitlines() if re.match(r"\s*\[(ERROR|WARNING)\]\s*\[", line)]


def test_dali_lines_of_a_skipped_sample_stay_out_of_stderr(web_root: Path, tmp_path: Path) -> None:
    done = run_trainer(web_root, tmp_path, "skip")
    assert done.returncode == 0, done.stderr[-3000:]
    # (the last batch padded with 4 rows; the truncated JPEG's row cut off its batch)
    assert f"rows {W.TOTAL + 4 - 1}" in done.stdout
    assert native_log_lines(done.stderr) == [], done.stderr
    skip_lines = [line for line in done.stderr.splitlines() if line.startswith("skipped sample")]
    assert len(skip_lines) == 1 and f"00003.tar:{TRUNCATED}" in skip_lines[0], done.stderr
    assert "Invalid marker" in skip_lines[0]  # (what DALI printed, in the loader's line)


def test_dali_lines_of_a_failing_sample_reach_the_user_under_raise(
    web_root: Path, tmp_path: Path
) -> None:
    done = run_trainer(web_root, tmp_path, "raise")
    assert done.returncode != 0
    assert f"00003.tar:{TRUNCATED}" in done.stderr
    assert native_log_lines(done.stderr) != [], done.stderr  # DALI's own line, unhidden
    assert "[jpeg_parser] Invalid marker" in done.stderr.splitlines()[-1]  # and in the error
