"""Plain-text tables for the terminal (and for pasting into docs/performance.md)."""

from __future__ import annotations

from typing import TextIO

__all__ = ["Report", "Table"]


class Table:
    """Rows of strings under a title, printed when :meth:`Report.flush` or the next table comes."""

    def __init__(self, title: str, header: list[str]) -> None:
        self.title = title
        self.header = header
        self.rows: list[list[str]] = []
        self.notes: list[str] = []

    def row(self, *cells: str) -> None:
        """Add a row (as many cells as the header)."""
        self.rows.append([str(c) for c in cells])

    def note(self, text: str) -> None:
        """Add a line printed under the table."""
        self.notes.append(text)

    def render(self) -> str:
        """The table as aligned text."""
        widths = [len(h) for h in self.header]
        for r in self.rows:
            for i, c in enumerate(r):
                widths[i] = max(widths[i], len(c))
        line = "  ".join("-" * w for w in widths)
        out = [
            f"\n== {self.title}",
            "  ".join(h.ljust(w) for h, w in zip(self.header, widths, strict=True)),
            line,
        ]
        for r in self.rows:
            cells = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
            out.append("  ".join(cells))
        out += [f"   {n}" for n in self.notes]
        return "\n".join(out)


class Report:
    """Collects tables and prints each as soon as the next output starts."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._open: Table | None = None

    def _flush(self) -> None:
        if self._open is not None:
            print(self._open.render(), file=self.stream, flush=True)
            self._open = None

    def table(self, title: str, header: list[str]) -> Table:
        """Start a table (the previous one is printed now)."""
        self._flush()
        self._open = Table(title, header)
        return self._open

    def text(self, text: str) -> None:
        """Print a line (after any open table)."""
        self._flush()
        print(text, file=self.stream, flush=True)

    def flush(self) -> None:
        """Print the open table, if any."""
        self._flush()
