"""Where engines run and how requests reach them: the engine client contract, the in-process client."""
