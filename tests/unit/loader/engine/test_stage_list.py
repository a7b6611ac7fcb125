"""A worker's timing stages are listed once (``ipc.wire.STAGES`` and ``MEASURES``): the wire
record and its bytes, the trainer's totals and windows and ``loader.stats()``'s ``Stages`` are made
from that list, so a new stage is one edit there (and the code that measures it)."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path

from ipc import wire
from loader.engine import _stats
from loader.observe import _advice, _diagnose

ROOT = Path(__file__).resolve().parents[4]


def test_every_consumer_takes_its_stage_list_from_the_wire() -> None:
    times = (*wire.STAGES, *wire.MEASURES)
    # the wire record: started_ns, then each time but those a BatchReady carries itself
    assert wire.StageTimes._fields == wire.TIME_FIELDS
    carried = tuple(f"{name}_ns" for name in times if name not in wire.IN_BATCH)
    assert ("started_ns", *carried) == wire.TIME_FIELDS
    for name in wire.IN_BATCH:
        assert f"{name}_ns" in {f.name for f in dataclasses.fields(wire.BatchReady)}
    # its packed format: one int64 per field
    assert wire.TIMING.size == 8 * len(wire.StageTimes._fields)
    # the trainer's: loader.stats()'s stage names and Stages, the totals' positions
    assert _stats.STAGES is wire.STAGES
    assert _advice.STAGES is wire.STAGES and _diagnose.STAGES is wire.STAGES
    assert tuple(f.name for f in dataclasses.fields(_stats.Stages)) == ("batches", *times)
    assert len(_stats.WorkerTrack(4).totals) == 1 + len(times)


def test_the_bytes_and_the_positions_did_not_move() -> None:
    """Today's list, as it was written out by hand before it was declared once."""
    assert wire.STAGES == ("load", "dali", "blocked", "publish", "idle")
    assert wire.TIMING.format == "<8q"
    values = (10**15, 1, 2, 3, 4, 5, 6, 7)
    assert wire.TIMING.pack(*wire.StageTimes(*values)) == struct.pack("<8q", *values)
    track = _stats.WorkerTrack(4)
    timing = wire.StageTimes(
        started_ns=10**12,
        load_ns=10**6,
        dali_ns=2 * 10**6,
        publish_ns=3 * 10**6,
        idle_ns=4 * 10**6,
        read_ns=5 * 10**6,
        read_cpu_ns=6 * 10**6,
        cpu_ns=7 * 10**6,
    )
    track.add(0, 0, 8 * 10**6, timing)
    assert track.total() == _stats.Stages(1, 0.001, 0.002, 0.008, 0.003, 0.004, 0.005, 0.006, 0.007)
    assert _stats.batch_end(timing, 8 * 10**6) == 10**12 + 14 * 10**6


#: Run with a stage added to ipc/wire.py's list (between dali and blocked): what it changes.
_WITH_A_NEW_STAGE = r"""
import json, sys, types
from pathlib import Path
path = Path(sys.argv[1])
text = path.read_text(encoding="utf-8")
line = 'STAGES = ("load", "dali", "blocked", "publish", "idle")'
assert text.count(line) == 1
module = types.ModuleType("ipc.wire")
module.__file__ = str(path)
sys.modules["ipc.wire"] = module
exec(compile(text.replace(line, line.replace('"dali", ', '"dali", "decode", ')), path, "exec"),
     module.__dict__)
from ipc import wire
from loader.engine._stats import Stages, Timeline, WorkerTrack

times = wire.StageTimes(started_ns=1000, load_ns=1, dali_ns=2, decode_ns=40, publish_ns=3)
batch = wire.BatchReady(0, 0, 0, 0, 1, (), 0, 0, 7, 0, timing=times)
codec = wire.BatchCodec()
frame = codec.encode(batch)
size, kind = wire.FRAME.unpack_from(frame)
decoded = codec.decode(kind, frame, wire.FRAME.size, wire.FRAME.size + size)
timeline = Timeline(1)
timeline.batch(0, 0, batch)
track = timeline.workers[0]
print(json.dumps({
    "fields": list(wire.StageTimes._fields),
    "timing_size": wire.TIMING.size,
    "round_trip": decoded == batch,
    "stages": [f for f in Stages.__dataclass_fields__],
    "totals": track.totals,
    "window_decode": track.window(1000 + 1 + 2, 1000 + 1 + 2 + 40).decode,
}))
"""


def test_a_stage_added_to_the_list_reaches_every_consumer() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITH_A_NEW_STAGE, str(ROOT / "ipc" / "wire.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["fields"] == [
        "started_ns",
        "load_ns",
        "dali_ns",
        "decode_ns",
        "publish_ns",
        "idle_ns",
        "read_ns",
        "read_cpu_ns",
        "cpu_ns",
    ]
    assert seen["timing_size"] == 8 * 9 and seen["round_trip"]
    assert seen["stages"] == [
        "batches",
        "load",
        "dali",
        "decode",
        "blocked",
        "publish",
        "idle",
        "read",
        "read_cpu",
        "cpu",
    ]
    assert seen["totals"] == [1, 1, 2, 40, 7, 3, 0, 0, 0, 0]
    # laid out on the time line after dali and before blocked: the whole window is decode
    assert seen["window_decode"] == 40 / 1e9
