"""modeling."""
