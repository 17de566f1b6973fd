#!/usr/bin/env bash
# One short GPU lease, prepared: `make gpu-check` on a lent GPU machine (the device tool's
# H200), with everything it writes collected under $OUT. docs/gpu-check.md says how to call it.
#
#   bash tools/gpu_lease.sh prepare   # HERE, once, with PyPI reachable: the wheels the GPU
#                                     # machine lacks, into .whl/ (git-ignored via .git/info/exclude)
#   bash tools/gpu_lease.sh run       # THERE, through the device tool (carry: [".whl"]):
#                                     # installs .whl/ into /tmp/site, runs gpucheck, collects
#
# The GPU machine has no network and its own python3 (3.12) with torch, transformers, peft,
# accelerate, pyarrow, numpy, matplotlib, rich, psutil and nvidia-ml-py (KINDS.md); the
# project's pins do not apply there. What it lacks travels as wheels (about 50 MiB of the
# 64 a call may carry): pydantic (the config), DeepSpeed (the ZeRO jobs), torchao (FSDP2's
# NF4 base) and bitsandbytes (QLoRA on DDP, 41 MiB). zero3_offload is left out: DeepSpeed's
# CPU Adam compiles with g++ at first use, minutes of the lease.
#
# The run must end inside one device call (at most 600 s; budget 540 s): every stage has its
# own timeout, and whatever was written is collected even when a stage runs out.
set -uo pipefail

MODE="${1:-run}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2

# Pinned as pyproject.toml pins them (pydantic-core, annotated-types and typing-inspection
# as pydantic 2.14.3 requires; hjson for DeepSpeed).
# liger-kernel as the GPU image pins it (images/bnb/requirements.lock; Triton is torch's).
WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
        typing-inspection==0.4.5 torchao==0.18.0 hjson==3.1.0 bitsandbytes==0.50.2
        liger-kernel==0.8.5)
DEEPSPEED=deepspeed==0.19.8
# Most telling first: a lease that runs out keeps the rows it finished (report.json).
STRATEGIES="${GPULEASE_ONLY:-ddp fsdp zero3 mfu_8b lora fsdp_qlora zero2 fsdp_ac fsdp_lora qlora zero3_lora}"
GPUCHECK_ARGS="${GPULEASE_ARGS:---layers 8 --steps 6 --timeout 120}"
BUDGET_S="${GPULEASE_BUDGET_S:-480}"

prepare() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    rm -rf .whl && mkdir -p .whl
    local py="${ROOT}/.venv/bin/python"
    [ -x "$py" ] || py=python3
    "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}" || return 1
    # DeepSpeed publishes an sdist only: its wheel is pure Python (ops build at run time).
    "$py" -m pip wheel --no-deps --no-build-isolation -w .whl "$DEEPSPEED" || return 1
    du -ch .whl/* | tail -n 1
    echo "prepared: carry .whl in the device call (docs/gpu-check.md)"
}

run() {
    : "${OUT:?run on the device machine, where \$OUT is set}"
    local t0=$SECONDS
    mkdir -p "$OUT/logs"
    exec > >(tee -a "$OUT/lease.log") 2>&1
    echo "gpu-lease: start $(date -u +%FT%TZ) in $ROOT"
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/nvidia-smi.txt" 2>&1
    if ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || echo "gpu-lease: wheel install failed"
    else
        echo "gpu-lease: no .whl/ carried: run 'bash tools/gpu_lease.sh prepare' here first"
    fi
    export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    export DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    python3 - > "$OUT/versions.txt" 2>&1 <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
for name in ("transformers", "peft", "accelerate", "pydantic", "deepspeed", "torchao", "pynvml",
             "triton", "liger_kernel"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING", type(exc).__name__, exc)
PY
    cat "$OUT/versions.txt"
    local left=$((BUDGET_S - (SECONDS - t0)))
    # shellcheck disable=SC2086
    timeout -k 10 "$left" python3 -m tools.gpucheck --out "$OUT/gpucheck" --only $STRATEGIES \
        $GPUCHECK_ARGS > "$OUT/gpucheck.log" 2>&1
    echo "gpu-lease: gpucheck exit $? after $((SECONDS - t0)) s"
    tail -n 40 "$OUT/gpucheck.log"
    # The model, data and run folders stay behind (weights are not collected); the report,
    # the PNG, the calibration file, the profiler traces and the per-job logs come back.
    rm -rf "$OUT/gpucheck/assets" "$OUT/gpucheck/runs"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$OUT/nvidia-smi.txt" 2>&1
    echo "gpu-lease: done $(date -u +%FT%TZ), $((SECONDS - t0)) s"
    find "$OUT" -maxdepth 3 | head -n 60
}

case "$MODE" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash tools/gpu_lease.sh prepare|run" >&2; exit 2 ;;
esac
