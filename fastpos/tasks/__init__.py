"""fastpos.tasks: not built yet (see the open issues)."""
