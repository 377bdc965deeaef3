"""Model adapters: stored vectors equal the model's own hidden states; early exit (identity: test_model_identity.py)."""

import json

import numpy as np
import pytest
import torch

from builders import ARCH_CONFIGS, MINILM, TEXT_ARCHS, text_spec, typed, vision_spec
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract, models, tokenization
from saeflow.store import shards


def _reference_hidden_states(plan_, sd: shards.ShardDir):
    """The model's own output_hidden_states on the exact inputs the extraction used."""
    adapter = adapters.load(plan_.model_spec, "float32", "cpu", info=plan_.info)
    if plan_.info.modality == "vision":
        x = torch.from_numpy(np.stack([plan_.dataset.example(i, plan_.preprocess)[0] for i in range(sd.n_ex)]))
        out = adapter.model(pixel_values=x, output_hidden_states=True)
    else:
        x = torch.from_numpy(np.array(sd.aux("tokens.bin"), dtype=np.int64))
        out = adapter.model(input_ids=x, output_hidden_states=True)
    return adapter, out.hidden_states


def _final_norm(model):
    """GPT-2 / Llama apply this to their last hidden_states entry (we store the raw residual instead)."""
    return getattr(model, "ln_f", None) or getattr(model, "norm", None)


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_stored_vectors_equal_hidden_states(arch, shards_root):
    spec = text_spec(arch) if arch in TEXT_ARCHS else vision_spec(arch)
    plan_ = extract.plan(typed(spec))
    result = extract.extract(typed(spec), shards_root, progress=False)
    sd = shards.ShardDir(result.dpath)
    adapter, hidden = _reference_hidden_states(plan_, sd)
    n_layers = plan_.info.n_layers
    assert list(sd.metadata.layers) == [0, n_layers - 1]
    for layer in sd.metadata.layers:
        stored_ntd = torch.from_numpy(np.stack([sd.example(i, layer) for i in range(sd.n_ex)]))
        ref_ntd = hidden[layer + 1]
        if arch == "dinov2_with_registers":  # registers sit between CLS and the patches; not stored
            ref_ntd = torch.cat([ref_ntd[:, :1], ref_ntd[:, 1 + ARCH_CONFIGS[arch]["num_register_tokens"] :]], 1)
        if layer == n_layers - 1 and arch in ("gpt2", "llama"):
            stored_ntd = _final_norm(adapter.model)(stored_ntd)
        assert stored_ntd.shape == ref_ntd.shape
        torch.testing.assert_close(stored_ntd, ref_ntd.float(), atol=1e-5, rtol=0)
    expected_tokens = {"siglip_vision_model": 16, "gpt2": 16, "llama": 16, "bert": 16}.get(arch, 17)
    assert sd.metadata.tokens_per_ex == expected_tokens
    assert sd.metadata.cls_token == (expected_tokens == 17)


def test_real_minilm_matches_hidden_states(shards_root):
    spec = {
        "model": {"name": MINILM},
        "layers": [2, -1],
        "dataset": {"kind": "builtin_text", "n_ex": 3},
        "context_length": 24,
        "device": "cpu",
    }
    plan_ = extract.plan(typed(spec))
    sd = shards.ShardDir(extract.extract(typed(spec), shards_root, progress=False).dpath)
    _, hidden = _reference_hidden_states(plan_, sd)
    ids = np.array(sd.aux("tokens.bin"))
    assert (ids[:, 0] == 101).all() and (ids[:, -1] == 102).all()  # [CLS] ... [SEP]
    for layer in (2, 5):
        stored_ntd = torch.from_numpy(np.stack([sd.example(i, layer) for i in range(sd.n_ex)]))
        torch.testing.assert_close(stored_ntd, hidden[layer + 1], atol=1e-5, rtol=0)


def test_forward_stops_after_deepest_requested_block():
    spec = models.ModelSpec(random_arch="vit", random_config=ARCH_CONFIGS["vit"])
    adapter = adapters.load(spec)
    ran = []
    handles = [b.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, b in enumerate(adapter.blocks)]
    acts = adapter.run(torch.zeros(1, 3, 32, 32), layers=(0, 1))
    for handle in handles:
        handle.remove()
    assert sorted(acts) == [0, 1] and ran == [0, 1]  # block 2 never ran


def test_negative_layers_resolve_before_hashing():
    last = ARCH_CONFIGS["vit"]["num_hidden_layers"] - 1
    h1 = extract.plan_activation(typed(vision_spec(layers=[-1]))).hash
    h2 = extract.plan_activation(typed(vision_spec(layers=[last]))).hash
    h3 = extract.plan_activation(typed(vision_spec(layers=[-1, 0]))).hash
    h4 = extract.plan_activation(typed(vision_spec(layers=[0, last]))).hash
    assert h1 == h2 and h3 == h4 and h1 != h3


@pytest.mark.parametrize("layers", [[3], [-4], [1, -2]])
def test_layer_out_of_range_or_repeated(layers):
    with pytest.raises(SaeflowError, match="out of range|same block"):
        extract.plan_activation(typed(vision_spec(layers=layers)))


def test_unknown_model_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SaeflowError, match="unknown model 'nobody/no-such-model'.*HF_HUB_OFFLINE"):
        models.describe(models.ModelSpec(name="nobody/no-such-model"))
    with pytest.raises(SaeflowError, match="no config.json"):
        models.describe(models.ModelSpec(name=str(tmp_path)))


def test_unsupported_architecture(tmp_path):
    local = tmp_path / "weird"
    local.mkdir()
    config = {"model_type": "gpt_neo"}
    (local / "config.json").write_text(json.dumps(config))
    with pytest.raises(SaeflowError, match="unsupported architecture 'gpt_neo'"):
        models.describe(models.ModelSpec(name=str(local)))


def test_bfloat16_compute_is_close_and_hashed(shards_root):
    md32 = extract.plan_activation(typed(vision_spec()))
    md16 = extract.plan_activation(typed(vision_spec(compute_dtype="bfloat16")))
    assert md32.hash != md16.hash and md16.data["compute_dtype"] == "bfloat16"
    sd32 = shards.ShardDir(extract.extract(typed(vision_spec()), shards_root, progress=False).dpath)
    sd16_dpath = extract.extract(typed(vision_spec(compute_dtype="bfloat16")), shards_root, progress=False).dpath
    sd16 = shards.ShardDir(sd16_dpath)
    a, b = sd32.example(0, 2), sd16.example(0, 2)
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 0.1 * np.abs(a).max()


@pytest.mark.parametrize("arch", sorted(models.CONFIG_DEFAULTS))
def test_planning_defaults_match_transformers(arch):
    """Planning reads config.json without transformers; its defaults table must agree with transformers."""
    import transformers

    config = transformers.AutoConfig.for_model(arch)
    assert {k: getattr(config, k) for k in models.CONFIG_DEFAULTS[arch]} == models.CONFIG_DEFAULTS[arch]


def test_packing_tokenizer_matches_transformers_tokenizer():
    import transformers

    info = models.describe(models.ModelSpec(name=MINILM))
    fast, hf = tokenization.packing_tokenizer(info, None), transformers.AutoTokenizer.from_pretrained(MINILM)
    texts = ["Hello, World! Déjà vu.", "x" * 3000, "def f(a, b):\n    return a ** b  # comment"]
    assert list(tokenization.tokenize(fast, texts)) == hf(texts, add_special_tokens=False)["input_ids"]
    assert tokenization.special_tokens(fast) == ((hf.cls_token_id,), (hf.sep_token_id,))
    assert tokenization.load_tokenizer(info, None)("a b")["input_ids"] == hf("a b")["input_ids"]


def test_local_vision_checkpoint_uses_its_preprocessor_config(tmp_path, shards_root):
    spec = models.ModelSpec(random_arch="dinov2", random_config=ARCH_CONFIGS["dinov2"])
    adapters.build(models.describe(spec), spec).save_pretrained(tmp_path / "tiny-dino")
    (tmp_path / "tiny-dino" / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "size": {"shortest_edge": 40}, "crop_size": {"height": 24, "width": 24},
        "image_mean": [0.4, 0.4, 0.4], "image_std": [0.2, 0.2, 0.2],
    }))
    info = models.describe(models.ModelSpec(name=str(tmp_path / "tiny-dino")))
    assert (info.resize_size, info.image_size, info.patches_per_ex, info.mean) == (40, 24, 9, (0.4, 0.4, 0.4))
    assert info.ckpt.startswith("tiny-dino@local-")
    vspec = vision_spec("dinov2", model={"name": str(tmp_path / "tiny-dino")})
    sd = shards.ShardDir(extract.extract(typed(vspec), shards_root, progress=False).dpath)
    assert sd.metadata.data["preprocess"]["settings"]["size"] == {"shortest_edge": 40}  # its own processor
    assert sd.metadata.tokens_per_ex == 10
    _, hidden = _reference_hidden_states(extract.plan(typed(vspec)), sd)
    torch.testing.assert_close(torch.from_numpy(sd.example(3, 0)), hidden[1][3], atol=1e-5, rtol=0)


def test_full_clip_checkpoint_uses_its_vision_tower(tmp_path, shards_root):
    """Real CLIP checkpoints hold text + vision towers (model_type "clip"); extraction runs the vision tower."""
    import transformers

    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
        vision_config=ARCH_CONFIGS["clip_vision_model"],
        projection_dim=8,
    )
    torch.manual_seed(0)
    clip = transformers.CLIPModel(config).eval()
    clip.save_pretrained(tmp_path / "tiny-clip")
    spec = vision_spec("clip_vision_model", model={"name": str(tmp_path / "tiny-clip")}, layers=[1])
    plan_ = extract.plan(typed(spec))
    assert (plan_.metadata.family, plan_.info.model_type, plan_.metadata.tokens_per_ex) == (
        "clip", "clip_vision_model", 17
    )
    sd = shards.ShardDir(extract.extract(typed(spec), shards_root, progress=False).dpath)
    x = torch.from_numpy(plan_.dataset.example(0, plan_.preprocess)[0])[None]
    hidden = clip.vision_model(pixel_values=x, output_hidden_states=True).hidden_states
    torch.testing.assert_close(torch.from_numpy(sd.example(0, 1)), hidden[2][0], atol=1e-5, rtol=0)
