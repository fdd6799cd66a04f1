"""mRoPE sections in `posdiag rope`: which pairs each position stream drives (chunked for Qwen2-VL, interleaved
for Qwen3-VL), with the critical pair, wavelengths and unseen phases per stream; a config without sections has none."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from posdiag.cli import app
from posdiag.testing.multimodal import small_config
from posdiag.tools import mrope, rope_math


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def test_layouts_match_transformers_recomposition():
    import torch
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    for model_type, rotary, kind in (("qwen2_vl", Qwen2VLRotaryEmbedding, "chunked"),
                                     ("qwen3_vl", Qwen3VLTextRotaryEmbedding, "interleaved")):
        config = small_config(model_type).get_text_config(decoder=True)
        assert mrope.layout(config, config.rope_parameters) == kind
        module = rotary(config)
        # stream s at position 1, the others at 0: the angle of pair i is nonzero exactly on s's pairs
        for s, pairs in mrope.stream_pairs(config.rope_parameters["mrope_section"], kind).items():
            pos = torch.zeros(3, 1, 1, dtype=torch.long)
            pos[mrope.STREAMS.index(s)] = 1
            _, sin = module(torch.zeros(1, dtype=torch.float32), pos)
            moved = np.flatnonzero(sin[0, 0, : len(module.inv_freq)].numpy() != 0.0)
            assert moved.tolist() == pairs.tolist(), (model_type, s)


@pytest.mark.parametrize("model_type, layout, pairs", [("qwen2_vl", "chunked", [4, 2, 2]),
                                                         ("qwen3_vl", "interleaved", [4, 2, 2])])
def test_rope_config_only_reports_sections(tmp_path, model_type, layout, pairs):
    small_config(model_type).save_pretrained(tmp_path)
    out = tmp_path / "rope.json"
    result = CliRunner().invoke(app, ["rope", str(tmp_path), "--config-only", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert f"mRoPE sections ({layout})" in result.output
    sections = json.loads(out.read_text())["rope"][0]["mrope_sections"]
    assert [s["stream"] for s in sections] == ["t", "h", "w"]
    assert [s["pairs"] for s in sections] == pairs
    freqs = rope_math.default_inv_freq(1e6 if model_type == "qwen2_vl" else 5e5, 16)
    lam = 2 * np.pi / freqs
    for s in sections:  # the critical pair is the stream's own first pair with λ > L (L = 256 here)
        owned = mrope.stream_pairs(pairs, layout)[s["stream"]]
        beyond = owned[lam[owned] > 256]
        assert s["critical_pair"] == (int(beyond[0]) if beyond.size else None)


def test_plain_rope_has_no_sections():
    config = small_config("llama")
    assert all(not r.sections for r in rope_math.analyze_config(config))
