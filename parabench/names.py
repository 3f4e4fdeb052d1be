"""One message for every user-given name parabench does not know (a strategy, model, suite, recipe,
precision...): one line that names the closest valid names and, for long lists, points to
``parabench list`` rather than printing every name.

Stdlib only: the CLI, the suite loader and the registry all raise through it, and ``parabench list``
must not pay for an import it does not need.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# Lists up to this long are printed whole (precisions, recipes, layouts): shorter than any pointer to them.
SHORT_LIST = 6
CLOSEST = 3


class UnknownName(KeyError, ValueError):
    """A name that is none of the valid ones. A KeyError for the lookups that raised KeyError and a
    ValueError for the validators that raised ValueError; ``str()`` is the message itself, where a
    plain KeyError's would be its quoted repr."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def closest_names(name, valid: Iterable[str], n: int = CLOSEST) -> list[str]:
    """The valid names nearest ``name``, best first: the name in other capitals, those whose part after
    the last dot is ``name`` ("ddp": ref.ddp and torch.ddp), then difflib's closest to the whole
    name, then to that part."""
    valid = list(dict.fromkeys(valid))
    text = str(name).lower()
    tails: dict[str, list[str]] = {}
    for v in valid:
        tails.setdefault(v.rsplit(".", 1)[-1].lower(), []).append(v)
    tail = text.rsplit(".", 1)[-1]
    lowered = {v.lower(): v for v in valid}
    close = [lowered[text]] if text in lowered else []  # the name in other capitals
    close += tails.get(tail, [])
    close += [lowered[v] for v in difflib.get_close_matches(text, list(lowered), n=n, cutoff=0.6)]
    for near in difflib.get_close_matches(tail, list(tails), n=n, cutoff=0.75):
        close += tails[near]
    return list(dict.fromkeys(close))[:n]


def _plural(word: str) -> str:
    return word[:-1] + "ies" if word.endswith("y") and word[-2:-1] not in "aeiou" else word + "s"


def unknown_name_message(
    what: str,
    name,
    valid: Iterable[str],
    *,
    plural: str | None = None,
    also: str = "",
    listing: str = "`parabench list`",
) -> str:
    """``unknown strategy 'ddp'; closest: ref.ddp, torch.ddp (valid strategies: `parabench list`)``.

    ``what`` is the kind of name, ``plural`` its plural where adding "s" is wrong, ``also`` a valid
    form no list holds (a model's ``custom-L<layers>-...``), ``listing`` where the whole list is.
    Up to ``SHORT_LIST`` valid names are listed whole."""
    valid = list(dict.fromkeys(valid))
    plural = plural or _plural(what)
    close = closest_names(name, valid)
    extra = f", or {also}" if also else ""
    if len(valid) <= SHORT_LIST:
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return f"unknown {what} {name!r}; {hint}valid {plural}: {', '.join(valid)}{extra}"
    hint = f"closest: {', '.join(close)}" if close else "none is close"
    return f"unknown {what} {name!r}; {hint} (valid {plural}: {listing}{extra})"


def unknown_name(what: str, name, valid: Iterable[str], **kwargs) -> UnknownName:
    """The exception to raise for an unknown name (``raise unknown_name("strategy", name, STRATEGIES)``)."""
    return UnknownName(unknown_name_message(what, name, valid, **kwargs))


def error_text(exc: BaseException) -> str:
    """An exception as a person reads it: a KeyError's message without the quotes its ``str`` adds."""
    if isinstance(exc, KeyError) and not isinstance(exc, UnknownName) and len(exc.args) == 1:
        return str(exc.args[0])
    return str(exc)
