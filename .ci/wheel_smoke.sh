#!/usr/bin/env bash
# The package as users receive it: build the sdist and the wheel (from the sdist) out of this
# checkout, install each non-editable into a fresh venv, and from a directory outside the
# checkout run the main job briefly, import every public name, check that the pytest plugin
# registers and that the command lines answer --help.
# Usage: .ci/wheel_smoke.sh PYTHON_WITH_BUILD   (a Python that has `build`, setuptools, wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
builder="$1"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dist="$work/dist"

# a clean copy of what git tracks: the build sees no egg-info, venv or cache of this checkout
mkdir -p "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$work/src"
(cd "$work/src" && "$builder" -m build --no-isolation --outdir "$dist" .)
wheel="$(ls "$dist"/*.whl)"
sdist="$(ls "$dist"/*.tar.gz)"
echo "built $(basename "$wheel") and $(basename "$sdist")"

python -m venv --clear "$work/venv"
"$work/venv/bin/pip" install --quiet "$wheel" pytest
run="$work/run"
mkdir -p "$run"
cd "$run"  # outside the checkout: nothing of it is importable from here
py="$work/venv/bin/python"

"$py" - "$root" <<'PY'
import importlib, sys
from pathlib import Path

import loader
checkout = Path(sys.argv[1]).resolve()
where = Path(loader.__file__).resolve()
assert checkout not in where.parents, f"loader imported from the checkout: {where}"
for name in loader.__all__:
    getattr(loader, name)
for module in ("loader.tars", "loader.testing", "loader.sample", "workers.sources", "ipc.wire"):
    importlib.import_module(module)
print(f"imported {len(loader.__all__)} public names of loader {loader.__version__} from {where.parent}")
PY

version="$("$py" -m loader --version)"
echo "$version"
wheel_version="$(basename "$wheel" | cut -d- -f2)"
[[ "$version" == *" $wheel_version" ]] || { echo "--version says '$version', the wheel is $wheel_version"; exit 1; }
"$py" -m loader.tars --help > /dev/null
"$py" -m loader doctor --help > /dev/null
"$py" -m loader --epochs 1 --batch-size 32 --no-progress

cat > test_plugin_registers.py <<'PY'
def test_the_fixture_comes_from_the_installed_plugin(leak_check, request):
    names = {getattr(p, "__name__", "") for p in request.config.pluginmanager.get_plugins()}
    assert "loader.testing" in names, sorted(names)
PY
"$py" -m pytest -q -p no:cacheprovider test_plugin_registers.py

# the sdist installs too (built by pip from the source archive)
"$work/venv/bin/pip" install --quiet --no-deps --force-reinstall "$sdist"
"$py" -c "import loader, workers.sources, loader.tars; print('sdist install imports', loader.__version__)"
echo "wheel smoke: passed"
