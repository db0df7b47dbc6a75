"""diffjax models in the lm-evaluation-harness: :class:`DiffJaxLM`, registered with lm-eval as
``diffjax`` when this package is imported.

    python -m diffjax.lm_eval --model diffjax --model_args path=runs/default,model=diff \\
        --tasks lambada_openai --batch_size 16 --output_path out/

    import lm_eval
    from diffjax.lm_eval import DiffJaxLM
    lm_eval.simple_evaluate(model=DiffJaxLM(path="export/"), tasks=["arc_easy"])

``python -m diffjax.lm_eval`` is lm-eval's own command line (every option of ``lm-eval run``)
with the model registered; docs/lm_eval.md describes the model arguments and each request
type."""

from diffjax.lm_eval.loading import load
from diffjax.lm_eval.model import DiffJaxLM, data_mesh, parse_batch_size

__all__ = ["DiffJaxLM", "data_mesh", "load", "parse_batch_size"]
