"""A DIFF V1 model and its twin trained on a mixture of two corpora, CPU-sized: the standard
library's top-level modules (``os.py``, ``typing.py``, ...: about 40% of its code by bytes)
and the files of its packages (``asyncio/``, ``email/``, ...), mixed half and half, so the
modules are seen more often than in the stdlib corpus itself. Both are built from this
interpreter's own sources (nothing to download or prepare), byte-level, disjoint (each file
in one of them, with the train/validation split it has in the whole corpus).

The default comparison's model, steps and two paired seeds otherwise. Every evaluation logs
``val_loss/modules`` and ``val_loss/packages`` beside ``val_loss`` (their blend by the training
shares), in ``metrics.jsonl`` and TensorBoard; ``report.md`` gives per component its share of
the trained examples, the passes over it and DIFF − twin in its validation loss.

For prepared corpora (local or ``gs://``) write the components the same way with their
folders: ``data.mixture.components=web:0.7:gs://BUCKET/web,code:0.3:gs://BUCKET/code``
(docs/data.md#mixtures)."""

import dataclasses

from diffjax.data import MixtureComponent, MixtureData
from diffjax.compare import default_comparison


def get_config():
    exp = default_comparison()
    data = dataclasses.replace(
        exp.data,
        source="mixture",
        mixture=MixtureData(
            components=(
                MixtureComponent("modules", weight=0.5, source="stdlib", stdlib_part="modules"),
                MixtureComponent("packages", weight=0.5, source="stdlib", stdlib_part="packages"),
            ),
            exhausted="repeat",  # a component that runs out starts over (said in the log)
        ),
    )
    return dataclasses.replace(exp, run=dataclasses.replace(exp.run, name="mixture_cpu"), data=data)
