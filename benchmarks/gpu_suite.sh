#!/usr/bin/env bash
# The whole GPU side of vattn on a bare CUDA machine, in one command from the repo root:
# builds the native library, installs any carried wheels, runs the test suite (the CUDA
# tests included) and the GPU benchmarks, and copies logs and results to $OUT (or ./gpu-out).
#
#   bash benchmarks/gpu_suite.sh            # everything
#   SKIP_BENCH=1 bash benchmarks/gpu_suite.sh  # tests only
#
# Needs python3 with torch (CUDA build), cuda-bindings, pytest, pytest-timeout, hypothesis,
# tqdm and matplotlib. flash-attn and flashinfer are optional: put their wheels (and the
# wheels they need) in .whl/ and they are installed first; kernels whose library is missing
# are skipped with the reason, and so are the model parts of prefill and decode when the
# default model (transformers, network or ~/.cache/vattn) is not there. Exit status: the tests' status, else the first failed benchmark's.
set -uo pipefail

out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

cc -O2 -Wall -Wextra -Werror -shared -fPIC -o vattn/libvattn_native.so native/vattn_native.c -ldl -lpthread || exit 1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 - <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
for name in ("cuda-bindings", "flash-attn", "flashinfer-python"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
} 2>&1 | tee "$out/versions.txt"

python3 -m pytest -q -rs -p no:cacheprovider tests 2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}

if [[ -z "${SKIP_BENCH:-}" ]]; then
    # Table 7, Fig. 10, Fig. 8 and Fig. 9 write to paper_repro/results/<device>/ (prefill and
    # decode run every CUDA kernel family on either cache when they see a GPU).
    for bench in "paper_repro.gpu_allocation" "paper_repro.latency_hiding --backend cuda" "paper_repro prefill" \
        "paper_repro decode"; do
        # shellcheck disable=SC2086  # the benchmark's arguments are meant to split
        python3 -m $bench 2>&1 | tee -a "$out/benchmarks.log"
        code=${PIPESTATUS[0]}
        ((status == 0 && code != 0)) && status=$code
    done
    tar czf "$out/gpu_results.tgz" --exclude=paper_repro/results/cpu benchmarks/results/gpu_* paper_repro/results \
        2>/dev/null
fi
exit "$status"
