"""One command-line convention for every ``python -m diffjax.*`` program.

A program takes its inputs as positional arguments (a run directory, input files), ``--config
FILE`` where a config file applies, a few mode switches (``--help``, ``--quick``, ...), and every
setting as a ``section.field=value`` override of a typed settings dataclass (``eval.bits=4,8``,
``sample.temperature=0.8``, ``prepare.tokenizer=byte``). Values are parsed by the field's
declared type (:func:`diffjax.config.convert`); the dataclass checks them at construction, so
an unknown key or a bad value stops with ``"<key>: <problem>. Fix: <fix>."`` before any
compute. ``--help`` lists every key with its type, default, the first sentence of its field's
comment and its allowed values (:func:`keys_help`).

A flag a program used to take is refused with the spelling that replaced it
(:func:`refuse_renamed`): ``--temperature 0.8`` -> ``the flag --temperature is now
sample.temperature=0.8``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import shlex
import sys
import textwrap
from typing import Any, Mapping, Sequence

from diffjax.config import (
    ConfigError,
    check_fields,
    convert,
    describe_type,
    fail,
    field_comments,
    field_types,
)

# what a program's settings dataclass checks itself with (the kernels' check imports them from
# here: the kernels import no other module of diffjax)
__all__ = [
    "ConfigError",
    "Renamed",
    "Section",
    "apply_overrides",
    "check_fields",
    "fail",
    "keys",
    "keys_help",
    "parse",
    "parser",
    "refuse_renamed",
    "split_overrides",
    "summary",
]

# an override: a dotted key of identifiers, then "=" (a positional input never looks like one
# unless it is given after "--")
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")


@dataclasses.dataclass(frozen=True)
class Section:
    """One settings dataclass of a program: its ``name`` (the keys' prefix), its ``default``
    instance (whose values ``--help`` shows and overrides start from) and the allowed values of
    the fields that have a fixed set (``choices``); the fields in ``exclude`` are no keys."""

    name: str
    default: Any
    choices: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
    exclude: tuple[str, ...] = ()  # fields that are not settings (a mode sets them)


@dataclasses.dataclass(frozen=True)
class Renamed:
    """What a flag a program no longer takes became: ``new`` with ``{}`` where its value goes
    (``"sample.temperature={}"``), or the whole new spelling for a switch
    (``"lm_eval.only=true"``); ``values``: how many values followed the flag ("none", "one" or
    "many": a list, written comma-separated)."""

    new: str
    values: str = "one"
    note: str = ""  # said after the new spelling, e.g. " (a positional argument)"


def summary(comment: str, limit: int = 120) -> str:
    """A field comment's first sentence, its first letter lowercased (not an acronym's); one
    over ``limit`` characters up to its first ``:`` or ``;`` outside parentheses."""
    end = re.search(r"\.\s+(?=[A-Z\"'`])", comment)
    first = comment[: end.start()] if end else comment.rstrip(".")
    if len(first) > limit:
        depth = 0
        for i, ch in enumerate(first):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and i >= 30 and first[i : i + 2] in (": ", "; "):
                first = first[:i]
                break
    if first[:2].istitle():
        first = first[0].lower() + first[1:]
    return first


def keys(sections: Sequence[Section]) -> list[tuple[str, str, Any, str]]:
    """Every key of ``sections`` as ``(key, type, default, one-line description)``; the
    description is the first sentence of the field's comment and, where the field has a fixed
    set, its allowed values."""
    out = []
    for section in sections:
        cls = type(section.default)
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            if f.name in section.exclude:
                continue
            text = summary(comments.get(f.name, ""))
            if f.name in section.choices:
                values = "one of " + ", ".join(map(repr, section.choices[f.name]))
                text = f"{text}; {values}" if text else values
            out.append(
                (f"{section.name}.{f.name}", str(f.type), getattr(section.default, f.name), text)
            )
    return out


def keys_help(
    sections: Sequence[Section], title: str = "settings (set as section.field=value):"
) -> str:
    """The ``--help`` text of ``sections``: a key per line with its type and default, then its
    description on the next line."""
    lines = [title]
    for key, type_str, value, text in keys(sections):
        lines.append(f"  {key:<27} {type_str:<24} default: {value!r}")
        if text:
            lines.append(f"      {text}")
    return "\n".join(lines)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(the section.field=value overrides, everything else)`` of ``argv``; after ``--``
    everything is positional (a prompt or a path that looks like an override)."""
    overrides, rest = [], []
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--":
            rest.extend(argv[i:])
            break
        (overrides if _OVERRIDE.match(arg) else rest).append(arg)
    return overrides, rest


def refuse_renamed(argv: Sequence[str], renamed: Mapping[str, Renamed], prog: str) -> None:
    """Raise :class:`ConfigError` naming the new spelling when ``argv`` (before ``--``) holds
    one of the ``renamed`` flags (``--flag value``, ``--flag=value``, or a switch)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--":
            return
        flag, eq, inline = arg.partition("=")
        if not flag.startswith("--") or flag not in renamed:
            continue
        r = renamed[flag]
        if r.values == "none":
            new = r.new
        else:
            if eq:
                values = [inline]
            else:
                values = []
                for nxt in argv[i + 1 :]:
                    if nxt == "--" or nxt.startswith("--") or _OVERRIDE.match(nxt):
                        break
                    values.append(nxt)
                    if r.values == "one":
                        break
            value = ",".join(values) if values else "VALUE"
            quoted = shlex.quote(value) if value != "VALUE" else value
            new = r.new.format(quoted)
        raise ConfigError(
            f"the flag {flag} is now {new}{r.note}. Fix: write {new} instead ({prog} --help "
            f"lists every setting)."
        )


def apply_overrides(
    sections: Sequence[Section], overrides: Sequence[str], prog: str
) -> dict[str, Any]:
    """``{section name: its dataclass}`` with ``["section.field=value", ...]`` applied, each
    value parsed by its field's type and each dataclass built once (its checks run then). An
    unknown key, a value of the wrong type or a value its dataclass refuses raises
    :class:`ConfigError` naming the key and the fix."""
    by_name = {s.name: s for s in sections}
    known = [k for k, _, _, _ in keys(sections)]
    changes: dict[str, dict[str, Any]] = {s.name: {} for s in sections}
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(
                f"{item!r} is not section.field=value. Fix: write it like {known[0]}=... "
                f"({prog} --help lists every setting)."
            )
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"unknown setting {key!r}. Fix: {hint}{prog} --help lists every setting."
            )
        name, _, fname = key.partition(".")
        tp = field_types(type(by_name[name].default))[fname]
        try:
            changes[name][fname] = convert(tp, raw, text=True)
        except ValueError as e:
            raise ConfigError(
                f"{key}: bad value {raw!r}: {e}. Fix: give {describe_type(tp)}."
            ) from None
    out = {}
    for s in sections:
        try:
            out[s.name] = dataclasses.replace(s.default, **changes[s.name])
        except ConfigError as e:  # "<Class>.<field>: ..." -> "<section>.<field>: ..."
            cls = type(s.default).__name__
            text = str(e)
            raise ConfigError(
                f"{s.name}.{text[len(cls) + 1 :]}" if text.startswith(cls + ".") else text
            ) from None
    return out


def _wrap(text: str) -> str:
    """``text`` with each paragraph written on one line wrapped at 95 characters (a paragraph
    already broken into lines is kept as written)."""
    return "\n\n".join(
        p if "\n" in p else textwrap.fill(p, 95, break_on_hyphens=False) for p in text.split("\n\n")
    )


def parser(
    prog: str,
    description: str,
    sections: Sequence[Section],
    *,
    example: str = "",
    epilog: str = "",
) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` ends with every key of ``sections``; the program
    adds its positional inputs and mode switches, and parses with :func:`parse` (which adds the
    settings, after the inputs)."""
    text = keys_help(sections)
    if epilog:
        text = _wrap(epilog.rstrip()) + "\n\n" + text
    if example:
        text += f"\n\nexample: {example}"
    p = argparse.ArgumentParser(
        prog=prog,
        description=_wrap(description),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=text,
    )
    return p


def parse(
    p: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    sections: Sequence[Section],
    renamed: Mapping[str, Renamed] | None = None,
    *,
    others: bool = False,
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """``(the parsed flags and positionals, {section: settings})``: a renamed flag, an unknown
    key or a bad value raises :class:`ConfigError` (the program prints it and exits 2), an
    argument argparse refuses exits 2 with argparse's usage message, ``--help`` exits 0.
    ``args.overrides``: the settings of ``sections`` as given. With ``others``, settings of
    other sections are left to the program (a config's keys: ``args.others``)."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    refuse_renamed(argv, renamed or {}, p.prog)
    overrides, rest = split_overrides(argv)
    if not any(a.dest == "overrides" for a in p._actions):
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="section.field=value",
            help="settings (listed below); values are parsed by the field's type",
        )
    args = p.parse_args(rest)
    if args.overrides:  # a positional left over, that no input took
        p.error(f"unrecognized arguments: {' '.join(args.overrides)}")
    names = {s.name for s in sections}
    args.others = [o for o in overrides if others and o.partition(".")[0] not in names]
    args.overrides = [o for o in overrides if o not in args.others]
    return args, apply_overrides(sections, args.overrides, p.prog)
