"""Parameter-server training internals: connections to PS tasks, the per-process session,
and the variable handles that read and update values held by the parameter servers."""
