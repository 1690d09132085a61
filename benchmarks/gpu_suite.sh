#!/usr/bin/env bash
# vattn's GPU check on an H100/H200 (or any CUDA GPU), no network needed. From the repo root, run:
#
#   bash benchmarks/gpu_suite.sh
#
# then send back the folder gpu-out/ (or only gpu-out/gpu_results.tgz, which holds all of it:
# every log, versions.txt, kernels.txt, summary.txt and the results under paper_repro/results/).
# About 15-30 min on an H100; SKIP_BENCH=1 runs the builds and tests only (a few minutes).
#
# Settings (environment): OUT (the folder, default ./gpu-out); PYTHON (default .venv/bin/python
# when there is one, else python3: it needs a CUDA build of torch, plus cuda-bindings, pytest,
# pytest-timeout, hypothesis, tqdm, matplotlib and what the project imports); SKIP_BENCH=1;
# PROBE_TIMEOUT (seconds per kernel-library probe, default 1800: FlashInfer may compile).
# flash-attn and flashinfer are optional: put their wheels (with flashinfer-cubin and the
# matching flashinfer-jit-cache, so FlashInfer needs no nvcc) in .whl/ and they are installed first.
#
# Steps, each with its own status (summary.txt) and log in $OUT:
#   wheels    .whl/*.whl installed into a folder on PYTHONPATH (only when there are any);
#   build     vattn/libvattn_native.so and vattn/libvattn_ops.so (and the tests' fake libcuda)
#             by the Makefile's own rules against $PYTHON's torch, then loaded once;
#   versions  driver, torch, CUDA, cuda-bindings, flash-attn, flash-attn-4, flashinfer, nvcc;
#   (no GPU: the suite says so here and stops, with status 0 unless a step above failed)
#   kernels   flash_attn, flash_attn.cute and flashinfer each probed in its own process (FlashInfer
#             plans and runs a float16 decode and prefill, building or loading its kernels):
#             `available` or `unavailable: <why>` in kernels.txt, never a failure;
#   cuda      tests/test_cuda.py on the GPU (cuda_tests.log): the GPU verdict;
#   fake      the other tests/test_cuda*.py and the fake-driver tests (fake_tests.log; without the
#             default model, those marked needs_model are deselected);
#   rest      the rest of the tests, only when the default model is in the cache (else skipped);
#   bench-*   Table 7, Fig. 10, Fig. 8 and Fig. 9 into paper_repro/results/<device>/.
# The exit status is 1 when a step failed; skipped steps and unavailable libraries are not failures.
# shellcheck disable=SC2329  # (this whole file) functions run through run_step are used
set -uo pipefail

root=$PWD
out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
: >"$out/summary.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
failed=0

record() { # step status: one line of the summary
    printf '%-20s %s\n' "$1" "$2" | tee -a "$out/summary.txt"
}

logged() { # log command...: runs the command with its output also in $out/<log>; its exit status
    local log=$1
    shift
    echo "== $*"
    "$@" 2>&1 | tee "$out/$log"
    return "${PIPESTATUS[0]}"
}

recorded() { # step log status [note]: records ok, or FAILED (a real failure: the suite's status is 1)
    local note=${4:+ ($4)}
    if (($3 == 0)); then
        record "$1" "ok$note"
    else
        record "$1" "FAILED (exit $3, see $2)$note"
        failed=1
    fi
    return "$3"
}

run_step() { # step log command...
    logged "${@:2}"
    recorded "$1" "$2" $?
}

finish() { # the tarball of $out and the results, the summary, and the exit status
    local tarball="${TMPDIR:-/tmp}/gpu_results.$$.tgz" # written outside $out, which it holds
    if tar czf "$tarball" --exclude=gpu_results.tgz --exclude=paper_repro/results/cpu \
        -C "$out" . -C "$root" paper_repro/results; then
        mv "$tarball" "$out/gpu_results.tgz"
    else
        rm -f "$tarball" "$out/gpu_results.tgz"
        echo "note: could not write $out/gpu_results.tgz (send the folder $out instead)"
    fi
    echo
    echo "== summary ($out/summary.txt; send back $out)"
    cat "$out/summary.txt"
    exit "$failed"
}

if ! command -v "$PYTHON" >/dev/null; then
    record python "FAILED: no '$PYTHON' (set PYTHON to a python with a CUDA build of torch)"
    failed=1
    finish
fi

# --- wheels ---------------------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
    site=/tmp/vattn-gpu-site
    run_step wheels wheels.log "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
fi

# --- build ----------------------------------------------------------------------------------
load_libraries() {
    "$PYTHON" -c 'import ctypes, torch; ctypes.CDLL("vattn/libvattn_native.so"); torch.ops.load_library("vattn/libvattn_ops.so"); print("both libraries load")'
}

build() {
    # The Makefile's rules (its flags, -march=native included), with $PYTHON's torch; -o: never
    # the Makefile's CPU venv (.venv/.installed), whose rule would install torch from the network.
    local make_args=(--no-print-directory -j"$(nproc 2>/dev/null || echo 4)" -o .venv/.installed PY="$PYTHON")
    command -v make >/dev/null || {
        echo "make is not installed (it and a C/C++ compiler build the native libraries)"
        return 1
    }
    make "${make_args[@]}" native || return
    load_libraries && return
    # Built earlier against another torch: compile the operators again (-W: as if their sources changed).
    echo "vattn/libvattn_ops.so does not load with this torch: building it again"
    local sources=(native/*.cpp)
    make "${make_args[@]}" "${sources[@]/#/-W}" vattn/libvattn_ops.so && load_libraries
}
run_step build build.log build

# --- versions -------------------------------------------------------------------------------
versions() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv ||
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    echo "nvcc: $(command -v nvcc || echo 'not found (FlashInfer cannot build kernels it has no cubins for)')"
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import importlib.util
import platform

print("python", platform.python_version())
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("cuda-bindings", "cuda-python", "flash-attn", "flash-attn-4", "flashinfer-python",
             "flashinfer-cubin", "flashinfer-jit-cache"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
try:
    found = importlib.util.find_spec("flash_attn.cute") is not None
except ModuleNotFoundError:  # no flash_attn at all
    found = False
except Exception as exc:  # flash_attn is there but fails to import
    found = f"False ({type(exc).__name__}: {exc})"
print("flash_attn.cute (FlashAttention 4, not used by vattn):", found)
EOF
}
run_step versions versions.txt versions

gpu_check() { # prints why there is no GPU; status 0 when there is one
    "$PYTHON" -c '
import sys
try:
    import torch
except Exception as exc:
    sys.exit(f"torch does not import with {sys.executable}: {type(exc).__name__}: {exc}")
if not torch.cuda.is_available():
    sys.exit(f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
' 2>&1
}
if ! why=$(gpu_check); then
    echo
    echo "NO GPU HERE: $why."
    echo "Nothing more to run: this suite is for a machine with a CUDA GPU (the CUDA logic's CI tests"
    echo "run in 'make test' on the fake driver). Stopping after the build and versions steps."
    record gpu "none: stopped here (${why})"
    finish
fi

# --- kernels --------------------------------------------------------------------------------
PROBE='
import sys
import traceback

import torch


def flash_attn():
    from flash_attn import flash_attn_with_kvcache

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float16, device="cuda")

    lengths = torch.tensor([100], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(rand(1, 1, 8, 128), rand(1, 256, 2, 128), rand(1, 256, 2, 128), cache_seqlens=lengths)


def flash_attn_cute():
    import flash_attn.cute  # noqa: F401  (FlashAttention 4: imported only, vattn does not use it)


def flashinfer():
    import flashinfer

    heads, kv_heads, dim, page = 8, 2, 128, 16  # one request: 2 pages, 21 tokens

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    kv = tuple(torch.randn(2, page, kv_heads, dim, dtype=torch.float16, device="cuda") for _ in range(2))
    table = (i32([0, 2]), i32([0, 1]), i32([5]))
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    decode.plan(*table, heads, kv_heads, dim, page, q_data_type=torch.float16)
    decode.run(torch.randn(1, heads, dim, dtype=torch.float16, device="cuda"), kv)
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    prefill.plan(i32([0, 4]), *table, heads, kv_heads, dim, page, causal=True, q_data_type=torch.float16)
    prefill.run(torch.randn(4, heads, dim, dtype=torch.float16, device="cuda"), kv)


try:
    {"flash_attn": flash_attn, "flash_attn.cute": flash_attn_cute, "flashinfer": flashinfer}[sys.argv[1]]()
    torch.cuda.synchronize()
except Exception as exc:
    traceback.print_exc()
    reason = (str(exc).strip().splitlines() or [""])[0]
    print(f"PROBE unavailable: {type(exc).__name__}: {reason}")
    sys.exit(1)
print("PROBE available")
'

probe() { # library: one line, "<library>: available" or "<library>: unavailable: <why>"
    local library=$1 output code verdict runner=()
    command -v timeout >/dev/null && runner=(timeout "${PROBE_TIMEOUT:-1800}")
    output=$("${runner[@]}" "$PYTHON" -c "$PROBE" "$library" 2>&1)
    code=$?
    printf -- '-- %s (exit %s)\n%s\n' "$library" "$code" "$output" >>"$out/kernels.log"
    verdict=$(grep '^PROBE ' <<<"$output" | tail -n 1)
    if ((code == 124)); then
        verdict="PROBE unavailable: timed out after ${PROBE_TIMEOUT:-1800} s (building its kernels?)"
    elif [[ -z $verdict ]]; then
        verdict="PROBE unavailable: the probe died (exit $code), see kernels.log"
    fi
    echo "$library: ${verdict#PROBE }"
}
echo "== kernels: each library probed in its own process (kernels.log)"
: >"$out/kernels.log"
: >"$out/kernels.txt"
for library in flash_attn flash_attn.cute flashinfer; do
    line=$(probe "$library")
    echo "$line" | tee -a "$out/kernels.txt"
    status=${line#"$library: "}
    record "$library" "${status:0:100}"
done

# --- tests ----------------------------------------------------------------------------------
pytest_step() { # step log pytest-arguments...: recorded with pytest's counts (all skipped shows there)
    logged "$2" "$PYTHON" -m pytest -q -rs -p no:cacheprovider "${@:3}"
    local code=$? counts
    counts=$(grep -E '(passed|failed|skipped|errors?|no tests ran).* in [0-9.]+s' "$out/$2" | tail -n 1 |
        sed -E 's/^[= ]+|[= ]+$//g')
    recorded "$1" "$2" "$code" "$counts"
}
shopt -s nullglob
fake_tests=()
for test in tests/test_cuda*.py tests/test_fake_cuda*.py tests/test_gpu_kernel_guards.py; do
    [[ $test != tests/test_cuda.py ]] && fake_tests+=("$test")
done
shopt -u nullglob
model_check() { # prints where the default model is, or why it cannot be used; status 0 when it is there
    "$PYTHON" -c '
import sys
from serving.default_model import default_model_dir, is_converted
folder = default_model_dir()
sys.exit(0 if is_converted(folder) else f"{folder} holds no converted model")
' 2>&1 | tail -n 1
}
model_here=1
why=$(model_check) || model_here=0
without_model=()
((model_here)) || without_model=(-m "not needs_model") # the fake tests that load the model: deselected
pytest_step cuda cuda_tests.log tests/test_cuda.py
((${#fake_tests[@]})) && pytest_step fake fake_tests.log "${without_model[@]}" "${fake_tests[@]}"

if ((model_here)); then
    ignored=()
    for test in tests/test_cuda.py "${fake_tests[@]}"; do ignored+=(--ignore "$test"); done
    pytest_step rest rest_tests.log tests "${ignored[@]}"
else
    record rest "skipped: no default model ($why); 'python -m serving.default_model' with network, or set VATTN_CACHE_DIR to a copied cache"
fi

# --- benchmarks -----------------------------------------------------------------------------
if [[ ${SKIP_BENCH:-0} != 0 ]]; then
    record bench "skipped: SKIP_BENCH is set"
else
    # prefill and decode run every CUDA kernel family on either cache; a kernel library that is
    # not here is a skipped row, and the model tables are skipped without the model.
    for bench in "paper_repro.gpu_allocation" "paper_repro.latency_hiding --backend cuda" "paper_repro prefill" \
        "paper_repro decode"; do
        name=${bench%% -*}
        name="bench-${name##*[ .]}" # bench-gpu_allocation, bench-latency_hiding, bench-prefill, bench-decode
        # shellcheck disable=SC2086  # the benchmark's arguments are meant to split
        logged "$name.log" "$PYTHON" -m $bench
        code=$?
        if ((code == 2)) && why=$(grep -m 1 "cannot run here" "$out/$name.log"); then
            why=${why#*cannot run here: }
            record "$name" "skipped: ${why:0:100}" # measure.gpu.cannot_run (status 2): not a failure
        else
            recorded "$name" "$name.log" "$code"
        fi
    done
fi
finish
