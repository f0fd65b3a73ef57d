"""One worker's engine: request state machine, paged KV block manager, continuous-batching scheduler,
and (later) the model runner. Submodules are imported where used; this package imports nothing heavy."""
