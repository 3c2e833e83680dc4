"""The chat template where transformers' `save_pretrained` writes it now, `chat_template.jinja` beside a
tokenizer_config.json without one (llm-compressor's W8A8 checkpoints are saved so): the server renders it as
transformers' tokenizer does, and the file wins over a tokenizer_config.json entry, as in transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from npuserve.engine.server.chat_template import ChatTemplate  # noqa: E402

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
RAW = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}" \
      "{% if add_generation_prompt %}[assistant] {% endif %}"


def _saved_as_transformers_saves(tiny_model_dir: Path, out: Path, *, keep_config_entry: bool) -> Path:
    shutil.copytree(tiny_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if not keep_config_entry:
        config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(RAW)
    return out


@pytest.mark.parametrize("keep_config_entry", [False, True], ids=["file-only", "file-and-config-entry"])
def test_the_jinja_file_renders_as_transformers_renders_it(tiny_model_dir: Path, tmp_path: Path,
                                                           keep_config_entry: bool) -> None:
    folder = _saved_as_transformers_saves(tiny_model_dir, tmp_path / "m", keep_config_entry=keep_config_entry)
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert expected.startswith("[system] be brief")  # the file's template, not the config's
    template = ChatTemplate.from_model_dir(folder)
    assert template is not None
    assert template.render(MESSAGES, add_generation_prompt=True) == expected
