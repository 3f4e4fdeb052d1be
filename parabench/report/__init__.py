"""HTML reports: a pure function of result folders (never imports training code)."""

from parabench.report.html import write_report

__all__ = ["write_report"]
