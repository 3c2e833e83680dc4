"""npuserve: LLM inference on Kubernetes clusters of Ascend NPUs.

This package holds the contracts shared by the engine, the operator and the load generator.
"""

__version__ = "0.1.0"
