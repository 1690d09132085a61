"""Run inside vLLM's venv (`make peer-vllm`) by benchmarks.quality: each window's prompt
log-probabilities through vLLM's own `prompt_logprobs`, the scored positions' log-probability of
the text's token and vLLM's most likely token there.

    .peers/vllm/bin/python benchmarks/peer_drivers/vllm_logprobs.py MODEL_DIR WINDOWS.json OUT.json FIRST_SCORED
"""

import json
import os
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    model, windows_path, out_path, first_scored = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(windows_path) as file:
        windows = json.load(file)
    llm = LLM(model=model, dtype="float32", max_model_len=len(windows[0]) + 8, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params)
    logprobs, argmax = [], []
    for window, output in zip(windows, outputs, strict=True):
        for position in range(first_scored, len(window)):
            entry = output.prompt_logprobs[position]
            logprobs.append(entry[window[position]].logprob)
            argmax.append(next(token for token, value in entry.items() if value.rank == 1))
    with open(out_path, "w") as file:
        json.dump({"logprobs": logprobs, "argmax": argmax}, file)
    # vLLM's engine threads can abort the interpreter's teardown (seen here: SIGABRT, "terminate
    # called without an active exception", after a long run's results were written).
    os._exit(0)


if __name__ == "__main__":
    main()
