"""The ranks table: one row per rank of every job on every agent, sortable and filterable."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual import on
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import DataTable

from trainguard.tui.model import COLUMN_KEYS, RANK_COLUMNS, RankRow, select_rows


class RanksTable(DataTable[Text]):
    """Rows rebuilt from :class:`~tui.model.RankRow` on every poll; the highlighted rank stays put."""

    sort_key: reactive[str] = reactive("rank", init=False)
    """Column the rows are ordered by (a key of ``tui.model.RANK_COLUMNS``)."""
    reverse: reactive[bool] = reactive(False, init=False)
    filter_text: reactive[str] = reactive("", init=False)
    """Space-separated words that every shown row contains."""

    class Selected(Message):
        """The highlighted rank changed (None: the table is empty)."""

        def __init__(self, row: RankRow | None) -> None:
            super().__init__()
            self.row = row

    class Sorted(Message):
        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)  # type: ignore[arg-type]
        self._all_rows: list[RankRow] = []
        self._shown: list[RankRow] = []
        self._show_node = False
        self._selected_key: str | None = None

    @property
    def selected(self) -> RankRow | None:
        return next((r for r in self._shown if r.key == self._selected_key), None)

    @property
    def shown(self) -> list[RankRow]:
        return list(self._shown)

    def sort_label(self) -> str:
        label = next(c.label for c in RANK_COLUMNS if c.key == self.sort_key)
        return f"{label} {'desc' if self.reverse else 'asc'}"

    def on_mount(self) -> None:
        self._build_columns()

    def _build_columns(self) -> None:
        self.clear(columns=True)
        for c in RANK_COLUMNS:
            if c.key == "node" and not self._show_node:
                continue
            mark = (" v" if self.reverse else " ^") if c.key == self.sort_key else ""
            self.add_column(c.label + mark, key=c.key)

    def show(self, rows: Sequence[RankRow], several_nodes: bool) -> None:
        self._all_rows = list(rows)
        if several_nodes != self._show_node:
            self._show_node = several_nodes
            self._build_columns()
        self._render_rows()

    def _render_rows(self) -> None:
        keep = self._selected_key
        self._shown = select_rows(self._all_rows, self.filter_text, self.sort_key, self.reverse)
        self.clear()
        for r in self._shown:
            style = "bold red" if not r.healthy else ("yellow" if r.straggling else "")
            cells = [Text(c.cell(r), style=style) for c in RANK_COLUMNS if c.key != "node" or self._show_node]
            self.add_row(*cells, key=r.key)
        if not self._shown:
            self._select(None)
            return
        index = next((i for i, r in enumerate(self._shown) if r.key == keep), 0)
        self.move_cursor(row=index, animate=False)
        self._select(self._shown[index])

    def _select(self, row: RankRow | None) -> None:
        self._selected_key = row.key if row else None
        self.post_message(self.Selected(row))

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        key = event.row_key.value
        row = next((r for r in self._shown if r.key == key), None)
        if row is not None:
            self._select(row)

    @on(DataTable.HeaderSelected)
    def _header(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        key = str(event.column_key.value)
        self.sort_by(key, reverse=(not self.reverse) if key == self.sort_key else False)

    def sort_by(self, key: str, reverse: bool = False) -> None:
        if key not in COLUMN_KEYS:
            raise ValueError(f"no rank column {key!r}")
        self.sort_key, self.reverse = key, reverse
        self._build_columns()
        self._render_rows()
        self.post_message(self.Sorted(self.sort_label()))

    def cycle_sort(self) -> None:
        """Next column (skipping the node column when there is one node)."""
        keys = [k for k in COLUMN_KEYS if k != "node" or self._show_node]
        nxt = keys[(keys.index(self.sort_key) + 1) % len(keys)] if self.sort_key in keys else keys[0]
        # Worst first for the figures an on-call engineer sorts by: slowest, lowest score last step.
        self.sort_by(nxt, reverse=nxt in ("step_ms", "compute_ms", "comm_ms", "data_ms"))

    def filter(self, query: str) -> None:
        self.filter_text = query.strip()
        self._render_rows()
