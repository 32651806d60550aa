"""The ``refstream`` commands and what only they need: the CLI, the demo dataset writer and its
loopback server, ``doctor``, the ``inspect`` report, the bench with its baselines, and the
conformance runner with every kind's adapter. A training job never imports this package; the
library (``refstream``) never imports it either."""
