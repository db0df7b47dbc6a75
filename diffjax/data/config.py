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


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data: a corpus (``stdlib``, ``text``, ``tokens``) or a synthetic task (``needle``,
    ``mqar``), cut into examples of ``seq_len`` inputs and ``seq_len`` next-token targets.

    Every field is checked in ``__post_init__``. The data behind ``path`` is checked by
    :func:`diffjax.data.check_data` (and by :func:`diffjax.data.make_dataset`).
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
    token_dtype: str = declared(
        "uint16", choices=TOKEN_DTYPES, what="dtype"
    )  # dtype of raw .bin token files (.npy files carry their own)
    shuffle: bool = True  # train: a new permutation every epoch; validation: one fixed permutation
    max_files: int | None = declared(
        None, ge=1, fix="use a positive integer, or None for every file"
    )  # use only the first N files (sorted) of the corpus
    # Batches the input pipeline reads ahead of the step (two threads; a batch from a bucket is
    # one round of concurrent ranged reads); 0 reads each batch when the step asks for it. Only
    # the speed depends on it, never the batches (benchmarks/data_speed.py measures it).
    prefetch: int = declared(8, ge=0, fix="use e.g. data.prefetch=8")
    stdlib_tests: bool = False  # include the stdlib's test packages (test/, tests/, idle_test/)
    # which stdlib files: "all", its top-level "modules" or those in its "packages". The
    # modules are os.py, typing.py, ...; the packages asyncio/, email/, ...; a file's split is
    # the same in each
    stdlib_part: str = declared("all", choices=STDLIB_PARTS, what="part")
    # needle: how many sentences "The magic number for <key> is <value>." hide in a haystack.
    # Of them, num_queries are asked at the end; the loss counts only the answer digits.
    num_needles: int = declared(4, ge=1, fix="use a positive integer")
    num_queries: int = declared(
        2, ge=1, fix="use a positive integer"
    )  # needle and mqar: the queries that end each example
    # needle and mqar: draw the queried needles/pairs with replacement. One may be asked twice,
    # and num_queries may exceed the needles/pairs: more answers to learn from per example, and
    # no answer follows by elimination; False asks each at most once.
    query_replacement: bool = False
    needle_depths: tuple[float, ...] | None = None  # one per needle in [0, 1]; None: random
    key_len: int = declared(
        5, ge=1, fix="use a positive integer"
    )  # needle: characters per key (from needle_key_letters)
    value_len: int = declared(
        6, ge=1, fix="use a positive integer"
    )  # needle: decimal digits per value
    # needle: the sentence each needle is. Both templates are ASCII, with "{key}" once before
    # "{value}" once; the defaults are the paper's wording.
    needle_template: str = NEEDLE_TEMPLATE
    query_template: str = QUERY_TEMPLATE  # needle: each query (its answer is the value)
    # needle: keys are drawn from the first `needle_num_key_letters` characters of
    # `needle_key_letters` (all of them when it has fewer). ASCII, distinct, no digits.
    # Characters that are rare in the haystack text (e.g. "JQZXYKVW") make a key's only earlier
    # occurrence its needle, as with the paper's keys; lowercase letters also occur in the text.
    needle_key_letters: str = "abcdefghijklmnopqrstuvwxyz"
    needle_num_key_letters: int = 26  # needle: how many of needle_key_letters keys use
    # mqar: num_pairs (key, value) byte pairs, then num_queries keys; the loss counts the values.
    num_pairs: int = declared(16, ge=1, fix="use a positive integer")
    # mqar: keys are drawn from byte ids 0..mqar_num_keys-1. A smaller vocabulary (of keys or
    # values) is learned in fewer steps; the defaults use all 128 of each.
    mqar_num_keys: int = MQAR_MAX_PAIRS
    mqar_num_values: int = MQAR_MAX_PAIRS  # mqar: values from byte ids 128..127+mqar_num_values
    num_val_examples: int = declared(
        1024, ge=1, fix="use a positive integer"
    )  # validation set size of the synthetic tasks
    # needle and mqar, train split: a context-length curriculum. Over the first
    # `curriculum_steps` train steps the examples grow linearly from `curriculum_start_len`
    # tokens (None: the task's shortest, `task_min_seq_len`: no haystack / no padding gap) to
    # seq_len; each is PAD (no weight) after its end, so every batch has one shape. Validation
    # is always full length. 0: off (every example is seq_len long).
    curriculum_steps: int = 0
    # the curriculum's first length; None: the task's shortest (task_min_seq_len)
    curriculum_start_len: int | None = None
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
    # source="mixture": the corpora trained on, each with its weight (MixtureComponent). On
    # the command line data.mixture=NAME:WEIGHT:PATH,NAME:WEIGHT:PATH (text:PATH for text
    # files, stdlib for the stdlib corpus); one field of a component data.mixture.NAME.FIELD=V
    mixture: tuple[MixtureComponent, ...] = ()
    # source="mixture": a component that has given all its train examples is read again in
    # a new order ("repeat") or ends training ("stop"). Either is said in the log (a stop also
    # before training, where it will come)
    mixture_exhausted: str = "repeat"
    # source="mixture": at a resume, allow weights other than the checkpoint's. They apply
    # from the resumed step on and are recorded in the checkpoints and the report; without
    # it such a resume is refused
    mixture_reweight: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_values()
        self._check_mixture()

    # ------------------------------------------------------------------ validation
    def _check_values(self) -> None:
        check_declared(self)  # the bounds and choices declared with the fields
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
        if self.tokenizer not in (None, "byte") and self.source in SYNTHETIC_SOURCES:
            _fail(
                "tokenizer",
                f"source={self.source!r} does not tokenize text (its ids are byte-level by "
                "construction)",
                "leave data.tokenizer unset, or use source='stdlib', 'text' or 'tokens'",
            )
        if self.tokenizer is not None and not self.tokenizer.strip():
            _fail("tokenizer", "is an empty string", "give a tokenizer.json path, or 'byte'")
        reads_stdlib = self.source == "stdlib" or (self.source == "needle" and self.path is None)
        if self.stdlib_part != "all" and not reads_stdlib:
            _fail(
                "stdlib_part",
                f"is a stdlib setting but source={self.source!r}"
                + (f" reads {self.path!r}" if self.path else ""),
                "leave data.stdlib_part=all, or use source='stdlib'",
            )
        if self.needle_depths is not None:
            if self.source != "needle":
                _fail(
                    "needle_depths",
                    f"is a needle-task setting but source={self.source!r}",
                    "leave needle_depths=None or set source='needle'",
                )
            if len(self.needle_depths) != self.num_needles:
                _fail(
                    "needle_depths",
                    f"has {len(self.needle_depths)} depths for num_needles={self.num_needles}",
                    f"give exactly {self.num_needles} depths (or None for random depths)",
                )
            bad = [d for d in self.needle_depths if not 0.0 <= d <= 1.0]
            if bad:
                _fail(
                    "needle_depths",
                    f"depths must be fractions in [0, 1], got {bad}",
                    "use e.g. (0.0, 0.25, 0.5, 1.0)",
                )
        if self.source != "needle":
            for name in (
                "needle_template",
                "query_template",
                "needle_key_letters",
                "needle_num_key_letters",
            ):
                if getattr(self, name) != getattr(DataConfig, name):
                    _fail(
                        name,
                        f"is a needle-task setting but source={self.source!r}",
                        f"leave {name} at its default or set source='needle'",
                    )
        if self.source == "needle":
            self._check_needle()
        if self.source == "mqar":
            self._check_mqar()
        if self.document_mask and self.is_synthetic:
            _fail(
                "document_mask",
                f"is a corpus setting but source={self.source!r} (its examples are one "
                "document each)",
                "leave data.document_mask unset (or false), or use source='stdlib', 'text' or "
                "'tokens'",
            )
        self._check_curriculum()

    def _check_curriculum(self) -> None:
        if self.curriculum_steps < 0:
            _fail(
                "curriculum_steps",
                f"must be >= 0, got {self.curriculum_steps}",
                "use 0 (off) or the number of train steps over which the context grows",
            )
        if self.curriculum_steps > 0 and not self.is_synthetic:
            _fail(
                "curriculum_steps",
                f"is a needle/mqar setting but source={self.source!r}",
                "leave curriculum_steps=0, or use source='needle' or 'mqar'",
            )
        if self.curriculum_start_len is None:
            return
        if self.curriculum_steps == 0:
            _fail(
                "curriculum_start_len",
                "is set but curriculum_steps=0 (no curriculum)",
                "set curriculum_steps > 0, or leave curriculum_start_len=None",
            )
        low, high = self.task_min_seq_len, self.seq_len
        if not low <= self.curriculum_start_len <= high:
            _fail(
                "curriculum_start_len",
                f"must be in [{low}, seq_len={high}] (the shortest "
                f"example that holds the task, up to full length), got {self.curriculum_start_len}",
                f"use a length in [{low}, {high}], or None for {low}",
            )

    def _check_needle(self) -> None:
        n, r = self.num_needles, self.num_queries
        for name in ("needle_template", "query_template"):
            problem = template_problem(getattr(self, name))
            if problem:
                _fail(
                    name,
                    f"{getattr(self, name)!r} {problem}",
                    "write it like 'The magic number for {key} is {value}.'",
                )
        letters = self.needle_key_letters
        if (
            not letters
            or not letters.isascii()
            or len(set(letters)) != len(letters)
            or any(ch.isdigit() for ch in letters)
        ):
            _fail(
                "needle_key_letters",
                f"{letters!r} must be non-empty ASCII characters, each "
                "once, and no digits (the values are digits)",
                "use e.g. 'abcdefghij' or 'JQZXYKVW'",
            )
        if not 1 <= self.needle_num_key_letters <= 26:
            _fail(
                "needle_num_key_letters",
                f"must be in [1, 26], got {self.needle_num_key_letters}",
                "use 1..26 (the first characters of needle_key_letters that keys are drawn from)",
            )
        if r > n and not self.query_replacement:
            _fail(
                "num_queries",
                f"{r} queries but only num_needles={n} needles",
                f"set num_queries <= {n} (or more needles, or query_replacement=True)",
            )
        if len(self.key_alphabet) ** min(self.key_len, 12) < n:
            _fail(
                "key_len",
                f"{self.key_len} of {len(self.key_alphabet)} letters give "
                f"fewer than {n} distinct keys",
                "use a longer key_len (or more needle_num_key_letters, or fewer needles)",
            )
        if 9 * 10 ** (min(self.value_len, 12) - 1) < n:
            _fail(
                "value_len",
                f"{self.value_len} digits give fewer than {n} distinct values",
                "use a longer value_len",
            )
        need = self.needle_min_seq_len
        if self.seq_len < need:
            _fail(
                "seq_len",
                f"{self.seq_len} is too short for {n} needles of "
                f"{self.needle_bytes} bytes and {r} queries of "
                f"{self.query_bytes} bytes (needs >= {need})",
                f"set seq_len >= {need} (a haystack needs more), or fewer needles/queries",
            )

    def _check_mqar(self) -> None:
        p, r = self.num_pairs, self.num_queries
        for name in ("mqar_num_keys", "mqar_num_values"):
            if not 1 <= getattr(self, name) <= MQAR_MAX_PAIRS:
                _fail(
                    name,
                    f"must be in [1, {MQAR_MAX_PAIRS}], got {getattr(self, name)}",
                    f"use 1..{MQAR_MAX_PAIRS} (keys are byte ids 0..127, values 128..255)",
                )
        if p > self.mqar_num_keys:
            _fail(
                "num_pairs",
                f"{p} pairs, but mqar_num_keys={self.mqar_num_keys} distinct keys",
                f"use num_pairs <= {self.mqar_num_keys} (or more keys, at most {MQAR_MAX_PAIRS})",
            )
        if r > p and not self.query_replacement:
            _fail(
                "num_queries",
                f"{r} queries but only num_pairs={p} pairs",
                f"set num_queries <= {p} (or query_replacement=True)",
            )
        need = 2 * p + 2 * r
        if self.seq_len < need:
            _fail(
                "seq_len",
                f"{self.seq_len} is too short for {p} pairs and {r} queries (needs >= {need})",
                f"set seq_len >= {need} or fewer pairs/queries",
            )

    def _check_mixture(self) -> None:
        if self.source != "mixture":
            for name in ("mixture", "mixture_exhausted", "mixture_reweight"):
                if getattr(self, name) != getattr(DataConfig, name):
                    _fail(
                        name,
                        f"is a mixture setting but source={self.source!r}",
                        f"set data.source=mixture to train on data.mixture, or leave {name} unset",
                    )
            return
        if not self.mixture:
            _fail(
                "mixture",
                "source='mixture' but no component is given",
                "give the components, e.g. data.mixture=web:0.7:prepared/web,code:0.3:text:src/",
            )
        if self.path is not None:
            _fail(
                "path",
                f"source='mixture' reads its components' paths, but path={self.path!r}",
                "leave data.path unset and give each component its path in data.mixture",
            )
        names = [c.name for c in self.mixture]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            _fail(
                "mixture",
                f"names the component {twice[0]!r} more than once",
                "give each component one entry (and a name of its own)",
            )
        if not sum(c.weight for c in self.mixture) > 0:
            _fail(
                "mixture",
                f"every weight is 0 ({', '.join(names)}): nothing to train on",
                f"give at least one component a weight > 0, e.g. data.mixture.{names[0]}.weight=1",
            )
        if self.mixture_exhausted not in MIXTURE_EXHAUSTED:
            _fail(
                "mixture_exhausted",
                f"unknown setting {self.mixture_exhausted!r}",
                f"use one of {', '.join(map(repr, MIXTURE_EXHAUSTED))}",
            )
        for c in self.mixture:
            self.component(c.name)  # each component's own settings, checked as a DataConfig

    def component(self, name: str) -> "DataConfig":
        """The data config of the mixture's component ``name``: its corpus with this config's
        ``seq_len``, tokenizer, seed, shuffle and document settings (its own ``max_files`` and
        ``val_fraction`` where it sets them)."""
        found = [c for c in self.mixture if c.name == name]
        if not found:
            names = ", ".join(c.name for c in self.mixture) or "none"
            raise ConfigError(
                f"DataConfig.mixture: no component {name!r} (the components: {names}). Fix: "
                f"name one of them, or add {name!r} to data.mixture."
            )
        c = found[0]
        try:
            return DataConfig(
                source=c.source,
                path=c.path,
                seq_len=self.seq_len,
                val_fraction=self.val_fraction if c.val_fraction is None else c.val_fraction,
                seed=component_seed(self.seed, c.name),
                token_dtype=self.token_dtype,
                shuffle=self.shuffle,
                max_files=c.max_files,
                prefetch=self.prefetch,
                stdlib_tests=c.stdlib_tests,
                stdlib_part=c.stdlib_part,
                tokenizer=self.tokenizer,
                document_mask=self.document_mask,
            )
        except ConfigError as e:  # "DataConfig.<field>: ..." -> "DataConfig.mixture[name].<field>"
            text = str(e)
            if text.startswith("DataConfig."):
                text = f"DataConfig.mixture[{c.name}]." + text[len("DataConfig.") :]
            raise ConfigError(text) from None

    @property
    def weights(self) -> dict[str, float]:
        """A mixture's weights by component name, as given (not normalised)."""
        return {c.name: c.weight for c in self.mixture}

    # ------------------------------------------------------------------ derived values
    @property
    def needle_min_seq_len(self) -> int:
        """The shortest ``seq_len`` that holds BOS, the needles and the queries (no haystack)."""
        return self.num_needles * self.needle_bytes + self.num_queries * self.query_bytes

    @property
    def task_min_seq_len(self) -> int:
        """The shortest example that holds the synthetic task: needle, no haystack
        (:attr:`needle_min_seq_len`); mqar, the pairs then the queries with no padding between."""
        if self.source == "needle":
            return self.needle_min_seq_len
        if self.source == "mqar":
            return 2 * self.num_pairs + 2 * self.num_queries
        raise ValueError(f"task_min_seq_len: source={self.source!r} is not a synthetic task")

    def context_len(self, step: int) -> int:
        """Tokens of the train examples of ``step`` (0-based) under the context-length
        curriculum: ``curriculum_start_len`` at step 0, growing linearly to ``seq_len`` at step
        ``curriculum_steps``; ``seq_len`` when there is no curriculum."""
        if self.curriculum_steps == 0 or step >= self.curriculum_steps:
            return self.seq_len
        start = self.curriculum_start_len or self.task_min_seq_len
        return start + (self.seq_len - start) * max(int(step), 0) // self.curriculum_steps

    @property
    def key_alphabet(self) -> str:
        """The characters needle keys are drawn from: the first ``needle_num_key_letters`` of
        ``needle_key_letters`` (all of them when it has fewer)."""
        return self.needle_key_letters[: self.needle_num_key_letters]

    @property
    def needle_bytes(self) -> int:
        """Bytes of one needle sentence (``needle_template`` filled in)."""
        return needle_len(self.key_len, self.value_len, self.needle_template)

    @property
    def query_bytes(self) -> int:
        """Bytes of one query with its answer (``query_template`` filled in)."""
        return query_len(self.key_len, self.value_len, self.query_template)

    @property
    def uses_byte_tokenizer(self) -> bool:
        """Whether token ids are bytes (+ BOS/EOS/PAD): every source but ``tokens`` and a text
        source with a ``tokenizer``."""
        if self.source == "mixture":
            return self.tokenizer in (None, "byte") and all(
                c.source != "tokens" for c in self.mixture
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
        """The data config a run saved (its ``to_dict()``): fields it lacks take the value
        they meant before they existed (:data:`SAVED_BEFORE`), fields this version does not
        know are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**SAVED_BEFORE, **{k: v for k, v in saved.items() if k in names}})

    def replace(self, **changes: Any) -> "DataConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
