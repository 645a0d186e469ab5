"""Writes the project's own image demo: pictures of one colored shape, and conversations about them.

    python scripts/make_shapes_task.py [--out-dir data] [--seed 7] [--train 32] [--test 8]

Each picture (data/shapes/NNN.png, 96 x 64 pixels) shows a red, green, blue or yellow circle, square or triangle
of random size and place on a light background. Each row is a sharegpt conversation with `<image>` in the
question: what is in the picture, then (every other row) a follow-up about its color, so multi-turn rows with an
image in the first turn are covered too. Registered as shapes_train / shapes_test in data/dataset_info.json
(columns messages + images); a vision-language model learns to name shape and color in a few dozen steps. The
output is a pure function of the seed and the sizes: tests/data/test_shapes_task.py rebuilds it and compares the
rows and the decoded pixels.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
SIZE = (96, 64)
QUESTIONS = ("<image>What is in this picture?", "What shape do you see?<image>", "<image>Describe the image.")


def draw(rng: random.Random, color: str, shape: str) -> Image.Image:
    image = Image.new("RGB", SIZE, (245, 245, 240))
    side = rng.randint(24, 44)
    x, y = rng.randint(2, SIZE[0] - side - 2), rng.randint(2, SIZE[1] - side - 2)
    pen = ImageDraw.Draw(image)
    box = (x, y, x + side, y + side)
    if shape == "circle":
        pen.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        pen.rectangle(box, fill=COLORS[color])
    else:
        pen.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=COLORS[color])
    return image


def row(rng: random.Random, index: int, color: str, shape: str, folder: str) -> dict:
    messages = [{"role": "user", "content": rng.choice(QUESTIONS)},
                {"role": "assistant", "content": f"A {color} {shape}."}]
    if index % 2:
        messages += [{"role": "user", "content": "What color is it?"},
                     {"role": "assistant", "content": f"It is {color}."}]
    return {"messages": messages, "images": [f"{folder}/{index:03d}.png"]}


def build(seed: int, train: int, test: int) -> tuple[list[dict], list[dict], list[Image.Image]]:
    rng = random.Random(seed)
    rows, images = [], []
    for index in range(train + test):
        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        images.append(draw(rng, color, shape))
        rows.append(row(rng, index, color, shape, "shapes"))
    return rows[:train], rows[train:], images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("data"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--train", type=int, default=32)
    parser.add_argument("--test", type=int, default=8)
    args = parser.parse_args()
    train, test, images = build(args.seed, args.train, args.test)
    folder = args.out_dir / "shapes"
    folder.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(images):
        image.save(folder / f"{index:03d}.png")
    for name, rows in (("shapes_train", train), ("shapes_test", test)):
        (args.out_dir / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
