""":class:`DiffJaxLM`: a diffjax model as an lm-evaluation-harness model, registered as
``diffjax``.

Tokenization and the empty-context rule come from lm-eval's ``TemplateLM`` (the code its ``hf``
model uses too), so both models see the same tokens. Each request type:

- ``loglikelihood``: context + continuation cut to the last ``max_length + 1`` tokens (the
  context truncated from the left); the sum of the continuation tokens' log-probs and whether
  each is the argmax. Requests are right-padded to a few bucket lengths and batched, one
  compiled forward per bucket.
- ``loglikelihood_rolling``: the document in lm-eval's rolling windows (each token scored
  exactly once, each window with as much preceding text as fits), batched like the above.
- ``generate_until``: greedy :func:`diffjax.generate` (sampling when the task asks for it), the
  context cut from the left to leave room for ``max_gen_toks``; the text ends at the tokenizer's
  end-of-text token or the first stop sequence.

With more than one device the batch rows are split over a ``data`` mesh (parameters
replicated)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from diffjax import ops
from diffjax.config import ConfigError
from diffjax.nn.decode import generate, pad_prompts
from diffjax.nn.model import TransformerLM
from diffjax.infra.runtime import Runtime
from diffjax.infra.sharding import MeshConfig, batch_sharding, make_mesh

from diffjax.lm_eval import loading
from diffjax.lm_eval import scoring as sc

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256


def parse_batch_size(batch_size: Any) -> int:
    """lm-eval's ``--batch_size``: an int (or its text); ``auto`` gives the default."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    try:
        value = int(batch_size)
    except (TypeError, ValueError):
        raise ConfigError(
            f"batch_size={batch_size!r} is not a number. Fix: give an int such as 8"
        ) from None
    if value < 1:
        raise ConfigError(f"batch_size={value} must be >= 1")
    return value


def data_mesh() -> jax.sharding.Mesh | None:
    """A mesh splitting the batch over every device (None on one device)."""
    return make_mesh(MeshConfig(data=-1)) if jax.device_count() > 1 else None


def _gen_settings(kwargs: dict[str, Any], default_max: int) -> dict[str, Any]:
    """``until``, ``max_gen_toks``, ``temperature``, ``top_k`` of a request's generation kwargs
    (``do_sample`` false or absent: greedy)."""
    kw = dict(kwargs)
    until = kw.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    max_gen = kw.pop("max_gen_toks", kw.pop("max_new_tokens", default_max))
    sample = bool(kw.get("do_sample", False))
    temperature = float(kw.get("temperature", 0.0) or 0.0) if sample else 0.0
    top_k = kw.get("top_k") if temperature > 0 else None
    return {
        "until": until,
        "max_gen_toks": int(max_gen),
        "temperature": temperature,
        "top_k": top_k,
    }


@register_model("diffjax")
class DiffJaxLM(TemplateLM):
    """A diffjax model in lm-evaluation-harness.

    ``path``: a ``train.py`` run directory (``model`` = the label, ``diff`` or ``standard``;
    ``seed``: default the run's; ``step``: ``best``, ``latest`` or a step), the folder of one of
    its models, or a Hugging Face directory written by :func:`diffjax.save_pretrained`; local
    or in a bucket (``gs://bucket/runs/default``: a missing bucket or no permission is refused
    before anything is read). ``tokenizer``: a ``tokenizer.json`` (or its directory; local or
    ``gs://``) or ``byte`` instead of the model's own (the run's ``data.tokenizer``; the
    directory's ``tokenizer.json``, else bytes).
    ``batch_size``: rows per compiled batch (rounded up to a multiple of the devices).
    ``max_length``: the context (default and at most the model's ``max_seq_len``).
    ``max_gen_toks``: tokens generated when a task does not say (default 256, at most half the
    context). ``prefix_token_id``: the token before an empty context or a document (default the
    tokenizer's BOS, else its EOS). ``device`` and ``max_batch_size`` are accepted and unused
    (JAX places the model on its default devices)."""

    def __init__(
        self,
        path: str | None = None,
        model: str = "diff",
        seed: int | None = None,
        step: int | str = "best",
        tokenizer: str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int | None = None,
        prefix_token_id: int | None = None,
        device: str | None = None,
        max_batch_size: int | None = None,
    ):
        super().__init__()
        if path is None:
            raise ConfigError(
                "the diffjax model needs path=. Fix: --model_args path=RUN_DIR (a train.py "
                "run directory) or path=HF_DIR (a directory written by diffjax.save_pretrained)"
            )
        mesh = data_mesh()
        lm, tok, where = loading.load(
            str(path), model=str(model), seed=seed, step=step, tokenizer=tokenizer, mesh=mesh
        )
        log.info("diffjax model from %s (%s), tokenizer %r", where, lm.config.attention, tok)
        self._setup(lm, tok, mesh, batch_size, max_length, max_gen_toks, prefix_token_id)

    @classmethod
    def from_model(
        cls,
        model: TransformerLM,
        tokenizer: loading.Tokenizer,
        *,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int | None = None,
        prefix_token_id: int | None = None,
    ) -> "DiffJaxLM":
        """A :class:`DiffJaxLM` of a model and tokenizer already in memory (the model is not
        changed; with several devices its parameters are copied onto the data mesh)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        mesh = data_mesh()
        if mesh is not None:
            graphdef, state = nnx.split(model)
            state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
            model = nnx.merge(graphdef, state)
        self._setup(model, tokenizer, mesh, batch_size, max_length, max_gen_toks, prefix_token_id)
        return self

    def _setup(self, model, tokenizer, mesh, batch_size, max_length, max_gen_toks, prefix):
        cfg = model.config
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary only "
                f"{cfg.vocab_size}. Fix: pass the tokenizer the model was trained with "
                f"(tokenizer=...)"
            )
        max_length = cfg.max_seq_len if max_length is None else int(max_length)
        if not 1 <= max_length <= cfg.max_seq_len:
            raise ConfigError(
                f"max_length={max_length} must be in [1, {cfg.max_seq_len}] (the model's "
                f"max_seq_len)"
            )
        ops.check_kernels(cfg)
        self._model = model
        self._graphdef, self._state = nnx.split(model)
        self._tok = tokenizer
        self._mesh = mesh
        shards = 1 if mesh is None else mesh.shape["data"]
        self._rows = sc.batch_rows(parse_batch_size(batch_size), shards)
        self._max_length = max_length
        self._buckets = sc.length_buckets(max_length)
        default_gen = min(DEFAULT_MAX_GEN_TOKS, max(1, max_length // 2))
        self._max_gen_toks = default_gen if max_gen_toks is None else int(max_gen_toks)
        self._prefix = None if prefix is None else int(prefix)

    # ------------------------------------------------------------------ tokens
    @property
    def model(self) -> TransformerLM:
        return self._model

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._rows

    @property
    def eot_token_id(self) -> int | None:
        """The tokenizer's end-of-text (EOS) token."""
        return self._tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context or a rolling document: ``prefix_token_id`` when
        given, else the tokenizer's BOS, else its EOS."""
        for token in (self._prefix, self._tok.bos_id, self._tok.eos_id):
            if token is not None:
                return int(token)
        raise ConfigError(
            "the tokenizer names no BOS or EOS token to put before an empty context. Fix: "
            "pass prefix_token_id=N in --model_args"
        )

    @property
    def tokenizer_name(self) -> str:
        return repr(self._tok)

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """The ids of ``string`` (no special tokens added)."""
        return self._tok.encode(string).tolist()

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode(np.asarray(tokens, np.int64))

    # ------------------------------------------------------------------ scoring
    def _forward(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._mesh is None:
            out = sc.token_scores(self._graphdef, self._state, inputs, targets)
        else:
            place = batch_sharding(self._mesh, 2)
            with jax.set_mesh(self._mesh):
                out = sc.token_scores(
                    self._graphdef,
                    self._state,
                    jax.device_put(inputs, place),
                    jax.device_put(targets, place),
                )
        return tuple(np.asarray(x) for x in out)

    def score_rows(
        self, rows: Sequence[sc.Row], disable_tqdm: bool = True
    ) -> list[tuple[float, bool]]:
        """``(log-prob sum, greedy)`` of each row, batched by bucket length."""
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        batches = sc.plan_batches([len(r[0]) for r in rows], self._buckets, self._rows)
        for width, idx in tqdm(batches, desc="diffjax scoring", disable=disable_tqdm):
            inputs = sc.pad_rows([rows[i][0] for i in idx], width, self._rows)
            targets = sc.pad_rows([rows[i][1] for i in idx], width, self._rows)
            logp, greedy = self._forward(inputs, targets)
            for r, i in enumerate(idx):
                results[i] = sc.row_result(logp[r], greedy[r], rows[i])
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows = [sc.loglikelihood_row(ctx, cont, self._max_length) for _, ctx, cont in requests]
        results = self.score_rows(rows, disable_tqdm)
        for (request, _, _), answer in zip(requests, results):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole document, in rolling windows."""
        rows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in sc.rolling_windows(
                self.tok_encode(text), self.prefix_token_id, self._max_length
            ):
                rows.append(sc.loglikelihood_row(ctx, cont, self._max_length))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self.score_rows(rows, disable_tqdm)):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def _generate_batch(self, contexts: Sequence[list[int]], settings: dict[str, Any], rng: int):
        """The new tokens of each context (their rows up to the end-of-text token)."""
        n = len(contexts)
        prompts = list(contexts) + [[self.prefix_token_id]] * (self._rows - n)
        tokens, lengths = pad_prompts(prompts)
        kw = dict(
            prompt_lengths=lengths,
            eos_id=self.eot_token_id,
            temperature=settings["temperature"],
            top_k=settings["top_k"],
            rng=rng if settings["temperature"] > 0 else None,
        )
        model = nnx.merge(self._graphdef, self._state)
        runtime = None if self._mesh is None else Runtime(self._mesh)
        out = generate(model, tokens, settings["max_gen_toks"], runtime=runtime, **kw)
        new = np.asarray(out)[:n, tokens.shape[1] :]
        return [sc.until_token(row, self.eot_token_id) for row in new]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled when a task sets ``do_sample``), cut at the first stop
        sequence."""
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        calls = 0
        for idx in groups.values():
            settings = _gen_settings(requests[idx[0]].args[1], self._max_gen_toks)
            room = self._max_length - settings["max_gen_toks"]
            if room < 1:
                raise ConfigError(
                    f"max_gen_toks={settings['max_gen_toks']} leaves no room for a context in "
                    f"the model's {self._max_length} tokens. Fix: ask for fewer new tokens"
                )
            contexts = [
                (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-room:]
                for i in idx
            ]
            order = sorted(range(len(idx)), key=lambda k: -len(contexts[k]))
            for k in tqdm(
                range(0, len(order), self._rows), desc="diffjax generation", disable=disable_tqdm
            ):
                chunk = order[k : k + self._rows]
                new = self._generate_batch([contexts[c] for c in chunk], settings, calls)
                calls += 1
                for c, toks in zip(chunk, new):
                    text = sc.cut_at_stops(self.tok_decode(toks), settings["until"])
                    results[idx[c]] = text
                    self.cache_hook.add_partial("generate_until", requests[idx[c]].args, text)
        return results

    def get_model_info(self) -> dict[str, Any]:
        cfg = self._model.config
        return {"diffjax_attention": cfg.attention, "diffjax_max_seq_len": cfg.max_seq_len}


__all__ = ["DiffJaxLM", "data_mesh", "parse_batch_size"]
