#!/usr/bin/env bash
# The GPU checks in one script, for a machine with an NVIDIA GPU, CuPy, torch and pytest (no DALI
# needed): the GPU tests, then the GPU transport benchmark. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PYTHON" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
# the package is not installed there, so load its pytest plugin (leak_check) by module name
timeout 240 "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider -p loader.testing -rs
timeout 120 "$PYTHON" -m bench.gpu_transport
