"""Hugging Face Trainer on the "smddp" backend: a tiny BERT built from a config (no download).

The Trainer takes the process group it finds: initialise it first (``ddp_backend="smddp"`` is
refused by name by transformers' TrainingArguments).

    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.hf_trainer
    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.hf_trainer --compile   # torch_compile=True
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import smddp_lite
from smddp_lite.examples import _outcome


class Sentences(torch.utils.data.Dataset):
    """Random token ids whose label is whether the first token is even: learnable, generated."""

    def __init__(self, n: int, length: int = 12, vocab: int = 100) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": int(self.ids[i, 0] % 2)}


def tiny_bert() -> BertForSequenceClassification:
    """The model both Trainer examples train, the same on every rank."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(config)


def training_arguments(output_dir: str, steps: int, **more) -> TrainingArguments:
    """The examples' TrainingArguments (CPU, no saving, a loss logged every step), and ``more``."""
    return TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **more)


def main() -> None:
    args = _outcome.arguments(__doc__)
    smddp_lite.init(backend=args.backend)  # before TrainingArguments: the Trainer uses this group
    model = tiny_bert()
    with tempfile.TemporaryDirectory() as output_dir:
        training = training_arguments(output_dir, args.steps, ddp_find_unused_parameters=False,
                                      torch_compile=args.compile)
        trainer = Trainer(model=model, args=training, train_dataset=Sentences(64))
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if dist.get_rank() == 0:
        print(f"Trainer on {args.backend}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    _outcome.write(args.out, losses, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
