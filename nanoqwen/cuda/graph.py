"""The decode step as one CUDA graph.

Launching a kernel from Python costs several microseconds of host time; a 7B decode step is
about 250 launches, so an eager step is bound by the host, not the GPU. A CUDA graph records
the step's launches once and replays them with one call. Three rules make that legal here:

* nothing inside the step allocates, synchronises or copies to the host;
* every kernel argument is frozen at capture, so the values that change per token (token id,
  position, sequence length, page table) live in device memory (`CudaBackend.state`) and the
  last kernel of the step (argmax_select_next) advances them for the next replay;
* pages for the whole request are reserved before decoding starts, so a step that crosses into
  a new page needs no host decision: the page table already names it.

The article this book grew from captured two graph variants and chose one per token depending
on whether the token opened a new page. Keeping the page table and position in device memory
makes that choice unnecessary: one graph serves every step.
"""

from __future__ import annotations

from .launch import programmatic_launches


def capture(stream, issue):
    """A CUDA graph of the launches `issue()` makes on `stream`, uploaded and ready to launch.

    If `issue` fails, the capture is ended and the original error raised (ending an
    invalidated capture raises an error of its own, which would otherwise hide the cause).
    """
    with stream:
        stream.begin_capture()
        try:
            issue()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:
                pass
            raise
        graph = stream.end_capture()
    graph.upload(stream)
    return graph


class DecodeGraph:
    """`backend.decode_step_launches` captured once on `backend.stream`; `launch()` replays it.

    With `pdl`, every kernel of the step that waits for its predecessor in the kernel itself
    (nanoqwen.cuda.launch.KERNELS_THAT_WAIT) is captured as a programmatic dependent launch, so
    it may start while the kernel before it finishes. `self.pdl` says whether that happened
    (False where cuda.bindings is missing: the launches are then plain, after one warning).
    """

    def __init__(self, backend, pdl: bool = False):
        self.stream = backend.stream
        self.launches = backend.launches_per_token
        with programmatic_launches(pdl) as self.pdl:
            self.graph = capture(self.stream, lambda: backend.decode_step_launches(self.stream))

    @property
    def mode(self) -> str:
        return "pdl" if self.pdl else "plain"

    def launch(self) -> None:
        self.graph.launch(self.stream)
