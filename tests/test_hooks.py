"""diffjax.train.hooks: what runs after a step, every N steps, in the order added."""

import pytest

from diffjax.train.hooks import Hooks


def test_hooks_run_every_n_steps_and_at_the_steps_also_names_in_order():
    seen = []
    hooks = Hooks()
    hooks.add(
        lambda step, state: seen.append(("eval", step, state)), every=3, also=lambda s: s == 4
    )
    hooks.add(lambda step, state: seen.append(("save", step, state)), every=2, name="save")
    hooks.add(lambda step, state: seen.append(("each", step, state)))
    for step in range(1, 7):
        hooks.run(step, f"s{step}")
    assert seen == [
        ("each", 1, "s1"),
        ("save", 2, "s2"),
        ("each", 2, "s2"),
        ("eval", 3, "s3"),
        ("each", 3, "s3"),
        ("eval", 4, "s4"),
        ("save", 4, "s4"),
        ("each", 4, "s4"),
        ("each", 5, "s5"),
        ("eval", 6, "s6"),
        ("save", 6, "s6"),
        ("each", 6, "s6"),
    ]
    assert [h.name for h in hooks.hooks] == ["<lambda>", "save", "<lambda>"]


@pytest.mark.parametrize("every", [0, -1, 1.5, None])
def test_a_hook_runs_every_n_steps_for_a_whole_n_of_at_least_one(every):
    with pytest.raises(ValueError, match="every N >= 1"):
        Hooks().add(lambda step, state: None, every=every)
