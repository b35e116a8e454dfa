"""Small datasets shipped inside psflow (Keras's ``keras.datasets``), loaded without a download.

Example:
    >>> from psflow.keras.datasets import digits
    >>> (x_train, y_train), (x_test, y_test) = digits.load_data()
    >>> x_train.shape, x_test.shape
    ((1437, 8, 8), (360, 8, 8))
"""

from psflow.keras.datasets import ctr, digits
