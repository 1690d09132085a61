"""Prefix caching and forking by page sharing, on and off in one run.

- shared system prompt: `--system-tokens` of one system prompt before each of `--questions`
  short questions (random token ids), `--concurrency` requests in flight (a new one starts
  when one ends), 16 output tokens each; and the same with a `--short-system-tokens` one,
  which ends inside the first 256-token unit.
- multi-turn chat: `--chats` conversations of `--turns` turns; each turn's prompt is the
  whole conversation so far (the previous prompt, its answer, a new question); a chat's
  next turn queues behind the chats already waiting.
- many chats: `--many-chats` conversations of 3 turns: each chat returns after all the others
  have had a turn, when the slot that kept its pages has been handed out again, so what the
  cache holds alone decides the hits (and least-recently-used eviction finds nothing unless
  every history fits).

For each, the engine with the prefix cache off, on matching whole units only (64 KiB pages: a
unit is 256 tokens), and on matching to the token: time to first token p50/p99, prompt tokens
computed, hit rate, and two peaks of physical KV bytes: those the running requests map
(what they need; a shared page counts once) and those held (mapped, idle slots' pages
kept for reuse included, + cached: all of it reclaimable on demand). Then each workload
again, matching to the token, for a sweep of `prefix_cache_share` (how much of the budget
entries may hold in pages no slot maps; 1.0 keeps them until a step needs the pages, as vLLM
and SGLang do): what the bound costs in hits against what it saves in bytes held. Last, the
physical KV bytes of n = 4 copies of a `--system-tokens` request: 4 independent requests
against one request forked 3 times (`KVCache.fork_reqid`: whole pages shared, the partial
one copied). Also: one request's TTFT alone, cold and with
its system prompt cached; and what beam search (width 4, 16 tokens) after the system prompt
shares and copies by forking.

    python -m benchmarks.prefix_caching [--quick]
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, percentiles, save_figure, write_results
from serving import LLM, SamplingParams
from vattn import KVCache, KVCacheConfig
from vattn.sizes import KiB, MiB

SHARE = KVCacheConfig.prefix_cache_share
CONFIGS = (("off", False, "token"), ("on, whole units", True, "unit"), ("on", True, "token"))
"""(name, prefix caching, prefix_match): the cache off, matching whole 256-token units only
(64 KiB pages), and matching to the token (the part of a unit copied), at the default
`prefix_cache_share`."""
SHARE_SWEEP = (0.0, 0.1, 0.25, 0.5, 1.0)
OUTPUT_TOKENS = 16


def random_ids(generator: torch.Generator, count: int) -> list[int]:
    return torch.randint(100, 40_000, (count,), generator=generator).tolist()


def run_closed_loop(llm: LLM, chats: list[list[list[int]]], concurrency: int) -> dict[str, Any]:
    """Runs each chat's turns in order (turn k's prompt: turn k-1's prompt and answer, then
    its own new tokens), `concurrency` chats in flight; a chat whose turn ends queues its next
    behind the chats already waiting, as users who read an answer before they reply do.
    Per-request TTFT and cache figures."""
    engine, params = llm.engine, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    pending = [list(chat) for chat in chats]
    waiting = deque(range(len(chats)))
    history: dict[int, list[int]] = {}
    running: dict[str, int] = {}
    ttft, computed, prompt_tokens, peak_active, peak_held = [], 0, 0, 0, 0
    total = sum(map(len, chats))
    with tqdm(total=total, desc="requests", leave=False) as bar:
        while waiting or running:
            while waiting and len(running) < concurrency:
                chat = waiting.popleft()
                prompt = history.get(chat, []) + pending[chat].pop(0)
                history[chat] = prompt
                running[engine.add_request(prompt, params)] = chat
            finished = [delta.request_id for delta in engine.step() if delta.finished]
            kv = engine.stats().kv
            peak_active = max(peak_active, kv.active_bytes)
            peak_held = max(peak_held, kv.mapped_bytes + kv.cached_bytes)
            for request_id in finished:
                chat = running.pop(request_id)
                output = engine.result(request_id)
                history[chat] = history[chat] + output.token_ids
                if pending[chat]:
                    waiting.append(chat)
                ttft.append(output.ttft or 0.0)
                prompt_tokens += len(output.prompt_token_ids)
                computed += len(output.prompt_token_ids) - output.cached_tokens
                bar.update()
    stats = engine.stats().kv.prefix
    return {
        "ttft_p50_s": percentiles(ttft)["p50"],
        "ttft_p99_s": percentiles(ttft)["p99"],
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": computed,
        "hit_rate": stats.hits / stats.queries if stats.queries else 0.0,
        "peak_active_kv_bytes": peak_active,
        "peak_held_kv_bytes": peak_held,
        "units_evicted": stats.evictions,
    }


def fork_memory(tokens: int, copies: int) -> list[dict[str, Any]]:
    """Physical KV bytes of `copies` requests holding the same `tokens` tokens."""
    config = KVCacheConfig(30, 3, 64, copies, tokens + 64, dtype="float32", page_size=64 * KiB, background=False)
    rows = []
    for how in ("independent", "forked"):
        with KVCache(config) as cache:
            first = cache.alloc_reqid()
            cache.step({first: tokens})
            for _ in range(copies - 1):
                if how == "forked":
                    cache.fork_reqid(first)
                else:
                    cache.step({cache.alloc_reqid(): tokens})
            rows.append({"table": "n=4", "how": how, "tokens": tokens, "kv_bytes": cache.stats().mapped_bytes})
    return rows


def single_prefill(system: list[int], questions: list[list[int]]) -> list[dict[str, Any]]:
    """TTFT of one request alone: cold, then (another question) with the system prompt cached."""
    rows = []
    for name, _, match in CONFIGS[1:]:
        llm = LLM(
            dtype="float32",
            max_slots=4,
            max_context=len(system) + 64,
            kv_budget=256 * MiB,
            prefix_match=match,
        )
        params = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([system[::-1] + questions[0]], params, use_tqdm=False)  # warm-up, sharing nothing
        for state, question in (("cold", questions[0]), ("system prompt cached", questions[1])):
            [out] = llm.generate([system + question], params, use_tqdm=False)
            computed = len(out.prompt_token_ids) - out.cached_tokens
            rows.append(
                {
                    "table": "one request",
                    "cache": f"{name}, {state}",
                    "ttft_p50_s": out.ttft,
                    "prompt_tokens_computed": computed,
                }
            )
        llm.close()
    return rows


def beam_forks(prompt: list[int], width: int = 4, max_tokens: int = 16) -> dict[str, Any]:
    """Bytes beam search's forks shared (mapped) and copied, on 64 KiB pages."""
    llm = LLM(
        dtype="float32",
        max_slots=8,
        max_context=len(prompt) + max_tokens + 1,
        kv_budget=256 * MiB,
        prefix_caching=False,
    )
    llm.beam_search([prompt], beam_width=width, max_tokens=max_tokens, use_tqdm=False)
    stats = llm.engine.stats().kv
    llm.close()
    counters = stats.counters
    return {
        "table": "beam search",
        "how": f"width {width}, {max_tokens} tokens",
        "tokens": len(prompt),
        "forks": counters.forks,
        "shared_bytes": counters.fork_shared_pages * stats.page_size,
        "copied_bytes": counters.fork_copied_bytes,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--short-system-tokens", type=int, default=150, help="a system prompt inside one unit")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--many-chats", type=int, default=12, help="chats of 3 turns, each returning after all the others"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a tiny run that checks the script")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.questions, args.system_tokens, args.chats, args.turns, args.many_chats = 4, 300, 2, 2, 4
    generator = torch.Generator().manual_seed(0)
    system, short = random_ids(generator, args.system_tokens), random_ids(generator, args.short_system_tokens)
    workloads = {
        "system prompt": [[system + random_ids(generator, 20)] for _ in range(args.questions)],
        "short system prompt": [[short + random_ids(generator, 20)] for _ in range(args.questions)],
        "multi-turn chat": [
            [random_ids(generator, 300 if turn == 0 else 40) for turn in range(args.turns)] for _ in range(args.chats)
        ],
        "many chats": [
            [random_ids(generator, 300 if turn == 0 else 40) for turn in range(3)] for _ in range(args.many_chats)
        ],
    }
    longest = max(args.system_tokens + 20, 300 + 40 * (args.turns - 1) + OUTPUT_TOKENS * args.turns) + 64
    rows: list[dict[str, Any]] = []
    runs = [(workload, name, caching, match, SHARE) for workload in workloads for name, caching, match in CONFIGS]
    sweep = [share for share in SHARE_SWEEP if share != SHARE]
    runs += [(workload, f"on, share {share}", True, "token", share) for workload in workloads for share in sweep]
    for workload, name, caching, match, share in tqdm(runs, desc="runs"):
        llm = LLM(
            dtype="float32",
            max_slots=16,
            max_context=longest,
            kv_budget=384 * MiB,
            prefix_caching=caching,
            prefix_match=match,
            prefix_cache_share=share,
        )
        figures = run_closed_loop(llm, workloads[workload], args.concurrency)
        llm.close()
        rows.append({"table": workload, "cache": name, "prefix_cache_share": share if caching else None, **figures})
    rows += fork_memory(args.system_tokens, 4)
    rows += single_prefill(system, [chat[0][len(system) :] for chat in workloads["system prompt"][:2]])
    rows.append(beam_forks(workloads["system prompt"][0][0]))
    payload = {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows}
    csv_path, json_path, png_path = write_results(args.out, "prefix_caching", rows, payload)
    for row in rows:
        print(
            "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "table"),
            f"({row['table']})",
        )
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    measured = [r for r in rows if "peak_held_kv_bytes" in r]
    workloads = list(dict.fromkeys(r["table"] for r in measured))
    fig, axes = plt.subplots(1, 5, figsize=(24, 4))
    width = 0.8 / len(CONFIGS)
    for axis, key, label in (
        (axes[0], "ttft_p50_s", "TTFT p50 (s)"),
        (axes[1], "prompt_tokens_computed", "prompt tokens computed"),
        (axes[2], "peak_active_kv_bytes", "peak KV bytes of running requests"),
        (axes[3], "peak_held_kv_bytes", "peak KV bytes held (mapped + cached)"),
    ):
        for offset, (name, *_) in enumerate(CONFIGS):
            values = [next(r[key] for r in measured if r["table"] == w and r["cache"] == name) for w in workloads]
            axis.bar([i + width * offset for i in range(len(workloads))], values, width=width, label=f"cache {name}")
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads, fontsize=8)
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    sweep = axes[4]
    for workload in workloads:
        points = sorted(
            (r["prefix_cache_share"], r["peak_held_kv_bytes"] / 1e6, r["hit_rate"])
            for r in measured
            if r["table"] == workload and r["prefix_cache_share"] is not None and r["cache"] != "on, whole units"
        )
        off = next(r["peak_held_kv_bytes"] / 1e6 for r in measured if r["table"] == workload and r["cache"] == "off")
        line = sweep.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=workload)[0]
        sweep.axhline(off, color=line.get_color(), linestyle=":", linewidth=1)
        for share, held, hits in points:
            sweep.annotate(f"{hits:.0%}", (share, held), fontsize=7, textcoords="offset points", xytext=(0, 4))
    sweep.set_xlabel("prefix_cache_share (labels: hit rate; dotted: cache off)")
    sweep.set_ylabel("peak KV MB held, matching to the token")
    sweep.legend(fontsize=7)
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
