"""hsd-jax: Hidden-State Speculative Decoding in JAX/Flax."""
