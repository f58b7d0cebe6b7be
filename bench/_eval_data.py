"""bench/eval.py's data, written to a folder: two lm-eval tasks of invented words (a
4-choice task and a `generate_until` task, YAML over JSON Lines), and a random float32
Llama of the SmolLM2-135M shape (tiny sizes in `--quick`) with a byte-level BPE tokenizer
trained on the tasks' text. Nothing is downloaded.
"""

import json
import pathlib
import random


SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tu",
    "sa",
    "vi",
    "no",
    "pe",
    "dar",
    "bo",
    "qui",
    "el",
    "zo",
    "fa",
    "min",
    "rus",
    "te",
    "ga",
    "hol",
]


# -- the checkpoint and the tasks ------------------------------------------------------------


def words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def task_records(cfg: dict) -> tuple[list[dict], list[dict]]:
    """The 4-choice questions and the generation prompts, from a seeded generator."""
    rng = random.Random(0)
    questions = []
    for _ in range(cfg["questions"]):
        passage = words(rng, rng.randint(30, 60))
        at = rng.randrange(len(passage) - 1)
        answer = passage[at + 1]
        others = [w for w in words(rng, 12) if w != answer][:3]
        choices = [answer, *others]
        rng.shuffle(choices)
        questions.append(
            {
                "passage": " ".join(passage),
                "word": passage[at],
                "choices": choices,
                "answer": choices.index(answer),
            }
        )
    prompts = [
        {"prompt": " ".join(words(rng, rng.randint(20, 40))), "target": " ".join(words(rng, 3))}
        for _ in range(cfg["prompts"])
    ]
    return questions, prompts


CHOICE_YAML = """task: bench_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}\\nQuestion: which word comes after {{{{word}}}}?\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata:
  version: 1.0
"""
UNTIL_YAML = """task: bench_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: " {{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
metadata:
  version: 1.0
"""


def write_tasks(cfg: dict, folder: pathlib.Path) -> list[str]:
    questions, prompts = task_records(cfg)
    for name, records in (("choice.jsonl", questions), ("until.jsonl", prompts)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "bench_choice.yaml").write_text(CHOICE_YAML.format(data=folder / "choice.jsonl"))
    (folder / "bench_until.yaml").write_text(
        UNTIL_YAML.format(data=folder / "until.jsonl", max_gen_toks=cfg["max_gen_toks"])
    )
    corpus = [
        f"{q['passage']}\nQuestion: which word comes after {q['word']}?\n"
        f"Answer: {' '.join(q['choices'])}"
        for q in questions
    ] + [p["prompt"] + " " + p["target"] for p in prompts]
    return corpus


def write_checkpoint(cfg: dict, corpus: list[str], folder: pathlib.Path) -> dict:
    """The tokenizer and a random float32 Llama of the SmolLM2-135M shape (tiny sizes in
    `--quick`), saved as transformers saves them."""
    import tokenizers
    import torch
    import transformers
    from _shapes import SMOLLM2_135M
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(folder)
    fields = dict(SMOLLM2_135M)
    if cfg["tiny"]:
        fields.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            vocab_size=max(512, backend.get_vocab_size()),
        )
    config = transformers.LlamaConfig(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return {"hf_config": fields, "tokenizer_vocab": backend.get_vocab_size()}
