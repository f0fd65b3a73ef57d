"""`legato bench`: a streaming TTS benchmark client (datasets, async client, metrics, goodput), a topology
× concurrency sweep that starts and stops `legato serve`, and a comparison of two runs.

Roles: `datasets` (meta.lst prompts → request bodies), `client` (async streaming requests → records),
`metrics` (per-request and aggregate definitions, SLOs, goodput), `report` (JSON, WAV, tables, plots),
`sweep` (server lifecycle, fairness rules), `cli` (the subcommands).
"""


class MissingExtraError(RuntimeError):
    """An optional dependency of the bench (the `bench` extra) is not installed."""
