"""refstream — reference episode-based streaming of LeRobot v3 datasets into PyTorch.

``StreamingDataset`` is imported on first use, so ``import refstream`` and its I/O-free core
need neither torch nor PyAV.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "StreamingDataset":
        from refstream.stream import StreamingDataset

        return StreamingDataset
    raise AttributeError(f"module 'refstream' has no attribute {name!r}")
