"""The psflow worker process."""
