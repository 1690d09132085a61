#!/usr/bin/env bash
# The GPU side of vattn on a bare CUDA machine (no network needed), in one command from the repo root:
#
#   bash benchmarks/gpu_suite.sh               # everything (about 15-30 min on an H100)
#   SKIP_BENCH=1 bash benchmarks/gpu_suite.sh  # tests only
#
# and send back the $OUT folder (default ./gpu-out): a log per step (versions.log first), kernels.txt,
# summary.txt and gpu_results.tgz.
#
# Needs python3 (or $PYTHON; .venv/bin/python when there is one) with a CUDA build of torch,
# cuda-bindings, pytest, pytest-timeout, hypothesis, tqdm and matplotlib; flash-attn and
# flashinfer are optional: put their wheels (and what they need) in .whl/ and they are installed
# first. Steps, each with its own status and log:
#   build     both native libraries (the Makefile's own rules) and the tests' fake libcuda;
#   versions  the driver, torch, CUDA and kernel libraries;
#   kernels   each GPU kernel made once on a small cache: `available`, or `unavailable: <why>`
#             (a library that is missing or cannot build its kernels, FlashInfer without nvcc);
#   cuda      tests/test_cuda.py on the GPU;
#   fake      the CI tests of the CUDA logic (fake driver, engine dry run) beside the real driver;
#   rest      the rest of the test suite, when the default model is in the cache (else skipped);
#   bench     Table 7, Fig. 10, Fig. 8 and Fig. 9 into paper_repro/results/<device>/.
# Without a GPU it stops after `versions`, saying so, with status 0. The exit status is 1 when a
# step failed; a skipped step or an unavailable kernel library is not a failure.
set -uo pipefail

out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
: >"$out/summary.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
failed=0

record() { # step status
    printf '%-9s %s\n' "$1" "$2" | tee -a "$out/summary.txt"
}

run_step() { # step command...: runs it with its log in $out/<step>.log and records its status
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    if ((code == 0)); then
        record "$name" ok
    else
        record "$name" "FAILED (exit $code, see $name.log)"
        failed=1
    fi
    return "$code"
}

finish() {
    echo "== summary"
    cat "$out/summary.txt"
    exit "$failed"
}

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# -o: the libraries need torch, not the Makefile's CPU venv.
run_step build make --no-print-directory -j4 -o .venv/.installed PY="$PYTHON" native || finish

versions() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    echo "nvcc: $(command -v nvcc || echo 'not found (FlashInfer cannot build kernels it has no cubins for)')"
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name())
for name in ("cuda-bindings", "flash-attn", "flash-attn-4", "flashinfer-python", "flashinfer-cubin"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
try:
    print("flash_attn.cute (FlashAttention 4, not supported by vattn):", importlib.util.find_spec("flash_attn.cute") is not None)
except ModuleNotFoundError:
    print("flash_attn.cute (FlashAttention 4, not supported by vattn): False")
EOF
}
run_step versions versions

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "No CUDA GPU here (torch.cuda.is_available() is False): nothing more to run. The CUDA logic's CI"
    echo "tests run in make test on the fake driver; this suite is for a machine with a GPU."
    record gpu "none: stopped"
    finish
fi

probe_kernels() {
    "$PYTHON" - <<'EOF'
"""Each GPU kernel made once on a small bfloat16 cache (FlashInfer's build its kernels then)."""
import traceback

from vattn import KVCache, KVCacheConfig, UnavailableError
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel

for name in ("flash_attn", "flashinfer_single", "flashinfer_paged", "paged_flash_attn", "paged_flashinfer"):
    try:
        if name.startswith("paged"):
            block = 256 if name == "paged_flash_attn" else 16
            cache = PagedKVCache(PagedKVCacheConfig(2, 8, 128, 2, 4096, dtype="bfloat16", block_size=block, device="cuda"))
            make_paged_kernel(name, cache, 32)
        else:
            with KVCache(KVCacheConfig(2, 8, 128, 2, 4096, dtype="bfloat16", backend="cuda", page_size=2 << 20)) as cache:
                make_kernel(name, cache, 32)
        print(f"{name}: available")
    except UnavailableError as exc:
        print(f"{name}: unavailable: {exc}")
    except Exception as exc:  # a kernel that loads but breaks: the cuda tests will say more
        traceback.print_exc()
        print(f"{name}: ERROR: {type(exc).__name__}: {exc}")
EOF
}
run_step kernels probe_kernels
grep -E '^[a-z_]+: ' "$out/kernels.log" >"$out/kernels.txt"

pytest_step() { # step pytest-arguments...
    run_step "$1" "$PYTHON" -m pytest -q -rs -p no:cacheprovider "${@:2}"
}
FAKE_TESTS=(tests/test_cuda_fake.py tests/test_fake_cuda_bites.py tests/test_cuda_dry_run.py tests/test_gpu_kernel_guards.py)
pytest_step cuda tests/test_cuda.py
pytest_step fake "${FAKE_TESTS[@]}"
if "$PYTHON" -c "import sys; from serving.default_model import default_model_dir, is_converted; sys.exit(0 if is_converted(default_model_dir()) else 1)" 2>/dev/null; then
    ignored=()
    for test in tests/test_cuda.py "${FAKE_TESTS[@]}"; do ignored+=(--ignore "$test"); done
    pytest_step rest tests "${ignored[@]}"
else
    record rest "skipped: the default model is not in the cache (run 'python -m serving.default_model' with network, or carry \$VATTN_CACHE_DIR)"
fi

if [[ -z "${SKIP_BENCH:-}" ]]; then
    # prefill and decode run every CUDA kernel family on either cache; a kernel library that is
    # not here is a skipped row, and the model tables are skipped without the model.
    for bench in "paper_repro.gpu_allocation" "paper_repro.latency_hiding --backend cuda" "paper_repro prefill" \
        "paper_repro decode"; do
        # shellcheck disable=SC2086  # the benchmark's arguments are meant to split
        run_step "bench-${bench//[ .]/-}" "$PYTHON" -m $bench
    done
    tar czf "$out/gpu_results.tgz" --exclude=paper_repro/results/cpu benchmarks/results/gpu_* paper_repro/results \
        2>/dev/null
fi
finish
