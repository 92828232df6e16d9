"""Graph passes. Each pass is a no-op when its pattern is absent."""
