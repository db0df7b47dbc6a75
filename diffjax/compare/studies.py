"""Which program a config file is for: each study its own command, and a config file says which.

A config file's ``get_config()`` is the experiment every program starts from; a study adds one
module-level declaration, and the declaration names the program that runs it:

| declared | program |
|---|---|
| nothing | ``python train.py``: the comparison (DIFF and its twin, paired seeds) |
| ``SWEEP = Ladder(...)`` | ``python -m diffjax.sweep``: the comparison at every size or arm |
| ``SENSITIVITY = Ladder(field="train.lr", ...)`` | ``python -m diffjax.sweep.lr_sensitivity``: the learning-rate sensitivity |
| ``RETROFIT = RetrofitStudy(...)`` | ``python -m diffjax.retrofit_study``: the retrofit study |

A file run under another program is refused before anything runs, with the right command
(:func:`check_command`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from diffjax.config import ConfigError

# every program's exit codes: bad input (refused before any compute), a run that diverged, an
# unreadable checkpoint, and stopped by SIGTERM/SIGINT after saving (EX_TEMPFAIL: rerun to resume)
EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_CHECKPOINT = 2, 3, 4
EXIT_PREEMPTED = 75

TRAIN = "python train.py"
COMMANDS = {
    "SWEEP": "python -m diffjax.sweep",
    "SENSITIVITY": "python -m diffjax.sweep.lr_sensitivity",
    "RETROFIT": "python -m diffjax.retrofit_study",
}


def declared(path: str | None) -> tuple[str | None, Any]:
    """``(name, value)`` of the study the config file at ``path`` declares (a name of
    :data:`COMMANDS`), or ``(None, None)``: a plain training config (or no file)."""
    if path is None or not os.path.isfile(path):
        return None, None
    spec = importlib.util.spec_from_file_location("_diffjax_study_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [name for name in COMMANDS if hasattr(module, name)]
    if len(found) > 1:
        raise ConfigError(
            f"{path} declares {' and '.join(found)}: a config file is for one program. Fix: "
            f"keep one of them (a file per study)."
        )
    return (found[0], getattr(module, found[0])) if found else (None, None)


def check_command(path: str | None, name: str | None) -> Any:
    """The value of the declaration ``name`` in the config file at ``path`` (None: a plain
    training config, for ``train.py``). A :class:`ConfigError` naming the right command when
    the file is for another program, or the declaration it lacks."""
    found, value = declared(path)
    if found == name:
        return value
    command = TRAIN if name is None else COMMANDS[name]
    if found is not None:
        raise ConfigError(
            f"{path} declares {found}: it is for {COMMANDS[found]}, not {command}. Fix: "
            f"{COMMANDS[found]} --config {path}"
        )
    raise ConfigError(
        f"{path} declares no {name}: it is a training config for {TRAIN}, not {command}. "
        f"Fix: {TRAIN} --config {path}, or give {command} a config file with a module-level "
        f"{name} (docs/sweep.md, docs/retrofit.md)"
    )


def error(message: str) -> None:
    """``error: message`` on stderr: how every program reports what it refuses."""
    print(f"error: {message}", file=sys.stderr)
