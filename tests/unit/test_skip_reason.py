"""The one-line reason logged for a skipped sample names DALI's operator and its cause."""

from __future__ import annotations

from workers._loop import _short_reason

DALI_TEXT = """Critical error in pipeline:
Critical error in pipeline:
Error in CPU operator `nvidia.dali.ops.decoders.Image`,
which was used in the pipeline definition with the following traceback:
  File "_capture.py", line 953, in _wire_capture_graph
    out = op(*positional, **kw_nodes)
encountered:
nvImageCodec failure: '#3'
Current pipeline object is no longer valid."""


def test_a_dali_error_is_summed_up_by_its_operator_and_cause() -> None:
    assert _short_reason(RuntimeError(DALI_TEXT)) == (
        "RuntimeError: Error in CPU operator `nvidia.dali.ops.decoders.Image` "
        "encountered: nvImageCodec failure: '#3'"
    )


def test_any_other_error_keeps_its_first_lines() -> None:
    assert _short_reason(ValueError("bad shape\n\n(3, 4)\nmore\nmore")) == (
        "ValueError: bad shape (3, 4) more"
    )


def test_an_eager_steps_error_adds_its_cause() -> None:
    """DALI raises "An error happened during asynchronous execution" from the real error."""
    try:
        try:
            raise RuntimeError("nvImageCodec failure: '#4'")
        except RuntimeError as cause:
            raise RuntimeError("An error happened during asynchronous execution") from cause
    except RuntimeError as error:
        reason = _short_reason(error)
    assert reason == (
        "RuntimeError: An error happened during asynchronous execution "
        "(RuntimeError: nvImageCodec failure: '#4')"
    )
