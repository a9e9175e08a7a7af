"""MODEL arguments: resolve (local HF folder | Hub id | GGUF file), fingerprint and load."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ..format.gguf_read import GGUFMeta, read_gguf_metadata
from ..pypi_models import sha256_file
from .capture_hf import HF_TO_GGUF_ARCH, UnsupportedModelError

# GGUF architectures the transformers backend can load through gguf_file= and capture
HF_CAPTURE_GGUF_ARCHS = {"llama", "qwen2", "qwen3", "gemma3"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelError(ValueError):
    """MODEL cannot be used; the message says what to do."""


@dataclass
class ModelRef:
    kind: str          # "gguf" | "hf"
    path: Path         # the GGUF file or the HF model folder
    name: str          # as the user gave it (path or Hub id)


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model(spec: str) -> ModelRef:
    p = Path(spec).expanduser()
    if p.is_file():
        if not is_gguf(p):
            raise ModelError(f"MODEL {p} is a file but not a GGUF; pass a .gguf file or a Hugging Face model folder")
        return ModelRef("gguf", p.resolve(), spec)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelRef("hf", p.resolve(), spec)
        ggufs = sorted(p.glob("*.gguf"))
        hint = f" (it holds {', '.join(g.name for g in ggufs[:3])}: pass the .gguf file itself)" if ggufs else ""
        raise ModelError(f"MODEL {p} has no config.json, so it is not a Hugging Face model folder{hint}")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return ModelRef("hf", _download(spec), spec)
    raise ModelError(f"MODEL {spec} not found: pass a local Hugging Face model folder, a GGUF file, "
                     f"or a Hub id like org/name")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                               "tokenizer*"]))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"could not fetch {repo_id} from the Hugging Face Hub ({msg}); "
                         f"check the id and your network, or pass a local folder") from None


def fingerprint(ref: ModelRef) -> str:
    """sha256 of the GGUF file, or of an HF folder's config.json followed by its first weight shard."""
    if ref.kind == "gguf":
        return sha256_file(ref.path)
    h = hashlib.sha256((ref.path / "config.json").read_bytes())
    shards = sorted(ref.path.glob("*.safetensors")) or sorted(ref.path.glob("pytorch_model*.bin"))
    if shards:
        h.update(bytes.fromhex(sha256_file(shards[0])))
    return h.hexdigest()


def gguf_architecture(path: Path, meta: GGUFMeta | None = None) -> str:
    """general.architecture of a GGUF (meta: its header, when already read)."""
    arch = (meta or read_gguf_metadata(path)).get("general.architecture")
    if not arch:
        raise ModelError(f"{path} has no general.architecture; is it a model GGUF?")
    return str(arch)


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise ModelError(f"--device must be cpu, cuda or auto, not {device!r}")
    return device


def load_hf(ref: ModelRef, device: str = "cpu"):
    """(model, tokenizer, gguf_arch) through transformers; float32 on CPU, bf16 on CUDA with
    accelerate's device_map="auto" spreading layers over the visible GPUs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .capture_hf import gguf_architecture as hf_arch, text_config

    hf_logging.set_verbosity_error()
    kwargs: dict = {}
    if device == "cuda":
        kwargs.update(dtype=torch.bfloat16, device_map="auto")
    else:
        kwargs.update(dtype=torch.float32)
    try:
        if ref.kind == "gguf":
            arch = gguf_architecture(ref.path)
            if arch not in HF_CAPTURE_GGUF_ARCHS:
                raise UnsupportedModelError(
                    f"GGUF architecture {arch!r} is not supported by the transformers backend "
                    f"(supported: {', '.join(sorted(HF_CAPTURE_GGUF_ARCHS))}); use --backend llama")
            src, extra = str(ref.path.parent), {"gguf_file": ref.path.name}
        else:
            src, extra = str(ref.path), {}
            arch = hf_arch(text_config(AutoConfig.from_pretrained(src)))
        tok = AutoTokenizer.from_pretrained(src, **extra)
        model = AutoModelForCausalLM.from_pretrained(src, **extra, **kwargs)
    except (UnsupportedModelError, ModelError):
        raise
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"transformers could not load {ref.name} ({msg})") from None
    model.eval()
    if device == "cuda" and not hasattr(model, "hf_device_map"):
        model.to("cuda")
    return model, tok, arch


def hf_encode(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_bos_prefix(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before a text (BOS for most models, none for SmolLM2)."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(plain)
    if n > 0 and with_special[n:] == plain:
        return list(with_special[:n])
    return []


def supported_hf_types() -> str:
    return ", ".join(sorted(HF_TO_GGUF_ARCH))
