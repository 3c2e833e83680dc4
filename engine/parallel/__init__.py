"""Tensor parallel (docs/engine.md#tensor-parallel): one process per rank, rank 0 schedules, the others follow its
steps."""
