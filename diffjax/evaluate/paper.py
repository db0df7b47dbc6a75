"""The paper's numbers that ``eval.md`` prints beside the measured ones, each with the table or
figure it comes from (Ye et al., "Differential Transformer", ICLR 2025; the paper's text is
summarised in shared/reference/diff-transformer.md). Pairs are ``(Transformer, DIFF)``. The
paper's models are DIFF V1 and its Transformer baseline at 3B parameters."""

from __future__ import annotations

SCALE = "the paper's 3B-size models at 4K context"

# Table 2: multi-needle retrieval accuracy at 4K context; (N needles, R queried) -> (T, DIFF).
RETRIEVAL = {
    (1, 1): (1.00, 1.00),
    (2, 2): (0.85, 0.92),
    (4, 2): (0.62, 0.84),
    (6, 2): (0.55, 0.85),
}
RETRIEVAL_SETTINGS = tuple(RETRIEVAL)  # the (N, R) settings of Table 2

# Table 3: attention allocation by needle depth;
# depth -> (answer T, answer DIFF, noise context T, noise context DIFF).
ALLOCATION = {
    0.0: (0.03, 0.27, 0.51, 0.01),
    0.25: (0.03, 0.30, 0.54, 0.02),
    0.5: (0.03, 0.31, 0.52, 0.02),
    0.75: (0.07, 0.32, 0.49, 0.02),
    1.0: (0.09, 0.40, 0.49, 0.01),
}

# Table 5: activation outliers of the 3B models; activation -> statistic -> (T, DIFF).
OUTLIERS = {
    "attention logits": {"top-1": (318.0, 38.8), "top-10": (284.7, 32.0), "median": (5.4, 3.3)},
    "hidden states": {"top-1": (3608.6, 1688.2), "top-10": (3552.1, 1624.3), "median": (0.6, 1.2)},
}

# Fig. 8: the logit bit widths of the quantization experiment, and what it shows.
QUANTIZATION_BITS = (16, 8, 6, 4)
QUANTIZATION_FINDING = (
    "DIFF keeps its accuracy down to 6 bits, the Transformer drops at 6 bits, and 4-bit DIFF "
    "is about as good as 6-bit Transformer"
)
