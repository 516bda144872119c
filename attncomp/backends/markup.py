"""Numba's coloured error text made without colorama's stream set-up, while attncomp compiles.

Numba builds a message for every value it cannot type directly and every template that refuses a
call, most of them thrown away (an operator such as ``operator.add`` is typed through its template
after ``typeof`` refused it).  Where colorama is installed, each piece of such a message is marked
up (``HighlightColorScheme._markup``) inside a ``ColorShell``, which calls colorama's ``init``,
``reinit`` and ``deinit``: each wraps ``sys.stdout`` and ``sys.stderr`` again, on every platform, for
a string that does not depend on them.  A bf16 tensor-core forward kernel's PTX made some 13,000
such pieces (6% of its compile); a cpu kernel module, some 5,000.

Inside attncomp's compile window (:func:`attncomp.backends.call_types.remembered`), :func:`install`
makes the same string (the colour and style codes, the text, colorama's reset code) without the
shell.  Outside it, and where colorama is missing (Numba then marks nothing up), Numba's own runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from attncomp.backends import call_types, replaced

#: the modules whose ``HighlightColorScheme._markup`` is replaced
MODULES = ("numba.core.errors", "numba.cuda.core.errors")


def install(module: str) -> None:
    """Replace ``HighlightColorScheme._markup`` in Numba's errors module ``module`` (one of
    :data:`MODULES`; idempotent, and nothing where colorama is missing)."""
    errors = importlib.import_module(module)
    scheme = getattr(errors, "HighlightColorScheme", None)
    if scheme is not None:  # else no colorama: Numba's messages carry no markup
        replaced.replace(scheme, "_markup", lambda original: _plain(errors, original))


def _plain(errors: Any, original: Any) -> Any:
    """``HighlightColorScheme._markup`` of the errors module ``errors``, without the shell inside
    the window."""
    reset = errors.Style.RESET_ALL
    bright = errors.Style.BRIGHT

    def _markup(self: Any, msg: str, color: str | None = None, style: str | None = bright) -> str:
        if not call_types.compiling():
            return original(self, msg, color, style)
        return f"{color or ''}{style or ''}{msg}{reset}"

    return _markup
