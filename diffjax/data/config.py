"""``DataConfig``: what the model reads, validated at construction.

Field problems raise :class:`diffjax.config.ConfigError` ("DataConfig.<field>: <problem>.
Fix: <fix>."). Problems with the data itself (a path that does not exist, a file with no text,
a token id the model cannot embed) are found by :func:`diffjax.data.check_data` /
:func:`diffjax.data.make_dataset` and raise :class:`DataError`, a ``ConfigError`` subclass, so
one ``except ConfigError`` catches both before training starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Any, NoReturn

from diffjax.infra import storage
from diffjax.config import ConfigError, check_declared, check_fields, declared, fail

SOURCES = ("stdlib", "text", "tokens", "needle", "mqar", "mixture")
COMPONENT_SOURCES = ("tokens", "text", "stdlib")  # what a mixture's component may be
MIXTURE_EXHAUSTED = ("repeat", "stop")  # what a mixture does when a component runs out
# Which of the stdlib corpus's files: all, its top-level modules (os.py, typing.py, ...) or
# the files of its packages (asyncio/, email/, ...): two disjoint kinds of code
STDLIB_PARTS = ("all", "modules", "packages")
TOKEN_DTYPES = ("uint16", "uint32", "int32")
SYNTHETIC_SOURCES = ("needle", "mqar")

# The needle task's templates (bytes; the key is lowercase letters, the value decimal digits).
NEEDLE_TEMPLATE = "\nThe magic number for {key} is {value}.\n"
QUERY_TEMPLATE = "\nWhat is the magic number for {key}? {value}."
MQAR_MAX_PAIRS = 128  # keys are byte ids 0..127, values byte ids 128..255


# What a saved data config that lacks a field meant: a run saved before `document_mask` existed
# trained on windows of the concatenated stream.
SAVED_BEFORE: dict[str, Any] = {
    "document_mask": False,
    "mixture": [],
    "mixture_exhausted": "repeat",
    "mixture_reweight": False,
    "stdlib_part": "all",
}


class DataError(ConfigError):
    """Data that cannot be used as configured (missing path, no text, bad token ids, ...).

    The message names the path or field and the fix."""


def needle_len(key_len: int, value_len: int, template: str = NEEDLE_TEMPLATE) -> int:
    """Bytes of one needle sentence."""
    return len(template.format(key="k" * key_len, value="0" * value_len).encode())


def query_len(key_len: int, value_len: int, template: str = QUERY_TEMPLATE) -> int:
    """Bytes of one query (question and answer)."""
    return len(template.format(key="k" * key_len, value="0" * value_len).encode())


def template_problem(template: str) -> str | None:
    """What is wrong with a needle or query template, or None: it must be ASCII (one byte per
    character) and hold ``{key}`` once, then ``{value}`` once, and no other braces."""
    if not template.isascii():
        return "is not ASCII (the byte-level task needs one byte per character)"
    rest = template.replace("{key}", "", 1).replace("{value}", "", 1)
    if template.count("{key}") != 1 or template.count("{value}") != 1:
        return "must hold '{key}' exactly once and '{value}' exactly once"
    if template.index("{key}") > template.index("{value}"):
        return "must put '{key}' before '{value}'"
    if "{" in rest or "}" in rest:
        return "holds braces other than '{key}' and '{value}'"
    return None


def component_seed(seed: int, name: str) -> int:
    """The shuffle seed of a mixture's component ``name`` under ``data.seed``: its own order,
    unchanged when other components are added or removed."""
    return (int(seed) + zlib.crc32(name.encode("utf-8"))) % 2**32


def _fail(field: str, problem: str, fix: str) -> NoReturn:
    fail("DataConfig", field, problem, fix)


_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
COMPONENT_TEXT = (
    "NAME:WEIGHT:PATH (a prepared folder), NAME:WEIGHT:text:PATH or NAME:WEIGHT:stdlib[:PART]"
)


@dataclasses.dataclass(frozen=True)
class MixtureComponent:
    """One corpus of a mixture (``DataConfig.mixture``): its name (the metrics' and the
    report's), where it is and its weight. A component is a prepared corpus (``source="tokens"``:
    a folder or ``gs://`` prefix written by ``python -m diffjax.data.prepare``), text files
    (``"text"``) or the stdlib corpus (``"stdlib"``); every component is cut into examples of the
    mixture's ``data.seq_len`` and read with its ``data.tokenizer``.

    On the command line a component is written ``NAME:WEIGHT:PATH`` (a prepared corpus),
    ``NAME:WEIGHT:text:PATH`` or ``NAME:WEIGHT:stdlib`` (``...:stdlib:modules`` or
    ``...:stdlib:packages``: a part of it); one field of a component is set as
    ``data.mixture.NAME.FIELD=VALUE`` (e.g. ``data.mixture.web.weight=0.5``)."""

    name: str  # letters, digits, '_', '-', '.': the metrics call it val_loss/NAME
    # a prepared folder or gs:// prefix ("tokens"), text files ("text"), None ("stdlib")
    path: str | None = None
    # the share of training examples, relative to the other components' weights (their sum
    # need not be 1). 0: evaluated only, never trained on
    weight: float = 1.0
    source: str = "tokens"  # "tokens" (a prepared corpus), "text" or "stdlib"
    max_files: int | None = None  # use only its first N files (prepared: shards per split)
    # its held-out share (None: the mixture's data.val_fraction); 0: no validation of it
    val_fraction: float | None = None
    stdlib_tests: bool = False  # stdlib: include its test packages
    stdlib_part: str = "all"  # stdlib: "all", its top-level "modules" or its "packages"

    # how the command line writes one (diffjax.config.describe_type says it in messages)
    TEXT = f"components written {COMPONENT_TEXT}"

    def __post_init__(self) -> None:
        check_fields(self)
        where = f"DataConfig.mixture[{self.name}]"
        if not _COMPONENT_NAME.match(self.name):
            fail(
                "DataConfig.mixture",
                "name",
                f"{self.name!r} is not a component name (letters, digits, '_', '-', '.'; "
                "starting with a letter or digit)",
                "name each component like 'web', 'code' or 'books-2'",
            )
        if self.source not in COMPONENT_SOURCES:
            fail(
                where,
                "source",
                f"unknown component source {self.source!r}",
                f"use one of {', '.join(map(repr, COMPONENT_SOURCES))}",
            )
        if not (math.isfinite(self.weight) and self.weight >= 0):
            fail(
                where,
                "weight",
                f"must be a finite number >= 0, got {self.weight}",
                f"give a weight like data.mixture.{self.name}.weight=0.5 (0: evaluate only)",
            )
        if self.source == "stdlib" and self.path is not None:
            fail(where, "path", "a stdlib component reads no files", "leave its path unset")
        if self.source != "stdlib" and not (self.path or "").strip():
            what = "a prepared folder or gs:// prefix" if self.source == "tokens" else "text files"
            fail(
                where,
                "path",
                f"a {self.source!r} component reads {what} from its path, which is unset",
                f"set data.mixture.{self.name}.path (or write it {COMPONENT_TEXT})",
            )
        if self.stdlib_tests and self.source != "stdlib":
            fail(where, "stdlib_tests", "is a stdlib setting", "leave it false")
        if self.stdlib_part not in STDLIB_PARTS:
            fail(
                where,
                "stdlib_part",
                f"unknown part {self.stdlib_part!r}",
                f"use one of {', '.join(map(repr, STDLIB_PARTS))}",
            )
        if self.stdlib_part != "all" and self.source != "stdlib":
            fail(where, "stdlib_part", "is a stdlib setting", "leave it 'all'")

    @classmethod
    def from_text(cls, text: str) -> "MixtureComponent":
        """``NAME:WEIGHT:PATH``, ``NAME:WEIGHT:text:PATH`` or ``NAME:WEIGHT:stdlib[:PART]`` (the
        command line's spelling); ValueError when it is none of them."""
        parts = text.strip().split(":", 2)
        if len(parts) < 3:
            raise ValueError(f"{text!r} is not {COMPONENT_TEXT}")
        name, weight, rest = (p.strip() for p in parts)
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"the weight {weight!r} of {text!r} is not a number") from None
        head, _, tail = rest.partition(":")
        if head == "stdlib" and (not tail or tail in STDLIB_PARTS):
            return cls(name, None, value, "stdlib", stdlib_part=tail or "all")
        if head in ("text", "tokens") and tail and not tail.startswith("//"):
            return cls(name, tail, value, head)
        return cls(name, rest, value, "tokens")

    def __str__(self) -> str:
        if self.source == "stdlib":
            part = "" if self.stdlib_part == "all" else f":{self.stdlib_part}"
            return f"{self.name}:{self.weight:g}:stdlib{part}"
        kind = "text:" if self.source == "text" else ""
        return f"{self.name}:{self.weight:g}:{kind}{self.path}"


def _check_section(config: Any, name: str) -> None:
    """A section's types and declared values, its errors naming it ``DataConfig.<name>``."""
    check_fields(config, f"DataConfig.{name}")
    check_declared(config, f"DataConfig.{name}")


@dataclasses.dataclass(frozen=True)
class StdlibData:
    """``data.stdlib``: which of the standard library's sources ``source="stdlib"`` reads (and
    the needle task's haystack when ``data.path`` is unset)."""

    tests: bool = False  # include the stdlib's test packages (test/, tests/, idle_test/)
    # which stdlib files: "all", its top-level "modules" or those in its "packages". The
    # modules are os.py, typing.py, ...; the packages asyncio/, email/, ...; a file's split is
    # the same in each
    part: str = declared("all", choices=STDLIB_PARTS, what="part")

    def __post_init__(self) -> None:
        _check_section(self, "stdlib")


@dataclasses.dataclass(frozen=True)
class TokensData:
    """``data.tokens``: how ``source="tokens"`` (and a mixture's prepared components) read
    token files."""

    # dtype of raw .bin token files (.npy files carry their own)
    dtype: str = declared("uint16", choices=TOKEN_DTYPES, what="dtype")

    def __post_init__(self) -> None:
        _check_section(self, "tokens")


@dataclasses.dataclass(frozen=True)
class NeedleData:
    """``data.needle``: the multi-needle retrieval task (``source="needle"``)."""

    # how many sentences "The magic number for <key> is <value>." hide in a haystack. Of
    # them, num_queries are asked at the end; the loss counts only the answer digits.
    num_needles: int = declared(4, ge=1, fix="use a positive integer")
    # the needles asked at the end of each example
    num_queries: int = declared(2, ge=1, fix="use a positive integer")
    # draw the queried needles with replacement. One may be asked twice, and num_queries may
    # exceed the needles: more answers to learn from per example, and no answer follows by
    # elimination; False asks each at most once.
    query_replacement: bool = False
    depths: tuple[float, ...] | None = None  # one per needle in [0, 1]; None: random
    key_len: int = declared(5, ge=1, fix="use a positive integer")  # characters per key
    value_len: int = declared(6, ge=1, fix="use a positive integer")  # decimal digits per value
    # the sentence each needle is. Both templates are ASCII, with "{key}" once before
    # "{value}" once; the defaults are the paper's wording.
    template: str = NEEDLE_TEMPLATE
    query_template: str = QUERY_TEMPLATE  # each query (its answer is the value)
    # keys are drawn from the first `num_key_letters` characters of `key_letters` (all of them
    # when it has fewer). ASCII, distinct, no digits. Characters that are rare in the haystack
    # text (e.g. "JQZXYKVW") make a key's only earlier occurrence its needle, as with the
    # paper's keys; lowercase letters also occur in the text.
    key_letters: str = "abcdefghijklmnopqrstuvwxyz"
    # how many of key_letters keys use
    num_key_letters: int = declared(
        26,
        ge=1,
        le=26,
        fix="use 1..26 (the first characters of data.needle.key_letters that keys are drawn from)",
    )

    def __post_init__(self) -> None:
        _check_section(self, "needle")
        n, r = self.num_needles, self.num_queries
        for name in ("template", "query_template"):
            problem = template_problem(getattr(self, name))
            if problem:
                _fail(
                    f"needle.{name}",
                    f"{getattr(self, name)!r} {problem}",
                    "write it like 'The magic number for {key} is {value}.'",
                )
        letters = self.key_letters
        if (
            not letters
            or not letters.isascii()
            or len(set(letters)) != len(letters)
            or any(ch.isdigit() for ch in letters)
        ):
            _fail(
                "needle.key_letters",
                f"{letters!r} must be non-empty ASCII characters, each once, and no digits (the "
                "values are digits)",
                "use e.g. 'abcdefghij' or 'JQZXYKVW'",
            )
        if self.depths is not None:
            if len(self.depths) != n:
                _fail(
                    "needle.depths",
                    f"has {len(self.depths)} depths for num_needles={n}",
                    f"give exactly {n} depths (or None for random depths)",
                )
            bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
            if bad:
                _fail(
                    "needle.depths",
                    f"depths must be fractions in [0, 1], got {bad}",
                    "use e.g. (0.0, 0.25, 0.5, 1.0)",
                )
        if r > n and not self.query_replacement:
            _fail(
                "needle.num_queries",
                f"{r} queries but only num_needles={n} needles",
                f"set num_queries <= {n} (or more needles, or query_replacement=True)",
            )
        if len(self.key_alphabet) ** min(self.key_len, 12) < n:
            _fail(
                "needle.key_len",
                f"{self.key_len} of {len(self.key_alphabet)} letters give fewer than {n} "
                "distinct keys",
                "use a longer key_len (or more num_key_letters, or fewer needles)",
            )
        if 9 * 10 ** (min(self.value_len, 12) - 1) < n:
            _fail(
                "needle.value_len",
                f"{self.value_len} digits give fewer than {n} distinct values",
                "use a longer value_len",
            )

    @property
    def key_alphabet(self) -> str:
        """The characters keys are drawn from: the first ``num_key_letters`` of
        ``key_letters`` (all of them when it has fewer)."""
        return self.key_letters[: self.num_key_letters]

    @property
    def needle_bytes(self) -> int:
        """Bytes of one needle sentence (``template`` filled in)."""
        return needle_len(self.key_len, self.value_len, self.template)

    @property
    def query_bytes(self) -> int:
        """Bytes of one query with its answer (``query_template`` filled in)."""
        return query_len(self.key_len, self.value_len, self.query_template)

    @property
    def min_seq_len(self) -> int:
        """The shortest example that holds BOS, the needles and the queries (no haystack)."""
        return self.num_needles * self.needle_bytes + self.num_queries * self.query_bytes


@dataclasses.dataclass(frozen=True)
class MqarData:
    """``data.mqar``: multi-query associative recall (``source="mqar"``): ``num_pairs`` (key,
    value) byte pairs, then ``num_queries`` keys; the loss counts the values."""

    num_pairs: int = declared(16, ge=1, fix="use a positive integer")  # key-value pairs
    # the keys asked after the pairs, each answered by its value
    num_queries: int = declared(2, ge=1, fix="use a positive integer")
    # draw the queried pairs with replacement (a pair may be asked twice, num_queries may
    # exceed num_pairs); False asks each at most once
    query_replacement: bool = False
    # keys are drawn from byte ids 0..num_keys-1. A smaller vocabulary (of keys or values) is
    # learned in fewer steps; the defaults use all 128 of each.
    num_keys: int = declared(
        MQAR_MAX_PAIRS,
        ge=1,
        le=MQAR_MAX_PAIRS,
        fix=f"use 1..{MQAR_MAX_PAIRS} (keys are byte ids 0..127, values 128..255)",
    )
    num_values: int = declared(
        MQAR_MAX_PAIRS,
        ge=1,
        le=MQAR_MAX_PAIRS,
        fix=f"use 1..{MQAR_MAX_PAIRS} (keys are byte ids 0..127, values 128..255)",
    )  # values from byte ids 128..127+num_values

    def __post_init__(self) -> None:
        _check_section(self, "mqar")
        p, r = self.num_pairs, self.num_queries
        if p > self.num_keys:
            _fail(
                "mqar.num_pairs",
                f"{p} pairs, but num_keys={self.num_keys} distinct keys",
                f"use num_pairs <= {self.num_keys} (or more keys, at most {MQAR_MAX_PAIRS})",
            )
        if r > p and not self.query_replacement:
            _fail(
                "mqar.num_queries",
                f"{r} queries but only num_pairs={p} pairs",
                f"set num_queries <= {p} (or query_replacement=True)",
            )

    @property
    def min_seq_len(self) -> int:
        """The shortest example: the pairs then the queries, no padding between."""
        return 2 * self.num_pairs + 2 * self.num_queries


@dataclasses.dataclass(frozen=True)
class SyntheticData:
    """``data.synthetic``: what the synthetic tasks (``needle``, ``mqar``) share."""

    num_val_examples: int = declared(
        1024, ge=1, fix="use a positive integer"
    )  # validation set size
    # train split: a context-length curriculum. Over the first `curriculum_steps` train steps
    # the examples grow linearly from `curriculum_start_len` tokens (None: the task's shortest,
    # `task_min_seq_len`: no haystack / no padding gap) to seq_len; each is PAD (no weight)
    # after its end, so every batch has one shape. Validation is always full length. 0: off
    # (every example is seq_len long).
    curriculum_steps: int = declared(
        0, ge=0, fix="use 0 (off) or the number of train steps over which the context grows"
    )
    # the curriculum's first length; None: the task's shortest (task_min_seq_len)
    curriculum_start_len: int | None = None

    def __post_init__(self) -> None:
        _check_section(self, "synthetic")
        if self.curriculum_start_len is not None and self.curriculum_steps == 0:
            _fail(
                "synthetic.curriculum_start_len",
                "is set but curriculum_steps=0 (no curriculum)",
                "set curriculum_steps > 0, or leave curriculum_start_len=None",
            )


@dataclasses.dataclass(frozen=True)
class MixtureData:
    """``data.mixture``: the weighted corpora ``source="mixture"`` trains on."""

    # the corpora trained on, each with its weight (MixtureComponent). On the command line
    # data.mixture.components=NAME:WEIGHT:PATH,NAME:WEIGHT:PATH (text:PATH for text files,
    # stdlib for the stdlib corpus); one field of a component data.mixture.NAME.FIELD=V
    components: tuple[MixtureComponent, ...] = ()
    # a component that has given all its train examples is read again in a new order
    # ("repeat") or ends training ("stop"). Either is said in the log (a stop also before
    # training, where it will come)
    exhausted: str = declared("repeat", choices=MIXTURE_EXHAUSTED, what="setting")
    # at a resume, allow weights other than the checkpoint's. They apply from the resumed step
    # on and are recorded in the checkpoints and the report; without it such a resume is refused
    reweight: bool = False

    def __post_init__(self) -> None:
        _check_section(self, "mixture")
        names = [c.name for c in self.components]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            _fail(
                "mixture.components",
                f"names the component {twice[0]!r} more than once",
                "give each component one entry (and a name of its own)",
            )
        if self.components and not sum(c.weight for c in self.components) > 0:
            _fail(
                "mixture.components",
                f"every weight is 0 ({', '.join(names)}): nothing to train on",
                f"give at least one component a weight > 0, e.g. data.mixture.{names[0]}.weight=1",
            )


# each source's sections (a section of another source must keep its defaults): the tagged
# union of the data settings
SOURCE_SECTIONS: dict[str, tuple[str, ...]] = {
    "stdlib": ("stdlib",),
    "text": (),
    "tokens": ("tokens",),
    "needle": ("needle", "synthetic", "stdlib"),  # stdlib: its haystack when path is unset
    "mqar": ("mqar", "synthetic"),
    "mixture": ("mixture", "tokens"),  # tokens: how its prepared components are read
}

# the flat fields of earlier versions, by where each lives now (relative to data.); a task's
# num_queries and query_replacement went to the task's own section
MOVED: dict[str, str] = {
    "token_dtype": "tokens.dtype",
    "stdlib_tests": "stdlib.tests",
    "stdlib_part": "stdlib.part",
    "num_needles": "needle.num_needles",
    "num_queries": "needle.num_queries",
    "query_replacement": "needle.query_replacement",
    "needle_depths": "needle.depths",
    "key_len": "needle.key_len",
    "value_len": "needle.value_len",
    "needle_template": "needle.template",
    "query_template": "needle.query_template",
    "needle_key_letters": "needle.key_letters",
    "needle_num_key_letters": "needle.num_key_letters",
    "num_pairs": "mqar.num_pairs",
    "mqar_num_keys": "mqar.num_keys",
    "mqar_num_values": "mqar.num_values",
    "num_val_examples": "synthetic.num_val_examples",
    "curriculum_steps": "synthetic.curriculum_steps",
    "curriculum_start_len": "synthetic.curriculum_start_len",
    "mixture": "mixture.components",
    "mixture_exhausted": "mixture.exhausted",
    "mixture_reweight": "mixture.reweight",
}
TASK_FIELDS = ("num_queries", "query_replacement")  # in the section of the saved source's task


def moved_keys() -> dict[str, str]:
    """``{old data.* key: the fix}`` for every flat key of an earlier version."""
    out = {}
    for old, new in MOVED.items():
        also = f" (or data.mqar.{new.split('.')[1]})" if old in TASK_FIELDS else ""
        out[f"data.{old}"] = f"write data.{new}{also}"
    return out


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data: a corpus (``stdlib``, ``text``, ``tokens``) or a synthetic task (``needle``,
    ``mqar``), or a ``mixture`` of corpora, cut into examples of ``seq_len`` inputs and
    ``seq_len`` next-token targets.

    The general settings are fields of their own; each source's are a section (``data.needle``,
    ``data.mqar``, ``data.synthetic``, ``data.stdlib``, ``data.tokens``, ``data.mixture``):
    a tagged union on ``source``, whose other sections keep their defaults
    (:data:`SOURCE_SECTIONS`). Every field is checked at construction. The data behind
    ``path`` is checked by :func:`diffjax.data.check_data` (and by
    :func:`diffjax.data.make_dataset`).
    """

    # Where the examples come from. "stdlib": this interpreter's standard-library .py sources
    # (built in, nothing to download). "text": UTF-8 text files under `path`. "tokens":
    # pre-tokenized .npy / .bin files. "needle": multi-needle retrieval. "mqar": multi-query
    # associative recall. "mixture": the weighted corpora of `mixture`.
    source: str = declared("stdlib", choices=SOURCES, what="source")
    # A file, a directory or a glob; several separated by commas. Required for "text" and
    # "tokens"; for "needle" the text the haystack is cut from (default: the stdlib corpus).
    path: str | None = None
    seq_len: int = declared(
        256, ge=8, fix="use e.g. seq_len=256"
    )  # inputs per example (each example holds seq_len + 1 tokens)
    # The share held out for validation. By file (a stable hash of the file's path) for
    # stdlib/text, the last fraction of the token stream for tokens (and for text with too few
    # files to split).
    val_fraction: float = declared(
        0.05, ge=0, lt=1, fix="use e.g. 0.05 (0 disables the validation split)"
    )
    seed: int = declared(
        0, ge=0, lt=2**32, fix="use a non-negative 32-bit seed (below 2**32)"
    )  # the shuffle order and the synthetic examples
    shuffle: bool = True  # train: a new permutation every epoch; validation: one fixed permutation
    max_files: int | None = declared(
        None, ge=1, fix="use a positive integer, or None for every file"
    )  # use only the first N files (sorted) of the corpus
    # Batches the input pipeline reads ahead of the step (two threads; a batch from a bucket is
    # one round of concurrent ranged reads); 0 reads each batch when the step asks for it. Only
    # the speed depends on it, never the batches (benchmarks/data_speed.py measures it).
    prefetch: int = declared(8, ge=0, fix="use e.g. data.prefetch=8")
    # stdlib/text: None or "byte" for bytes, else a Hugging Face tokenizer.json or a directory
    # holding one (a checkpoint's). Read with the `tokenizers` package (local only). tokens: the
    # tokenizer the ids were made with, checked against a prepared folder's manifest.
    tokenizer: str | None = None
    # stdlib/text/tokens: keep documents apart. Each batch then carries segment_ids (attention
    # stays inside a document) and positions (restarting at each document start), and no target
    # crosses a boundary (diffjax.data.documents). None: on where the boundaries are known (text
    # sources always; token files: a prepared folder, or the BOS/EOS ids of data.tokenizer),
    # off with one printed line where they are not, off for the synthetic tasks (their examples
    # are one document each). True: on, refused where the boundaries are unknown. False: windows
    # of the concatenated stream.
    document_mask: bool | None = None
    stdlib: StdlibData = StdlibData()
    tokens: TokensData = TokensData()
    needle: NeedleData = NeedleData()
    mqar: MqarData = MqarData()
    synthetic: SyntheticData = SyntheticData()
    mixture: MixtureData = MixtureData()

    def __post_init__(self) -> None:
        check_fields(self)
        check_declared(self)  # the bounds and choices declared with the fields
        self._check_sections()
        self._check_paths()
        self._check_task()
        self._check_mixture()

    # ------------------------------------------------------------------ validation
    def _check_sections(self) -> None:
        """The tagged union: a section the source does not read keeps its defaults."""
        mine = set(SOURCE_SECTIONS[self.source])
        if self.source == "needle" and self.path is not None:
            mine.discard("stdlib")  # its haystack is the files at path
        defaults = DataConfig.__dataclass_fields__
        for name in _SECTION_TYPES:
            if name in mine:
                continue
            value, default = getattr(self, name), defaults[name].default
            changed = [
                f.name
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(default, f.name)
            ]
            if changed:
                key = f"{name}.{changed[0]}"
                reads = f" reads {self.path!r}" if name == "stdlib" and self.path else ""
                _fail(
                    key,
                    f"is a {name} setting but source={self.source!r}{reads}",
                    f"leave data.{key} at its default, or use a source that reads it "
                    f"({', '.join(s for s, n in SOURCE_SECTIONS.items() if name in n)})",
                )

    def _check_paths(self) -> None:
        if self.path is not None and not self.path.strip():
            _fail("path", "is an empty string", "give a file, directory or glob, or leave it None")
        if self.path is not None and any(storage.is_remote(p) for p in self.path.split(",")):
            for p in self.path.split(","):
                storage.path(p.strip(), what="DataConfig.path")  # a known scheme
            if self.source != "tokens" or "," in self.path:
                _fail(
                    "path",
                    f"{self.path!r} is a URL; from a bucket diffjax reads one prepared prefix "
                    f"(source='tokens'), not {'several paths' if ',' in self.path else 'source=' + repr(self.source)}",
                    "prepare the corpus into the bucket (python -m diffjax.data.prepare INPUT... "
                    "prepare.tokenizer=T prepare.out=gs://BUCKET/prepared) and train with data.source=tokens "
                    "data.path=gs://BUCKET/prepared",
                )
        if self.source in ("text", "tokens") and self.path is None:
            what = "text files" if self.source == "text" else ".npy/.bin token files"
            _fail(
                "path",
                f"source={self.source!r} reads {what} from `path`, which is None",
                "set data.path to a file, directory or glob (comma-separated for several)",
            )
        if self.source in ("stdlib", "mqar") and self.path is not None:
            _fail(
                "path",
                f"source={self.source!r} does not read files, but path={self.path!r}",
                "leave path=None, or use source='text' (or 'tokens') to read these files",
            )
        if self.tokenizer is not None and not self.tokenizer.strip():
            _fail("tokenizer", "is an empty string", "give a tokenizer.json path, or 'byte'")

    def _check_task(self) -> None:
        """A synthetic task's settings against the general ones: its shortest example fits
        ``seq_len``, the curriculum's start in between; no tokenizer, no document mask."""
        if not self.is_synthetic:
            return
        if self.tokenizer not in (None, "byte"):
            _fail(
                "tokenizer",
                f"source={self.source!r} does not tokenize text (its ids are byte-level by "
                "construction)",
                "leave data.tokenizer unset, or use source='stdlib', 'text' or 'tokens'",
            )
        if self.document_mask:
            _fail(
                "document_mask",
                f"is a corpus setting but source={self.source!r} (its examples are one "
                "document each)",
                "leave data.document_mask unset (or false), or use source='stdlib', 'text' or "
                "'tokens'",
            )
        need = self.task_min_seq_len
        if self.seq_len < need:
            if self.source == "needle":
                n = self.needle
                problem = (
                    f"{self.seq_len} is too short for {n.num_needles} needles of "
                    f"{n.needle_bytes} bytes and {n.num_queries} queries of {n.query_bytes} "
                    f"bytes (needs >= {need})"
                )
                fix = f"set seq_len >= {need} (a haystack needs more), or fewer needles/queries"
            else:
                m = self.mqar
                problem = (
                    f"{self.seq_len} is too short for {m.num_pairs} pairs and {m.num_queries} "
                    f"queries (needs >= {need})"
                )
                fix = f"set seq_len >= {need} or fewer pairs/queries"
            _fail("seq_len", problem, fix)
        start = self.synthetic.curriculum_start_len
        if start is not None and not need <= start <= self.seq_len:
            _fail(
                "synthetic.curriculum_start_len",
                f"must be in [{need}, seq_len={self.seq_len}] (the shortest example that holds "
                f"the task, up to full length), got {start}",
                f"use a length in [{need}, {self.seq_len}], or None for {need}",
            )

    def _check_mixture(self) -> None:
        if self.source != "mixture":
            return
        if not self.mixture.components:
            _fail(
                "mixture.components",
                "source='mixture' but no component is given",
                "give the components, e.g. "
                "data.mixture.components=web:0.7:prepared/web,code:0.3:text:src/",
            )
        if self.path is not None:
            _fail(
                "path",
                f"source='mixture' reads its components' paths, but path={self.path!r}",
                "leave data.path unset and give each component its path in data.mixture.components",
            )
        for c in self.mixture.components:
            self.component(c.name)  # each component's own settings, checked as a DataConfig

    def component(self, name: str) -> "DataConfig":
        """The data config of the mixture's component ``name``: its corpus with this config's
        ``seq_len``, tokenizer, seed, shuffle, token and document settings (its own
        ``max_files`` and ``val_fraction`` where it sets them)."""
        found = [c for c in self.mixture.components if c.name == name]
        if not found:
            names = ", ".join(c.name for c in self.mixture.components) or "none"
            raise ConfigError(
                f"DataConfig.mixture: no component {name!r} (the components: {names}). Fix: "
                f"name one of them, or add {name!r} to data.mixture.components."
            )
        c = found[0]
        try:
            return DataConfig(
                source=c.source,
                path=c.path,
                seq_len=self.seq_len,
                val_fraction=self.val_fraction if c.val_fraction is None else c.val_fraction,
                seed=component_seed(self.seed, c.name),
                tokens=self.tokens if c.source == "tokens" else TokensData(),
                shuffle=self.shuffle,
                max_files=c.max_files,
                prefetch=self.prefetch,
                stdlib=StdlibData(c.stdlib_tests, c.stdlib_part),
                tokenizer=self.tokenizer,
                document_mask=self.document_mask,
            )
        except ConfigError as e:  # "DataConfig.<field>: ..." -> "DataConfig.mixture[name].<field>"
            text = str(e)
            if text.startswith("DataConfig."):
                text = f"DataConfig.mixture[{c.name}]." + text[len("DataConfig.") :]
            raise ConfigError(text) from None

    @property
    def task(self) -> NeedleData | MqarData | None:
        """The synthetic task's section (``needle`` or ``mqar``); None for a corpus."""
        return {"needle": self.needle, "mqar": self.mqar}.get(self.source)

    @property
    def weights(self) -> dict[str, float]:
        """A mixture's weights by component name, as given (not normalised)."""
        return {c.name: c.weight for c in self.mixture.components}

    # ------------------------------------------------------------------ derived values
    @property
    def task_min_seq_len(self) -> int:
        """The shortest example that holds the synthetic task: needle, no haystack; mqar, the
        pairs then the queries with no padding between."""
        if self.source == "needle":
            return self.needle.min_seq_len
        if self.source == "mqar":
            return self.mqar.min_seq_len
        raise ValueError(f"task_min_seq_len: source={self.source!r} is not a synthetic task")

    def context_len(self, step: int) -> int:
        """Tokens of the train examples of ``step`` (0-based) under the context-length
        curriculum: ``curriculum_start_len`` at step 0, growing linearly to ``seq_len`` at step
        ``curriculum_steps``; ``seq_len`` when there is no curriculum."""
        steps = self.synthetic.curriculum_steps
        if steps == 0 or step >= steps:
            return self.seq_len
        start = self.synthetic.curriculum_start_len or self.task_min_seq_len
        return start + (self.seq_len - start) * max(int(step), 0) // steps

    @property
    def uses_byte_tokenizer(self) -> bool:
        """Whether token ids are bytes (+ BOS/EOS/PAD): every source but ``tokens`` and a text
        source with a ``tokenizer``."""
        if self.source == "mixture":
            return self.tokenizer in (None, "byte") and all(
                c.source != "tokens" for c in self.mixture.components
            )
        return self.source != "tokens" and self.tokenizer in (None, "byte")

    @property
    def masks_documents(self) -> bool:
        """Whether batches keep documents apart where the corpus's boundaries are known
        (``document_mask`` True, or None for a corpus)."""
        return self.document_mask is not False and not self.is_synthetic

    @property
    def is_synthetic(self) -> bool:
        return self.source in SYNTHETIC_SOURCES

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> "DataConfig":
        """The data config a run saved (its ``to_dict()``, of this version or an earlier,
        flat one: :data:`MOVED`): fields it lacks take the value they meant before they
        existed (:data:`SAVED_BEFORE`), fields this version does not know are ignored."""
        source = saved.get("source")

        def sections(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
            nested: dict[str, dict[str, Any]] = {}
            for key, value in d.items():
                if key in _SECTION_TYPES and isinstance(value, dict):  # this version's section
                    nested.setdefault(key, {}).update(value)
                elif key in MOVED:  # an earlier version's flat field
                    section, name = MOVED[key].split(".")
                    if key in TASK_FIELDS:  # the task's own, else not this source's
                        if source not in ("needle", "mqar"):
                            continue
                        section = source
                    nested.setdefault(section, {})[name] = value
            return nested

        nested = sections(SAVED_BEFORE)
        for name, values in sections(saved).items():  # what was saved, over what it meant
            nested.setdefault(name, {}).update(values)
        general = {f.name for f in dataclasses.fields(cls)} - set(_SECTION_TYPES)
        flat = {**SAVED_BEFORE, **saved}
        out: dict[str, Any] = {k: v for k, v in flat.items() if k in general}
        for name, values in nested.items():
            tp = _SECTION_TYPES[name]
            names = {f.name for f in dataclasses.fields(tp)}
            out[name] = tp(**{k: v for k, v in values.items() if k in names})
        return cls(**out)

    def replace(self, **changes: Any) -> "DataConfig":
        """A copy with ``changes`` applied (validated again); a section given as a dict changes
        only those of its fields (``replace(needle={"num_needles": 3})``)."""
        for name, value in changes.items():
            if name in _SECTION_TYPES and isinstance(value, dict):
                changes[name] = dataclasses.replace(getattr(self, name), **value)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_TYPES: dict[str, type] = {
    "stdlib": StdlibData,
    "tokens": TokensData,
    "needle": NeedleData,
    "mqar": MqarData,
    "synthetic": SyntheticData,
    "mixture": MixtureData,
}
