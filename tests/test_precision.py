"""posdiag.model.precision: any computation on a model, run in a finer dtype and restored exactly.

The finer run converts one module at a time (never a whole float64 copy), so its result must be
the same float64 function as a whole-model float64 copy, and the model must come back unchanged.
"""

import copy

import pytest
import torch

from posdiag.model.loading import from_module
from posdiag.model.precision import (
    WAYS,
    everywhere_at_least,
    finer_dtype,
    memory_allows,
    reference_dtype,
    run_finer,
    weight_bytes,
)
from posdiag.testing import zoo


def hidden_states(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return model(ids, output_hidden_states=True).hidden_states


def test_run_finer_is_a_float64_forward_and_restores_the_model():
    model = zoo.tiny_model("llama")
    subject = from_module(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(4, 200, (2, 12))

    got = run_finer(subject, lambda: hidden_states(model, ids), reached=everywhere_at_least)

    assert got.ran and got.dtype == torch.float64 and got.how == WAYS["module"]
    whole = hidden_states(copy.deepcopy(model).to(torch.float64), ids)
    assert len(got.value) == len(whole)
    for finer, reference in zip(got.value, whole, strict=True):
        assert finer.dtype == torch.float64
        torch.testing.assert_close(finer, reference, rtol=1e-12, atol=1e-12)
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # past_key_values -> cache rename (5.x)
@pytest.mark.parametrize("how", list(WAYS))
def test_every_conversion_way_runs_a_cache_continuation_in_float64(how):
    """Not only a forward: a prefill and a chunk decoded against its KV cache, inside one block."""
    model = zoo.tiny_model("llama")
    subject = from_module(model)
    ids = torch.randint(4, 200, (1, 12))

    with finer_dtype(subject, torch.float64, how) as done, torch.inference_mode():
        first = model(ids[:, :8], use_cache=True)
        chunk = model(ids[:, 8:], past_key_values=first.past_key_values, use_cache=True).logits
    assert done == WAYS[how] and chunk.dtype == torch.float64
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_nothing_finer_says_why():
    model = zoo.tiny_model("llama")

    def refuse(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            raise RuntimeError("no float64 kernel for this op")
    model.model.norm.register_forward_pre_hook(refuse)
    subject = from_module(model)
    got = run_finer(subject, lambda: hidden_states(model, torch.randint(4, 200, (1, 8))), what="reference")
    assert not got.ran and got.value is None
    assert got.reason.startswith("no reference more precise than float32 runs on this model: "
                                 "float64: no float64 kernel")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_memory_budget_rule():
    subject = from_module(zoo.tiny_model("llama"))
    assert memory_allows(subject, weight_bytes(subject, torch.float64), 0.4)
    assert not memory_allows(subject, 1 << 62, 0.4)
    assert reference_dtype(subject) == torch.float64


def test_everywhere_at_least_walks_nested_outputs():
    assert everywhere_at_least({"h": [torch.zeros(2, dtype=torch.float64)], "ids": torch.zeros(2, dtype=torch.long)},
                               torch.float64)
    assert not everywhere_at_least((torch.zeros(2, dtype=torch.float64), [torch.zeros(2)]), torch.float64)
