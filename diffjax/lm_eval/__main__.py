"""``python -m diffjax.lm_eval ...``: lm-eval's command line with the ``diffjax`` model
registered (stock ``lm-eval`` discovers no model outside its own package)."""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

from diffjax.lm_eval import DiffJaxLM  # noqa: F401 - registers the model as "diffjax"

if __name__ == "__main__":
    cli_evaluate()
