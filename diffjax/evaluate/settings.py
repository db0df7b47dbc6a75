"""How much of each analysis ``python -m diffjax.evaluate`` runs: the quick or the full set."""

from __future__ import annotations

import dataclasses

from .paper import QUANTIZATION_BITS


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How much of each analysis to run. :meth:`for_run` gives the quick or full set."""

    quick: bool
    retrieval_examples: int
    allocation_examples: int
    val_examples: int
    outlier_examples: int
    depth_bins: int = 5
    bits: tuple[int, ...] = QUANTIZATION_BITS
    batch_size: int = 8
    loss_buckets: int = 16

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
