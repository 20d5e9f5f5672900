"""The context watcher and the chat wrapper, with a byte-level tokenizer (one token per UTF-8 byte)."""

import pytest
from transformers import ByT5Tokenizer

from l0_min.config import AgentConfig
from l0_min.context import CHATML_AFTER, CHATML_BEFORE, ChatFormat, ContextWatcher
from l0_min.models import CHATML_TEMPLATE, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


def dec(tok, ids):
    return tok.decode(ids)


# ---------------------------------------------------------------------------------------------
# ChatFormat


def test_chatml_wrapper_is_read_from_the_template(tok):
    chat = ChatFormat(tok)
    assert chat.before == "<|im_end|>\n<|im_start|>user\n"
    assert chat.after == "<|im_end|>\n<|im_start|>assistant\n"
    assert dec(tok, chat.prompt_ids("SYS", "TASK")) == (
        "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nTASK<|im_end|>\n<|im_start|>assistant\n"
    )
    assert dec(tok, chat.observation_ids("<output>\n2\n</output>", enc(tok, "x</code>"))) == (
        "<|im_end|>\n<|im_start|>user\n<output>\n2\n</output><|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_plus_action_plus_observation_renders_like_the_template(tok):
    """The appended context equals the template's own rendering of the same conversation."""
    chat = ChatFormat(tok)
    action = "<think>t</think><code>1</code>"
    ids = chat.prompt_ids("S", "U") + enc(tok, action) + chat.observation_ids("O", enc(tok, action))
    want = tok.apply_chat_template(
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": action},
            {"role": "user", "content": "O"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert dec(tok, ids) == want


def test_wrapper_of_a_non_chatml_template():
    t = ByT5Tokenizer(extra_ids=0)
    t.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = ChatFormat(t)
    assert (chat.before, chat.after) == ("[/assistant][user]", "[/user][assistant]")


def test_template_that_rejects_the_dummy_conversation_falls_back_to_chatml():
    t = ByT5Tokenizer(extra_ids=0)
    t.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    chat = ChatFormat(t)
    assert (chat.before, chat.after) == (CHATML_BEFORE, CHATML_AFTER)


def test_no_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat_template"):
        ChatFormat(ByT5Tokenizer(extra_ids=0))


def test_action_ending_with_the_end_token_is_not_closed_twice():
    """With <|im_end|> a special token (as in SmolLM2), an action that sampled it gets no second one."""
    t = ByT5Tokenizer(extra_ids=0, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    t.chat_template = CHATML_TEMPLATE
    chat = ChatFormat(t)
    im_end = t.convert_tokens_to_ids("<|im_end|>")
    closed = chat.observation_ids("O", enc(t, "<code>1") + [im_end])
    assert closed == enc(t, "\n<|im_start|>user\nO<|im_end|>\n<|im_start|>assistant\n")
    assert closed.count(im_end) == 1  # only the user turn's end
    open_ = chat.observation_ids("O", enc(t, "<code>1</code>"))
    assert open_ == enc(t, "<|im_end|>\n<|im_start|>user\nO<|im_end|>\n<|im_start|>assistant\n")
    assert open_[0] == im_end and open_.count(im_end) == 2  # the special token itself, not its characters


# ---------------------------------------------------------------------------------------------
# ContextWatcher


def watcher(tok, **kw):
    """A 600-token window that needs 100 tokens of room for an action; the prompt is 101 tokens."""
    cfg = AgentConfig(**{"max_context_tokens": 600, "min_action_tokens": 100, "keep_recent_steps": 1, "rebuild_fill": 0.6, **kw})
    return ContextWatcher(ChatFormat(tok), "SYS", "Task: what is 6*7?", cfg, max_new_tokens=100)


def step_ids(tok, i, size=50):
    """An action and an observation of `size` bytes each, marked with the step number."""
    a = enc(tok, f"<code>a{i}".ljust(size, "."))
    o = enc(tok, f"o{i}".ljust(size, "-"))
    return a, o


def test_context_grows_append_only(tok):
    w = watcher(tok)
    start = list(w.ids)
    a, o = step_ids(tok, 1)
    w.append(a, o)
    assert w.ids == start + a + o
    assert w.room() == 600 - len(w.ids)
    assert w.segment == 0 and w.truncations == 0


def test_min_room_is_capped_by_max_new_tokens(tok):
    cfg = AgentConfig(max_context_tokens=400, min_action_tokens=128)
    assert ContextWatcher(ChatFormat(tok), "S", "T", cfg, max_new_tokens=16).min_room == 16
    assert ContextWatcher(ChatFormat(tok), "S", "T", cfg, max_new_tokens=512).min_room == 128


def test_rebuild_keeps_task_notepad_note_and_recent_steps_verbatim(tok):
    w = watcher(tok)
    steps = [step_ids(tok, i) for i in range(1, 5)]
    for a, o in steps:
        assert not w.needs_rebuild()
        w.append(a, o)
    assert w.needs_rebuild()  # 101 + 4 x 100 tokens leaves 99 < 100
    assert w.rebuild("todo: multiply\nfacts: 6*7=42")
    text = dec(tok, w.ids)
    assert text.startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nTask: what is 6*7?")
    assert "facts: 6*7=42" in text and "todo: multiply" in text
    assert "steps 1-3 were dropped" in text
    # the kept steps are a verbatim suffix of ids, right after the generation prompt
    a4, o4 = steps[-1]
    assert w.ids[-len(a4 + o4) :] == a4 + o4
    assert text.index("Task: what is") < text.index("facts: 6*7") < text.index("<|im_start|>assistant\n<code>a4")
    assert "a1." not in text and "a3." not in text
    assert w.segment == 1 and w.truncations == 1 and w.dropped == 3
    assert not w.needs_rebuild()


def test_rebuild_keeps_more_steps_while_under_the_fill_target(tok):
    w = watcher(tok, rebuild_fill=0.9, keep_recent_steps=0)
    for i in range(1, 5):
        w.append(*step_ids(tok, i, size=20))
    for i in range(5, 7):
        w.append(*step_ids(tok, i, size=60))
    assert w.needs_rebuild()
    assert w.rebuild("np")
    # the rebuilt head is 242 tokens: two 120-token steps fit, a third would leave < 100 tokens of room
    assert w.dropped == 4
    text = dec(tok, w.ids)
    assert "<code>a5" in text and "<code>a6" in text and "<code>a4" not in text

    w2 = watcher(tok, rebuild_fill=0.3, keep_recent_steps=0)
    for i in range(1, 5):
        w2.append(*step_ids(tok, i, size=20))
    for i in range(5, 7):
        w2.append(*step_ids(tok, i, size=60))
    assert w2.rebuild("np")
    assert w2.dropped == 6  # even one step would fill more than 30% of 600
    assert "steps 1-6 were dropped" in dec(tok, w2.ids)


def test_keep_recent_steps_overrides_the_fill_target_when_they_fit(tok):
    w = watcher(tok, rebuild_fill=0.1, keep_recent_steps=2)
    for i in range(1, 4):
        w.append(*step_ids(tok, i, size=40))
    w.append(*step_ids(tok, 4, size=60))
    assert w.rebuild("np")
    assert w.dropped == 2
    assert "; the last 2 step(s) follow" in dec(tok, w.ids)


def test_successive_rebuilds_make_successive_segments(tok):
    w = watcher(tok)
    n, last = 0, ""
    for i in range(1, 12):
        if w.needs_rebuild():
            last = f"notepad after {i - 1} steps"
            assert w.rebuild(last)
            n += 1
        w.append(*step_ids(tok, i))
    assert n >= 2 and w.segment == n and w.truncations == n
    text = dec(tok, w.ids)
    assert last in text and f"steps 1-{w.dropped} were dropped" in text
    assert text.count("Task: what is 6*7?") == 1


def test_rebuild_fails_when_the_notepad_alone_does_not_fit(tok):
    w = watcher(tok)
    for i in range(1, 5):
        w.append(*step_ids(tok, i))
    before = list(w.ids)
    assert not w.rebuild("x" * 400)
    assert w.ids == before and w.segment == 0 and w.truncations == 0


def test_initial_prompt_too_long_cannot_be_rebuilt(tok):
    cfg = AgentConfig(max_context_tokens=100, min_action_tokens=40)
    w = ContextWatcher(ChatFormat(tok), "SYS", "Q" * 100, cfg, max_new_tokens=100)
    assert w.needs_rebuild()
    assert not w.rebuild("")


def test_fast_tokenizer_backend_encodes_exactly_like_the_tokenizer():
    # ChatFormat.encode calls a fast tokenizer's Rust backend directly once probes show it agrees
    import importlib.util
    import random
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("bench_rollout", bench / "rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tok = mod.fast_byte_tokenizer()
    chat = ChatFormat(tok)
    assert chat._backend is not None
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(["a", " ", "\n", "<", "é", "東", "<|im_end|>", "</s>", "x"]) for _ in range(rng.randint(0, 40)))
        assert chat.encode(text) == tok.encode(text, add_special_tokens=False), text
