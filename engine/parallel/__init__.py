"""Tensor parallel (DESIGN.md 3.3): one process per rank, rank 0 schedules, the others follow its steps."""
