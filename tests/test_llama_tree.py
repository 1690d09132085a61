"""serving.model.llama's tree against transformers' own models: the same weights by name and
shape, the same rotary tables, the default checkpoint read to the same numbers, and loading it
without importing transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from serving.default_model import ensure_default_model
from serving.model.llama import CausalLM, ModelConfig, RotaryEmbedding
from serving.model.loader import load_model, read_weights

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
}
LEGACY_LLAMA3 = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
}


def transformers_config(raw: dict[str, Any]) -> Any:
    return AutoConfig.for_model(**raw)


@pytest.mark.parametrize(
    "raw",
    [
        {"model_type": "llama", **SMALL},
        {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        {"model_type": "qwen2", **SMALL},
        {"model_type": "mistral", **SMALL, "head_dim": 32},
    ],
    ids=["llama", "llama-biases", "qwen2", "mistral"],
)
def test_the_tree_names_and_shapes_transformers_weights(raw: dict[str, Any]) -> None:
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(transformers_config(raw))
    ours = CausalLM(ModelConfig.from_dict(raw))
    expected = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    assert {name: tuple(p.shape) for name, p in ours.named_parameters()} == expected


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
        LEGACY_LLAMA3,
        {"rope_theta": 20000.0},
    ],
    ids=["default", "linear", "yarn", "legacy-llama3", "legacy-theta"],
)
def test_the_rotary_tables_are_transformers(rope: dict[str, Any]) -> None:
    raw = {"model_type": "llama", **SMALL, **rope}
    reference_config = transformers_config(json.loads(json.dumps(raw)))
    ours = RotaryEmbedding(ModelConfig.from_dict(raw))
    reference = LlamaRotaryEmbedding(reference_config)
    x, positions = torch.zeros(1, dtype=torch.float32), torch.arange(0, 4096, 7)[None]
    for got, want in zip(ours(x, positions), reference(x, positions), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_what_the_tree_cannot_hold_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="model type 'gemma' is not supported; supported: llama, mistral, qwen2"):
        ModelConfig.from_dict({"model_type": "gemma", **SMALL})
    dynamic = {"model_type": "llama", **SMALL, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        ModelConfig.from_dict(dynamic)
    config = ModelConfig.from_dict({"model_type": "llama", **SMALL})
    weights = {name: torch.zeros(p.shape) for name, p in CausalLM(config).named_parameters()}
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 weights the model needs: model\.layers\.1\.mlp\.up_proj\.weight"):
        CausalLM.of(config, weights, torch.float32)
    weights |= {"model.layers.1.mlp.up_proj.weight": torch.zeros(96, 64), "model.layers.9.extra": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"holds 1 unknown weights: model\.layers\.9\.extra"):
        CausalLM.of(config, weights, torch.float32)


def test_the_default_checkpoint_reads_to_transformers_numbers() -> None:
    folder = ensure_default_model()
    ours, tokenizer = load_model(folder, torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    state = ours.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied, as transformers ties it
    assert ours.config.eos_token_ids == (reference.generation_config.eos_token_id,)
    assert tokenizer("Hello world")["input_ids"] == [19556, 905]


def test_loading_a_checkpoint_imports_no_transformers_modeling() -> None:
    """transformers' modeling and configuration import torch.distributed.tensor and dynamo (4-6 s a
    process on a 2-core VM): each server start would pay them."""
    script = (
        "import sys, torch\n"
        "from serving.default_model import ensure_default_model\n"
        "from serving.model.loader import load_model\n"
        "load_model(ensure_default_model(), torch.float32)\n"
        "heavy = ('torch._dynamo', 'torch.distributed.tensor', 'transformers.modeling_utils')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stderr


def test_the_weights_are_the_files_transformers_reads(tmp_path: Path) -> None:
    """The index's shards, else model.safetensors, else every .safetensors at the folder's top: a
    Mistral repository's consolidated.safetensors (another naming) beside them is not read."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(1)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"layers.0.attention.wq.weight": torch.ones(1)}, tmp_path / "consolidated.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(read_weights(tmp_path)) == ["a", "b"]
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"c": torch.ones(1)}, tmp_path / "model.safetensors")
    assert sorted(read_weights(tmp_path)) == ["c"]
    (tmp_path / "model.safetensors").unlink()
    assert sorted(read_weights(tmp_path)) == ["a", "b", "layers.0.attention.wq.weight"]
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ValueError, match=r"holds no \.safetensors weights"):
        read_weights(tmp_path)


@pytest.mark.parametrize(
    "raw",
    [
        {"model_type": "qwen2", **SMALL, "vocab_size": 1024, "tie_word_embeddings": True},
        {"model_type": "mistral", **SMALL, "vocab_size": 1024, "head_dim": 32, **LEGACY_LLAMA3},
    ],
    ids=["qwen2-tied-biases", "mistral-head-dim-llama3-rope"],
)
def test_a_saved_checkpoint_serves_transformers_greedy_tokens(raw: dict[str, Any], tmp_path: Path) -> None:
    """transformers' own model of another architecture, saved as a checkpoint (safetensors,
    config, tokenizer), then served from the folder: the engine's greedy tokens are its generate's."""
    from serving import LLM, SamplingParams
    from serving.model.synthetic import build_tokenizer

    reference = AutoModelForCausalLM.from_config(transformers_config(raw)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # scales that part the logits (transformers' 0.02 leaves near-ties)
        for name, parameter in reference.named_parameters():
            std = 1.0 if "embed" in name or parameter.dim() == 1 else parameter.shape[-1] ** -0.5
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    reference.save_pretrained(tmp_path)
    build_tokenizer(raw["vocab_size"]).save_pretrained(tmp_path)
    prompt = torch.randint(0, 1000, (24,), generator=generator).tolist()
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    llm = LLM(model=str(tmp_path), dtype="float32", max_slots=2, max_context=64, kv_budget=8 << 20)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
    finally:
        llm.close()
    assert output.token_ids == expected[0, len(prompt) :].tolist()
