"""What the tests and the benches share: request fuzzing, hostile bodies, a stand-in engine and
trace-shaped trees. Nothing in the rest of ``gyre`` imports this package; ``tests/`` and ``bench/``
import it and never each other.

* :mod:`gyre.testing.json_paths` -- the places of a JSON value by path, for the request fuzzers;
* :mod:`gyre.testing.hostile_cases` -- hostile request bodies and what each must earn;
  :mod:`gyre.testing.hostile_exchange` -- sending them to the proxy and judging the answers;
* :mod:`gyre.testing.stand_in_engine` -- a stand-in SGLang engine that answers at once
  (``python -m gyre.testing.stand_in_engine``);
* :mod:`gyre.testing.trace_trees` -- trajectory trees shaped like the recorded harness traces.
"""
