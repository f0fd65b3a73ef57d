"""Writes complete random-weight Qwen3-TTS checkpoint directories (configs, safetensors, a text tokenizer).

Tests and the embedded default model load these through exactly the code path a released checkpoint takes.
`write_checkpoint(dir, preset("0.6B"))` writes the full-size configs with random weights for speed work.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from .config import Qwen3TTSConfig, SpeechTokenizerConfig
from .loader import GENERATION_DEFAULTS, write_json
from .model import Qwen3TTSModel, SpeechTokenizer
from .text_tokenizer import TextTokenizer
from .tiny import tiny_config, tiny_speech_tokenizer_config

# The special tokens of the Qwen2 vocabulary that Qwen3-TTS prompts use, at their real ids.
SPECIAL_TOKENS = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151671: "<tts_pad>",
    151672: "<tts_text_bos>",
    151673: "<tts_text_eod>",
}

_CORPUS = """\
<|im_start|>assistant
<|im_start|>user
The quick brown fox jumps over the lazy dog. Please call Stella and ask her to bring these things with her
from the store: six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a snack for her
brother Bob. Hello, world! How are you today? I'm fine, thanks; it's 12:30 and we'll meet at 7 p.m.
Speak in a warm, calm voice, like a narrator reading a bedtime story. A cheerful young woman, fast and bright.
今天天气很好，我们一起去公园散步吧。你好，世界！欢迎使用语音合成服务。
Bonjour tout le monde. Guten Tag! Hola, ¿cómo estás? こんにちは。안녕하세요.
"""


def write_text_tokenizer(out_dir: Path, vocab_size: int = 1000) -> None:
    """Trains a small byte-level BPE on a fixed corpus (deterministic) and writes it in the Qwen2 file
    layout: `vocab.json`, `merges.txt`, `tokenizer_config.json` with the special tokens at their real ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.replace("<|im_start|>", "").splitlines() + ["assistant", "user"], trainer)
    tok.model.save(str(out_dir))
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "add_prefix_space": False,
            "errors": "replace",
            "model_max_length": 131072,
            "added_tokens_decoder": {
                str(i): {"content": c, "special": True, "lstrip": False, "rstrip": False, "normalized": False}
                for i, c in SPECIAL_TOKENS.items()
            },
        },
    )
    # The prompt templates slice by position and need these to be single tokens.
    loaded = TextTokenizer.from_dir(out_dir)
    for word in ("assistant", "user", "\n"):
        if len(loaded.encode(word)) != 1:
            raise RuntimeError(f"tiny tokenizer splits {word!r}; enlarge the vocabulary")


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """N(0, std) for every linear and embedding matrix (the released models' init), module defaults for
    vectors and convolutions (whose fan-in scaling keeps codec activations in range), and random
    codebooks (`embed_sum`/`embedding_sum` tensors) so encoder and decoder lookups are not degenerate."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            if name.endswith(("embed_sum", "embedding_sum")):
                t.copy_(torch.randn(t.shape, generator=gen))
            elif name.endswith(("cluster_usage",)):
                t.fill_(1.0)
            elif isinstance(t, torch.nn.Parameter) and t.dim() == 2:
                t.copy_(torch.randn(t.shape, generator=gen) * std)


def write_checkpoint(
    out_dir: str | Path,
    config: Qwen3TTSConfig | None = None,
    speech_config: SpeechTokenizerConfig | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    eos_logit_scale: float | None = None,
) -> Path:
    """Writes a random-weight checkpoint directory and returns its path.

    `eos_logit_scale` multiplies the codec-head row of the codec EOS so that random weights stop on their
    own (random N(0, 0.02) weights almost never sample EOS)."""
    out = Path(out_dir)
    (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    speech_config = speech_config or tiny_speech_tokenizer_config()

    torch.manual_seed(seed)
    tts = Qwen3TTSModel(config)
    randomize_(tts, seed)
    if eos_logit_scale is not None:
        eos = config.talker_config.codec_eos_token_id
        with torch.no_grad():
            tts.talker.codec_head.weight[eos].mul_(eos_logit_scale)
    codec = SpeechTokenizer(speech_config)
    randomize_(codec, seed + 1)

    write_json(out / "config.json", config.to_dict())
    write_json(out / "generation_config.json", dict(GENERATION_DEFAULTS))
    write_json(out / "speech_tokenizer" / "config.json", speech_config.to_dict())
    _save(tts, out / "model.safetensors", dtype)
    # The codec is stored in fp32, as released.
    _save(codec, out / "speech_tokenizer" / "model.safetensors", torch.float32)
    write_text_tokenizer(out)
    return out


def _save(module: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in module.state_dict().items()
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def random_model(
    config: Qwen3TTSConfig,
    speech_config: SpeechTokenizerConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    codec_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
):
    """A `LoadedModel` with random weights built directly on `device`, for speed work on full-size configs
    (writing and reading GBs of random safetensors would only measure the disk). The text tokenizer is the
    small test one: the ids it produces are valid for any Qwen3-TTS text vocabulary."""
    from .default import cache_dir
    from .loader import GENERATION_DEFAULTS as defaults
    from .loader import LoadedModel

    tok_dir = Path(tokenizer_dir) if tokenizer_dir else cache_dir() / "random-model-tokenizer"
    if not (tok_dir / "tokenizer_config.json").is_file():
        tok_dir.mkdir(parents=True, exist_ok=True)
        write_text_tokenizer(tok_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        tts = Qwen3TTSModel(config)
        codec = SpeechTokenizer(speech_config)
    randomize_(tts, seed)
    randomize_(codec, seed + 1)
    return LoadedModel(
        path=tok_dir,
        config=config,
        speech_config=speech_config,
        model=tts.to(dtype).eval(),
        speech_tokenizer=codec.to(codec_dtype).eval(),
        text_tokenizer=TextTokenizer.from_dir(tok_dir),
        generation_defaults=dict(defaults),
    )
