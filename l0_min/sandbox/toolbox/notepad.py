"""The agent's notepad: a todo list, facts, a draft answer. It lives in the kernel, so it survives
context truncation; the host reads `render()` to rebuild the context around it.

    >>> n = Notepad()
    >>> n.todo.append("find the author")
    >>> n.facts.append("the book is from 1999")
    >>> n.draft = "Alice"
    >>> print(n.render())
    ## Todo
    1. find the author
    ## Facts
    - the book is from 1999
    ## Draft
    Alice
"""


class Notepad:
    def __init__(self):
        self.todo: list = []  # open steps, in order; remove an item (or mark it "[x] ...") when done
        self.facts: list = []  # what was found, ideally with its source ref
        self.draft: str = ""  # the answer so far

    def render(self) -> str:
        parts = []
        if self.todo:
            parts.append("## Todo\n" + "\n".join(f"{i}. {t}" for i, t in enumerate(self.todo, 1)))
        if self.facts:
            parts.append("## Facts\n" + "\n".join(f"- {f}" for f in self.facts))
        if str(self.draft).strip():
            parts.append(f"## Draft\n{self.draft}")
        return "\n".join(parts) if parts else "(the notepad is empty)"

    def __repr__(self) -> str:
        return self.render()
