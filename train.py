#!/usr/bin/env python
"""diffjax's main entry point.

Until the training loop lands this is a short demo: it builds a small DIFF V1 model and its
standard-attention twin, prints their parameter counts part by part, and runs a forward pass of
both on the same tokens.

    python train.py [--attention diff_v1|diff_v2] [--d-model 256] [--num-layers 4] [--num-heads 4]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", default="diff_v1", choices=["diff_v1", "diff_v2"])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4,
                        help="DIFF heads h (the V1 twin gets 2h; the V2 twin gets h)")
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import diffjax

    try:
        config = diffjax.ModelConfig(attention=args.attention, d_model=args.d_model,
                                     num_layers=args.num_layers, num_heads=args.num_heads,
                                     num_kv_heads=args.num_kv_heads,
                                     max_seq_len=max(args.seq_len, 1))
    except diffjax.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    twin = diffjax.twin(config)
    print(f"JAX {jax.__version__} on {jax.default_backend()}")
    for name, cfg in (("DIFF", config), ("twin", twin)):
        print(f"{name:>5}: {cfg.attention}, d_model={cfg.d_model}, layers={cfg.num_layers}, "
              f"heads={cfg.num_heads}, kv_heads={cfg.kv_heads}, head_dim={cfg.resolved_head_dim}")
    print("\nParameters by part:\n")
    print(diffjax.compare_params(config))

    tokens = jax.random.randint(jax.random.key(args.seed), (2, args.seq_len), 0, config.vocab_size)
    print(f"\nForward pass on tokens {tuple(tokens.shape)} (same seed, same tokens):")
    for name, cfg in (("DIFF", config), ("twin", twin)):
        model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(args.seed))
        logits = nnx.jit(lambda m, t: m(t))(model, tokens)
        targets = jnp.roll(tokens, -1, axis=1)[:, :-1]
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                             targets[..., None], axis=-1))
        extra = ""
        if cfg.attention == "diff_v1":
            extra = "  lambda per layer: " + " ".join(f"{float(l):.3f}" for l in model.lambdas())
        print(f"{name:>5}: logits {tuple(logits.shape)} {logits.dtype}, "
              f"loss at init {float(loss):.4f} (ln V = {jnp.log(cfg.vocab_size):.4f}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
