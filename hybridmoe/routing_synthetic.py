"""The synthetic skewed router used to test and benchmark load balancing (no model, no data)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def skewed_scores(key, num_tokens, num_experts, spread=2.0):
    """[N, E] sigmoid(z + offset_j), z ~ N(0, 1) fresh per call, offsets linear over [-spread, spread]."""
    offset = jnp.linspace(-spread, spread, num_experts)
    return jax.nn.sigmoid(jax.random.normal(key, (num_tokens, num_experts)) + offset)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def simulate(router, num_tokens, steps, key):
    """Routes `steps` fresh skewed batches, updating between them; returns (final state, stats per step)."""
    def step(state, k):
        scores = skewed_scores(k, num_tokens, router.num_experts)
        out = router.route(scores, state)
        return router.update(state, scores, out), out.stats
    return jax.lax.scan(step, router.init_state(num_tokens=num_tokens), jax.random.split(key, steps))
