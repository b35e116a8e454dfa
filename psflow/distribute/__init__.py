"""Distributed training with ``tf.distribute``'s programming model.

``psflow.distribute.cluster_resolver`` finds a process's role and its peers
(``TF_CONFIG``, Slurm, Kubernetes StatefulSets, or an explicit cluster).
"""

from psflow.distribute import cluster_resolver as cluster_resolver
