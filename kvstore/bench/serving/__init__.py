"""``kvstore bench serving``: a Mooncake-format trace replayed through a fleet of real vLLM
servers, with and without the store (``workload`` → ``fleet`` → ``front`` → ``runner`` →
``report``; ``cli`` wires them)."""
