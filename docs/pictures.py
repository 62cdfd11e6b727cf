"""Draw the README's pictures from a trained run: its training curves, read back from the TensorBoard event files
the run wrote, and the cross-attention of one translation (through `mtcli attention`'s own code).

    python docs/pictures.py --run runs/multi30k --sentence "A little girl climbs into a wooden playhouse."

Needs the tensorboard and plot extras (pip install -e '.[tensorboard,plot]').
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from mtcli.pictures import cross_attention, plot_attention  # noqa: E402
from mtcli.translate import Translator  # noqa: E402

HERE = Path(__file__).parent


def scalars(run: Path, tag: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one TensorBoard scalar; a resumed run's later event file wins for repeated steps."""
    values: dict[int, float] = {}
    for events in sorted((run / "tb").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({e.step: e.value for e in accumulator.Scalars(tag)})
    steps = sorted(values)
    return steps, [values[s] for s in steps]


def draw_curves(run: Path, out: Path) -> None:
    fig, (loss_ax, bleu_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps, loss = scalars(run, "train/loss")
    window = 50  # the per-update loss is noisy: a running mean over 50 updates
    smooth = [sum(loss[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(loss))]
    loss_ax.plot(steps, loss, color="0.8", linewidth=0.5, label="train (per update)")
    loss_ax.plot(steps, smooth, color="C0", label="train (mean of 50)")
    valid_steps, valid_loss = scalars(run, "valid/loss")
    loss_ax.plot(valid_steps, valid_loss, "o-", color="C1", label="valid")
    loss_ax.set(xlabel="update", ylabel="label-smoothed loss", ylim=(2, 8), title="loss")
    loss_ax.legend()
    valid_steps, bleu = scalars(run, "valid/bleu")
    bleu_ax.plot(valid_steps, bleu, "o-", color="C2")
    bleu_ax.set(xlabel="update", ylabel="BLEU", title="validation BLEU (greedy)")
    bleu_ax.grid(alpha=0.3)
    fig.suptitle(f"{run.name}: TensorBoard scalars from {run / 'tb'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--sentence", required=True)
    args = parser.parse_args()
    draw_curves(args.run, HERE / "curves.png")
    translator = Translator.from_run(args.run)
    plot_attention(cross_attention(translator, args.sentence), HERE / "attention.png")
    print(f"wrote {HERE / 'attention.png'}")


if __name__ == "__main__":
    main()
