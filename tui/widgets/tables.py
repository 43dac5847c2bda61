"""Plain table panels: GPUs, kernel latency histograms, checkpoint tiers. Each shows a note line
saying what is missing and why ("n/a" cells, or no rows at all) instead of an empty box."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from trainguard.tui.model import HistLine, fmt_latency


class TablePanel(Vertical):
    """A note over a read-only table; rows are replaced wholesale on each poll."""

    HEADERS: tuple[str, ...] = ()

    def compose(self):  # noqa: ANN201 - textual's ComposeResult
        yield Static(classes="note")
        yield DataTable(cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*self.HEADERS)

    @property
    def table(self) -> DataTable[str | Text]:
        return self.query_one(DataTable)

    def show_rows(self, rows: Sequence[Sequence[str | Text]], note: str) -> None:
        table = self.table
        table.clear()
        for row in rows:
            table.add_row(*row)
        self.query_one(".note", Static).update(note)


class GpuPanel(TablePanel):
    """Per GPU: utilisation, memory, temperature, power, throttle reasons, XIDs, ECC."""

    HEADERS = ("node", "gpu", "name", "util", "memory", "temp", "power", "throttle", "XID", "ECC")

    def show_gpus(self, rows: Sequence[tuple[str, ...]], why_none: str) -> None:
        styled = []
        for r in rows:
            hot = r[7] not in ("", "-", "n/a") or r[8] not in ("0", "n/a")
            styled.append([Text(c, style="yellow" if hot else "") for c in r])
        self.show_rows(styled, f"{len(rows)} GPU(s)" if rows else why_none)


class KernelPanel(TablePanel):
    """Run-queue and block-I/O latency histograms (log2 slots) per node, device and rank."""

    HEADERS = ("node", "histogram", "series", "count", "p50", "p99", "distribution (log2 µs)")

    def show_hists(self, lines: Sequence[HistLine], why_none: str) -> None:
        rows = [(h.node, h.histogram, h.series, str(h.count), fmt_latency(h.p50_s), fmt_latency(h.p99_s),
                 h.bars or "-") for h in lines]
        self.show_rows(rows, f"{len(lines)} histogram series" if lines else why_none)


class CheckpointPanel(TablePanel):
    """Per job and tier: the newest checkpoint's step, age, size and commit time."""

    HEADERS = ("node", "job", "tier", "newest step", "age", "size", "written", "count")

    def show_checkpoints(self, rows: Sequence[tuple[str, ...]], note: str) -> None:
        styled = [[Text(c, style="red" if r[3] == "error" else "") for c in r] for r in rows]
        self.show_rows(styled, note)
