"""The model's chat template, read from the GGUF: rendered as llama.cpp should tokenize it, and a
template that is broken (it does not parse, or it fails on a conversation) is one clear error in
every command that renders it (chat, calibrate, eval run), never a jinja2 traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tiny_model as tm  # noqa: E402
from tests.conftest import one_line_error  # noqa: E402

TURNS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
GOOD = "{{ bos_token }}" + TURNS + "{% if add_generation_prompt %}<assistant>{% endif %}"
UNPARSABLE = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"  # no endfor
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{% for m in messages %}{% if 'forbidden' in m.content %}"
             "{{ raise_exception('no forbidden words') }}{% endif %}{% endfor %}" + TURNS)


def tiny(tmp_path: Path, template: str | None) -> Path:
    path = tmp_path / "tiny-chat.gguf"
    tm.write_tiny_llama(path, chat_template=template)
    return path


def test_render_drops_the_bos_text_llama_cpp_adds_itself(tmp_path):
    from page_local.chat.template import ChatTemplate
    from page_local.native.runtime import Model

    with Model(tiny(tmp_path, GOOD)) as m:
        t = ChatTemplate(m, fallback="use run")
        assert m.llama_model.add_bos_token()  # the tiny vocabulary asks llama.cpp to add <s>
        msgs = [{"role": "user", "content": "hi"}]
        assert t.render(msgs) == "<user>hi</user><assistant>"  # not "<s><user>..."
        assert t.render(msgs, generation_prompt=False) == "<user>hi</user>"
        ids = m.tokenize(t.render(msgs), add_special=True)
        assert ids[0] == tm.BOS_ID and ids.count(tm.BOS_ID) == 1


@pytest.mark.parametrize("template,needles", [
    (None, ["has no chat template", "use run"]),
    (UNPARSABLE, ["does not parse", "line 1", "endfor", "use run"]),
], ids=["missing", "unparsable"])
def test_a_missing_or_unparsable_template_is_one_clear_error(tmp_path, template, needles):
    from page_local.chat.template import ChatTemplate, ChatTemplateError
    from page_local.native.runtime import Model

    with Model(tiny(tmp_path, template)) as m:
        with pytest.raises(ChatTemplateError) as e:
            ChatTemplate(m, fallback="use run")
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_a_template_that_fails_on_a_conversation_names_the_roles(tmp_path):
    from page_local.chat.template import ChatTemplate, ChatTemplateError
    from page_local.native.runtime import Model

    with Model(tiny(tmp_path, NO_SYSTEM)) as m:
        t = ChatTemplate(m, fallback="use run")
        assert t.render([{"role": "user", "content": "hi"}]) == "<user>hi</user>"
        with pytest.raises(ChatTemplateError) as e:
            t.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert "[system, user]" in msg and "System role not supported" in msg and msg.endswith("use run")


def test_commands_report_a_broken_template_in_one_line(cli, tmp_path):
    model = tiny(tmp_path, UNPARSABLE)
    one_line_error(cli("chat", "--model", model, "--n-ctx", 256, "--threads", 1), 1,
                   "does not parse", "page-local run")
    pilot = tmp_path / "pilot.txt"
    pilot.write_text("one prompt\nanother prompt\n", encoding="utf-8")
    one_line_error(cli("calibrate", "--model", model, "--pilot", pilot, "--n-ctx", 256, "--threads", 1), 1,
                   "does not parse", "--plain")
    out = tmp_path / "rows.jsonl"
    one_line_error(cli("eval", "run", "--model", model, "--tasks", "niah_single_1", "--n", 1, "--length", 200,
                       "--threads", 1, "--quiet", "--out", out), 1, "does not parse", "--plain")
    assert not out.exists() or out.read_text() == ""

    # --plain does not read the template: the pilot is measured (the random tiny model's D is 0 on
    # every prompt, so calibration itself then stops on sigma = 0, which says so)
    res = cli("calibrate", "--model", model, "--pilot", pilot, "--plain", "--n-ctx", 256, "--threads", 1, "--json")
    assert "template" not in res.output and "all 2 pilot D values are equal" in res.output, res.output


def test_chat_reports_a_template_failure_and_keeps_the_conversation(tmp_path):
    """A template that rejects the system prompt: the REPL reports it, and nothing is lost."""
    from rich.console import Console

    from page_local.engine.engine import Engine
    from page_local.cli.repl import Repl

    with Engine(tiny(tmp_path, NO_SYSTEM), n_ctx=256, threads=1, gate="never") as eng:
        out = Console(record=True, width=200)
        repl = Repl(eng, out, max_tokens=2)
        repl.handle("hello")
        assert [m.role for m in repl.session.messages] == ["user", "assistant"]
        cells = eng.cells_used()
        repl.handle("a forbidden word")
        assert eng.cells_used() == cells  # rendering failed before anything reached the cache
        repl.handle("/system be brief")
        text = out.export_text()
        assert "the message was not sent" in text and "no forbidden words" in text, text
        assert "System role not supported" in text and "[system, user, assistant]" in text, text
        assert "n_ctx" not in text and "Traceback" not in text, text
        assert [m.role for m in repl.session.messages] == ["user", "assistant"] and repl.session.system is None
