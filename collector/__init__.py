"""stepmem: GPU memory inside every training step, sampled by NVML and joined with PyTorch's
allocator statistics on one clock."""

__version__ = "0.1.0"
