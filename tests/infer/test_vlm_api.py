"""`tuneforge api` with a vision-language model: OpenAI image_url parts through the official client."""

from __future__ import annotations

import base64

import openai
import pytest
from infer_helpers import api_server, infer_cfg
from PIL import Image

from tuneforge.infer.engine import Engine


@pytest.fixture(scope="module")
def served(vlm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    Image.new("RGB", (90, 60), (200, 30, 60)).save(root / "red.png")
    (root.parent / "secret.png").write_bytes((root / "red.png").read_bytes())
    with Engine.from_config(infer_cfg(vlm_dir, max_new_tokens=6, image_max_pixels=112 * 112,
                                      media_dir=str(root))) as engine, api_server(engine) as url:
        yield engine, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60), root


def ask(client, engine, url: str):
    return client.chat.completions.create(model=engine.name, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What is this?"}]}])


def test_data_urls_and_files_in_media_dir_are_seen(served):
    engine, client, root = served
    expected = engine.complete([{"role": "user", "content": "What is this?", "images": [str(root / "red.png")]}])
    data = "data:image/png;base64," + base64.b64encode((root / "red.png").read_bytes()).decode()
    for url in (data, "red.png", f"file://{root / 'red.png'}"):
        reply = ask(client, engine, url)
        assert reply.choices[0].message.content == expected.choices[0].text
        assert reply.usage.prompt_tokens == expected.prompt_tokens


@pytest.mark.parametrize("url, words", [
    ("../secret.png", "outside the server's media_dir"),
    ("http://example.com/a.png", "plain http URLs are refused"),
    ("file://otherhost/tmp/a.png", "file URLs of other hosts are refused"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("nowhere.png", "does not exist"),
])
def test_other_sources_are_refused_and_the_server_keeps_serving(served, url, words):
    engine, client, root = served
    with pytest.raises(openai.BadRequestError, match=words):
        ask(client, engine, url)
    assert ask(client, engine, "red.png").choices[0].message.content is not None


def test_without_media_dir_no_local_file_is_read(served):
    engine, client, root = served
    engine.media_root, saved = None, engine.media_root
    try:
        with pytest.raises(openai.BadRequestError, match="reads no local files"):
            ask(client, engine, "red.png")
    finally:
        engine.media_root = saved


def test_an_audio_model_hears_input_audio_parts(tmp_path, lf_data_dir):
    pytest.importorskip("soundfile")
    from mm_families import build_family

    model_dir = build_family("qwen2_audio", tmp_path / "qwen2-audio")
    clip = lf_data_dir / "mllm_demo_data" / "2.wav"
    with Engine.from_config(infer_cfg(model_dir, max_new_tokens=4)) as engine, api_server(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        expected = engine.complete([{"role": "user", "content": "What is it?", "audios": [str(clip)]}])
        reply = client.chat.completions.create(model=engine.name, max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip.read_bytes()).decode(),
                                                        "format": "wav"}},
                {"type": "text", "text": "What is it?"}]}])
        assert reply.choices[0].message.content == expected.choices[0].text
        assert reply.usage.prompt_tokens == expected.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="cannot read images"):
            ask(client, engine, "data:image/png;base64," + base64.b64encode(b"x").decode())
