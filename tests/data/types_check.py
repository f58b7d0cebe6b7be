"""The public types as an editor sees them: tests/test_types.py runs mypy on this file.

Never run: every line is for the type checker (`typing.assert_type` fails mypy when the
inferred type differs).
"""

from typing import Any, assert_type

import jax
import optax

import eqrope
from eqrope.adapters import AdapterTrainStep
from eqrope.training import TrainStep


model = eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.key(0))
prompt = jax.numpy.arange(8)
tokenizer = eqrope.Tokenizer.from_pretrained("tokenizer-folder")

# generate: tokens, or a Generation with return_logprobs=True.
assert_type(eqrope.generate(model, prompt, 20), jax.Array)
assert_type(eqrope.generate(model, prompt, 20, temperature=0.8, key=jax.random.key(1)), jax.Array)
assert_type(eqrope.generate(model, prompt, 20, return_logprobs=False), jax.Array)
assert_type(eqrope.generate(model, prompt, 20, return_logprobs=True), eqrope.Generation)
assert_type(eqrope.generate(model, prompt, 20, return_logprobs=True).logprobs, jax.Array)

# generate_text: a string for a string, a list for a list, one more list with num_samples.
assert_type(eqrope.generate_text(model, tokenizer, "hello", 8), str)
assert_type(eqrope.generate_text(model, tokenizer, ["hello", "the cat"], 8), list[str])
assert_type(eqrope.generate_text(model, tokenizer, "hello", 8, num_samples=3), list[str])
assert_type(eqrope.generate_text(model, tokenizer, ["a", "b"], 8, num_samples=3), list[list[str]])
assert_type(eqrope.generate_text(model, tokenizer, "hello", 8, temperature=0.7), str)

# make_train_step: a TrainStep that gives back a model of the type it was given.
optimizer = optax.adam(1e-3)
step = eqrope.make_train_step(optimizer)
assert_type(step, TrainStep)
opt_state = eqrope.init_optimizer(optimizer, model)
ids = jax.numpy.zeros((2, 8), jax.numpy.int32)
new_model, new_state, loss = step(model, opt_state, ids, ids, ids > 0)
assert_type(new_model, eqrope.RotaryDecoder)
assert_type(new_state, Any)
assert_type(loss, jax.Array)

# make_adapter_train_step: an AdapterTrainStep, with the same return types and a key.
adapter_step = eqrope.make_adapter_train_step(optimizer)
assert_type(adapter_step, AdapterTrainStep)
adapted, adapter_state, adapter_loss = adapter_step(model, opt_state, ids, ids, key=jax.random.key(2))
assert_type(adapted, eqrope.RotaryDecoder)
assert_type(adapter_loss, jax.Array)
