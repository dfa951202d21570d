"""tools/step_timeline.py's arithmetic on made-up records, and nanoqwen.cuda.profile's launch list."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_tool

from nanoqwen.byte_floor import READ_BANDWIDTH, kernel_bytes
from nanoqwen.random_model import QWEN25_CODER_7B

step_timeline = load_tool("step_timeline")

LAYER = ["add_rmsnorm_cluster", "gemv_int4_qkv_rope", "paged_attention_decode", "paged_attention_combine",
         "gemv_int4_from_q_dim", "add_rmsnorm_cluster", "gemv_int4_gate_up_silu", "gemv_int4_from_intermediate"]
# The layer with RoPE in a launch of its own (CudaBackend.rope_in_qkv off, INT8 activations)
LAYER_ROPE_APART = [*LAYER[:1], "gemv_int4_from_hidden", "rope_write_kv", *LAYER[2:]]


def step_names(config) -> list[str]:
    return ["embed_tokens", *LAYER * config.num_layers, "add_rmsnorm_cluster", "lm_head_logits", "argmax_select_next"]


@pytest.fixture
def records():
    """Three steps of random kernel shares (1-20 µs) and head starts (0-5 µs), in ns."""
    config = QWEN25_CODER_7B
    names = step_names(config)
    rng = np.random.default_rng(3)
    shares = rng.integers(1_000, 20_000, (3, len(names)))
    released = 7_000 + np.cumsum(shares, axis=1) - shares  # kernel k's wait returns after the shares before it
    start = released - rng.integers(0, 5_000, released.shape)
    step_ns = (released[:, -1] + shares[:, -1] - start[:, 0]).astype(float)  # the last share ends the step
    return config, names, start, released, step_ns, shares


def test_shares_add_up_to_the_step(records):
    config, names, start, released, step_ns, shares = records
    summary = step_timeline.summarize(config, names, start, released, step_ns, READ_BANDWIDTH)
    after_first_wait = step_ns - (released[:, 0] - start[:, 0])  # the first kernel's head start is no share
    assert summary["shares_sum_us"] == pytest.approx(np.median(after_first_wait) / 1e3)
    assert sum(r["share_us_per_step"] for r in summary["rows"]) == pytest.approx(np.mean(after_first_wait) / 1e3)
    by_kernel = {r["kernel"]: r for r in summary["rows"]}
    assert by_kernel["add_rmsnorm_cluster"]["launches_per_step"] == 2 * config.num_layers + 1
    assert sum(r["launches_per_step"] for r in summary["rows"]) == len(names)
    gate_up = [k for k, name in enumerate(names) if name == "gemv_int4_gate_up_silu"]
    assert by_kernel["gemv_int4_gate_up_silu"]["share_us_per_launch"] == pytest.approx(shares[:, gate_up].mean() / 1e3)
    assert by_kernel["argmax_select_next"]["share_us_per_launch"] == pytest.approx(shares[:, -1].mean() / 1e3)


def test_head_starts_and_the_first_layer(records):
    config, names, start, released, step_ns, _ = records
    summary = step_timeline.summarize(config, names, start, released, step_ns, READ_BANDWIDTH)
    lm_head = names.index("lm_head_logits")
    by_kernel = {r["kernel"]: r for r in summary["rows"]}
    assert by_kernel["lm_head_logits"]["head_start_us_per_launch"] == pytest.approx(
        (released[:, lm_head] - start[:, lm_head]).mean() / 1e3)
    assert [r["kernel"] for r in summary["layer_0"]] == LAYER


def test_floors_are_the_kernels_bytes_per_launch(records):
    config, names, start, released, step_ns, _ = records
    by_kernel = {r["kernel"]: r for r in step_timeline.summarize(config, names, start, released, step_ns, READ_BANDWIDTH)["rows"]}
    budget = kernel_bytes(config, step_timeline.STEP_PROMPT_TOKENS + 1)
    gate_up = budget["gemv_int4_gate_up_silu"] / config.num_layers / READ_BANDWIDTH * 1e6
    assert by_kernel["gemv_int4_gate_up_silu"]["floor_us_per_launch"] == pytest.approx(gate_up)
    assert by_kernel["paged_attention_decode"]["floor_us_per_launch"] == pytest.approx(
        budget["attention_decode"] / config.num_layers / READ_BANDWIDTH * 1e6)
    qkv = budget["gemv_int4_qkv_rope"] / config.num_layers / READ_BANDWIDTH * 1e6
    assert by_kernel["gemv_int4_qkv_rope"]["floor_us_per_launch"] == pytest.approx(qkv)

    # The same step with RoPE apart: the plain GEMV reads q|k|v's bytes, rope_write_kv none of them.
    names = ["embed_tokens", *LAYER_ROPE_APART * config.num_layers, *names[-3:]]
    shares = np.full((1, len(names)), 2_000)
    released = np.cumsum(shares, axis=1)
    rows = step_timeline.summarize(config, names, released - 500, released, released[:, -1] + 2_000.0, READ_BANDWIDTH)["rows"]
    by_kernel = {r["kernel"]: r for r in rows}
    assert by_kernel["gemv_int4_from_hidden"]["floor_us_per_launch"] == pytest.approx(qkv)
    assert by_kernel["rope_write_kv"]["floor_us_per_launch"] is None  # it reads nothing of the byte floor
    assert sum(kernel_bytes(config, 513).values()) == sum(kernel_bytes(config, 513, rope_in_qkv=False).values())


class _RecordedAttention:
    """The two kernels a PagedAttention decode launches, as attributes step_launch_names swaps."""

    decode_kernel = "paged_attention_decode"

    def __init__(self):
        self._decode = self._combine = _never

    def decode(self, *args, **kwargs):
        self._decode()
        self._combine()


def _never(*args, **kwargs):
    raise AssertionError("step_launch_names launched a kernel")


class _TwoLayerBackend:
    """decode_step_launches of a CudaBackend in miniature: kernels by name, attention in between."""

    stream = None

    def __init__(self):
        self.kernels = {"add_rmsnorm_cluster": _never, "gemv_int4_from_hidden": _never, "lm_head_logits": _never}
        self.attention = _RecordedAttention()

    def decode_step_launches(self, stream):
        for _ in range(2):
            self.kernels["add_rmsnorm_cluster"]()
            self.kernels["gemv_int4_from_hidden"]()
            self.attention.decode()
        self.kernels["lm_head_logits"]()


def test_step_launch_names_records_in_order_and_restores_the_kernels():
    from nanoqwen.cuda.profile import step_launch_names

    backend = _TwoLayerBackend()
    layer = ["add_rmsnorm_cluster", "gemv_int4_from_hidden", "paged_attention_decode", "paged_attention_combine"]
    assert step_launch_names(backend) == [*layer, *layer, "lm_head_logits"]
    assert all(kernel is _never for kernel in backend.kernels.values())
    assert backend.attention._decode is _never and backend.attention._combine is _never


def test_the_persistent_kernels_operations_add_up_to_its_layers():
    """Made-up traces of the persistent kernel: each operation's blocks begin, wait and finish at
    known times; the shares are the gaps between the operations' last finishes, the hand-offs the
    gaps to their first returned wait."""
    config = QWEN25_CODER_7B
    blocks, ops, steps = 6, len(step_timeline.OPERATIONS), 2
    rng = np.random.default_rng(5)
    records = np.zeros((steps, blocks, config.num_layers, ops, 3), dtype=np.int64)
    clock = 1_000
    for step in range(steps):
        for layer in range(config.num_layers):
            for op in range(ops):
                part = rng.random(blocks) < 0.7
                part[0] = True  # every operation has a block
                handoff, work = rng.integers(500, 1_500), rng.integers(1_000, 9_000)
                records[step, part, layer, op, 0] = clock - 400
                records[step, part, layer, op, 1] = clock + handoff + rng.integers(0, 300, part.sum())
                records[step, part, layer, op, 2] = clock + handoff + work - rng.integers(0, 300, part.sum())
                records[step, 0, layer, op, 1] = clock + handoff  # block 0's wait returned first
                records[step, 0, layer, op, 2] = clock + handoff + work  # and it finished last
                clock += handoff + work
    summary = step_timeline.summarize_persistent(config, records, READ_BANDWIDTH)
    assert [r["operation"] for r in summary["operations"]] == list(step_timeline.OPERATIONS)
    first_begun = records[:, 0, 0, 0, 0]  # every block that takes part begins at once
    last_done = records[:, :, -1, -1, 2].max(axis=1)
    assert summary["layers_us"] == pytest.approx(np.mean(last_done - first_begun) / 1e3)
    assert sum(r["share_us_per_step"] for r in summary["operations"]) == pytest.approx(summary["layers_us"])
    assert all(0.5 <= r["handoff_us_per_layer"] <= 1.5 for r in summary["operations"][1:])


def test_attention_floor_follows_the_context_the_steps_follow(records):
    """--context: the floors are the bytes of a step after that many tokens, attention's growing with it."""
    config, names, start, released, step_ns, _ = records
    floors = {}
    for context in (step_timeline.STEP_PROMPT_TOKENS, 4096):
        rows = step_timeline.summarize(config, names, start, released, step_ns, READ_BANDWIDTH, prompt_tokens=context)["rows"]
        floors[context] = {r["kernel"]: r["floor_us_per_launch"] for r in rows}
        budget = kernel_bytes(config, context + 1)
        assert floors[context]["paged_attention_decode"] == pytest.approx(
            budget["attention_decode"] / config.num_layers / READ_BANDWIDTH * 1e6)
    assert floors[4096]["paged_attention_decode"] > 7 * floors[step_timeline.STEP_PROMPT_TOKENS]["paged_attention_decode"]
    assert floors[4096]["gemv_int4_gate_up_silu"] == floors[step_timeline.STEP_PROMPT_TOKENS]["gemv_int4_gate_up_silu"]
