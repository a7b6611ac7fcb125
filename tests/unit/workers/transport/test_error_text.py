"""What a worker's error says: DALI's long text in a line (its operator and cause), the failing
samples named first, and the decoder's own stderr line held back while samples are re-run
alone (no processes; real DALI errors, run eagerly in this one)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from loader.sample import list_images, write_sample_dataset
from workers.capture._stderr import repeats_captured, split_native
from workers.spec import ErrorContext, attach, context_of
from workers.spec._error_context import UNKNOWN
from workers.transport._error_text import (
    dali_summary,
    failed_in_decoder,
    failure,
    message,
    short_reason,
)

#: DALI 2.4's text for a corrupt JPEG in a captured pipeline (as the worker gets it)
CAPTURED_TEXT = """Critical error in pipeline:
Critical error in pipeline:
Error in CPU operator `nvidia.dali.ops.decoders.Image`,
which was used in the pipeline definition with the following traceback:

  File "_capture.py", line 582, in build_pipeline
    _wire_capture_graph(self.sources, self.nodes, captured_rngs)
  File "_capture.py", line 953, in _wire_capture_graph
    out = op(*positional, **kw_nodes)

encountered:

nvImageCodec failure: '#3'
Current pipeline object is no longer valid.
Current pipeline object is no longer valid."""

#: ... and for a crop out of bounds, with the C++ line that follows DALI's cause
CROP_TEXT = """Critical error in pipeline:
Error in CPU operator `nvidia.dali.ops.Crop`,
which was used in the pipeline definition with the following traceback:

  File "_capture.py", line 953, in _wire_capture_graph
    out = op(*positional, **kw_nodes)

encountered:

Slice can't be placed out of bounds with current policy. Got: input_shape={1 x 1 x 3}
C++ context: [/opt/dali/dali/operators/generic/slice/out_of_bounds_policy.h:106]
Current pipeline object is no longer valid."""


def test_a_captured_pipelines_error_is_its_operator_and_cause() -> None:
    assert dali_summary(RuntimeError(CAPTURED_TEXT)) == (
        "CPU operator decoders.Image",
        "nvImageCodec failure: '#3'",
    )
    assert dali_summary(RuntimeError(CROP_TEXT)) == (
        "CPU operator Crop",
        "Slice can't be placed out of bounds with current policy. Got: input_shape={1 x 1 x 3}",
    )


def test_a_decoders_failure_is_told_from_another_operators_and_from_pythons() -> None:
    """The skip-limit error's "file undecodable" (the data) against "exception in step" (the
    step): told by the operator DALI names, not by words such as "image" in the message."""
    assert failed_in_decoder(RuntimeError(CAPTURED_TEXT))
    assert not failed_in_decoder(RuntimeError(CROP_TEXT))
    assert not failed_in_decoder(ValueError("could not decode the image: bad marker"))


def test_the_failing_samples_come_first_then_the_error_in_a_line() -> None:
    error = RuntimeError(CAPTURED_TEXT)
    text = message(error, ["sample 14 (/d/a.jpg)"], ["[jpeg_parser] Invalid marker"])
    assert text == (
        "failing sample 14 (/d/a.jpg): CPU operator decoders.Image failed: nvImageCodec "
        "failure: '#3' (printed: [jpeg_parser] Invalid marker)"
    )
    assert message(error) == "CPU operator decoders.Image failed: nvImageCodec failure: '#3'"


def test_any_other_error_keeps_its_message() -> None:
    error = ValueError("bad shape\n\n(3, 4)\nmore\nmore")
    assert dali_summary(error) is None
    assert message(error) == str(error)
    assert message(error, ["sample 3"]) == f"failing sample 3: {error}"
    assert short_reason(error) == "ValueError: bad shape (3, 4) more"


def test_an_errors_context_travels_with_it_and_names_its_phase_and_message() -> None:
    error = ValueError("bad bytes")  # built-in: not weakly referenceable
    assert context_of(error) is UNKNOWN
    attach(error, phase="load, sample 14")
    attach(error, message="failing sample 14: bad bytes")
    assert context_of(error) == ErrorContext("load, sample 14", "failing sample 14: bad bytes")
    record = failure(error, phase="dali", epoch=2, step=5)
    assert (record.type_name, record.phase) == ("ValueError", "load, sample 14")
    assert (record.message, record.epoch, record.step) == ("failing sample 14: bad bytes", 2, 5)
    assert "bad bytes" in record.traceback
    plain = failure(KeyError("x"), phase="step", epoch=None, step=None)
    assert (plain.phase, plain.message) == ("step", "'x'")


def test_a_skip_reason_is_one_line() -> None:
    assert short_reason(RuntimeError(CAPTURED_TEXT), ["[jpeg_parser] Invalid marker"]) == (
        "RuntimeError: CPU operator decoders.Image failed: nvImageCodec failure: '#3' "
        "(printed: [jpeg_parser] Invalid marker)"
    )


def test_an_eager_error_is_its_cause_without_dalis_wrapper() -> None:
    """DALI raises "An error happened during asynchronous execution" from the real error."""
    try:
        try:
            raise RuntimeError("nvImageCodec failure: '#4'")
        except RuntimeError as cause:
            raise RuntimeError("An error happened during asynchronous execution") from cause
    except RuntimeError as error:
        assert dali_summary(error) == (None, "nvImageCodec failure: '#4'")
        assert short_reason(error) == "RuntimeError: nvImageCodec failure: '#4'"


@pytest.fixture(scope="module")
def corrupt_jpeg(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = write_sample_dataset(tmp_path_factory.mktemp("one"), count=1, classes=1, seed=3)
    [path], _labels = list_images(root)
    return Path(path).read_bytes()[:200]


def test_a_real_eager_decode_error_names_its_operator_and_holds_back_the_decoders_line(
    corrupt_jpeg: bytes, capfd: pytest.CaptureFixture[str]
) -> None:
    """As a sample re-run alone fails: the operator comes from DALI's own frames; the line
    nvImageCodec writes to file descriptor 2 comes back instead of reaching stderr."""
    import nvidia.dali.experimental.dynamic as ndd

    error: BaseException | None = None
    with repeats_captured() as printed, ndd.EvalContext(num_threads=1):
        try:
            images = ndd.decoders.image(ndd.batch([np.frombuffer(corrupt_jpeg, np.uint8)]))
            ndd.resize(images, size=[8, 8]).evaluate()
        except RuntimeError as caught:
            error = caught
    assert error is not None and "asynchronous execution" in str(error)
    assert dali_summary(error) == ("CPU operator decoders.Image", "nvImageCodec failure: '#3'")
    assert failed_in_decoder(error)  # (a skip of the kind "file undecodable")
    assert printed.native == ["[jpeg_parser] Invalid marker"]
    assert "Invalid marker" not in capfd.readouterr().err


def test_other_output_of_a_held_block_still_reaches_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with repeats_captured() as printed:
        os.write(2, b"\x1b[0;31m[ERROR] \x1b[0m[jpeg_parser] Invalid marker\n")
        os.write(2, b"a user's own line\n")
        os.write(2, b"[ERROR] [jpeg_parser] Invalid marker\n")  # the same line again: once
    assert printed.native == ["[jpeg_parser] Invalid marker"]
    assert capfd.readouterr().err == "a user's own line\n"


def test_native_log_lines_are_told_apart() -> None:
    native, rest = split_native("[WARNING] [x] slow\nplain\n  [ERROR]  [y] bad \n[notalevel] z\n")
    assert native == ["[x] slow", "[y] bad"]
    assert rest == "plain\n[notalevel] z\n"


def test_a_long_reason_is_cut_between_words() -> None:
    error = ValueError(" ".join(f"word{i}" for i in range(200)))
    reason = short_reason(error)
    assert len(reason) <= 300 and reason.endswith(" ...")
    last = reason[: -len(" ...")].split(" ")[-1]
    assert last in str(error).split(" ")  # (a whole word, not a part of one)
