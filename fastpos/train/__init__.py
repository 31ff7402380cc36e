"""fastpos.train: not built yet (see the open issues)."""
