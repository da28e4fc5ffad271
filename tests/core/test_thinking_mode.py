"""Which samples are generated with thinking off (`data.thinking_share`): by id alone."""

from __future__ import annotations

import pytest

from draftline.core.target import sample_template_kwargs, thinking_mode

IDS = [f"{i:016x}" for i in range(4000)]


@pytest.mark.parametrize("share", [0.0, 0.25, 0.7, 1.0])
def test_the_share_of_thinking_samples_follows_the_setting(share):
    on = [thinking_mode(i, share) for i in IDS]
    assert sum(on) / len(IDS) == pytest.approx(share, abs=0.03)
    assert on == [thinking_mode(i, share) for i in IDS]  # the same on every call and node


def test_a_sample_keeps_its_mode_as_the_share_grows():
    """Raising the share only turns more samples on: a rerun with a higher share regenerates
    only the samples whose mode changed."""
    low = {i for i in IDS if thinking_mode(i, 0.3)}
    high = {i for i in IDS if thinking_mode(i, 0.6)}
    assert low <= high


def test_template_kwargs_turn_thinking_off_only_where_the_template_has_it():
    kwargs = {"enable_thinking": True, "preserve_thinking": False}
    off = next(i for i in IDS if not thinking_mode(i, 0.5))
    on = next(i for i in IDS if thinking_mode(i, 0.5))
    assert sample_template_kwargs(kwargs, off, 0.5) == {**kwargs, "enable_thinking": False}
    assert sample_template_kwargs(kwargs, on, 0.5) == kwargs
    assert sample_template_kwargs({}, off, 0.5) == {}  # a template without thinking
    assert sample_template_kwargs(kwargs, off, 1.0) == kwargs
