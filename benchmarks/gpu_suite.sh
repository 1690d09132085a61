#!/usr/bin/env bash
# vattn's whole GPU check, prepared for one lent quarter hour on an H100/H200 (any CUDA GPU): no
# network, PIP_NO_INDEX=1 throughout. From the repo root:
#
#   bash benchmarks/gpu_suite.sh              # on the GPU machine
#   FAKE_GPU=1 bash benchmarks/gpu_suite.sh   # here, on the CPU: every GPU step on the tests' fakes
#
# Prepared here first with `make gpu-wheels` (the server's packages the GPU image lacks, about
# 7 MiB, into .whl/), then through the device tool, in one call:
#
#   run(command="SEND=$OUT bash benchmarks/gpu_suite.sh", carry=[".whl"], timeout_s=600)
#
# Settings (environment): SUITE_SECONDS, the budget of the whole run (default 540: a 600-second
# command with room to pack up); OUT, where every log goes (default ./gpu-out); SEND, a folder
# that gets only summary.txt and gpu_results.tgz (which holds all of OUT and the results under
# paper_repro/results/): the device tool brings back 8 files at most; PYTHON (default
# .venv/bin/python when there is one, else python3, the GPU image's, which has torch);
# WHEELS, the folder of wheels to install first (default .whl); FAKE_GPU=1; ONLY, the steps to run
# (comma-separated names from the list below; the rest are recorded as not asked), for a rerun of
# what failed on what is left of the quarter hour, e.g. ONLY=wheels,serve after a built native library.
#
# The steps, in the order of what they tell; each has its own limit in seconds, cut to what is
# left of the budget, and a step with under 10 seconds left is skipped, so the run always ends
# with its summary and tarball inside the budget:
#   wheels 40     $WHEELS/*.whl installed into a folder on PYTHONPATH (only when there are any)
#   build 150     vattn's native libraries, by the Makefile's rules, against $PYTHON's torch
#   versions 30   driver, GPU, torch, CUDA, cuda-bindings, flash-attn, flashinfer, nvcc
#   gpu           is there a GPU? (none: the suite stops here, status 0 unless a step failed)
#   kernels 180   each GPU kernel built and run once in bfloat16 and float16, in a process of
#                 its own (benchmarks.gpu_probe; one whose library is not installed is recorded as
#                 unavailable without one): kernels.jsonl, with build and first-call seconds
#   sdpa 60       torch SDPA's backend choice and first-call cost at new lengths, cuDNN allowed,
#                 excluded (as the engine calls it) and alone (benchmarks.gpu_sdpa_backends)
#   model 150     the random-weight models (nothing to download) generating on CUDA through
#                 vattn's own pages, every cache and kernel, against a CPU float32 run
#                 (benchmarks.gpu_model_check): model_check.json
#   serve 90      `vattn serve --model synthetic:tiny --backend cuda` answers a completion
#   cuda 180      tests/test_cuda.py (JUnit XML too); a kernel the probe found available whose
#                 tests all skipped is a failure
#   decode 150    Fig. 9 at the paper's shapes: FA2 on virtual tensors against FA2 paged, FlashInfer
#                 and SDPA where present; the model table on synthetic:paper
#   prefill 120   Fig. 8, quick: the paper's models at 4K and 16K tokens
#   host_ops 120  the host CPU's projection tests, at its own ISA (AMX on the H100s' Xeons) and
#                 with oneDNN held below AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)
#   host_rows 90  benchmarks.few_rows there: how many rows vattn's tiles should take from oneDNN
#   host_offline 300  benchmarks.offline_compare of vattn's presets on two host cores
#                 (synthetic:smollm2: the default model cannot travel), written round by round;
#                 the host's checks alone: ONLY=wheels,build,host_ops,host_rows,host_offline
#   then, while time remains: fake (the fake-driver tests), allocation (Table 7), hiding (Fig. 10)
# The exit status is 1 when a step failed; skipped steps and unavailable libraries are not failures.
# shellcheck disable=SC2329,SC2086  # (this whole file) functions run through step are used; $GPU_PYTHON splits
set -uo pipefail

started=$SECONDS
budget=${SUITE_SECONDS:-540}
root=$PWD
out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [[ $out == / || $out == "$root" || $out == "$HOME" ]]; then
    echo "OUT=$out would be emptied: name a folder of its own" >&2
    exit 2
fi
rm -rf "${out:?}"/* # a fresh summary and logs
: >"$out/summary.txt"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
fake=${FAKE_GPU:-0}
GPU_PYTHON=$PYTHON # what runs a GPU step (split on spaces): with FAKE_GPU=1, the tests' fake GPU around it
((fake)) && GPU_PYTHON="$PYTHON -m tests.fake_gpu"
export out PYTHON GPU_PYTHON
results="$root/paper_repro/results"
((fake)) && results="$out/results" # fake figures never land beside real ones
failed=0

record() { # step status: one line of the summary
    printf '%-10s %5ss  %s\n' "$1" "$((SECONDS - started))" "$2" | tee -a "$out/summary.txt"
}

left() { # seconds left of the budget, keeping 10 to pack up
    echo $((budget - (SECONDS - started) - 10))
}

step() { # name limit log command...: runs it with the output also in $out/<log>, within its limit
    local name=$1 limit=$2 log=$3 code
    shift 3
    if [[ -n ${ONLY:-} && " ${ONLY//,/ } " != *" $name "* ]]; then
        record "$name" "not asked (ONLY=$ONLY)"
        return 0
    fi
    local remaining cut=0
    remaining=$(left)
    ((remaining < limit)) && limit=$remaining cut=1
    if ((limit < 10)); then
        record "$name" "skipped: out of time (${budget}s budget)"
        return 0
    fi
    echo "== $name (at most ${limit}s): $*"
    timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$out/$log" # bash: a function too
    code=${PIPESTATUS[0]}
    if ((code == 0)); then
        record "$name" "ok${note:+ ($note)}"
    elif ((code == 124 || code == 137)) && ((cut)); then
        record "$name" "cut short: the budget's last ${limit}s ran out, see $log"
    elif ((code == 124 || code == 137)); then
        record "$name" "FAILED: timed out after ${limit}s, see $log"
        failed=1
    else
        record "$name" "FAILED (exit $code, see $log)${note:+ ($note)}"
        failed=1
    fi
    note=""
    return "$code"
}
note=""

stub() { # name why: a step that cannot run on the fakes
    record "$1" "stubbed (FAKE_GPU): $2"
}

finish() { # the tarball of $out and the results, the summary, SEND, and the exit status
    local tarball="${TMPDIR:-/tmp}/gpu_results.$$.tgz" # written outside $out, which it holds
    local parts=(-C "$out" .)
    ((fake)) || parts+=(-C "$root" paper_repro/results)
    if tar czf "$tarball" --exclude=gpu_results.tgz --exclude=paper_repro/results/cpu "${parts[@]}"; then
        mv "$tarball" "$out/gpu_results.tgz"
    else
        rm -f "$tarball" "$out/gpu_results.tgz"
        echo "note: could not write $out/gpu_results.tgz (send the folder $out instead)"
    fi
    record total "$((SECONDS - started))s of a ${budget}s budget"
    if [[ -n ${SEND:-} ]]; then
        mkdir -p "$SEND" && cp "$out/summary.txt" "$SEND/" && cp "$out/gpu_results.tgz" "$SEND/" 2>/dev/null
    fi
    echo
    echo "== summary ($out/summary.txt)"
    cat "$out/summary.txt"
    exit "$failed"
}

if ! command -v "$PYTHON" >/dev/null; then
    record python "FAILED: no '$PYTHON' (set PYTHON to a python with a CUDA build of torch)"
    failed=1
    finish
fi

# --- wheels, build, versions ----------------------------------------------------------------
wheels=${WHEELS:-.whl}
if ((fake)) && compgen -G "$wheels/*.whl" >/dev/null; then
    stub wheels "they are built for the GPU image's Python (make gpu-wheels: CPython 3.12)"
elif compgen -G "$wheels/*.whl" >/dev/null; then
    site=/tmp/vattn-gpu-site
    step wheels 40 wheels.log "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
fi

load_libraries() {
    "$PYTHON" -c 'import ctypes, torch; ctypes.CDLL("vattn/libvattn_native.so"); torch.ops.load_library("vattn/libvattn_ops.so"); print("both libraries load")'
}

build() {
    # The Makefile's rules with $PYTHON's torch; -o: never the Makefile's CPU venv (.venv/.torch),
    # whose rule would install torch from the network.
    local make_args=(--no-print-directory -j"$(nproc 2>/dev/null || echo 4)" -o .venv/.torch PY="$PYTHON")
    command -v make >/dev/null || {
        echo "make is not installed (it and a C/C++ compiler build the native libraries)"
        return 1
    }
    make "${make_args[@]}" native || return
    load_libraries && return
    echo "vattn/libvattn_ops.so does not load with this torch: building it again"
    rm -f build/ops/torch.env # the torch it was built against: asked again, every source follows
    make "${make_args[@]}" vattn/libvattn_ops.so && load_libraries
}
export -f load_libraries build
step build 150 build.log build

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
import platform

import torch

print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu available", torch.cuda.is_available())
print("torch's FlashAttention 2:", torch.ops.aten._flash_attention_forward.default._schema)
for name in ("cuda-bindings", "flash-attn", "flash-attn-4", "flashinfer-python", "flashinfer-cubin",
             "flashinfer-jit-cache", "transformers", "tokenizers", "fastapi", "uvicorn", "pydantic"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
}
export -f versions
step versions 30 versions.txt versions

gpu_check() { # prints the GPU, or why there is none (status 1)
    $GPU_PYTHON -c '
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"no GPU: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {torch.version.cuda})")
from paper_repro._harness import results_dir
print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print(results_dir().name)
'
}
if ! gpu_check 2>&1 | tee "$out/gpu.txt"; then
    record gpu "none: stopped here ($(tail -n 1 "$out/gpu.txt"))"
    echo "Nothing more to run: this suite is for a machine with a CUDA GPU (the CUDA logic's CI tests"
    echo "run in 'make test' on the fake driver; FAKE_GPU=1 runs this script on them)."
    finish
fi
record gpu "$(grep '^gpu ' "$out/gpu.txt")"
results_folder="$results/$(tail -n 1 "$out/gpu.txt")" # paper_repro/results/<device>, as the experiments name it

# --- kernels --------------------------------------------------------------------------------
probe_all() {
    local kernel code=0
    : >"$out/kernels.jsonl"
    for kernel in $("$PYTHON" -m benchmarks.gpu_probe --plan --out "$out/kernels.jsonl"); do
        timeout --kill-after=5 "${PROBE_TIMEOUT:-60}" $GPU_PYTHON -m benchmarks.gpu_probe "$kernel" \
            --out "$out/kernels.jsonl" || code=1
    done
    return $code
}
export -f probe_all
step kernels 180 kernels.log probe_all
if ((fake)); then
    stub sdpa "backend choices and timings need the device"
else
    step sdpa 60 sdpa_backends.log "$PYTHON" -m benchmarks.gpu_sdpa_backends --out "$out/sdpa_backends.json"
fi

# --- the model on CUDA, and served ----------------------------------------------------------
if ((fake)); then
    stub model "greedy tokens need the device's values (the engine's dry run on fake CUDA runs in make test)"
else
    # tiny and paper (75 s on an H200); smollm2, the default model's shape, is for the AMX host's run
    step model 150 model_check.log "$PYTHON" -m benchmarks.gpu_model_check --models tiny,paper --out "$out/model_check.json"
fi

serve_once() {
    local port=8321 code=1
    "$PYTHON" -m serving.server.cli serve --model synthetic:tiny --backend cuda --dtype bfloat16 \
        --host 127.0.0.1 --port "$port" >"$out/server.log" 2>&1 &
    local server=$!
    "$PYTHON" - "$port" <<'EOF' && code=0
import json
import sys
import time
import urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        urllib.request.urlopen(f"{base}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
body = json.dumps({"model": "synthetic:tiny", "prompt": "The lighthouse keeper", "max_tokens": 16, "temperature": 0})
request = urllib.request.Request(f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
print(json.dumps(answer, indent=1))
assert answer["choices"][0]["text"], "an empty completion"
assert answer["usage"]["completion_tokens"] == 16, answer["usage"]
EOF
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    echo "-- server log"
    tail -n 30 "$out/server.log"
    return $code
}
export -f serve_once
if ((fake)); then
    stub serve "sampling needs the device's values"
else
    step serve 90 serve.log serve_once
fi

# --- the tests on the GPU -------------------------------------------------------------------
cuda_tests() {
    "$PYTHON" -m pytest -q -rs -p no:cacheprovider --junitxml="$out/cuda_tests.xml" tests/test_cuda.py
    local code=$?
    "$PYTHON" -m benchmarks.gpu_probe --untested "$out/kernels.jsonl" "$out/cuda_tests.xml" || code=1
    return $code
}
export -f cuda_tests
if ((fake)); then
    stub cuda "tests/test_cuda.py skips without a GPU; its untested-kernel check is tested in make test"
else
    step cuda 180 cuda_tests.log cuda_tests
fi

# --- the paper's experiments ----------------------------------------------------------------
if ((fake)); then # the shapes are the paper's, the sizes tiny: on fake tensors only the logic runs
    decode_args=(--context 512 --batches 1 2 --repeats 1 --attention-only)
    prefill_args=(--gpu-contexts 512 --repeats 1 --attention-only)
else
    decode_args=(--batches 1 4 16 32 --repeats 10 --model synthetic:paper --model-batches 1 16 --model-context 512 --steps 8)
    prefill_args=(--gpu-contexts 4096 16384 --repeats 3 --rounds 1 --model synthetic:paper)
fi
step decode 150 decode.log $GPU_PYTHON -m paper_repro.decode --out "$results_folder" "${decode_args[@]}"
step prefill 120 prefill.log $GPU_PYTHON -m paper_repro.prefill --out "$results_folder" "${prefill_args[@]}"

# --- the host CPU (an AMX Xeon on the H100 machines lent so far) ----------------------------
host_ops() { # the CPU projections' tests at the host's own ISA, then with oneDNN held below AMX
    local cap code=0
    for cap in "" AVX512_CORE_BF16; do
        echo "-- ONEDNN_MAX_CPU_ISA=${cap:-(not set)}"
        env ${cap:+ONEDNN_MAX_CPU_ISA=$cap} "$PYTHON" -m pytest -q -p no:cacheprovider -m "not needs_model" \
            tests/test_cpu_isa.py tests/test_linear.py tests/test_tiled_linear.py || code=1
    done
    return $code
}
two_cores() { # runs "$@" on two of the host's cores, as the CPU comparisons run
    if command -v taskset >/dev/null && (($(nproc) >= 4)); then taskset -c 2,3 "$@"; else "$@"; fi
}
host_rows() { # where oneDNN's matmul (AMX's, on an AMX host) overtakes vattn's tiles in decode steps
    two_cores "$PYTHON" -m benchmarks.few_rows --rounds 3 --out "$out/host_rows"
}
host_offline() { # vattn's presets on two of the host's cores, the results written after every round
    two_cores "$PYTHON" -m benchmarks.offline_compare --model synthetic:smollm2 --prompts 24 --max-tokens 32 \
        --systems vattn-fp32,vattn-default,vattn-bf16,vattn-q8 --rounds 3 --out "$out/host_offline"
}
export -f host_ops two_cores host_rows host_offline
if ((fake)); then
    stub host_ops "make test runs them here"
    stub host_rows "the host's speed is the lent machine's"
    stub host_offline "the host's speed is the lent machine's"
else
    step host_ops 120 host_ops.log host_ops
    step host_rows 90 host_rows.log host_rows
    step host_offline 300 host_offline.log host_offline
fi

# --- while time remains ---------------------------------------------------------------------
if ((fake)); then
    stub fake "make test runs them"
    stub allocation "times the driver's calls"
    stub hiding "times the driver's calls"
else
    fake_tests=(tests/test_cuda_fake.py tests/test_fake_cuda_bites.py tests/test_cuda_dry_run.py tests/test_torch_flash_attn.py)
    step fake 90 fake_tests.log "$PYTHON" -m pytest -q -p no:cacheprovider -m "not needs_model" "${fake_tests[@]}"
    step allocation 90 allocation.log "$PYTHON" -m paper_repro.gpu_allocation --out "$results_folder"
    step hiding 90 hiding.log "$PYTHON" -m paper_repro.latency_hiding --backend cuda --out "$results_folder"
fi
finish
