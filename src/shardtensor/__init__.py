"""shardtensor: distributed tensors for PyTorch."""
