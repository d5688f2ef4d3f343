"""RE2's options for patterns the gateway did not write (an operator's rules, a client's guided regex):
RE2 runs in time linear in the text, whatever the pattern, where Python's ``re`` can backtrack for
seconds. Shared by the plugins that compile such patterns, so each bounds them the same way."""

from __future__ import annotations

import re2

#: RE2's own default memory bound per pattern: a pattern that needs more is refused, not run.
DEFAULT_MAX_MEM = 8 << 20


def re2_options(*, max_mem: int = DEFAULT_MAX_MEM) -> re2.Options:
    """Options that bound a pattern's memory and keep RE2 from writing a refused pattern to stderr (the
    caller reports it: a config error, or a client's 400)."""
    options = re2.Options()
    options.log_errors = False
    options.max_mem = max_mem
    return options
