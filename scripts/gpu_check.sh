#!/bin/bash
# The GPU checks as one prepared run (issue 67): the GPU tests, then bench.gpu (eager against decode
# graphs, HF generate, the logprob mismatch, a colocated push). Written for a lent device machine whose
# image holds torch, transformers and pytest but not this project's other needs: those travel as
# wheels in .whl/ (fetch them here first with `scripts/gpu_check.sh --fetch-wheels`), installed into
# /tmp/site. Logs go to $OUT (or out/gpu_check) as they are written.
#
#   scripts/gpu_check.sh --fetch-wheels   # here, with a package registry: the wheels into .whl/
#   scripts/gpu_check.sh                  # there: install the wheels, run the tests and the bench
set -uo pipefail

WHEELS=(pyzmq msgspec xxhash fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn
        prometheus-client peft wandb)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    for w in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$w" || echo "no wheel for $w"
    done
    exit 0
fi

out=${OUT:-out/gpu_check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 WANDB_MODE=offline
nvidia-smi -L | tee "$out/device.txt"
timeout 420 python3 -m pytest -q -m gpu tests/gpu -rs 2>&1 | tee "$out/pytest.log"
timeout 300 python3 -m bench.gpu 2>&1 | tee "$out/bench_gpu.log"
