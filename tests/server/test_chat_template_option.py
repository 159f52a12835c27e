"""`[model] chat_template`: a template file or inline template replaces the tokenizer's (issue 13),
and mlx-lm reads tool-call markers from it; a file that cannot be read stops loading with the reason."""

from __future__ import annotations

import pytest
from toolmodel import TOOL_TEMPLATE

from mlx_kvserve.config import load_config
from mlx_kvserve.errors import ModelLoadError
from mlx_kvserve.models.loader import load_model, read_chat_template

PLAIN = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _rendered(loaded) -> str:
    return loaded.tokenizer.decode(loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))


def test_inline_and_file_templates_replace_the_tokenizers(tiny_model_dir, tmp_path):
    own = load_model(str(tiny_model_dir), tmp_path, "float32")
    assert "<|im_start|>system" in _rendered(own)
    inline = load_model(str(tiny_model_dir), tmp_path, "float32", chat_template=PLAIN)
    assert _rendered(inline) == "[system] Be brief.\n[user] Hi\n[assistant] "
    path = tmp_path / "template.jinja"
    path.write_text(PLAIN)
    from_file = load_model(str(tiny_model_dir), tmp_path, "float32", chat_template=str(path))
    assert _rendered(from_file) == _rendered(inline)
    assert load_config(overrides={"model": {"chat_template": str(path)}}).model.chat_template == str(path)


def test_a_template_with_tool_calls_gives_the_model_tool_calling(tiny_model_dir, tmp_path):
    plain = load_model(str(tiny_model_dir), tmp_path, "float32")
    assert not plain.tokenizer.has_tool_calling
    with_tools = load_model(str(tiny_model_dir), tmp_path, "float32", chat_template=TOOL_TEMPLATE)
    assert with_tools.tokenizer.has_tool_calling
    assert with_tools.tokenizer.tool_call_start == "<tool_call>"


def test_an_unreadable_template_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot read the chat template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "bin.jinja").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ModelLoadError, match="cannot read the chat template"):
        read_chat_template(str(tmp_path / "bin.jinja"))
