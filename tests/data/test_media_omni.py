"""An omni model (Qwen2.5-Omni, tiny and random) hearing videos with their sound (use_audio_in_video), on
LlamaFactory's mllm_video_audio_demo: rows are token-exact with the processor's own interleaving of each video's
frames with its sound, the loss is the thinker's own and changes with the sound, and a video's own audio track is
decoded when the row gives no audio.

The family tests need transformers' video processor (torchvision: scripts/test.sh runs them in .venv-vision); the
audio-track decoding needs PyAV only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from mm_families import NO_VIDEO_REASON, video_processors_load

from tuneforge.data.formats import BadRow
from tuneforge.data.media import MediaSettings, load_audio, load_soundtrack, load_video, video_decoder

pytestmark = pytest.mark.vision
RATE = 16000


def write_clip_with_sound(path, seconds=2.0, tone=440.0):
    """A small video with a sine on its audio track (16-bit PCM in AVI), and the sine as written."""
    import av

    samples = (0.5 * np.sin(2 * np.pi * tone * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)
    with av.open(str(path), "w", format="avi") as out:
        video = out.add_stream("mpeg4", rate=4)
        video.width, video.height, video.pix_fmt = 56, 56, "yuv420p"
        sound = out.add_stream("pcm_s16le", rate=RATE, layout="mono")
        for i in range(int(seconds * 4)):
            frame = av.VideoFrame.from_ndarray(np.full((56, 56, 3), 30 * i, dtype=np.uint8), format="rgb24")
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        chunk = 1600
        for start in range(0, len(samples), chunk):
            pcm = (samples[None, start:start + chunk] * 32767).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            frame.sample_rate, frame.pts = RATE, start
            out.mux(sound.encode(frame))
        out.mux(sound.encode(None))
    return samples


@pytest.mark.skipif(video_decoder() != "pyav", reason="decoding a video's audio track needs PyAV")
def test_a_videos_own_audio_track_is_decoded_at_the_sampling_rate(tmp_path):
    written = write_clip_with_sound(tmp_path / "clip.avi")
    heard = load_soundtrack("clip.avi", MediaSettings(media_dir=str(tmp_path), audio_sampling_rate=RATE))
    assert heard.dtype == np.float32 and abs(len(heard) - len(written)) <= 32
    n = min(len(heard), len(written))
    np.testing.assert_allclose(heard[:n], written[:n], atol=1e-4)
    half = load_soundtrack("clip.avi", MediaSettings(media_dir=str(tmp_path), audio_sampling_rate=RATE // 2))
    assert abs(len(half) - len(written) // 2) <= 32


def test_a_silent_video_cannot_be_heard(lf_data_dir):
    with pytest.raises(BadRow, match=r"4\.mp4 has no audio track.*audios column.*use_audio_in_video: false"):
        load_soundtrack("mllm_demo_data/4.mp4", MediaSettings(media_dir=str(lf_data_dir)))


# ---------------------------------------------------------------------------------------------------------------
# the family, through its own processor (torchvision needed)

needs_video_processor = pytest.mark.skipif(not video_processors_load(), reason=NO_VIDEO_REASON)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from mm_families import build_family
    from transformers import AutoConfig

    from tuneforge.model.processor import load_processor

    if not video_processors_load():
        pytest.skip(NO_VIDEO_REASON)
    path = build_family("qwen2_5_omni", tmp_path_factory.mktemp("qwen2_5_omni"))
    return path, load_processor(path, AutoConfig.from_pretrained(path))


@pytest.fixture
def demo(tmp_path, lf_data_dir):
    root = tmp_path / "data"
    shutil.copytree(lf_data_dir / "mllm_demo_data", root / "mllm_demo_data")
    rows = json.loads((lf_data_dir / "mllm_video_audio_demo.json").read_text())
    info = {"mllm_video_audio_demo": json.loads((lf_data_dir / "dataset_info.json").read_text())[
        "mllm_video_audio_demo"]}
    return root, rows, info


def write_dataset(root, info, rows):
    (root / "mllm_video_audio_demo.json").write_text(json.dumps(rows))
    (root / "dataset_info.json").write_text(json.dumps(info))


@needs_video_processor
def test_videos_heard_with_their_sound_match_the_processor_and_train_with_the_thinkers_loss(omni, demo, home):
    from transformers import AutoModelForMultimodalLM

    from tuneforge.batch import Batch, Layout
    from tuneforge.config import from_dict
    from tuneforge.data import build
    from tuneforge.data.collate import Collator
    from tuneforge.data.encode import IGNORE_INDEX
    from tuneforge.model import load_model
    from tuneforge.train.objectives.lm import LMObjective

    path, processor = omni
    root, rows, info = demo
    write_dataset(root, info, rows)
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mllm_video_audio_demo", "dataset_dir": str(root),
                     "cutoff_len": 8192, "use_audio_in_video": True}, for_training=False)
    splits = build(cfg, processor.tokenizer, processor)
    assert len(splits.train) == len(rows)
    settings = MediaSettings(media_dir=str(root))
    audio_id, video_id = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|AUDIO|>", "<|VIDEO|>"))
    for i, row in enumerate(rows):
        frames, metadata = load_video(row["videos"][0], settings, processor)
        question = row["messages"][0]["content"].replace("<video>", "").replace("<audio>", "")
        messages = [{"role": "user", "content": [{"type": "video", "video": row["videos"][0]},
                                                 {"type": "text", "text": question}]},
                    {"role": "assistant", "content": [{"type": "text", "text": row["messages"][1]["content"]}]}]
        text = processor.apply_chat_template(messages, tokenize=False)
        ref = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                        audio=[load_audio(row["audios"][0], settings)], audio_from_video_indices=[0],
                        load_audio_from_video=True, return_tensors="pt")
        ours = splits.train[i]
        assert ours["input_ids"] == ref["input_ids"][0].tolist(), i
        ids = ours["input_ids"]
        # one span: a chunk of frames, then its sound, ... (not the video, then the audio after it)
        first_audio, last_video = ids.index(audio_id), len(ids) - 1 - ids[::-1].index(video_id)
        assert first_audio < last_video, i
        supervised = processor.tokenizer.decode([t for t, lab in zip(ids, ours["labels"], strict=True)
                                                 if lab != IGNORE_INDEX])
        assert row["messages"][1]["content"] in supervised, i

    batch = Collator(processor.tokenizer.pad_token_id)([splits.train[0], splits.train[1]])
    model = load_model(from_dict({"model_name_or_path": str(path), "finetuning_type": "full",
                                  "use_audio_in_video": True, "disable_gradient_checkpointing": True},
                                 for_training=False)).eval()
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    thinker = AutoModelForMultimodalLM.from_pretrained(path, dtype=torch.float32).thinker.eval()
    objective, labels = LMObjective(), batch.targets["labels"]
    with torch.no_grad():
        ours = objective(model, batch).loss_sum / objective.count(batch)
        theirs = thinker(**batch.model_inputs, labels=labels, use_audio_in_video=True).loss
        unaware = thinker(**batch.model_inputs, labels=labels).loss  # the sound's positions placed as a plain video's
        noise = torch.randn(batch.model_inputs["input_features"].shape, generator=torch.Generator().manual_seed(0))
        other = dict(batch.model_inputs, input_features=noise)
        other_sound = objective(model, Batch(other, {"labels": labels}, Layout())).loss_sum / objective.count(batch)
    assert torch.allclose(ours, theirs, atol=1e-4)
    assert not torch.allclose(ours, unaware, atol=1e-5)
    assert abs(float(ours - other_sound)) > 1e-5, float(ours - other_sound)


@needs_video_processor
def test_a_videos_own_track_is_heard_when_the_row_gives_no_audio(omni, demo, tmp_path, home):
    from tuneforge.config import from_dict
    from tuneforge.data import build

    path, processor = omni
    root, rows, info = demo
    write_clip_with_sound(root / "clip.avi")
    info["mllm_video_audio_demo"]["columns"].pop("audios")
    write_dataset(root, info, [{"messages": [{"role": "user", "content": "<video>What do you hear?"},
                                             {"role": "assistant", "content": "A tone."}], "videos": ["clip.avi"]}])
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mllm_video_audio_demo", "dataset_dir": str(root),
                     "cutoff_len": 8192, "use_audio_in_video": True}, for_training=False)
    ids = build(cfg, processor.tokenizer, processor).train[0]["input_ids"]
    assert processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>") in ids


@needs_video_processor
def test_hearing_videos_needs_an_omni_model_and_one_sound_per_video(omni, demo, tmp_path, home):
    from mm_families import build_family
    from transformers import AutoConfig

    from tuneforge.config import from_dict
    from tuneforge.data import build
    from tuneforge.errors import DataError
    from tuneforge.model.processor import load_processor

    path, processor = omni
    root, rows, info = demo
    write_dataset(root, info, [dict(rows[0], audios=rows[0]["audios"] * 2,
                                    messages=[dict(rows[0]["messages"][0], content="<video><audio><audio>Hi?"),
                                              rows[0]["messages"][1]]), rows[1]])
    base = {"dataset": "mllm_video_audio_demo", "dataset_dir": str(root), "cutoff_len": 8192,
            "use_audio_in_video": True}
    cfg = from_dict({"model_name_or_path": str(path), "skip_bad_rows": True, **base}, for_training=False)
    splits = build(cfg, processor.tokenizer, processor)
    assert len(splits.train) == 1 and splits.stats["bad_rows"] == 1
    with pytest.raises(DataError, match=r"row 0.*1 video\(s\) and 2 audio\(s\)"):
        build(from_dict({"model_name_or_path": str(path), **base}, for_training=False), processor.tokenizer,
              processor)

    vl = build_family("qwen2_vl", tmp_path / "qwen2_vl")
    vl_processor = load_processor(vl, AutoConfig.from_pretrained(vl))
    with pytest.raises(DataError, match=r"use_audio_in_video is true, but Qwen2VLProcessor cannot hear"):
        build(from_dict({"model_name_or_path": str(vl), **base}, for_training=False), vl_processor.tokenizer,
              vl_processor)
