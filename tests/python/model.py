"""The small deterministic model and data of the Optimizer tests."""
import torch


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def global_batch(epoch, size):
    """The global batch of an epoch: the same on every peer; peer i trains on its slice."""
    g = torch.Generator().manual_seed(1000 + epoch)
    x = torch.randn(size, 8, generator=g)
    w = torch.linspace(-1, 1, 16).reshape(8, 2)
    return x, torch.tanh(x @ w)
