"""``python -m lmdq.metrics``: the queue exporter (:mod:`lmdq.metrics.cli`)."""

from lmdq.metrics.cli import main

if __name__ == "__main__":
    main()
