"""Small utilities shared by the engine and the strategies."""
