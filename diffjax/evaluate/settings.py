"""How much of each analysis ``python -m diffjax.evaluate`` runs: the quick or the full set,
each field settable as ``eval.field=value``."""

from __future__ import annotations

import dataclasses

from diffjax.config import check_fields, fail

from diffjax.evaluate.paper import QUANTIZATION_BITS


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How much of each analysis to run. :meth:`for_run` gives the quick or full set; every
    field is checked at construction."""

    # the quick subset (one context length, the examples below), chosen by --quick
    quick: bool
    retrieval_examples: int  # examples per cell of the multi-needle retrieval grid
    allocation_examples: int  # examples of the attention allocation (signal vs noise)
    val_examples: int  # validation sequences of the loss by position and the noise floor
    outlier_examples: int  # sequences whose activations the outlier statistics read
    depth_bins: int = 5  # needle depths of the retrieval grid (bins of the context)
    bits: tuple[int, ...] = QUANTIZATION_BITS  # bit widths of the logit quantization
    batch_size: int = 8  # sequences per forward pass
    loss_buckets: int = 16  # position buckets of the loss by position

    def __post_init__(self):
        check_fields(self)
        for name in (
            "retrieval_examples",
            "allocation_examples",
            "val_examples",
            "outlier_examples",
            "depth_bins",
            "batch_size",
            "loss_buckets",
        ):
            if getattr(self, name) < 1:
                fail(
                    "EvalSettings",
                    name,
                    f"must be >= 1, got {getattr(self, name)}",
                    f"set eval.{name} to a positive integer",
                )
        if not self.bits or any(not 2 <= b <= 24 for b in self.bits):
            fail(
                "EvalSettings",
                "bits",
                f"must be bit widths in [2, 24], got {self.bits}",
                f"e.g. eval.bits={','.join(map(str, QUANTIZATION_BITS))}",
            )

    @classmethod
    def for_run(cls, quick: bool) -> "EvalSettings":
        if quick:
            return cls(
                True,
                retrieval_examples=16,
                allocation_examples=8,
                val_examples=16,
                outlier_examples=4,
            )
        return cls(
            False,
            retrieval_examples=128,
            allocation_examples=64,
            val_examples=128,
            outlier_examples=16,
        )
