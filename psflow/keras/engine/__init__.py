"""Keras's training machinery: data adaptation, step runners, the Model class."""
