"""nanoqwen.book.persistent_model: the persistent kernel's walk of a step, played out on the host.

At every published size and at the test shapes, at short and long context and on SM counts from
one to the H200's: every wait is met and every tile counted once. A walk that waits on a later
operation is caught as the deadlock it would be.
"""

import dataclasses

import pytest

from nanoqwen.book.persistent_model import OPERATIONS, block_share, play, step_operations
from nanoqwen.config import ModelConfig
from nanoqwen.cuda.attention import decode_splits, split_pages
from nanoqwen.cuda.plan import projection_splits
from nanoqwen.random_model import PRESETS
from nanoqwen.testing import CHECKED_SHAPES, DEFAULT_CONFIG

SHAPES = {**PRESETS, **{name: ModelConfig(**{**DEFAULT_CONFIG, **over}) for name, over in CHECKED_SHAPES.items()},
          "default": ModelConfig(**DEFAULT_CONFIG)}


def splits_of(config, num_sms):
    return {p: projection_splits(p, *config.projection_shapes[p], num_sms) for p in ("qkv", "o", "gate_up", "down")}


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("num_sms, context", [(132, 640), (132, 16384), (7, 77), (1, 33)])
def test_every_wait_is_met(name, num_sms, context):
    config = SHAPES[name]
    context = min(context, config.max_position_embeddings)
    attention_splits = decode_splits(config.num_kv_heads, config.max_position_embeddings, num_sms)
    ops = step_operations(config, splits_of(config, num_sms), context, attention_splits)
    finished = play(ops, num_sms)
    assert {k for _, k in finished} == set(range(len(ops)))  # every operation had a block
    active = len(split_pages(context, attention_splits))
    assert len(ops) == config.num_layers * (len(OPERATIONS) - (active == 1))  # no combine for one split


def test_the_runs_cover_every_unit_once():
    for units in (1, 7, 131, 132, 133, 2880):
        covered = [u for b in range(132) for u in block_share(units, 132, b)]
        assert covered == list(range(units))


def test_a_wait_on_a_later_operation_is_a_deadlock():
    config = PRESETS["qwen2.5-coder-0.5b"]
    ops = step_operations(config, splits_of(config, 132), 640, 132)
    ops[1] = dataclasses.replace(ops[1], waits_on=3)  # layer 0's attention on its o, which comes after it
    with pytest.raises(RuntimeError, match="deadlock"):
        play(ops, 132)
