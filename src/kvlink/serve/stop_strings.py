"""Cuts streamed text at the first stop string, without ever emitting part of one.

A stop string can arrive split over several decoded pieces, so text that could be
the beginning of a stop string is held back until the next piece settles it. As vLLM
does, the stop string that ends first wins (ties: the one listed first), and with
`min_tokens` a stop string counts only if it ends after the text of the first
`min_tokens` tokens (pushed with `protected=True`); it may begin inside that text.
With `include_in_output` the text ends with the stop string instead of before it.
"""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stop_strings: list[str], include_in_output: bool = False) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.include_in_output = include_in_output  # the answer ends with the stop string, not before it
        self._held = ""
        self._emitted = 0  # characters returned so far (the held text starts there)
        self._protected_until = 0  # no stop string may end at or before this character
        self.stopped = False

    def push(self, text: str, protected: bool = False) -> str:
        """Return the text that is safe to emit; sets `stopped` when a stop string was seen.
        `protected`: `text` belongs to the first `min_tokens` tokens."""
        if self.stopped:
            return ""
        buffer = self._held + text
        if protected:
            self._protected_until = self._emitted + len(buffer)
        if not self.stop_strings:
            return self._emit(buffer, len(buffer))
        floor = self._protected_until - self._emitted  # a match must end past this index of buffer
        best: tuple[int, int, int] | None = None  # (end, list position, start)
        for position, stop in enumerate(self.stop_strings):
            start = buffer.find(stop, max(0, floor - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), position) < best[:2]):
                best = (start + len(stop), position, start)
        if best is not None:
            self.stopped = True
            self._held = ""
            return buffer[: best[0] if self.include_in_output else best[2]]
        keep = self._longest_stop_prefix_suffix(buffer)
        return self._emit(buffer, len(buffer) - keep)

    def _emit(self, buffer: str, upto: int) -> str:
        self._held = buffer[upto:]
        self._emitted += upto
        return buffer[:upto]

    def flush(self) -> str:
        """Text still held back when generation ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
