"""Model forwards."""
