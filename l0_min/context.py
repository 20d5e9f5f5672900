"""The context watcher: the token ids of one episode's context, its budget, and memory truncation.

    prompt(system, task) + action_1 + obs_1 + action_2 + obs_2 + ...        <- one segment

Actions are appended as the exact ids the sampler returned; only observation text is ever tokenized. When the next
action would not fit, the context is rebuilt (a new segment): the prompt with an "N earlier steps were dropped" note
and the notepad's text, then the most recent steps verbatim, as many as fit (docs/internals.md).
"""

from __future__ import annotations

import re
import weakref

from l0_min.config import AgentConfig

CHATML_BEFORE = "<|im_end|>\n<|im_start|>user\n"
CHATML_AFTER = "<|im_end|>\n<|im_start|>assistant\n"
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with its lone surrogates (no tokenizer or UTF-8 file takes them; a sandbox sends any str) as U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


class ChatFormat:
    """The tokenizer's chat template, as the three pieces the agent needs: prompt_ids, decode, observation_ids."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat_template; the agent needs a chat model "
                             "(set tokenizer.chat_template to a Jinja template, e.g. ChatML)")
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        self.before, self.after = self._wrapper()
        self._backend = self._same_backend(tokenizer, self.before + "x" + self.after)

    @staticmethod
    def _same_backend(tokenizer, wrapper: str):
        """A fast tokenizer's Rust backend, if it encodes probes exactly like `tokenizer.encode`: calling it skips
        the transformers wrapper, about half the cost of encoding a short observation."""
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is None:
            return None
        probes = [wrapper, " leading space", "\n\nx = 1\nprint(x)\n", "<output>\ncafé 東京 ✓\n</output>\n[2 steps left]"]
        same = all(backend.encode(t, add_special_tokens=False).ids
                   == list(tokenizer.encode(t, add_special_tokens=False)) for t in probes)
        return backend if same else None

    def _wrapper(self) -> tuple[str, str]:
        act, obs = "\x00ACTION\x00", "\x00OBSERVATION\x00"
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": act}, {"role": "user", "content": obs}]
        try:
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that rejects this conversation: fall back to ChatML
            text = ""
        if text.count(act) != 1 or text.count(obs) != 1 or text.index(act) > text.index(obs):
            return CHATML_BEFORE, CHATML_AFTER
        return tuple(text[text.index(act) + len(act) :].split(obs))  # (before, after): the marker is there once

    def encode(self, text: str) -> list[int]:
        text = valid_text(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """`decode(ids, skip_special_tokens=True)`, with the special ids dropped first: several times faster with a
        slow tokenizer, which recomputes its special tokens for every id it skips."""
        if getattr(self.tokenizer, "is_fast", False):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids])

    def prompt_ids(self, system: str, user: str, examples: tuple = ()) -> list[int]:
        """System turn, then `examples` (earlier chat messages, e.g. a worked example), then the user turn."""
        msgs = [{"role": "system", "content": valid_text(system)}, *examples, {"role": "user", "content": valid_text(user)}]
        ids = self.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding from some versions
            ids = ids["input_ids"]
        return list(ids)

    def observation_ids(self, text: str, action_ids: list[int]) -> list[int]:
        """Ids of `before + text + after`: `before` closes the assistant turn and opens a user turn, `after` closes
        it and opens the next assistant turn (both read once from the template by rendering a dummy conversation
        and cutting it at marker strings; ChatML if that fails). An action that already ended with a special end
        token that `before` starts with (e.g. `<|im_end|>`) does not get it twice."""
        before = self.before
        if action_ids and action_ids[-1] in self.special_ids:
            tok = self.tokenizer.convert_ids_to_tokens(action_ids[-1])
            if tok and before.startswith(tok):
                before = before[len(tok) :]
        return self.encode(before + text + self.after)


_chat_formats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (template, ChatFormat)


def chat_format(tokenizer) -> ChatFormat:
    """One ChatFormat per tokenizer and chat template (reading the template costs a few ms per episode)."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        cached = _chat_formats.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable: no cache
        return ChatFormat(tokenizer)
    if cached is None or cached[0] != template:
        cached = _chat_formats[tokenizer] = (template, ChatFormat(tokenizer))
    return cached[1]


def budget_note(steps_left: int, tokens_left: int, low_tokens: int) -> str:
    """The line after each observation that tells the agent what it has left.

    >>> budget_note(3, 900, 256), budget_note(1, 100, 256)
    ('[3 steps left, ~900 context tokens left]', '[1 step left: call submit_final_answer(...) now, ~100 context tokens left; old steps will be dropped soon, keep key facts in the notepad]')
    """
    if steps_left <= 0:
        return "[no steps left]"
    note = "[1 step left: call submit_final_answer(...) now" if steps_left == 1 else f"[{steps_left} steps left"
    note += f", ~{max(0, tokens_left)} context tokens left"
    if tokens_left < low_tokens:
        note += "; old steps will be dropped soon, keep key facts in the notepad"
    return note + "]"


class ContextWatcher:
    """Owns one episode's context ids; see the module docstring.

        w = ContextWatcher(chat_format(tok), system, task_text, cfg.agent, cfg.sampling.max_new_tokens)
        if w.needs_rebuild():    # less than min_room left for the next action
            ok = w.rebuild(await kernel.read_notepad())   # False: not even the head fits
        w.ids, w.room()          # the prompt ids to sample from, and max_new_tokens for the action
        obs = w.add_step(action_ids, output_text, steps_left)  # the observation text the agent sees
    """

    def __init__(self, chat: ChatFormat, system: str, task_text: str, cfg: AgentConfig, max_new_tokens: int,
                 examples: tuple = ()):
        self.chat, self.system, self.task_text = chat, system, task_text
        self.examples = tuple(examples)  # chat messages between the system and the task turn, kept on rebuild
        self.prefill_ids = chat.encode(cfg.prefill) if cfg.prefill else []
        self.max_tokens = cfg.max_context_tokens
        self.min_room = max(1, min(cfg.min_action_tokens, max_new_tokens))
        self.keep_recent, self.fill = cfg.keep_recent_steps, cfg.rebuild_fill
        self.turns: list[list[int]] = []  # each step's action + observation ids, also the dropped steps'
        self.segment = self.truncations = self.dropped = 0  # dropped: steps not in the current context
        self.ids: list[int] = self._head(task_text)

    def _head(self, user_text: str) -> list[int]:
        return self.chat.prompt_ids(self.system, user_text, self.examples) + self.prefill_ids

    def room(self) -> int:
        """Tokens left in the window for the next action."""
        return self.max_tokens - len(self.ids)

    def needs_rebuild(self) -> bool:
        return self.room() < self.min_room

    def append(self, action_ids: list[int], obs_ids: list[int]) -> None:
        """The context grows by exactly the sampled action ids and the observation's ids."""
        self.turns.append(list(action_ids) + list(obs_ids))
        self.ids = self.ids + self.turns[-1]

    def add_step(self, action_ids: list[int], output: str, steps_left: int) -> str:
        """The observation text "<output>...</output>" plus a budget note (the tokens left after the whole
        observation, its own included: rewritten until the count stays the same); if a step is left, the action
        and the observation's ids are appended."""
        head = f"<output>\n{output}\n</output>\n"
        before = len(self.ids) + len(action_ids)
        left = self.max_tokens - before - len(head)  # a guess: about one token per character or fewer
        for _ in range(4):
            text = head + budget_note(steps_left, left, 2 * self.min_room)
            ids = self.chat.observation_ids(text, action_ids) + self.prefill_ids  # then the next turn's prefill
            if self.max_tokens - before - len(ids) == left:
                break
            left = self.max_tokens - before - len(ids)
        if steps_left > 0:
            self.append(action_ids, ids)
        return text

    def rebuild_user_text(self, notepad: str, dropped: int) -> str:
        kept = len(self.turns) - dropped
        gone = "step 1 was" if dropped == 1 else f"steps 1-{dropped} were"
        note = (f"[Context rebuilt: {gone} dropped to save space"
                + (f"; the last {kept} step(s) follow" if kept else "")
                + ". Kernel variables and your notepad are kept.]")
        return f"{self.task_text}\n\n{note}\nNotepad:\n{notepad.strip() or '(empty)'}"

    def rebuild(self, notepad: str) -> bool:
        """Start a new segment: system, task, drop note, notepad, then the most recent steps that fit; False (context
        unchanged) if not even the head leaves `min_room` for an action."""
        n, limit = len(self.turns), self.max_tokens - self.min_room
        k, used = 0, len(self._head(self.rebuild_user_text(notepad, n)))  # choose k recent steps, newest first
        for turn in reversed(self.turns):
            if used + len(turn) > limit or (k >= self.keep_recent and used + len(turn) > self.fill * self.max_tokens):
                break
            k, used = k + 1, used + len(turn)
        # the note's numbers change with k: shrink k until the exact rebuilt context fits
        while True:
            ids = self._head(self.rebuild_user_text(notepad, n - k))
            for turn in self.turns[n - k :]:
                ids += turn
            if len(ids) <= limit:
                break
            if k == 0:
                return False
            k -= 1
        self.ids, self.dropped = ids, n - k
        self.segment += 1
        self.truncations += 1
        return True
