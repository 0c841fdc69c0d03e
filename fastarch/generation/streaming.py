"""Streaming generated tokens: to a callback, or through an iterator fed from a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CallbackStreamer", "TextStreamer", "TokenIteratorStreamer", "notify_end", "notify_put"]


class CallbackStreamer:
    """Calls ``on_token(tokens)`` with the new tokens ``(B,)`` of every step, and ``on_end()`` once."""

    def __init__(self, on_token: Callable[[torch.Tensor], Any], on_end: Callable[[], Any] | None = None) -> None:
        self.on_token = on_token
        self.on_end = on_end

    def put(self, tokens: torch.Tensor) -> None:
        self.on_token(tokens)

    def end(self) -> None:
        if self.on_end is not None:
            self.on_end()


class TextStreamer:
    """Decode a single sequence incrementally with ``tokenizer.decode`` and pass each new piece of text to
    ``on_text`` (default: print without newline). Text is emitted only up to the last space, so a word is
    never shown half-decoded; the rest is flushed at ``end``."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], Any] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.on_text = on_text or (lambda s: print(s, end="", flush=True))
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._shown = 0

    def put(self, tokens: torch.Tensor) -> None:
        if tokens.numel() != 1:
            raise ValueError(f"TextStreamer: streams one sequence, got {tokens.numel()} tokens per step")
        self.ids.append(int(tokens.reshape(-1)[0]))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        cut = text.rfind(" ") + 1
        if cut > self._shown:
            self.on_text(text[self._shown:cut])
            self._shown = cut

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if len(text) > self._shown:
            self.on_text(text[self._shown:])
        self._shown = len(text)


class TokenIteratorStreamer:
    """Iterate over the tokens of a generation that runs in another thread.

    ``put`` queues each step's tokens ``(B,)`` (as a CPU tensor); iteration yields them until ``end``.
    Typical use::

        streamer = TokenIteratorStreamer()
        threading.Thread(target=generate, args=(model, ids, 20), kwargs={"streamer": streamer}).start()
        for tokens in streamer: ...

    ``timeout`` (seconds) bounds each wait; an exception raised by the producer can be forwarded with
    :meth:`fail` and is re-raised in the consumer.
    """

    _END = object()

    def __init__(self, timeout: float | None = None) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self.timeout = timeout
        self._lock = threading.Lock()

    def put(self, tokens: torch.Tensor) -> None:
        self._q.put(tokens.detach().to("cpu", copy=True))

    def end(self) -> None:
        self._q.put(self._END)

    def fail(self, exc: BaseException) -> None:
        self._q.put(exc)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        item = self._q.get(timeout=self.timeout)
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item


def notify_put(streamer: Any, tokens: torch.Tensor) -> None:
    """Send one step's tokens to ``streamer``: an object with ``put`` or a plain callable."""
    if streamer is None:
        return
    if hasattr(streamer, "put"):
        streamer.put(tokens)
    else:
        streamer(tokens)


def notify_end(streamer: Any) -> None:
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
