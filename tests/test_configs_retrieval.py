"""The retrieval configs (configs/needle.py, configs/mqar.py) load, validate and describe a task
that needs retrieval; ``query_chance`` gives the chance levels their docs quote, checked against
a brute-force guesser on generated examples."""

import os

import numpy as np
import pytest

from diffjax.data import DataConfig, make_dataset, make_source, MqarData, NeedleData, SyntheticData
from diffjax.data.synthetic import query_chance
from diffjax.train.config import ExperimentConfig, apply_overrides, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str) -> ExperimentConfig:
    return load_config(os.path.join(ROOT, "configs", f"{name}.py"))


@pytest.mark.parametrize("name", ["needle", "mqar"])
def test_retrieval_config_loads_and_needs_retrieval(name):
    cfg = _load(name)
    assert isinstance(cfg, ExperimentConfig) and cfg.compare.twins and cfg.model.is_diff
    # one init and one optimizer for both models (the init scale decides who learns MQAR first:
    # docs/retrieval.md), so a difference is the attention kind's
    models = cfg.models
    assert models["diff"].init_std == models["standard"].init_std == cfg.model.init_std
    assert cfg.data.source == name and cfg.data.seq_len <= cfg.model.max_seq_len
    d = cfg.data
    # distractors, and no query answerable by elimination alone: fewer queries than needles/pairs,
    # or queries drawn with replacement
    items = d.needle.num_needles if name == "needle" else d.mqar.num_pairs
    assert items >= 3 and (d.task.num_queries < items or d.task.query_replacement)
    chance = query_chance(d)
    assert 0 < chance["uniform"] < chance["no_retrieval"] < 0.5
    batch = next(iter(make_dataset(d, "train", batch_size=cfg.train.batch_size)))
    assert batch["inputs"].shape == (cfg.train.batch_size, d.seq_len)
    assert batch["answer_spans"].shape == (cfg.train.batch_size, d.task.num_queries, 2)
    # the overrides a notebook uses for a quick run keep the config valid
    quick = apply_overrides(cfg, ["train.steps=20", "train.eval_every=10", "compare.seeds=1"])
    assert quick.data == d and quick.train.steps == 20


def _brute_force_no_retrieval(config: DataConfig, n: int) -> float:
    """Expected accuracy of the guesser that copies the value of a random needle (pair) not
    asked by an earlier query of the example: exact per example, averaged over ``n``."""
    src = make_source(config, "validation")
    hits = []
    for i in range(n):
        ex = src[i]
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        if config.source == "needle":
            spans, asked = ex["needle_value_spans"], ex["query_needle"]
        else:
            spans, asked = ex["pair_spans"] + np.array([1, 0]), ex["query_pair"]
        values = [w[s:e].tobytes() for s, e in spans]
        for r, q in enumerate(asked):
            left = [
                j for j in range(len(values)) if config.task.query_replacement or j not in asked[:r]
            ]
            hits.append(np.mean([values[j] == values[q] for j in left]))
    return float(np.mean(hits))


def test_query_chance_matches_a_brute_force_guesser():
    needle = DataConfig(
        source="needle",
        seq_len=200,
        needle=NeedleData(num_needles=4, num_queries=2, key_len=1, value_len=1),
        synthetic=SyntheticData(num_val_examples=32),
    )
    c = query_chance(needle)
    assert c["uniform"] == pytest.approx(1 / 9)
    assert c["no_retrieval"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    assert c["no_retrieval_first"] == pytest.approx(1 / 4)  # query 0: nothing eliminated yet
    assert _brute_force_no_retrieval(needle, 32) == pytest.approx(c["no_retrieval"])  # exact
    mqar = DataConfig(
        source="mqar",
        seq_len=24,
        mqar=MqarData(num_pairs=8, num_queries=4, num_keys=16, num_values=4),
        synthetic=SyntheticData(num_val_examples=400),
    )
    c = query_chance(mqar)
    assert c["uniform"] == 0.25
    assert _brute_force_no_retrieval(mqar, 400) == pytest.approx(c["no_retrieval"], abs=0.01)
    # every pair queried: the last answer follows by elimination (probability 1)
    c = query_chance(mqar.replace(seq_len=32, mqar=dict(num_queries=8)))
    assert c["no_retrieval"] == pytest.approx(
        np.mean([1 / (8 - r) + (1 - 1 / (8 - r)) / 4 for r in range(8)])
    )
    with pytest.raises(ValueError, match="no queries"):
        query_chance(DataConfig())


def test_queries_with_replacement_repeat_keys_and_eliminate_nothing():
    mqar = DataConfig(
        source="mqar",
        seq_len=48,
        mqar=MqarData(
            num_pairs=8, num_queries=16, num_keys=16, num_values=16, query_replacement=True
        ),
        synthetic=SyntheticData(num_val_examples=300),
    )
    c = query_chance(mqar)
    assert c["no_retrieval"] == pytest.approx(1 / 8 + (1 - 1 / 8) / 16)  # the same for every query
    assert _brute_force_no_retrieval(mqar, 300) == pytest.approx(c["no_retrieval"], abs=0.01)
    src = make_source(mqar, "validation")
    asked = np.stack([src[i]["query_pair"] for i in range(50)])
    assert asked.shape == (50, 16) and asked.max() < 8
    assert all(len(set(row)) < 16 for row in asked)  # 16 queries of 8 pairs: repeats
    ex = src[0]
    w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
    for r, q in enumerate(ex["query_pair"]):  # each answer is the value of the asked pair
        s, e = ex["answer_spans"][r]
        assert w[e] == w[ex["pair_spans"][q][0] + 1]
    needle = DataConfig(
        source="needle",
        seq_len=300,
        needle=NeedleData(
            num_needles=3, num_queries=4, key_len=1, value_len=1, query_replacement=True
        ),
        synthetic=SyntheticData(num_val_examples=8),
    )
    assert query_chance(needle)["no_retrieval"] == pytest.approx(1 / 3)
    assert make_source(needle, "validation")[0]["query_needle"].shape == (4,)
    with pytest.raises(ValueError, match="query_replacement=True"):
        mqar.replace(mqar=dict(query_replacement=False))


@pytest.mark.parametrize("name", ["needle", "mqar"])
def test_repeated_queries_can_be_copied_and_the_first_query_cannot(name):
    """A guesser that never reads the needles (pairs): a repeated query copies the answer that
    follows the earlier query of the same key; any other query copies a random needle's value.
    On the shipped configs it scores far above the all-query no-retrieval level, and at that
    level on the first query: why the first query's accuracy is what shows retrieval."""
    from diffjax.data import query_kinds

    d = _load(name).data.replace(synthetic=dict(num_val_examples=256))
    chance = query_chance(d)
    src = make_source(d, "validation")
    rng = np.random.default_rng(0)
    hits, first_hits = [], []
    for i in range(len(src)):
        ex = src[i]
        batch = {k: v[None] for k, v in ex.items()}
        first, repeat = (x[0] for x in query_kinds(batch))
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        asked = ex["query_needle" if name == "needle" else "query_pair"]
        spans = (
            ex["needle_value_spans"] if name == "needle" else ex["pair_spans"] + np.array([1, 0])
        )
        for r, q in enumerate(asked):
            s, e = ex["answer_spans"][r] + 1  # the answer in input coordinates
            truth = w[s:e].tobytes()
            if repeat[r]:
                earlier = max(j for j in range(r) if asked[j] == q)
                es, ee = ex["answer_spans"][earlier] + 1
                guess = w[es:ee].tobytes()  # in the input before query r: copied, not retrieved
                assert es < s
            else:
                vs, ve = spans[rng.integers(len(spans))]
                guess = w[vs:ve].tobytes()
            hits.append(guess == truth)
            if first[r]:
                assert r == 0 and not repeat[r]
                first_hits.append(guess == truth)
    assert np.mean(hits) > chance["no_retrieval"] + 0.35  # well "above chance" without retrieval
    assert chance["no_retrieval_first"] == pytest.approx(chance["no_retrieval"])  # replacement
    assert abs(np.mean(first_hits) - chance["no_retrieval_first"]) < 0.1
    with pytest.raises(ValueError, match="needle and MQAR"):
        query_kinds({"inputs": np.zeros((1, 4))})


def test_needle_config_keys_occur_only_in_their_needle():
    """configs/needle.py draws its keys from characters rare in the haystack text, so a query's
    key occurs earlier in the example (outside its needle and earlier queries) in few examples,
    as the paper's keys do; with lowercase letters it occurs in about half (why the model must
    then also tell the needle from the text)."""
    d = _load("needle").data.replace(synthetic=dict(num_val_examples=256))

    def key_in_text(config: DataConfig) -> float:
        src = make_source(config, "validation")
        found = []
        for i in range(len(src)):
            ex = src[i]
            w = ex["inputs"]
            text = np.ones(len(w), bool)
            text[0] = False
            text[ex["query_spans"][0, 0] :] = False
            for s, e in ex["needle_spans"]:
                text[s:e] = False
            key = w[ex["needle_spans"][ex["query_needle"][0], 0]]  # bare needles: key first
            found.append(bool(np.any(text & (w == key))))
        return float(np.mean(found))

    assert d.needle.template == "{key}{value}" and d.needle.key_len == 1
    assert not set(d.needle.key_alphabet) & set("abcdefghijklmnopqrstuvwxyz0123456789")
    assert key_in_text(d) < 0.1
    assert key_in_text(d.replace(needle=dict(key_letters="abcdefghijklmnopqrstuvwxyz"))) > 0.3
