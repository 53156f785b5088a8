"""Live measurement of a user's own training run: :func:`~driftcli.live.monitor.monitor`
attaches to any ``nn.Module`` and measures the operands of its matmuls under what-if casts,
step by step, into tables a report reads (``docs/monitor.md``)."""
