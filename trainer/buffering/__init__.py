"""buffering."""
