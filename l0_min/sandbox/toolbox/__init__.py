"""The agent's tools inside the kernel; the standard library only.

Mounted read-only into every sandbox as the package `l0_toolbox` and preloaded by `boot.py` (no import needed):

    notepad                  the agent's memory: notepad.todo, notepad.facts, notepad.draft, render()
    web_search(query, k)     search results (title, ref, snippet; k defaults to tools.top_k); print() them
    read_page(ref)           the text of a result's page
    submit_final_answer(a)   give the final answer; only this ends the task

A failed call (a kernel without a tool server: every call) raises ToolError with the reason.
"""

from .client import ToolError, read_page, submit_final_answer, web_search
from .notepad import Notepad

notepad = Notepad()

__all__ = ["notepad", "web_search", "read_page", "submit_final_answer", "Notepad", "ToolError"]
