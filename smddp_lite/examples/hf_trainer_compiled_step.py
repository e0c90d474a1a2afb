"""The Hugging Face Trainer with the compiled step (``smddp_lite.hf_trainer.CompiledStepTrainer``):
the tiny BERT of ``hf_trainer.py``, its optimizer built by ``smddp_lite.compile``.

    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.hf_trainer_compiled_step
"""

from __future__ import annotations

import tempfile

import torch.distributed as dist

import smddp_lite
from smddp_lite.examples import _outcome
from smddp_lite.examples.hf_trainer import Sentences, tiny_bert, training_arguments
from smddp_lite.hf_trainer import CompiledStepTrainer


def main() -> None:
    args = _outcome.arguments(__doc__, accumulate=True)
    smddp_lite.init(backend=args.backend)  # before TrainingArguments: the Trainer uses this group
    model = tiny_bert()
    with tempfile.TemporaryDirectory() as output_dir:
        training = training_arguments(output_dir, args.steps, gradient_accumulation_steps=args.accumulate)
        trainer = CompiledStepTrainer(model=model, args=training, train_dataset=Sentences(64))
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if dist.get_rank() == 0:
        print(f"Trainer with the compiled step on {args.backend}: {len(losses)} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    _outcome.write(args.out, losses, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
