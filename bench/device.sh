#!/usr/bin/env bash
# The accelerator check, prepared to run once inside a short device lease (random weights of
# SmolLM2-135M's shapes: the GGUF does not travel, and the values do not matter to speed).
#
#   bash bench/device.sh fetch   # here, once: the one wheel the device image lacks -> .whl/
#   bash bench/device.sh run     # there (carry .whl): results into $OUT (default runs/device)
#   QUICK=1 BATCHES=2 bash bench/device.sh run   # a smoke run of the script itself, on CPU
#
# What it measures, each in one process after warm-up with compile time apart:
#   bench.kernels attention  attention alone, 30 layers of decode over a 32-page bucket (rows
#                       ~250 tokens): reference vs xla vs pallas_gpu (JAX's Triton paged kernel,
#                       only where JAX sees a GPU) vs layout_copy (a lower bound of the Pallas
#                       wrapper's per-layer copy of our cache into the kernel's layout), ms per
#                       step at batch 8, 32, 128, 256. Runs first; a failure is logged and the
#                       script goes on.
#   bench.step          one decode step against full depth (`early_exit=False`'s program):
#                       policies all / per_row with checks never firing, forced exits at L/3
#                       and 2L/3 (the ceiling), weight dtypes, attention backends, the layers
#                       stacked against per layer (the GPU default: no copy of a layer's
#                       weights before its GEMMs, docs/architecture.md), batch 1-128.
# Batch 1 against batch 2: compiled here without a GPU, XLA's GPU compiler rewrites a one-row
# bf16 product into a weight-sized elementwise product and a reduction (3x the weight bytes;
# docs/roofline.md, "CUDA"), two rows into a GEMM, so the engine's GPU steps
# start at two rows (`scheduler.default_batch_buckets`). bench.step runs the runner at exactly
# B rows: if batch 1's full-depth step is faster than batch 2's on the device, that rule goes.
# On a GPU, `per_row` runs one stage (no row compaction: `served_min_row_bucket`; a
# layer over B/2 rows is expected to cost what it costs over B until B is large). Compare its
# forced-exit rows at batch 128 with the CPU's to see whether that holds on the chip.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
fetch)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d .whl "gguf>=0.10"
    ls -l .whl
    ;;
run)
    out="${OUT:-runs/device}"
    mkdir -p "$out"
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    export PYTHONUNBUFFERED=1
    if [ -n "${QUICK:-}" ]; then step_args="--rounds 1 --steps 2"; attn_args="--steps 1 --repeats 1"
    else step_args="--rounds 5 --steps 20"; attn_args="--steps 10 --repeats 5"; fi
    attn_backends="reference xla"
    if python3 -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
        attn_backends="reference xla pallas_gpu layout_copy"
    fi
    {
        date -u
        python3 -c "import jax; print(jax.__version__, jax.devices())"
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
        python3 -m bench.kernels attention --backends $attn_backends \
            --batches ${ATTN_BATCHES:-${BATCHES:-8 32 128 256}} $attn_args \
            || echo "bench.kernels attention failed (exit $?); the rest still runs"
        python3 -m bench.step --random --batches ${BATCHES:-1 2 8 32 128} $step_args \
            --layer-layouts stacked per_layer \
            --out "$out/step.md" || echo "bench.step failed (exit $?)"
    } 2>&1 | tee "$out/device.log"
    ;;
*)
    echo "usage: bash bench/device.sh fetch|run" >&2
    exit 2
    ;;
esac
