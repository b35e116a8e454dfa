"""``psflow.summary``: TensorBoard summaries as TensorFlow's ``tf.summary`` writes them.

Example:
    >>> import psflow as pf
    >>> writer = pf.summary.create_file_writer("/tmp/logs")  # doctest: +SKIP
    >>> with writer.as_default():  # doctest: +SKIP
    ...     for step in range(3):
    ...         pf.summary.scalar("loss", 1.0 / (step + 1), step=step)
    ...     writer.flush()

Needs the optional ``tensorboard`` package (``pip install psflow[tensorboard]``);
the Keras ``TensorBoard`` callback writes through the same writer.
"""

from psflow.summary import experimental
from psflow.summary.ops import flush, histogram, record_if, scalar, should_record_summaries, text
from psflow.summary.writer import SummaryWriter, create_file_writer, create_noop_writer

__all__ = [
    "SummaryWriter",
    "create_file_writer",
    "create_noop_writer",
    "experimental",
    "flush",
    "histogram",
    "record_if",
    "scalar",
    "should_record_summaries",
    "text",
]
