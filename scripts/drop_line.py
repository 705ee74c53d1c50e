"""Copy standard input to standard output, dropping one exact line.

    python scripts/drop_line.py "LINE" < in > out

The demo runs the benchmark's standard error through it: vLLM's CPU build
logs "Triton is installed, but doesn't include CPU backend. Disabling
Triton." once from every process it starts (at ``import vllm``, before
vLLM applies its logging level, so ``VLLM_LOGGING_LEVEL`` cannot keep it
out). Everything else passes as it comes, a progress bar's carriage-return
updates included: only a line that starts like the dropped one is held,
until it ends or departs from it.
"""

from __future__ import annotations

import os
import sys


class LineDropper:
    """Feeds bytes through, dropping each whole line equal to ``line``."""

    def __init__(self, line: bytes, write):
        self.target = line.rstrip(b"\n") + b"\n"
        self.write = write
        self.held = b""          # a line start that may still become the target
        self.at_line_start = True

    def feed(self, data: bytes) -> None:
        data = self.held + data
        self.held = b""
        start = 0
        while start < len(data):
            ends = [i for i in (data.find(b"\n", start), data.find(b"\r", start)) if i >= 0]
            end = min(ends) + 1 if ends else len(data)
            piece = data[start:end]
            complete = bool(ends)
            if self.at_line_start and piece == self.target:
                pass                                   # the dropped line
            elif (self.at_line_start and not complete
                    and self.target.startswith(piece)):
                self.held = piece                      # may become it: wait
                return
            else:
                self.write(piece)
            self.at_line_start = complete
            start = end

    def close(self) -> None:
        if self.held:
            self.write(self.held)
            self.held = b""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2

    def write(b: bytes) -> None:
        os.write(1, b)

    dropper = LineDropper(argv[0].encode(), write)
    while chunk := os.read(0, 1 << 16):
        dropper.feed(chunk)
    dropper.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
