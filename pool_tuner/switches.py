"""Environment variables that turn a behaviour on or off, read by one rule: ``1``, ``true``,
``yes``, ``on`` turn it on and ``0``, ``false``, ``no``, ``off`` off (any case, spaces ignored);
unset or empty leaves the default; anything else is a ``RuntimeWarning`` naming the variable and
what it takes, and the default -- a misspelt switch must not pass in silence, and a bad value
must not stop the user's program (or the command line) at import."""

from __future__ import annotations

import os
import warnings

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str, default: bool, what: str, stacklevel: int = 2) -> bool:
    """The switch ``name`` as the environment holds it now (``what``: the behaviour it switches,
    for the warning)."""
    text = os.environ.get(name)
    value = "" if text is None else text.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value:
        warnings.warn(f"{name}={text!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF)}); {what} stays "
                      f"{'on' if default else 'off'}", RuntimeWarning, stacklevel=stacklevel + 1)
    return default
