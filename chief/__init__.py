"""The psflow chief process."""
