"""Videos: decoded only at the frames the model's own video processor picks (at video_fps, at most video_maxlen),
each frame scaled as LlamaFactory scales it, then tokenized by the processor exactly as its chat template and
__call__ would, and trained on with the model's own loss.

The decoding tests need PyAV (tuneforge[video]); the family tests need transformers' video processors, i.e. a
torchvision that loads beside torch (not the CPU-only torch wheel: scripts/test.sh runs them in .venv-vision)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from mm_families import NO_VIDEO_REASON, video_processors_load
from transformers.video_utils import default_sample_indices_fn

from tuneforge.data.formats import BadRow
from tuneforge.data.media import MediaSettings, load_video, video_decoder

pytestmark = pytest.mark.vision
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


class UniformRule:
    """transformers' default frame rule (BaseVideoProcessor.sample_frames without a processor's own defaults), for
    the decoding tests where no video processor can be built."""

    def sample_frames(self, metadata, num_frames=None, fps=None, **kwargs):
        return default_sample_indices_fn(metadata, num_frames=num_frames, fps=fps)


class Holder:
    video_processor = UniformRule()


@pytest.fixture
def clip(lf_data_dir):
    return lf_data_dir / "mllm_demo_data" / "1.mp4"  # 243 frames at 25 fps, 640 x 360


def test_a_video_is_decoded_at_the_sampled_frames_and_scaled(clip):
    av = pytest.importorskip("av")
    from PIL import Image

    frames, metadata = load_video(str(clip), MediaSettings(video_fps=2.0), Holder())
    count = int(243 / 25 * 2)  # 19 frames: two a second of a 9.72 s clip
    expected = np.arange(count) * 243 // count
    assert list(metadata.frames_indices) == expected.tolist()
    assert (metadata.fps, metadata.total_num_frames) == (25.0, 243)
    factor = (256 * 256 / (640 * 360)) ** 0.5  # video_max_pixels 65536
    assert frames.shape == (count, int(360 * factor), int(640 * factor), 3) and frames.dtype == np.uint8
    with av.open(str(clip)) as container:  # the 4th kept frame, decoded and scaled by hand
        raw = next(f for i, f in enumerate(container.decode(video=0)) if i == expected[3])
    hand = Image.fromarray(raw.to_ndarray(format="rgb24")).resize((frames.shape[2], frames.shape[1]))
    assert np.array_equal(frames[3], np.asarray(hand))


def test_video_maxlen_caps_the_frames_and_bytes_read_like_files(clip):
    pytest.importorskip("av")
    frames, metadata = load_video(str(clip), MediaSettings(video_fps=2.0, video_maxlen=5), Holder())
    assert list(metadata.frames_indices) == (np.arange(5) * 243 // 5).tolist() and len(frames) == 5
    embedded, _ = load_video({"bytes": clip.read_bytes(), "path": None}, MediaSettings(video_maxlen=5), Holder())
    assert np.array_equal(frames, embedded)


def test_a_missing_or_broken_video_is_a_bad_row_naming_it(tmp_path):
    pytest.importorskip("av")
    with pytest.raises(BadRow, match="nope.mp4 does not exist"):
        load_video("nope.mp4", MediaSettings(media_dir=str(tmp_path)), Holder())
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    with pytest.raises(BadRow, match="broken.mp4 cannot be read"):
        load_video("broken.mp4", MediaSettings(media_dir=str(tmp_path)), Holder())


# ---------------------------------------------------------------------------------------------------------------
# the families, through their own processors (torchvision needed)


needs_video_processor = pytest.mark.skipif(not video_processors_load(), reason=NO_VIDEO_REASON)


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def video_family(request, tmp_path_factory):
    from mm_families import build_family
    from transformers import AutoConfig

    from tuneforge.model.processor import load_processor

    path = build_family(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_processor(path, AutoConfig.from_pretrained(path))


@pytest.fixture
def video_data(tmp_path, lf_data_dir):
    root = tmp_path / "data"
    shutil.copytree(lf_data_dir / "mllm_demo_data", root / "mllm_demo_data")
    rows = json.loads((lf_data_dir / "mllm_video_demo.json").read_text())
    shutil.copy(lf_data_dir / "mllm_video_demo.json", root / "mllm_video_demo.json")
    info = json.loads((lf_data_dir / "dataset_info.json").read_text())
    (root / "dataset_info.json").write_text(json.dumps({"mllm_video_demo": info["mllm_video_demo"]}))
    return root, rows


@pytest.mark.skipif(video_processors_load(), reason="torchvision loads here: videos are read")
def test_without_torchvision_videos_stop_before_tokenizing_saying_what_to_install(video_data, tmp_path, home):
    from mm_families import build_family
    from transformers import AutoConfig

    from tuneforge.config import from_dict
    from tuneforge.data import build
    from tuneforge.errors import DataError
    from tuneforge.model.processor import load_processor

    path = build_family("qwen2_vl", tmp_path / "qwen2_vl")
    processor = load_processor(path, AutoConfig.from_pretrained(path))
    assert getattr(processor, "video_processor", None) is None
    root, _ = video_data
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mllm_video_demo", "dataset_dir": str(root)},
                    for_training=False)
    with pytest.raises(DataError, match=r"mllm_video_demo.*holds videos.*torchvision.*setup.sh --vision"):
        build(cfg, processor.tokenizer, processor)


@needs_video_processor
def test_video_rows_match_the_processor_and_train_with_its_loss(video_family, video_data, home):
    from transformers import AutoModelForMultimodalLM
    from transformers.video_utils import load_video as decode_all

    from tuneforge.batch import Batch, Layout
    from tuneforge.config import from_dict
    from tuneforge.data import build
    from tuneforge.data.collate import Collator
    from tuneforge.data.encode import IGNORE_INDEX
    from tuneforge.data.multimodal import message_parts
    from tuneforge.model import load_model
    from tuneforge.train.objectives.lm import LMObjective

    name, path, processor = video_family
    root, rows = video_data
    big = 10**7  # no scaling before the processor: its own resize alone, to compare with its own sampling
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mllm_video_demo", "dataset_dir": str(root),
                     "cutoff_len": 8192, "video_max_pixels": big}, for_training=False)
    splits = build(cfg, processor.tokenizer, processor)
    assert len(splits.train) == len(rows), name
    settings = MediaSettings(media_dir=str(root), video_max_pixels=big)
    marks = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
    for i, row in enumerate(rows):
        frames, metadata = load_video(row["videos"][0], settings, processor)
        messages = [{"role": m["role"], "content": [{"type": "video", "video": row["videos"][0]}
                                                    if p["type"] == "video" else p
                                                    for p in message_parts(m["content"], marks)]}
                    for m in row["messages"]]
        text = processor.apply_chat_template(messages, tokenize=False)
        ref = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                        return_tensors="pt")
        ours = splits.train[i]
        assert ours["input_ids"] == ref["input_ids"][0].tolist(), (name, i)
        supervised = processor.tokenizer.decode([t for t, lab in zip(ours["input_ids"], ours["labels"], strict=True)
                                                 if lab != IGNORE_INDEX])
        assert row["messages"][1]["content"].strip() in supervised, (name, i)
        # the frames we kept are the ones the video processor keeps from the whole video at 2 fps
        every, whole = decode_all(str(root / row["videos"][0]), backend=video_decoder())
        own = processor.video_processor(videos=[every], video_metadata=[whole], do_sample_frames=True, fps=2.0,
                                        return_tensors="pt")
        assert torch.equal(own["pixel_values_videos"], ref["pixel_values_videos"]), (name, i)

    batch = Collator(processor.tokenizer.pad_token_id)([splits.train[0], splits.train[1]])
    model = load_model(from_dict({"model_name_or_path": str(path), "finetuning_type": "full",
                                  "disable_gradient_checkpointing": True}, for_training=False)).eval()
    plain = AutoModelForMultimodalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    objective, labels = LMObjective(), batch.targets["labels"]
    with torch.no_grad():
        ours = objective(model, batch).loss_sum / objective.count(batch)
        theirs = plain(**batch.model_inputs, labels=labels).loss
        grey = dict(batch.model_inputs, pixel_values_videos=torch.full_like(batch.model_inputs["pixel_values_videos"],
                                                                            0.5))
        without = objective(model, Batch(grey, {"labels": labels}, Layout())).loss_sum / objective.count(batch)
    assert torch.allclose(ours, theirs, atol=1e-4), name
    assert not torch.allclose(ours, without, atol=1e-5), name
