"""Packing for generation gives back the pages of a memory-mapped checkpoint that only the packed weights held."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tuneforge.model import mapped_pages, packed_linear

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """fp32 safetensors with decoder weights of many pages each (hidden 256), the head tied to the embeddings."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("mapped")
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def resident_bytes(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def recording_packing(monkeypatch, record):
    """PackedLinear, calling record() before each layer is packed."""
    packed_linear._works()  # its probe packs a layer of its own, once per process: before recording starts
    original = packed_linear.PackedLinear

    def packed(*args, **kwargs):
        record()
        return original(*args, **kwargs)

    monkeypatch.setattr(packed_linear, "PackedLinear", packed)


def test_packing_gives_back_the_packed_weights_pages(checkpoint, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    file = checkpoint / "model.safetensors"
    for p in model.parameters():  # read every page, as a first generation would
        p.sum()
    decoder = sum(m.weight.nbytes for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    embeddings = model.model.embed_tokens.weight.nbytes
    assert resident_bytes(file) > decoder + embeddings  # the map holds everything it was read for
    seen = []
    recording_packing(monkeypatch, lambda: seen.append(resident_bytes(file)))
    packed = packed_linear.pack_for_generation(model)
    assert packed == len(seen) == 2 * 7 + 1
    # each layer's pages go once it is packed: before the last one, only it, the embeddings (the tied head's weight:
    # kept), the norms and the pages each packed weight shares with its neighbours are resident; afterwards no more
    edges = mmap.PAGESIZE * (2 * packed + 5)
    largest = max(m.weight.nbytes for m in AutoModelForCausalLM.from_pretrained(checkpoint).model.layers.modules()
                  if isinstance(m, torch.nn.Linear))
    assert seen == sorted(seen, reverse=True)
    assert seen[-1] <= embeddings + largest + edges
    assert resident_bytes(file) <= embeddings + edges


def test_pages_a_kept_tensor_shares_are_never_given_back(checkpoint):
    """The head tied to the embeddings is packed, but the embeddings stay: their pages (written here) are kept."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:8] += 1.0  # written pages of a private map: dropped, they would be lost
    expected = model.model.embed_tokens.weight[:8].clone()
    packed_linear.pack_for_generation(model)
    assert torch.equal(model.model.embed_tokens.weight[:8], expected)


def test_memory_outside_a_file_mapping_is_left_alone():
    tensor = torch.arange(1 << 20, dtype=torch.float32)
    assert mapped_pages.release(tensor, [], mapped_pages.file_mappings()) == 0
    assert torch.equal(tensor, torch.arange(1 << 20, dtype=torch.float32))


def test_a_weight_two_packed_layers_share_is_packed_whole_twice(checkpoint):
    """The second layer is packed after the first is dropped: their shared weight's pages (written) must stay."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    first, second = model.model.layers[0].mlp, model.model.layers[1].mlp
    second.up_proj.weight = first.up_proj.weight
    with torch.no_grad():
        first.up_proj.weight += 0.5
    expected = first.up_proj.weight.detach().clone()
    packed_linear.pack_for_generation(model)
    x = torch.randn(3, expected.shape[1])
    for mlp in (first, second):
        torch.testing.assert_close(mlp.up_proj(x), x @ expected.T, rtol=1e-5, atol=1e-5)


def test_weights_converted_at_load_are_freed_as_packing_goes(checkpoint, tmp_path, monkeypatch):
    """A bf16 checkpoint loaded in fp32 lies in ordinary memory, not in the map: each dense weight is freed as soon
    as its packed copy is made, so the two are never all held together."""
    import weakref

    AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    dense = [weakref.ref(m.weight) for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    alive = []
    recording_packing(monkeypatch, lambda: alive.append(sum(r() is not None for r in dense)))
    assert packed_linear.pack_for_generation(model) == len(dense) + 1
    # one fewer at each layer packed (the tied head frees nothing): the last one is alone when it is packed
    assert alive == sorted(alive, reverse=True) and alive[-1] == 1
    assert all(r() is None for r in dense)
