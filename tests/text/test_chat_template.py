"""Chat templates: the default model's template against transformers, validation, errors."""

from __future__ import annotations

import pytest

from radixrelay.text.chat_template import ChatTemplate, ChatTemplateError, validate_messages
from radixrelay.text.tokenizer import Tokenizer, load_tokenizer
from tests.text.test_tokenizer import default_gguf
from tests.text.test_tokenizer_formats import sp_model  # noqa: F401 (fixture)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Quatre."},
        {"role": "user", "content": "Et 3+3 ? 中文 😀"},
    ],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(default_gguf())


@pytest.fixture(scope="module")
def template(tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(tok)


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = default_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(
    tok: Tokenizer, template: ChatTemplate, hf_tok, messages, add_generation_prompt: bool
) -> None:
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs)


def test_text_parts_are_joined(template: ChatTemplate) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there!"}]}]
    assert template.render(parts) == template.render(CONVERSATIONS[0])


def test_missing_template_names_the_model(sp_model) -> None:  # noqa: F811 (fixture)
    no_template = load_tokenizer(sp_model)  # a bare sentencepiece directory has no template
    with pytest.raises(ValueError, match=f"'{sp_model.name}' has no chat template"):
        ChatTemplate.for_tokenizer(no_template)
    assert ChatTemplate.for_tokenizer(no_template, override="{{ 'x' }}").render(CONVERSATIONS[0]) == "x"


def test_template_helpers() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ loop.index }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    messages = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "a"}]
    compiled = ChatTemplate(template, model_name="m", bos_token="<s>", eos_token="</s>")
    out = compiled.render(messages)
    assert out == '<s>[{"role": "user", "content": "é"}, {"role": "assistant", "content": "a"}]</s>14'
    with pytest.raises(ChatTemplateError, match="user first"):
        compiled.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}", model_name="m")


def test_sandbox_blocks_attribute_escape() -> None:
    # Reaching for internals on a plain conversation: refused when the template is loaded.
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", model_name="m")
    # Only on some conversations: refused when rendering one of them.
    escape = ChatTemplate("{% if messages|length > 2 %}{{ messages.__class__.__mro__ }}{% endif %}x",
                          model_name="m")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        escape.render(CONVERSATIONS[0] * 3)


def test_errors_name_the_template_the_user_gave_not_the_model(tok: Tokenizer) -> None:
    """A template passed with --chat-template is the user's: its errors say so rather than blame the model."""
    unsafe = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError, match=r"^the given chat template \(--chat-template\) is unsafe") as info:
        ChatTemplate.for_tokenizer(tok, override=unsafe)
    assert tok.name not in str(info.value)
    with pytest.raises(ChatTemplateError, match=r"^the given chat template \(--chat-template\) does not compile"):
        ChatTemplate.for_tokenizer(tok, override="{% if %}")
    failing = ChatTemplate.for_tokenizer(tok, override="{% if messages|length > 2 %}{{ 1 // 0 }}{% endif %}x")
    with pytest.raises(ChatTemplateError, match=r"^the given chat template \(--chat-template\) failed: Zero"):
        failing.render(CONVERSATIONS[0] * 3)
    with pytest.raises(ChatTemplateError, match=r"^the chat template of model 'm' is unsafe"):
        ChatTemplate(unsafe, model_name="m")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "content: required"),
        ([{"role": "user", "content": 3}], "expected a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only"),
        (["hello"], "expected an object"),
    ],
)
def test_invalid_messages(messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_assistant_may_omit_content() -> None:
    assert validate_messages([{"role": "assistant", "content": None}])[0]["content"] is None
