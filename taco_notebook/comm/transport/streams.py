"""Communication on its own CUDA stream, ordered by events against the stream that produced the tensor.

The caller records a *ready* event on its current stream when it submits a CUDA tensor; the communication
thread makes its own stream wait for that event, runs the collective (and any compression kernels) there and
records a *done* event; whoever takes the result makes its current stream wait for *done*. The host never
blocks on the GPU (no ``torch.cuda.synchronize()``), so backward keeps computing while buckets travel.
CPU tensors skip all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

__all__ = ["StreamFuture", "comm_stream", "ready_event", "enter_comm_stream", "done_event", "wait_done",
           "on_comm_stream"]

T = TypeVar("T")

_streams: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The communication stream of ``device`` (one per device and process, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def ready_event(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """On the submitting thread: an event after everything its current stream queued so far (None on CPU)."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def enter_comm_stream(tensor: torch.Tensor, ready: torch.cuda.Event | None) -> torch.cuda.Stream | None:
    """On the communication thread: make the device's comm stream current and wait (on the GPU) for ``ready``.

    The comm stream stays current on that thread, so torch futures completed there record their events on it.
    ``record_stream`` tells the caching allocator the caller's tensor is in use on the comm stream too.
    """
    if ready is None:
        return None
    stream = comm_stream(tensor.device)
    torch.cuda.set_stream(stream)
    stream.wait_event(ready)
    tensor.record_stream(stream)
    return stream


def done_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """On the communication thread, after the collective: an event the consumer's stream will wait for."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_done(done: torch.cuda.Event | None, device: torch.device) -> None:
    """On the consuming thread: order its current stream after ``done`` (no host wait)."""
    if done is not None:
        torch.cuda.current_stream(device).wait_event(done)


class StreamFuture(Future):  # type: ignore[type-arg]
    """A future for a CUDA collective: ``result()`` also orders the caller's current stream after it."""

    finished: torch.cuda.Event | None = None  # recorded on the comm stream after the collective
    device: Any = None

    def result(self, timeout: float | None = None) -> Any:
        value = super().result(timeout)
        wait_done(self.finished, self.device)
        return value


def on_comm_stream(tensor: Any, fn: Callable[[], T]) -> tuple[Callable[[], T], StreamFuture]:
    """Wrap ``fn`` (a collective on ``tensor``, run later on the comm thread) in the event ordering above.

    Called on the submitting thread, which records *ready* now. Run the returned work with the returned
    future (``comm_thread.submit(work, future)``): its ``result()`` orders the caller after *done*.
    """
    future = StreamFuture()
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        return fn, future
    ready = ready_event(tensor)
    future.device = tensor.device

    def work() -> T:
        stream = enter_comm_stream(tensor, ready)
        try:
            return fn()
        finally:
            future.finished = done_event(stream)

    return work, future
