"""Run inside vLLM's venv (`make peer-vllm`) by benchmarks.attention_vs_vllm: vattn's ragged
kernel (its built libvattn_ops.so, loaded into the same torch) against vLLM's CPU attention
(`cpu_attention_with_kv_cache` after `cpu_attn_reshape_and_cache`; the ISA vLLM picks here, and its
AVX-512 "vec" kernel beside it where that ISA is AMX) on
the same shapes, in one process, alternating. Each system gets LAYERS caches of its own, so a
pass reads as much K/V as a model step does: vattn's virtual rows `[slots, context, kv_heads,
head_dim]`, vLLM's blocks of 128 tokens `[blocks, kv_heads, 2 x 128, head_dim]`. Both store the
new tokens' K/V before they attend, as in a model step; queries, K/V and caches are bf16.

    .peers/vllm/bin/python benchmarks/peer_drivers/vllm_attention.py LIBRARY SPEC.json OUT.json
"""

import json
import os
import sys
import time

import torch
from tqdm import tqdm

BLOCK = 128  # vLLM's CPU default block size


def systems(shape: dict, heads: int, kv_heads: int, dim: int, layers: int) -> dict:
    """Each system's pass over `layers` layers of one batch: `batch` requests of `context` tokens, `new` of them new."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    batch, context, new = shape["batch"], shape["context"], shape["new"]
    tokens, scale = batch * new, dim**-0.5
    q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rows = [torch.randn(batch, context, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2 * layers)]
    reqids, starts = torch.arange(batch), torch.arange(0, tokens, new)
    news, lengths = torch.full((batch,), new), torch.full((batch,), context)
    out = torch.empty_like(q)

    def vattn() -> None:
        for layer in range(layers):
            keys, values = rows[2 * layer], rows[2 * layer + 1]
            torch.ops.vattn.ragged_attention(out, q, keys, values, reqids, starts, news, lengths, scale, k, v)

    per_request = -(-context // BLOCK)
    caches = [torch.randn(batch * per_request, kv_heads, 2 * BLOCK, dim, dtype=torch.bfloat16) for _ in range(layers)]
    table = torch.arange(batch * per_request, dtype=torch.int32).view(batch, per_request)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start = torch.arange(0, tokens + 1, new, dtype=torch.int32)
    firsts = [b * per_request * BLOCK for b in range(batch)]  # each request's first slot
    slots = torch.cat([torch.arange(first + context - new, first + context) for first in firsts])
    out_vllm = torch.empty_like(q)

    def vllm_on(isa: str):
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens,
            dtype=torch.bfloat16, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=True,
        )  # fmt: skip

        def vllm() -> None:
            for layer in range(layers):
                key_cache, value_cache = caches[layer].chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
                ops.cpu_attention_with_kv_cache(
                    query=q, key_cache=key_cache, value_cache=value_cache, output=out_vllm,
                    query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
                    sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
                )  # fmt: skip

        return vllm

    # The ISA vLLM picks here; where that is AMX, also its AVX-512 kernel ("vec"), to tell what AMX buys it.
    chosen = _get_attn_isa(torch.bfloat16, BLOCK, dim)
    return {"vattn": vattn} | {f"vllm-{isa}": vllm_on(isa) for isa in dict.fromkeys([chosen, "vec"])}


def best_of(run, repeats: int) -> float:
    """The fastest of `repeats` passes, seconds (after one unmeasured)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    library, spec_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.ops.load_library(library)
    with open(spec_path) as file:
        spec = json.load(file)
    torch.manual_seed(0)
    rows = []
    with tqdm(total=len(spec["shapes"]) * spec["rounds"], desc="shapes x rounds") as bar:
        for shape in spec["shapes"]:
            runs = systems(shape, spec["heads"], spec["kv_heads"], spec["head_dim"], spec["layers"])
            for round_number in range(spec["rounds"]):
                for name, run in runs.items():
                    seconds = best_of(run, spec["repeats"])
                    rows.append({**shape, "system": name, "round": round_number, "ms": 1000 * seconds})
                bar.update()
    with open(out_path, "w") as file:
        json.dump({"rows": rows, "torch": torch.__version__, "threads": torch.get_num_threads()}, file)
    os._exit(0)  # vLLM's threads can abort the interpreter's teardown (vllm_logprobs.py)


if __name__ == "__main__":
    main()
