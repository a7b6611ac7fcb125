#!/usr/bin/env bash
# This loader beside LitData and MosaicML Streaming on one S3 server (bench/anchors.py).
# Run from the repository root, in the project's environment (the test extra installed):
#   bash bench/anchors.sh                      # 1,000 x 20 and 10,000 x 4 samples
#   bash bench/anchors.sh --size 200x20        # any other size; --help lists the options
# The anchors go to .venv-anchors, made on the first run from bench/anchors-requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
anchors=.venv-anchors
if [ ! -x "$anchors/bin/python" ] || ! "$anchors/bin/python" -c "import litdata, torch, polars, pyarrow, s3fs" 2>/dev/null; then
    python -m venv "$anchors"
    "$anchors/bin/pip" install -q -r bench/anchors-requirements.txt
    # (torchvision, pulled in by mosaicml-streaming, is a CUDA build that cannot load here)
    "$anchors/bin/pip" uninstall -q -y torchvision || true
fi
datasets=.venv-datasets
case " $* " in *" --format parquet "*|*" --format=parquet "*)
    if [ ! -x "$datasets/bin/python" ] || ! "$datasets/bin/python" -c "import datasets, torchdata, s3fs, PIL, torch" 2>/dev/null; then
        python -m venv "$datasets"
        "$datasets/bin/pip" install -q -r bench/datasets-requirements.txt
    fi
esac
exec python -m bench.anchors --anchors-python "$anchors/bin/python" "$@"
