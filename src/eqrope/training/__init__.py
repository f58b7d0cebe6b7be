"""Training: the next-token loss, the optimizer state and the compiled optax train step.

Remat comes from the model's config (`remat=True`); the block scan stays stacked here.
"""

from ._loss import cross_entropy as cross_entropy
from ._step import (
    TrainStep as TrainStep,
    init_optimizer as init_optimizer,
    make_train_step as make_train_step,
)
