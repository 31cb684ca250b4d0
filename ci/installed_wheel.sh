#!/usr/bin/env bash
# What users install, tested where users run it (issue 39): build the sdist and the wheel (`python -m build`, the
# wheel made from the sdist), install the wheel non-editable into a fresh venv (torch first: this machine's pip finds
# the CPU wheel locally), then from a folder outside the repository: ci/test_installed.py (not the source tree; every
# module imports; the wheel, the sdist and the install hold every module, the five recipes and LICENSE; the version),
# the main job `hf-accum train lora_sft`, `hf-accum probe` and `hf-accum probe --estimate`.
# Run alone: `bash ci/installed_wheel.sh` (PYTHON picks the interpreter for the fresh venv; KEEP_WORK=1 keeps the
# work folder). .ci/run calls it after the README's test command.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hf_accum_wheel.XXXXXX")"
case "$WORK/" in "$ROOT"/*) echo "work folder $WORK is inside the repository" >&2; exit 1;; esac
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset PYTHONPATH  # nothing of the source tree may leak into the installed runs
T_START=$SECONDS

step() {  # step NAME COMMAND...: runs it and prints its duration
    local name=$1 t0=$SECONDS
    shift
    echo "=== $name"
    "$@"
    echo "=== $name: $((SECONDS - t0)) s"
}

build() {
    local builder="$PYTHON"
    if ! "$builder" -m build --version >/dev/null 2>&1; then  # run alone, outside the dev venv: a venv for `build`
        "$PYTHON" -m venv "$WORK/build-venv"
        "$WORK/build-venv/bin/python" -m pip install -q build >"$WORK/build-venv.log" 2>&1 \
            || { cat "$WORK/build-venv.log"; return 1; }
        builder="$WORK/build-venv/bin/python"
    fi
    "$builder" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; return 1; }
    tail -n 1 "$WORK/build.log"
    ls -l "$WORK/dist"
}

install() {
    local wheels=("$WORK"/dist/hf_accum-*.whl) pip="$WORK/venv/bin/python -m pip"
    "$PYTHON" -m venv "$WORK/venv"
    # --no-compile: Python compiles what it imports anyway; byte-compiling all of torch up front costs CI time
    { $pip install --no-compile torch==2.13.0 && $pip install --no-compile "${wheels[0]}[recipes]" "pytest>=8"; } \
        >"$WORK/install.log" 2>&1 \
        || { cat "$WORK/install.log"; return 1; }
    $pip show hf-accum | grep -E '^(Name|Version|Location):'
}

step "build sdist + wheel" build
step "install the wheel into a fresh venv" install

. "$WORK/venv/bin/activate"
mkdir -p "$WORK/run" && cd "$WORK/run"
[ "$(command -v hf-accum)" = "$WORK/venv/bin/hf-accum" ]
cp "$ROOT/ci/test_installed.py" .
step "installed package tests (ci/test_installed.py)" env HF_ACCUM_SOURCE="$ROOT" HF_ACCUM_DIST="$WORK/dist" \
    python -m pytest -q -p no:cacheprovider test_installed.py
step "hf-accum train lora_sft" hf-accum train lora_sft output_dir="$WORK/run/lora_sft"
test -s "$WORK/run/lora_sft/run_summary.json"
step "hf-accum probe" hf-accum probe --json "$WORK/run/probe.json"
python -c "from hf_accum.tiny import build_model; build_model().config.save_pretrained('tiny-config')"
step "hf-accum probe --estimate" hf-accum probe --estimate --model tiny-config --device cpu --device-memory 64MiB
deactivate

echo "=== installed wheel: all steps passed in $((SECONDS - T_START)) s"
if [ -z "${KEEP_WORK:-}" ]; then rm -rf "$WORK"; else echo "work folder kept: $WORK"; fi
