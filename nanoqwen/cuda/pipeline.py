"""The token pipeline: decode steps fed back to back, one queued behind the one being read.

When the device chooses the token and the graph runs, the device advances its own state, so the
host need not wait for token k before it launches step k + 1. Each step's argmax stores the new
state head in mapped host memory (row position % HEAD_SLOTS), so the queued step writes the other
row; an event after each step says when its row is there. A step whose draw the host must make (a
top-p alone over more tokens than the device keeps) copies its logits aside, and the host runs the
next step again from its own token.
"""

from __future__ import annotations

import numpy as np

from ..kvcache import check_positions, check_tokens
from ..sampling import GREEDY, SamplingParams, sample
from .abi import (
    STATE_PAGE_TABLE,
    STATE_POSITION,
    STATE_SEQ_LEN,
    STATE_STATUS,
    STATE_TOKEN,
)
from .sampler import device_top_k, may_hand_back, sampler_settings, token_of_head
from .step import HEAD_SLOTS


class TokenPipeline:
    """CudaBackend's part that runs decode steps for the engine: inputs up, tokens back."""

    def _check_positions(self, first: int, count: int, page_table) -> np.ndarray:
        return check_positions(first, count, page_table, self.num_pages, self.max_seq_len)

    def _check_tokens(self, token_ids) -> np.ndarray:
        return check_tokens(token_ids, self.config.vocab_size)

    def set_step_inputs(self, token_id: int, position: int, page_table) -> None:
        """One host-to-device copy of the step's inputs. The whole page table goes up, so that
        steps advanced on the device (argmax_select_next) find the pages reserved ahead."""
        token = int(self._check_tokens(np.array([token_id]))[0])
        self._upload_step_inputs(token, position, self._check_positions(position, 1, page_table))

    def _upload_step_inputs(self, token: int, position: int, pages: np.ndarray) -> None:
        """The copy itself, for inputs already checked."""
        host = np.empty(STATE_PAGE_TABLE + len(pages), dtype=np.int32)
        host[STATE_TOKEN], host[STATE_POSITION], host[STATE_SEQ_LEN] = token, position, position + 1
        host[STATE_STATUS] = 0
        host[STATE_PAGE_TABLE:] = pages
        self.state[: len(host)].set(host, stream=self.stream)
        self._device_holds = (token, int(position), pages)

    def forget_step_inputs(self) -> None:
        """Say the device state is unknown, so the next step uploads its inputs (call it after
        running steps outside `decode`/`decode_next`, as the benchmarks do)."""
        self._device_holds = None

    def _step(self, token_id: int, position: int, page_table) -> None:
        """Run one decode step for `token_id` at `position`.

        After a step chosen on the device the state already holds that token and the next
        position (argmax_select_next wrote them), so the next step's inputs are uploaded only
        when they differ: a token chosen on the host, a new request, a different page table. The inputs
        are checked on the host every time, uploaded or not.
        """
        token = int(self._check_tokens(np.array([token_id]))[0])
        pages = self._check_positions(position, 1, page_table)
        holds, self._device_holds = self._device_holds, None  # unknown until the step is read back
        if holds is None or holds[:2] != (token, position) or not np.array_equal(holds[2][: len(pages)], pages):
            self._upload_step_inputs(token, position, pages)  # checked above: no second check
            holds, self._device_holds = self._device_holds, None
        if self.use_graph:
            self.decode_graph().launch()
        else:
            self.decode_step_launches(self.stream)
        self._pending = holds[2]

    def decode(self, token_id: int, position: int, page_table) -> np.ndarray:
        """One token at `position` (its K/V is written there); logits [vocab] fp32.

        The caller samples the next token itself, so the device's choice is not read back (the
        sampler goes back to greedy, its cheapest) and the next step uploads its inputs.
        """
        self.set_sampler(GREEDY)
        self._step(token_id, position, page_table)
        return self.logits.get(stream=self.stream)

    def set_sampler(self, sampling: SamplingParams) -> None:
        """Put the sampler's settings where the decode step's last two kernels read them, when they
        change (one host-to-device copy, ordered before the steps that follow on the stream). The
        engine's requests set them; a benchmark of bare steps sets GREEDY first."""
        wanted = sampler_settings(sampling, self.config.vocab_size)
        if not np.array_equal(wanted, self._sampler_holds):
            self.sampler.set(wanted, stream=self.stream)
            self._sampler_holds = wanted

    def decode_next(self, token_id: int, position: int, page_table, sampling: SamplingParams = GREEDY) -> int:
        """The token `sampling` chooses after `decode` at `position`. The device chooses it (greedy,
        temperature, a top-k of at most TOP_K_MAX with or without top-p, a top-p alone whose run
        ends among the TOP_K_MAX most likely) and stores it (and the status word) in host memory;
        otherwise the host samples the logits (`host_draws` counts those steps). Non-finite logits
        raise FloatingPointError, as numpy's choice does."""
        if device_top_k(sampling, self.config.vocab_size) is None:
            self.host_draws += 1
            return sample(self.decode(token_id, position, page_table), sampling, position)
        self.set_sampler(sampling)
        self._step(token_id, position, page_table)
        self.stream.synchronize()
        token = self._token_after(position)
        if token is None:  # a top-p run longer than the device keeps
            return self._host_draw(position, sampling)
        self._device_holds = (token, position + 1, self._pending)
        return token

    def _host_draw(self, position: int, sampling: SamplingParams) -> int:
        """The token the host draws for the step at `position`, which left its draw to the host, from
        the logits that step copied to `handed_back` (waits for every step queued on the stream)."""
        self.host_draws += 1
        return sample(self.handed_back[position % HEAD_SLOTS].get(stream=self.stream), sampling, position)

    def _token_after(self, position: int) -> int | None:
        """The token that the finished step at `position` chose, from its row of `head_slots`
        (None: the host is to draw it)."""
        head = self.head_slots[position % HEAD_SLOTS]
        if head[STATE_POSITION] != position + 1:  # the row of another step: a bug, never data
            raise RuntimeError(f"the host's head row holds position {head[STATE_POSITION]} where the step at "
                               f"{position} should have left {position + 1}")
        return token_of_head(head)

    def next_tokens(self, token_id: int, position: int, page_table, steps: int, sampling: SamplingParams = GREEDY):
        """The next `steps` tokens after `token_id` at `position`, each chosen by `sampling` and fed
        back in turn.

        When the device chooses (decode_next says when) and the graph runs, the device advances
        its own state, so the host need not wait for token k before starting step k + 1: the
        generator keeps one step queued behind the one it reads. Each step's argmax stores the new
        state head (token, position, seq_len, status) in host memory itself, row position %
        HEAD_SLOTS of `head_slots`, so the queued step writes the other row; an event after each step
        says when its row is there: no copy runs in the stream between two graph launches. A
        consumer that stops early leaves at most one extra step computed, at a position inside the
        `steps` it asked for (the engine reserves their pages), never read.

        A top-p alone may leave a step's draw to the host (`may_hand_back`). That step copies its
        logits to `handed_back`, where the step queued behind it does not write; the host draws
        from them and runs the next step again from its token. After such a step the generator
        waits for each step until the device draws one again, so a flat stretch of steps wastes
        no more than its first.

        A True sent in instead of next() (Backend.next_tokens) stops the run: the step already
        queued behind the one just read, if any, is still read and yielded, and no other starts.
        """
        if steps <= 0:
            return
        if device_top_k(sampling, self.config.vocab_size) is None or not self.use_graph:
            # the host chooses, or eager launches: one step at a time, none ahead
            for k in range(steps):
                token_id = self.decode_next(token_id, position + k, page_table, sampling)
                if (yield token_id):
                    return
            return
        cp = self._cp
        self._check_positions(position, steps, page_table)  # the whole run, once
        self.set_sampler(sampling)
        self._step(token_id, position, page_table)  # checks and uploads the first step's inputs, runs it
        graph = self.decode_graph()
        done = [cp.cuda.Event(disable_timing=True) for _ in range(HEAD_SLOTS)]
        done[position % HEAD_SLOTS].record(self.stream)
        end, launched, run_ahead = position + steps, position, True  # launched: the last step on the stream

        def launch_next(p: int) -> int:
            graph.launch()  # step p + 1 reads the token step p chose, on the device
            done[(p + 1) % HEAD_SLOTS].record(self.stream)
            return p + 1

        try:
            p = position
            while p < end:
                if run_ahead and launched == p and p + 1 < end:
                    launched = launch_next(p)
                done[p % HEAD_SLOTS].synchronize()
                token = self._token_after(p)
                if token is None:  # drawn on the host, from the logits step p copied aside
                    if not may_hand_back(sampling, self.config.vocab_size):
                        raise RuntimeError(f"the step at {p} left its draw to the host with {sampling}")
                    token = self._host_draw(p, sampling)
                    if p + 1 < end:  # step p + 1 again (or first), from the host's token
                        self._device_holds = None
                        self._step(token, p + 1, page_table)
                        done[(p + 1) % HEAD_SLOTS].record(self.stream)
                        launched = p + 1
                    run_ahead = False  # a flat stretch: wait for each step until the device draws again
                else:
                    if launched == p and p + 1 < end:
                        launched = launch_next(p)
                    run_ahead = True
                if (yield token):  # no more steps: only the one already launched, if any
                    end = launched + 1
                p += 1
        finally:
            self._device_holds = None  # a step may have run ahead: the next request uploads

    def close(self) -> None:
        """Wait until no queued step can still store into `head_slots`, whose host memory goes
        with this backend (Engine.close calls it)."""
        self.stream.synchronize()
