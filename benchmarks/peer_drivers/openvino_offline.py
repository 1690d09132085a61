"""Run inside OpenVINO's venv (`make peer-openvino`) by benchmarks.offline_compare: one round
of OpenVINO GenAI's ContinuousBatchingPipeline on the given prompts (token ids), greedy, a
fixed number of new tokens each with EOS ignored, on the CPU with the given threads, inference
precision and KV-cache precision. Prints one JSON line: seconds, output tokens, peak RSS and
the generated ids (to check greedy agreement against vattn's).

    .peers/openvino/bin/python benchmarks/peer_drivers/openvino_offline.py IR_DIR PROMPTS.json OUT.json \
        --threads 2 --max-tokens 64 --cache-size 2 [--kv-precision f32] [--inference-precision f32]
"""

import argparse
import json
import resource
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ir_dir")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cache-size", type=int, required=True, help="KV space in GB (SchedulerConfig.cache_size)")
    parser.add_argument("--kv-precision", default=None, help="KV_CACHE_PRECISION; its default when absent")
    parser.add_argument("--inference-precision", default=None, help="INFERENCE_PRECISION_HINT; default when absent")
    args = parser.parse_args()
    with open(args.prompts) as file:
        prompts = json.load(file)
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = args.cache_size
    scheduler.max_num_seqs = len(prompts)
    scheduler.max_num_batched_tokens = 2048
    scheduler.enable_prefix_caching = False
    properties: dict[str, object] = {"INFERENCE_NUM_THREADS": args.threads}
    if args.kv_precision:
        properties["KV_CACHE_PRECISION"] = args.kv_precision
    if args.inference_precision:
        properties["INFERENCE_PRECISION_HINT"] = args.inference_precision
    started = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(args.ir_dir, scheduler, "CPU", properties)
    load_seconds = time.perf_counter() - started
    config = genai.GenerationConfig()
    config.max_new_tokens = args.max_tokens
    config.min_new_tokens = args.max_tokens
    config.ignore_eos = True
    config.do_sample = False
    inputs = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in prompts]
    pipe.generate(inputs[:1], [config])  # warm-up, as vattn's
    started = time.perf_counter()
    results = pipe.generate(inputs, [config] * len(inputs))
    seconds = time.perf_counter() - started
    outputs = [list(result.m_generation_ids[0]) for result in results]
    result = {
        "seconds": seconds,
        "load_seconds": load_seconds,
        "output_tokens": sum(len(ids) for ids in outputs),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "outputs": outputs,
    }
    with open(args.out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
