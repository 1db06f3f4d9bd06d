"""Cuts streamed text at the first stop string, without ever emitting part of one.

A stop string can arrive split over several decoded pieces, so text that could be
the beginning of a stop string is held back until the next piece settles it.
"""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Return the text that is safe to emit; sets `stopped` when a stop string was seen."""
        if self.stopped:
            return ""
        buffer = self._held + text
        if not self.stop_strings:
            return buffer
        hits = [index for index in (buffer.find(s) for s in self.stop_strings) if index >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)]
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

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
