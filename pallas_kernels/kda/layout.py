"""Layout helpers shared by the KDA backends: grouped heads and document boundaries."""

import jax.numpy as jnp


def expand_heads(x, num_value_heads):
    """x: [..., H, D] -> [..., HV, D]; value head j reads q/k head j // (HV // H) (grouped value heads)."""
    return jnp.repeat(x, num_value_heads // x.shape[-2], axis=-2)


def document_starts(segment_ids):
    """segment_ids: [B, T] int -> [B, T] bool, True where the id differs from the previous token's (never at t=0)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(change, ((0, 0), (1, 0)))


def document_index(segment_ids):
    """segment_ids: [B, T] int -> [B, T] int32 counting document starts so far (0 for the first document).

    Unlike raw ids this is unique per document even when a packer reuses ids (e.g. 0, 1, 0, 1, ...).
    """
    return jnp.cumsum(document_starts(segment_ids), axis=1, dtype=jnp.int32)
