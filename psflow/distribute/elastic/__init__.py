"""Elastic synchronous training: a MultiWorkerMirroredStrategy group that loses and drains workers.

:class:`ElasticOptions` turns it on (``MultiWorkerMirroredStrategy(elastic=...)``);
:mod:`.controller` re-forms the group and replays the interrupted step,
:mod:`.state` snapshots and hands over the training state, :mod:`.input`
re-shards the rest of the epoch over the new members.
"""

from psflow.distribute.elastic.options import BatchPolicy, ElasticOptions, MembershipChange

__all__ = ["BatchPolicy", "ElasticOptions", "MembershipChange"]
