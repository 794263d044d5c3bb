# The PyTorch pluggable allocator registry (see mempool/torch.py).
