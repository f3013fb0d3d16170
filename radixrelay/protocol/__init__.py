"""What crosses a process boundary, defined once, as msgspec structs (msgpack on the wire, never pickle).
Imports no torch, so every process (and every CPU test) can use it.

- ``step``: the scheduler -> worker step plan (a diff) and the worker's step output;
- ``kv``: KV tier transfers planned with a step and their acknowledgements;
- ``cascade``: the decode rows the cascade planner sees and the plan it sends the worker;
- ``messages``: the ZMQ envelopes of each channel, request updates, the child processes' arguments;
- ``stats``: each process's counters struct, the KV audit, and ``RuntimeStats`` nesting them; every
  field's annotation says what it is (``/metrics`` and ``Engine.stats()`` are derived from them).

``SamplingParams`` (``radixrelay.sampling_params``) and ``StructuredOutput`` (``radixrelay.structured.spec``)
cross the boundary too; they are public API types and live where the API names them.
"""
