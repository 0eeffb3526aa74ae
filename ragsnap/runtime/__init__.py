"""The model runtime: the only code that calls the model.

``attention`` (the registered attention function), ``forward`` (batched rows with
per-layer masks), ``prefill`` (chunked, with presses), ``decode`` (the decode loop),
``teacher_force`` and ``kv`` helpers; :class:`ModelRuntime` ties them to a loaded model.
"""
