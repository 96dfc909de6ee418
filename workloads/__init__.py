"""Real training workloads for stepmem: ``finetune`` (the seed scenario) and ``spiky``."""
