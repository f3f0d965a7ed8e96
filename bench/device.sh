#!/usr/bin/env bash
# The accelerator check, prepared to run once inside a short device lease (random weights of
# SmolLM2-135M's shapes: the GGUF does not travel, and the values do not matter to speed).
#
#   bash bench/device.sh fetch   # here, once: the one wheel the device image lacks -> .whl/
#   bash bench/device.sh run     # there (carry .whl): results into $OUT (default runs/device)
#   QUICK=1 BATCHES=2 bash bench/device.sh run   # a smoke run of the script itself, on CPU
#
# What it measures, each in one process after warm-up with compile time apart:
#   bench.decode_micro  the full-depth decode step, dense f32 layer weights vs Q4_1 blocks
#                       (quant.BlockQ, how ee-jax serves a Q4_1 GGUF), batch 1-128;
#   bench.per_row_step  one decode step: never / per_row with no row, half, all rows leaving at
#                       layer 10 / `all` with every row leaving, at batch 8, 32, 128, 256;
#   bench.early_exit    forced-exit ceiling and the overhead of exits never taken, batch 1-64;
#   bench.attention     attention alone, 30 layers of decode over a 32-page bucket (rows ~250
#                       tokens): reference vs xla vs pallas_gpu (JAX's Triton paged kernel,
#                       only where JAX sees a GPU) vs layout_copy (a lower bound of the Pallas
#                       wrapper's per-layer copy of our cache into the kernel's layout), absolute
#                       ms per step at batch 8, 32, 128, 256. Runs first (a few seconds); a failure
#                       there is logged and the script goes on.
# On a GPU a layer over B/2 rows is expected to cost about what it costs over B until B is large
# (weights are read once per layer whatever the rows; not measured yet): the half-rows-leave
# column says from which batch on compaction pays there; set `min_row_bucket` from it.
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
    if [ -n "${QUICK:-}" ]; then step_args="--steps 2 --repeats 1"; ee_args="--batches 1 --repeats 2"
        attn_args="--steps 1 --repeats 1"; micro_args="--repeats 1"
    else step_args="--steps 20 --repeats 5"; ee_args="--batches 1 8 32 64"
        attn_args="--steps 10 --repeats 5"; micro_args="--repeats 7"; fi
    attn_backends="reference xla"
    if python3 -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
        attn_backends="reference xla pallas_gpu layout_copy"
    fi
    {
        date -u
        python3 -c "import jax; print(jax.__version__, jax.devices())"
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
        python3 -m bench.attention --backends $attn_backends \
            --batches ${ATTN_BATCHES:-${BATCHES:-8 32 128 256}} $attn_args \
            || echo "bench.attention failed (exit $?); the rest still runs"
        python3 -m bench.decode_micro --step --batches ${BATCHES:-1 8 32 128} --attention xla \
            --layouts in blocks $micro_args \
            || echo "bench.decode_micro failed (exit $?); the rest still runs"
        for b in ${BATCHES:-8 32 128 256}; do
            python3 -m bench.per_row_step --random --batch "$b" $step_args
        done
        python3 -m bench.early_exit --random --skip-real $ee_args --out "$out/early_exit.md"
    } 2>&1 | tee "$out/device.log"
    ;;
*)
    echo "usage: bash bench/device.sh fetch|run" >&2
    exit 2
    ;;
esac
