"""``psflow.nn``: TensorFlow's ``tf.nn`` names."""

from psflow.ops.conv_ops import conv1d, conv2d
from psflow.ops.nn_ops import (
    bias_add,
    compute_average_loss,
    dropout,
    elu,
    embedding_lookup,
    gelu,
    l2_loss,
    l2_normalize,
    leaky_relu,
    log_softmax,
    moments,
    relu,
    relu6,
    scale_regularization_loss,
    selu,
    sigmoid,
    sigmoid_cross_entropy_with_logits,
    silu,
    softmax,
    softmax_cross_entropy_with_logits,
    softplus,
    sparse_softmax_cross_entropy_with_logits,
    swish,
    tanh,
)
from psflow.ops.normalization_ops import batch_normalization
from psflow.ops.pool_ops import avg_pool, avg_pool1d, avg_pool2d, max_pool, max_pool1d, max_pool2d
