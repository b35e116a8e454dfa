"""The engine's core: tensors, variables, sparse slices and the gradient tape."""
