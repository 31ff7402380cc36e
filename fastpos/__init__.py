"""fastpos: efficient attention with relative positional encodings in JAX/Flax."""

__version__ = "0.1.0"
