"""HTML reports: a pure function of result folders (never imports training code)."""

from __future__ import annotations

from pathlib import Path

from parabench.report.html import render_report
from parabench.results import write_text_atomic


class ReportWriteError(OSError):
    """The report could not be written (a folder in the way, a full disk...); nothing was left behind."""


def write_report(run_dirs: list[Path], output: Path, **kwargs) -> Path:
    """Render the run folders into one HTML file at ``output``, atomically and with the results'
    file mode. Unreadable results raise ``SchemaError`` / ``FileNotFoundError`` naming the file;
    an unwritable ``output`` raises ``ReportWriteError`` naming it, with no temporary file left."""
    output = Path(output)
    if output.is_dir():  # before rendering, which takes seconds
        raise ReportWriteError(
            f"cannot write the report to {output}: it is a folder; name a file such as {output / 'report.html'}"
        )
    kwargs.setdefault("link_from", output.parent)  # links to the runs' files start where the report is
    html = render_report([Path(d) for d in run_dirs], **kwargs)
    try:
        write_text_atomic(output, html)
    except OSError as exc:
        raise ReportWriteError(f"cannot write the report to {output}: {exc.strerror or exc}") from exc
    return output.resolve()


__all__ = ["ReportWriteError", "write_report"]
