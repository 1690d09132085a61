"""The synthetic models (serving.model.synthetic) served on every kernel: greedy tokens and logits
against each other and against a CPU float32 run of the same weights.

    python -m benchmarks.gpu_model_check --out gpu-out/model_check.json
    python -m benchmarks.gpu_model_check --device cpu --models tiny --max-tokens 4 --out /tmp/check.json

On CUDA that is 44 engines (each builds its model: ~2 s for `paper`) and 4 CPU float32 runs:
a couple of minutes, besides FlashInfer building its kernels if nothing has cached them.

For each model and prefill (`chunked`: 32 tokens an iteration, so long prompts run in chunks beside
decodes; `whole`: every prompt in one iteration), one fixed workload runs on each combination of
dtype, KV cache and kernel (KERNELS_TRIED; in float32 only those that take it): prompts of 5 to
203 tokens submitted together, one of them twice (the second forks the first's KV on the virtual
cache), then, once the longest has ended, the same prompt again (a prefix-cache hit on the
virtual cache) and a new one, whose prefills run beside the others' decodes. Each engine's
logits before every sampled token are kept. A kernel whose construction raises UnavailableError
is `unavailable`, a name this build does not register is `unregistered`; any other exception is
a failure.

Each run is compared with the first run of its dtype (the virtual cache's `sdpa`), with the runs
of its dtype and cache before it, and with a CPU float32 run (host backend, `ragged`) of the same
prefill: greedy agreement (each request's tokens equal up to the first divergence, the fraction
of requests fully equal, the fraction of first tokens equal) and the largest logit difference
over the steps whose token histories are equal (a divergence's step included), relative to the
reference logits' std at that step; the first step's alone too.

The bound (the exit status is 1 when a run breaks it, or fails): logits over equal histories
differ by at most LOGIT_BOUND[dtype] of their std, between two kernels of one dtype and cache
(the same math in other reduction orders: the caches hold the same values) and against CPU
float32. The weights are the same numbers in every dtype (bfloat16-representable), but a
bfloat16 engine rounds every activation to 8 bits of mantissa, through every layer: on the CPU,
bfloat16 runs differ from float32 by 0.04-0.06 of the logits' std (both models), and from each
other by as much; float16 keeps 3 more bits; float32 kernels differ by ~1e-5. The bounds are ~4x
that, and a real fault is far beyond them: a kernel that forgets the first key of contexts over
64 tokens moves the tiny model's float32 logits by 0.84 std. Greedy tokens are not bounded on
their own: they can differ only where two tokens are within twice the bound of a tie (a
divergence at a wider gap breaks the bound at that step), and a random model's next-token
distribution is flat (its two best logits lie ~0.3 std apart on average, a fifth of them
under 0.1), so half-precision runs do diverge, late or early, at near-ties: exact equality is
expected of float32 runs only.
The first tokens of at least MIN_FIRST_TOKEN_AGREEMENT of the requests must equal CPU float32's.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.model.synthetic import PREFIX, SYNTHETIC_MODELS, build_tokenizer, special_token_ids
from serving.sampling_params import SamplingParams
from vattn.errors import UnavailableError
from vattn.kernels import KERNELS
from vattn.paged import PAGED_KERNELS
from vattn.sizes import MiB

KERNELS_TRIED = {
    "cuda": {
        "virtual": ("sdpa", "flash_attn", "flashinfer_paged", "flashinfer_single", "torch_flash_attn"),
        "paged": ("paged_gather", "paged_flash_attn", "paged_flashinfer", "paged_torch_flash_attn"),
    },
    "cpu": {"virtual": ("sdpa", "ragged"), "paged": ("paged_gather", "paged", "paged_blockwise")},
}
HALF_PRECISION_KERNELS = frozenset(
    {"flash_attn", "flashinfer_paged", "flashinfer_single", "torch_flash_attn"}
    | {"paged_flash_attn", "paged_flashinfer", "paged_torch_flash_attn"}
)
"""Kernels that refuse a float32 cache: not tried in float32."""
DTYPES = {"cuda": ("bfloat16", "float32"), "cpu": ("float32",)}
FLASH_ATTENTION_BLOCK = 256
"""FlashAttention 2's paged path needs blocks of a multiple of 256 tokens; the others use 16."""
PREFILLS = {"chunked": 32, "whole": 4096}
"""max_batched_tokens of each prefill mode."""
PROMPT_TOKENS = {"short": 5, "medium": 37, "long": 203, "fork": 90, "late": 121}
LONG_TOKENS = 2
"""Tokens the long prompt's request generates: it ends early, and the same prompt again hits its cached KV."""
LOGIT_BOUND = {"float32": 1e-3, "float16": 0.03, "bfloat16": 0.2}
MIN_FIRST_TOKEN_AGREEMENT = 0.5

Workload = tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]
"""(name, prompt ids) submitted together, and those submitted once the long prompt's request has ended."""


@dataclass
class Run:
    """One engine's outcome on the workload."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[Tensor]] = field(default_factory=dict)
    """Each request's float32 logits before each of its tokens."""
    cached_tokens: dict[str, int] = field(default_factory=dict)
    forks: int = 0
    mixed_iterations: int = 0
    """Iterations that computed prompt tokens beside decodes."""
    seconds: float = 0.0


def workload(model: str) -> Workload:
    """The workload's prompts for `model`: random tokens after bos, the same on every run."""
    vocab = SYNTHETIC_MODELS[model].vocab_size
    bos = special_token_ids(vocab)[0]
    generator = torch.Generator().manual_seed(1234)
    prompts = {
        name: [bos, *torch.randint(0, bos, (length - 1,), generator=generator).tolist()]
        for name, length in PROMPT_TOKENS.items()
    }
    first = [(name, prompts[name]) for name in ("short", "medium", "long")]
    first += [("fork-0", prompts["fork"]), ("fork-1", prompts["fork"])]
    return first, [("prefix-hit", prompts["long"]), ("late", prompts["late"])]


def engine_config(model: str, device: str, dtype: str, cache: str, kernel: str, prefill: str) -> EngineConfig:
    return EngineConfig(
        model=PREFIX + model,
        dtype=dtype,
        backend="cuda" if device == "cuda" else "host",
        kv_cache=cache,
        kernel=kernel,
        block_size=FLASH_ATTENTION_BLOCK if "flash_attn" in kernel else 16,
        max_batched_tokens=PREFILLS[prefill],
        max_slots=8,
        max_context=512,
        kv_budget=512 * MiB,
    )


def run_workload(config: EngineConfig, max_tokens: int) -> Run:
    """The workload on an engine of `config` (a synthetic model); its construction's errors propagate."""
    engine = LLMEngine(config)
    try:
        return _drive(engine, workload(str(config.model).removeprefix(PREFIX)), max_tokens)
    finally:
        engine.close()


def _drive(engine: LLMEngine, prompts: Workload, max_tokens: int) -> Run:
    run, names = Run(), {}
    compute = engine.executor.compute

    def recording(sequences: Sequence[Any], new_tokens: Sequence[int], rows: Sequence[int]) -> Tensor:
        prefills = [s.num_computed < len(s.prompt_ids) for s in sequences]
        run.mixed_iterations += any(prefills) and not all(prefills)
        logits = compute(sequences, new_tokens, rows)
        first = 0
        for sequence, count in zip(sequences, rows, strict=True):
            if count:
                run.logits.setdefault(names[sequence.request_id], []).append(logits[first + count - 1].clone())
            first += count
        return logits

    engine.executor.compute = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    short_lived = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    first, later = prompts
    start = time.perf_counter()
    ids = engine.add_requests([ids for _, ids in first], [short_lived if n == "long" else params for n, _ in first])
    names.update(zip(ids, [name for name, _ in first], strict=True))
    while len(run.logits.get("long", [])) < LONG_TOKENS:  # then it has ended: its KV is in the prefix cache whole
        engine.step()
    for name, prompt in later:
        names[engine.add_request(prompt, params)] = name
    while engine.has_unfinished():
        engine.step()
    run.seconds = time.perf_counter() - start
    for request_id, name in names.items():
        output = engine.result(request_id)
        run.tokens[name], run.cached_tokens[name] = output.token_ids, output.cached_tokens
    run.forks = engine.stats().kv.counters.forks
    return run


def compare(run: Run, reference: Run) -> dict[str, Any]:
    """Greedy agreement and logit differences of `run` against `reference` (see the module's doc)."""
    agreed, worst, first_step = {}, 0.0, 0.0
    for name, theirs in reference.tokens.items():
        ours = run.tokens[name]
        equal = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        agreed[name] = equal
        for step in range(min(equal + 1, len(ours), len(theirs))):
            expected = reference.logits[name][step]
            relative = float((run.logits[name][step] - expected).abs().max() / expected.std())
            worst = max(worst, relative)
            if step == 0:
                first_step = max(first_step, relative)
    total = len(reference.tokens)
    return {
        "tokens_equal_until": agreed,
        "fully_equal": sum(run.tokens[n] == t for n, t in reference.tokens.items()) / total,
        "first_token_equal": sum(run.tokens[n][:1] == t[:1] for n, t in reference.tokens.items()) / total,
        "max_relative_logit_diff": worst,
        "first_step_relative_logit_diff": first_step,
    }


def check_model(
    model: str, device: str, dtypes: Sequence[str], prefills: Sequence[str], max_tokens: int
) -> tuple[dict[str, Any], list[str]]:
    """Every combination of `model`: the results and the bounds they break (see the module's doc)."""
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    references: dict[str, Run] = {}
    for prefill in prefills:
        cpu = references[prefill] = run_workload(
            engine_config(model, "cpu", "float32", "virtual", "ragged", prefill), max_tokens
        )
        for dtype in dtypes:
            runs: list[tuple[dict[str, Any], Run]] = []
            for cache, kernels in KERNELS_TRIED[device].items():
                for kernel in kernels:
                    if dtype == "float32" and kernel in HALF_PRECISION_KERNELS:
                        continue
                    entry, run = _one(model, device, dtype, cache, kernel, prefill, max_tokens)
                    results.append(entry)
                    where = f"{model} {prefill} {dtype} {cache}/{kernel}"
                    if entry["status"] == "failed":
                        failures.append(f"{where}: {entry['error'].strip().splitlines()[-1]}")
                    if run is not None:
                        failures += [f"{where}: {broken}" for broken in _compare_all(entry, run, cpu, runs, dtype)]
                        runs.append((entry, run))
    summary = {
        "shape": SYNTHETIC_MODELS[model].__dict__,
        "prompt_tokens": {name: len(ids) for wave in workload(model) for name, ids in wave},
        "cpu_float32": {p: {"tokens": r.tokens, "cached_tokens": r.cached_tokens} for p, r in references.items()},
        "combinations": results,
    }
    return summary, failures


def _compare_all(
    entry: dict[str, Any], run: Run, cpu: Run, earlier: list[tuple[dict[str, Any], Run]], dtype: str
) -> list[str]:
    """Adds the run's comparisons to its entry; returns the bounds it breaks."""
    broken = []
    entry["vs_cpu_float32"] = against_cpu = compare(run, cpu)
    if against_cpu["max_relative_logit_diff"] > LOGIT_BOUND[dtype]:
        broken.append("its logits differ from CPU float32's beyond the bound")
    if against_cpu["first_token_equal"] < MIN_FIRST_TOKEN_AGREEMENT:
        broken.append("too few of its first tokens equal CPU float32's")
    if earlier:  # the first run of this dtype: the virtual cache's sdpa
        entry["vs_first"] = {"kernel": earlier[0][0]["kernel"], **compare(run, earlier[0][1])}
    for other_entry, other in earlier:
        if other_entry["cache"] == entry["cache"]:
            entry.setdefault("vs_same_cache", {})[other_entry["kernel"]] = agreement = compare(run, other)
            if agreement["max_relative_logit_diff"] > LOGIT_BOUND[dtype]:
                broken.append(f"its logits differ from {other_entry['kernel']}'s beyond the bound")
    return broken


def _one(
    model: str, device: str, dtype: str, cache: str, kernel: str, prefill: str, max_tokens: int
) -> tuple[dict[str, Any], Run | None]:
    """One combination's entry, and its run unless it did not run."""
    entry: dict[str, Any] = {"prefill": prefill, "dtype": dtype, "cache": cache, "kernel": kernel}
    if kernel not in (KERNELS if cache == "virtual" else PAGED_KERNELS):
        entry["status"] = "unregistered"
        return entry, None
    try:
        config = engine_config(model, device, dtype, cache, kernel, prefill)
        run = run_workload(config, max_tokens)
    except UnavailableError as error:
        entry.update(status="unavailable", reason=str(error))
        return entry, None
    except Exception:
        entry.update(status="failed", error=traceback.format_exc())
        return entry, None
    finally:
        gc.collect()  # the engine's pages and weights go before the next one's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    entry.update(status="ok", seconds=round(run.seconds, 3), block_size=config.block_size, forks=run.forks)
    entry.update(mixed_iterations=run.mixed_iterations, tokens=run.tokens, cached_tokens=run.cached_tokens)
    return entry, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file written")
    parser.add_argument("--device", choices=tuple(KERNELS_TRIED), default="cuda", help="cpu: the host kernels")
    parser.add_argument("--dtypes", help="comma-separated (default: bfloat16,float32 on CUDA, float32 on the CPU)")
    parser.add_argument("--models", default=",".join(SYNTHETIC_MODELS), help="comma-separated synthetic model names")
    parser.add_argument("--prefills", default=",".join(PREFILLS), help="comma-separated prefill modes")
    parser.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per request")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",") if args.dtypes else DTYPES[args.device]
    if unknown := set(dtypes) - set(LOGIT_BOUND):
        parser.error(f"unknown dtypes {sorted(unknown)}; choose among {', '.join(LOGIT_BOUND)}")
    if unknown := set(args.models.split(",")) - set(SYNTHETIC_MODELS):
        parser.error(f"unknown models {sorted(unknown)}; choose among {', '.join(SYNTHETIC_MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --device cpu")
    build_tokenizer(SYNTHETIC_MODELS["tiny"].vocab_size)  # imports transformers before the clocks start
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "max_tokens": args.max_tokens,
        "bounds": {
            "relative_logit_diff": {dtype: LOGIT_BOUND[dtype] for dtype in dtypes},
            "min_first_token_agreement_vs_cpu_float32": MIN_FIRST_TOKEN_AGREEMENT,
        },
        "models": {},
        "failures": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        start = time.perf_counter()
        summary, failures = check_model(model, args.device, dtypes, args.prefills.split(","), args.max_tokens)
        summary["seconds"] = round(time.perf_counter() - start, 1)
        report["models"][model] = summary
        report["failures"] += failures
        report["ok"] = not report["failures"]
        args.out.write_text(json.dumps(report, indent=1))  # after each model: a run cut short keeps what it did
        print(f"{model}: {len(failures)} failures in {summary['seconds']} s", flush=True)
    for failure in report["failures"]:
        print("FAILED:", failure, file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
