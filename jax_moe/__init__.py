"""jax_moe: expert-parallel dispatch/combine for Mixture-of-Experts models in JAX."""
