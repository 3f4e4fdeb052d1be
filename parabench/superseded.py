"""Committed runs that no headline may cite any more, kept for their history (``results/superseded.toml``).

``parabench headline`` refuses a row drawn from one, and the report shows the entry at the top of that run's
report: both read the list here, so the report does not depend on the headline's generator."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUPERSEDED = ROOT / "results" / "superseded.toml"


@dataclass(frozen=True)
class Superseded:
    run: str  # folder relative to the repository, e.g. results/h100x2/20261126-180901
    reason: str
    by: str  # the run (or campaign) that replaces it
    strategies: tuple[str, ...] = ()  # only these strategies' records; empty: the whole run

    def covers(self, strategy: str | None) -> bool:
        return not self.strategies or strategy in self.strategies

    def text(self) -> str:
        scope = f" (its {', '.join(self.strategies)} records)" if self.strategies else ""
        return f"{self.run}{scope} is superseded by {self.by}: {self.reason}"


def load_superseded(path: Path | str = SUPERSEDED) -> list[Superseded]:
    """The entries of ``results/superseded.toml`` (none where the file is absent)."""
    path = Path(path)
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    out = []
    for i, e in enumerate(data.get("superseded") or []):
        missing = [k for k in ("run", "reason", "by") if not isinstance(e.get(k), str) or not e[k].strip()]
        if missing:
            raise ValueError(f"{path}: entry {i + 1} lacks {', '.join(missing)}")
        out.append(
            Superseded(e["run"].rstrip("/"), e["reason"].strip(), e["by"].strip(), tuple(e.get("strategies") or ()))
        )
    return out


def superseded_entries(run_dir: Path | str, entries: list[Superseded] | None = None) -> list[Superseded]:
    """The entries naming ``run_dir`` (a run folder, given from anywhere: it is resolved)."""
    entries = load_superseded() if entries is None else entries
    here = Path(run_dir).resolve()
    return [e for e in entries if (ROOT / e.run).resolve() == here]
