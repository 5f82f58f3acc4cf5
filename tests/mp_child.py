"""Stand-in for LMDeploy's engine process (``ZMQMPEngine._mp_proc``), started the same way: a
``torch.multiprocessing`` ``spawn`` child that gets LMDeploy's logger and logs through it."""

from __future__ import annotations

import logging


def engine_like(log_level: int) -> None:
    from lmdeploy.utils import get_logger

    logger = get_logger("lmdeploy")  # as zmq_engine.py does at import, in the child
    logger.setLevel(log_level)  # as _mp_proc does with the parent's level
    logger.info("child: engine info")
    logger.warning("child: engine warning")
    logging.getLogger("lmdq.worker.engines.stub").warning("child: lmdq module warning")
