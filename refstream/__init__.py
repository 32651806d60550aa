"""refstream — reference episode-based streaming of LeRobot v3 datasets into PyTorch.

The importable core (``rng``, ``shard``, ``planner``, ``resume``, ``windows``, ``mp4``,
``synth``, ``budget``, ``meta``) needs only numpy (and pyarrow for ``meta``); torch and PyAV are
imported only by the modules that use them (``stream``, ``decode``). ``StreamingDataset`` is
imported lazily so that ``import refstream`` stays light.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "StreamingDataset":
        from refstream.stream import StreamingDataset

        return StreamingDataset
    raise AttributeError(f"module 'refstream' has no attribute {name!r}")
