"""The SAE family: known codes from given weights, normalization undone in raw space, sae.pt round trip."""

import pytest
import torch

from saeflow.errors import SaeflowError
from saeflow.training.sae import SAE, load_sae, save_sae
from saeflow.training.specs import SAEConfig


def _identity_sae(arch: str, k: int = 2, scale: float = 1.0, threshold: float = 0.0) -> SAE:
    eye = torch.eye(4)
    return SAE.from_weights(eye, torch.zeros(4), eye, torch.zeros(4), arch=arch, k=k, scale=scale, threshold=threshold)


def test_known_codes_per_arch():
    x_bd = torch.tensor([[3.0, -1.0, 2.0, 0.5], [0.1, 0.2, 0.3, 4.0]])
    assert torch.equal(_identity_sae("relu").encode(x_bd), torch.relu(x_bd))
    topk = _identity_sae("topk", k=2).encode(x_bd)
    assert torch.equal(topk, torch.tensor([[3.0, 0, 2.0, 0], [0, 0, 0.3, 4.0]]))
    # BatchTopK in eval keeps what exceeds the stored threshold, per vector.
    assert torch.equal(
        _identity_sae("batchtopk", threshold=1.0).encode(x_bd), torch.tensor([[3.0, 0, 2, 0], [0, 0, 0, 4]])
    )
    sae = _identity_sae("batchtopk", k=2).train()
    f_bs = sae.encode(x_bd)
    assert (f_bs > 0).sum() == 4 and f_bs[0, 0] == 3.0 and f_bs[1, 3] == 4.0


def test_normalization_is_undone_in_raw_space():
    sae = _identity_sae("relu", scale=0.5)
    x_bd = torch.tensor([[2.0, 4.0, 6.0, 8.0]])
    x_hat_bd, f_bs = sae(x_bd)
    assert torch.allclose(f_bs, x_bd * 0.5)
    assert torch.allclose(x_hat_bd, x_bd)


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_model=8, d_sae=32, arch="batchtopk", k=3, matryoshka=(4, 16)))
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_()
        sae.scale.fill_(0.25)
        sae.threshold.fill_(0.5)
    fpath = tmp_path / "sae.pt"
    save_sae(sae, fpath)
    loaded = load_sae(fpath)
    assert not loaded.training and loaded.cfg == sae.cfg and (loaded.d_model, loaded.d_sae) == (8, 32)
    x_bd = torch.randn(5, 8)
    sae.eval()
    assert torch.equal(loaded(x_bd)[0], sae(x_bd)[0])
    assert [p.name for p in tmp_path.iterdir()] == ["sae.pt"]  # no temporary left behind


def test_bad_checkpoints_and_configs(tmp_path):
    with pytest.raises(SaeflowError, match="no such SAE checkpoint"):
        load_sae(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(SaeflowError, match="junk.pt"):
        load_sae(junk)
    with pytest.raises(SaeflowError, match="architecture"):
        SAEConfig(d_model=4, d_sae=8, arch="nope", k=1)
    with pytest.raises(SaeflowError, match="matryoshka"):
        SAEConfig(d_model=4, d_sae=8, arch="topk", k=2, matryoshka=(4, 2))
    with pytest.raises(SaeflowError, match=r"k: k=9 must be in \[1, d_sae=8\]"):
        SAEConfig(d_model=4, d_sae=8, arch="topk", k=9)


def test_decoder_geometry():
    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_model=6, d_sae=10, arch="relu", k=1))
    with torch.no_grad():
        sae.W_dec.normal_()
    sae.normalize_decoder()
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(10), atol=1e-6)
    sae.W_dec.grad = torch.randn(10, 6)
    sae.remove_parallel_grad()
    assert torch.allclose((sae.W_dec.grad * sae.W_dec).sum(-1), torch.zeros(10), atol=1e-6)
