"""Writes complete random-weight Qwen3-TTS checkpoint directories (configs, safetensors, a text tokenizer).

Tests and the embedded default model load these through exactly the code path a released checkpoint takes.
`write_checkpoint(dir, preset("0.6B"))` writes the full-size configs with random weights for speed work.
"""

from __future__ import annotations

import math
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
    frames_per_token: float | None = None,
) -> Path:
    """Writes a random-weight checkpoint directory and returns its path.

    `eos_logit_scale` multiplies the codec-head row of the codec EOS so that random weights stop on their
    own (random N(0, 0.02) weights almost never sample EOS). `frames_per_token` instead wires the talker so
    that it stops after about that many frames per text token (`shape_eos_for_length_`)."""
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
    if frames_per_token is not None:
        shape_eos_for_length_(tts, config, frames_per_token)
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


# Talker hidden dimensions that `shape_eos_for_length_` reserves: a text marker, the layer-0 average of
# that marker, and a constant that every codec-track embedding carries.
_MARK, _RATIO, _CONST = 0, 1, 2
# Entry sizes comparable to the N(0, 0.02) weights around them, so the reserved dimensions do not dominate
# the RMS norms that every other feature of the random model passes through.
_MARK_VALUE = _CONST_VALUE = 0.05
_RATIO_GAIN = 0.05  # the average marker read is ~1 (a normalised 0.05 among entries of ~0.05): scale it down


@torch.no_grad()
def shape_eos_for_length_(tts: Qwen3TTSModel, config: Qwen3TTSConfig, frames_per_token: float = 4.0,
                          sharpness: float = 400.0) -> None:
    """Wires a random talker so that it samples codec EOS after about `frames_per_token` frames per text
    token, as a trained model does, instead of never (random weights) or at a fixed rate.

    The talker can count: one attention head of layer 0 with zero queries attends uniformly over every
    position so far, and reads a marker that only text-track embeddings of real text carry. Its output, the
    share of text among all positions, falls as frames are generated; it is kept in a dimension no other
    weight writes to, and the codec head's EOS row compares it with a constant (carried by every codec-track
    embedding) through the final RMS norm, which scales both alike. EOS wins once the share falls below a
    threshold set from the marker's mean normalised size, so the length grows with the text. Everything else
    stays random (the model still makes noise). Written for the embedded default's non-streaming prompt
    layout (the whole text in the prompt); other layouts stop too, at other rates."""
    tc = config.talker_config
    if tc.hidden_size < 8 or tc.num_attention_heads < 1:
        raise ValueError("shape_eos_for_length_ needs a talker of width >= 8")
    talker = tts.talker
    reserved = [_MARK, _RATIO, _CONST]
    text_emb = talker.model.text_embedding.weight
    text_emb[:, 0] = 1.0  # text-hidden feature 0 flags real text; the tts control tokens do not carry it
    text_emb[[config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id], 0] = 0.0
    fc1, fc2 = talker.text_projection.linear_fc1, talker.text_projection.linear_fc2
    fc1.weight[0].zero_()
    fc1.weight[0, 0], fc1.bias[0] = 4.0, 0.0
    fc1.weight[1:, 0] = 0.0  # the flag reaches no other text feature
    fc2.weight[reserved] = 0.0
    fc2.bias[reserved] = 0.0
    fc2.weight[:, 0] = 0.0
    fc2.weight[_MARK, 0] = _MARK_VALUE / torch.nn.functional.silu(torch.tensor(4.0)).item()
    for table in [talker.model.codec_embedding, *talker.code_predictor.model.codec_embedding]:
        table.weight[:, reserved] = 0.0
    talker.model.codec_embedding.weight[:, _CONST] = _CONST_VALUE
    hd = tc.head_dim
    for i, layer in enumerate(talker.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj.weight[reserved] = 0.0
        mlp.down_proj.weight[reserved] = 0.0
        layer.input_layernorm.weight[reserved] = 1.0
        if i == 0:  # head 0: uniform attention over the marker, written to the ratio dimension
            attn.q_proj.weight[:hd] = 0.0
            attn.v_proj.weight[0] = 0.0
            attn.v_proj.weight[0, _MARK] = 1.0
            attn.o_proj.weight[:, 0] = 0.0
            attn.o_proj.weight[_RATIO, 0] = _RATIO_GAIN
    talker.model.norm.weight[reserved] = 1.0
    # The share of text the uniform head reads at the point to stop: a prompt of T text tokens (plus the
    # role tokens) stops near frames_per_token * T frames when the share falls to mean_mark / (k + 1).
    pad = talker.model.codec_embedding.weight[tc.codec_pad_id]
    body = talker.embed_text(torch.arange(min(tc.text_vocab_size, 4096))) + pad
    mean_mark = (body[:, _MARK] / body.pow(2).mean(-1).sqrt()).mean().item()
    threshold = mean_mark / (frames_per_token + 1.0)
    head = talker.codec_head.weight
    head[:, reserved] = 0.0  # no other logit reads the counting dimensions
    eos = head[tc.codec_eos_token_id]
    eos.zero_()
    eos[_CONST] = sharpness * threshold / _CONST_VALUE
    eos[_RATIO] = -sharpness / _RATIO_GAIN


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
        speech_tokenizer=_decoder_fp32(codec.to(codec_dtype).eval()),
        text_tokenizer=TextTokenizer.from_dir(tok_dir),
        generation_defaults=dict(defaults),
    )


# Below 1 so the 12 residual units of the vocoder do not blow activations up (the output would then sit
# on the ±1 clamp, where a wrong layer can hide); 0.7 keeps the waveform at std ~0.05 (tiny) to ~0.25 (full).
MATRIX_GAIN = 0.7


def randomize_codec_decoder_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrites every parameter of `module` in place with random values and returns it.

    The reference init leaves many parameters constant (codebooks zero, cluster usage one, layer scales
    0.01, SnakeBeta zeros, ConvNeXt gains 1e-6), which would hide wrong wiring. Matrices and conv kernels
    get N(0, gain²/fan_in) so activations stay O(1) at any width; norm weights get 1 + noise; cluster
    usage stays positive; every other vector gets N(0, 0.1²).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if leaf == "cluster_usage":
                value = torch.rand(p.shape, generator=gen) * 2 + 0.05
            elif leaf == "embedding_sum":
                value = torch.randn(p.shape, generator=gen) * 0.3
            elif leaf == "weight" and "norm" in owner.rpartition(".")[2]:
                value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
            elif p.ndim >= 2:
                value = torch.randn(p.shape, generator=gen) * (MATRIX_GAIN / math.sqrt(math.prod(p.shape[1:])))
            else:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(value)
    return module


def _decoder_fp32(codec: SpeechTokenizer) -> SpeechTokenizer:
    """As the loader: the decoder stays fp32, the source of the streaming decoder's serving copy."""
    codec.decoder.float()
    return codec
