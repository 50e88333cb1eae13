"""Export for inference / HF: the checkpoint's weights as one plain state dict that HF's unchanged
LlamaForCausalLM loads with ``save_pretrained`` / ``from_pretrained`` (names match; values bit-equal)."""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint
from vescale.zoo import tiny_hf_llama


def test_export_feeds_hf_save_pretrained(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_hf_llama()
    checkpoint.save(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()), step=1)
    weights = checkpoint.export(tmp_path / "ckpt", tmp_path / "weights.pt")
    assert all(type(t) is torch.Tensor for t in weights.values())
    assert not any(k.startswith(("optim", "state")) for k in weights)  # model weights only

    model.save_pretrained(tmp_path / "hf", state_dict=weights)
    torch.manual_seed(1)
    reloaded = type(model).from_pretrained(tmp_path / "hf")
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
