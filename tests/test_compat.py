"""A transformers internal a family hook reads that is not there (a release renamed or dropped it) is a SKIP naming
what changed and the releases posdiag knows, never an ERROR on a healthy model."""

import transformers

from posdiag._version import TRANSFORMERS_TESTED
from posdiag.api import run_checks
from posdiag.errors import InternalsChanged
from posdiag.model.loading import from_module
from posdiag.results import Status
from posdiag.testing import zoo


def test_the_message_names_what_changed_and_the_releases_known():
    text = str(InternalsChanged("the `alibi` kwarg"))
    assert f"this transformers version ({transformers.__version__}) changed the `alibi` kwarg" in text
    assert f"knows transformers {TRANSFORMERS_TESTED[0]} to {TRANSFORMERS_TESTED[1]}" in text


def test_falcon_alibi_whose_blocks_get_neither_alibi_nor_its_bias_skips_naming_it():
    """As if a release handed Falcon's blocks neither an `alibi` kwarg nor the float bias mask: every check that
    hands the blocks a pattern SKIPs naming it, the others still judge; nothing is an ERROR."""
    model = zoo.tiny_model("falcon_alibi")

    def as_if_moved(module, args, kwargs):
        kwargs.pop("alibi", None)
        kwargs["attention_mask"] = None
        return args, kwargs

    for block in model.transformer.h:
        block.register_forward_pre_hook(as_if_moved, with_kwargs=True)
    report = run_checks(from_module(model, name="falcon"), ["shuffle", "causal", "kernels"])
    shuffle = report.check("shuffle")
    assert shuffle.status is Status.SKIP and "changed how Falcon-ALiBi hands its bias" in shuffle.summary
    assert shuffle.details["internals_changed"].startswith("how Falcon-ALiBi")
    assert all(c.status is not Status.ERROR for c in report.checks), [c.summary for c in report.checks]


def test_blocks_moved_is_a_skip():
    model = zoo.tiny_model("bloom")
    model.transformer.blocks = model.transformer.h  # as if a release renamed the list
    del model.transformer.h
    result = run_checks(from_module(model, name="bloom"), ["shuffle"]).check("shuffle")
    assert result.status is Status.SKIP and "no transformer.h" in result.summary, result.summary
