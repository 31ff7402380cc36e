"""fastpos.models: not built yet (see the open issues)."""
