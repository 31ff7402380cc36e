"""fastpos.positional: not built yet (see the open issues)."""
