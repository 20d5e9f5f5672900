"""l0_min.viewer: the static HTML trajectory viewer, checked as HTML and in headless Chromium.

The Chromium tests skip when no chromium binary is installed (`apt-get install -y chromium`); the
last one leaves a screenshot in its tmp_path to look at (the path is printed; `pytest -s` shows it).
"""

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from l0_min.episode import Episode, Step, Task
from l0_min.log import RunDir
from l0_min.viewer import main, write_viewer

XSS = "<script>alert(1)</script><img src=x onerror=\"document.title='PWNED'\"><script>document.title='PWNED'</script>"
UNICODE_Q = "Wer schrieb «Faust»? 東京タワー → ✓ 🚀"
UNICODE_OUT = "naïve café — Ελληνικά 日本語 🎉"


def st(think, code, out, exec_ok=True, fmt=True, n=12, reward=0.0):
    return Step(context_ids=[1, 2], action_ids=list(range(n)), action_logprobs=[-0.1] * n,
                action_text=f"<think>{think}</think><code>{code}</code>", think=think, code=code,
                observation=f"<output>{out}</output>", format_ok=fmt, exec_ok=exec_ok, finish_reason="stop",
                weight_version="v1", reward=reward, seconds=0.8)


def episodes_step1():
    q = "Which river flows through the capital of Freedonia?"
    good = Episode(Task("fr-1", q, ["Blue River", "the Blue"], {"hops": 2}), [
        st("I should search for the capital of Freedonia first.", 'print(web_search("capital of Freedonia"))',
           "1. Fredville is the capital of Freedonia."),
        st("Now find the river through Fredville.", 'r = web_search("Fredville river")\nprint(r)',
           "1. The Blue River flows through Fredville."),
        st("The answer is Blue River.", 'submit_final_answer("Blue River")', "submitted", reward=0.8),
    ], final_answer="Blue River", status="answered", group=0, sample=0, reward=1.0,
        rewards={"answer": 0.8, "format": 0.1, "exec": 0.1, "em": 1.0, "f1": 1.0},
        tool_calls={"web_search": 2}, weight_version="v1", seconds=4.2)
    evil = Episode(Task("fr-1", q, ["Blue River"]), [
        st("Let me print some HTML.", 'print("<script>alert(1)</script>")', XSS, exec_ok=False),
        st("still looking", "x = 1", "", exec_ok=True),
    ], status="max_steps", group=0, sample=1, reward=0.05,
        rewards={"answer": 0.0, "format": 0.05, "exec": 0.0, "em": 0.0, "f1": 0.0}, seconds=9.9)
    broken = Episode(Task("fr-2", "How old is the bridge of Sylvania?", ["300"]),
                     [Step([1], [5, 6], [-1.0, -1.0], action_text="garbled <b>not bold</b>", format_ok=False)],
                     status="env_error", group=1, sample=0, masked=True, error="kernel died: <EOF>")
    return [good, evil, broken]


def episodes_step2():
    uni = Episode(Task("de-1", UNICODE_Q, ["Goethe"]), [
        st("Ich suche nach «Faust».", 'print(web_search("Faust Autor"))', UNICODE_OUT),
    ], final_answer="Goethe", status="answered", reward=1.0, rewards={"answer": 0.8, "em": 1.0}, seconds=1.5)
    slow = Episode(Task("m-2", "What is 17 times 23?", ["391"], env="math"), [  # another environment's episode
        st("Compute it.", "import time; time.sleep(99)", "", exec_ok=None),
    ], status="timeout", reward=0.0, rewards={"core": 0.0, "correct": 0.0}, seconds=300.0)
    return [uni, slow]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    rd = RunDir(tmp_path_factory.mktemp("viewer") / "demo_run")
    rd.write_trajectories(1, episodes_step1())
    rd.write_trajectories(2, episodes_step2())
    write_viewer(rd.path, rd.viewer_html)
    return rd


class Elements(HTMLParser):
    """Start tags with their attributes, and the text inside the page."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def eps(self) -> list[dict]:
        return [a for t, a in self.tags if t == "details" and "ep" in (a.get("class") or "").split()]


def test_html_escapes_everything(run_dir):
    html = run_dir.viewer_html.read_text(encoding="utf-8")
    page = Elements(html)
    assert [t for t, _ in page.tags].count("script") == 1  # only the page's own script
    assert [t for t, _ in page.tags].count("img") == 0
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>not bold</b>" not in html and "&lt;b&gt;not bold&lt;/b&gt;" in html
    text = "".join(page.text)
    assert XSS in text  # shown verbatim, as text
    assert UNICODE_Q in text and UNICODE_OUT in text
    assert [(a["data-status"], a["data-step"]) for a in page.eps()] == [
        ("answered", "step_00001"), ("max_steps", "step_00001"), ("env_error", "step_00001"),
        ("answered", "step_00002"), ("timeout", "step_00002")]
    for needle in ("Blue River", "the Blue", "kernel died: <EOF>", 'submit_final_answer("Blue River")',
                   "1. The Blue River flows through Fredville.", "Now find the river through Fredville."):
        assert needle in text, needle


def test_max_episodes_per_step_and_plain_jsonl(run_dir, tmp_path):
    out = write_viewer(run_dir.trajectories / "step_00001.jsonl", tmp_path / "v.html", max_episodes_per_step=2)
    page = Elements(out.read_text(encoding="utf-8"))
    assert len(page.eps()) == 2
    assert "3 episodes (first 2 shown)" in "".join(page.text)


def test_cli(run_dir, tmp_path, capsys):
    run_dir.viewer_html.unlink()
    main([str(run_dir.path)])
    assert run_dir.viewer_html.is_file() and "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such run folder"):
        main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.html")])


# ---------------------------------------------------------------------------------------------
# in a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")


def chromium(tmp_path: Path, url: str, *args: str) -> str:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", *args, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def shown_eps(dom: str) -> list[str]:
    return [a["data-status"] for a in Elements(dom).eps() if "hidden" not in a]


@pytest.mark.slow
@needs_chromium
def test_browser_shows_episodes_and_runs_no_trajectory_code(run_dir, tmp_path):
    url = run_dir.viewer_html.as_uri()
    dom = chromium(tmp_path, url, "--dump-dom")
    page = Elements(dom)
    title = next(i for i, (t, _) in enumerate(page.tags) if t == "title")
    assert "PWNED" not in dom.split("</title>")[0] and "demo_run" in dom.split("</title>")[0]
    assert [t for t, _ in page.tags].count("script") == 1 and [t for t, _ in page.tags].count("img") == 0, title
    text = "".join(page.text)
    for needle in ("Which river flows through the capital of Freedonia?", "I should search for the capital",
                   'print(web_search("capital of Freedonia"))', "1. Fredville is the capital of Freedonia.",
                   XSS, UNICODE_Q, UNICODE_OUT, "reward 1", "em 1", "answer 0.8", "5 of 5 shown"):
        assert needle in text, needle
    assert shown_eps(dom) == ["answered", "max_steps", "env_error", "answered", "timeout"]


@pytest.mark.slow
@needs_chromium
def test_browser_filters_from_url_hash(run_dir, tmp_path):
    url = run_dir.viewer_html.as_uri()
    dom = chromium(tmp_path, url + "#status=answered", "--dump-dom")
    assert shown_eps(dom) == ["answered", "answered"]
    assert "2 of 5 shown" in dom
    dom = chromium(tmp_path, url + "#status=answered,timeout,env_error&step=step_00002", "--dump-dom")
    assert shown_eps(dom) == ["answered", "timeout"]
    groups = re.findall(r'<section class="group" data-step="(step_\d+)"[^>]*?( hidden="")?>', dom)
    assert groups == [("step_00001", ' hidden=""'), ("step_00002", "")]  # a group with nothing shown hides
    # the filter bar the page's script built from its episodes: a box per status, an option per file
    assert re.findall(r'<input type="checkbox" name="status" value="(\w+)"', dom) == ["answered", "max_steps", "timeout", "env_error"]
    assert '<optgroup label="RL"><option value="step_00001">step_00001 (3)</option><option value="step_00002">' in dom
    dom = chromium(tmp_path, url + "#env=math", "--dump-dom")  # the environment filter of a mixed run
    assert shown_eps(dom) == ["timeout"] and "1 of 5 shown" in dom
    assert re.findall(r'<option value="(\w*)">', dom.split('id="env"')[1].split("</select>")[0]) == ["", "math", "qa"]


@pytest.mark.slow
@needs_chromium
def test_csp_blocks_a_script_even_if_escaping_failed(run_dir, tmp_path):
    html = run_dir.viewer_html.read_text(encoding="utf-8")
    bad = tmp_path / "bad.html"
    bad.write_text(html.replace("<main>", "<main><script>document.title='PWNED'</script>"
                                          "<img src=x onerror=\"document.title='PWNED'\">", 1), encoding="utf-8")
    dom = chromium(tmp_path, bad.as_uri() + "#status=timeout", "--dump-dom")
    assert "PWNED" not in dom.split("</title>")[0]
    assert shown_eps(dom) == ["timeout"]  # while the page's own script still runs


@pytest.mark.slow
@needs_chromium
def test_browser_expands_every_step_from_hash_and_keeps_a_screenshot(run_dir, tmp_path):
    url = run_dir.viewer_html.as_uri() + "#open=all"
    dom = chromium(tmp_path, url, "--dump-dom")  # the DOM after the page's script ran
    page = Elements(dom)
    assert all("open" in a for a in page.eps()) and len(page.eps()) == 5  # #open=all expanded every episode
    steps = [a for t, a in page.tags if t == "div" and a.get("class") == "step"]
    assert len(steps) == 3 + 2 + 1 + 1 + 1  # every step of every episode is rendered
    text = "".join(page.text)
    for needle in ("step 1", "step 3", "format ✓", "format ✗", "exec ✗", "exec –", "reward 0.8", "12 tokens",
                   "finish stop", "weights v1", "em 1", "f1 0", "format 0.05", "(none)", "raw action text",
                   "garbled <b>not bold</b>", "kernel died: <EOF>", XSS, "5 of 5 shown"):
        assert needle in text, needle
    # nothing an agent printed ran or became markup: the title is the page's own, the only script and
    # no image is the page's, and the printed tags are in the DOM as text
    assert dom.split("</title>")[0].endswith("demo_run · trajectories")
    assert [t for t, _ in page.tags].count("script") == 1 and [t for t, _ in page.tags].count("img") == 0
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and "<b>not bold</b>" not in dom
    png = tmp_path / "screenshot.png"
    chromium(tmp_path, url, f"--screenshot={png}", "--window-size=1280,1700")
    assert png.is_file()
    print(f"viewer screenshot: {png}")


def test_sft_rl_and_evaluation_episodes_are_shown_apart(tmp_path):
    rd = RunDir(tmp_path / "run")
    for prefix in ("sft", "step", "eval", "eval-greedy"):
        rd.write_trajectories(3, episodes_step1(), prefix=prefix)
    page = write_viewer(rd.path, tmp_path / "v.html").read_text()
    phases = re.findall(r'<section class="group" data-step="([^"]+)" data-phase="([^"]+)" data-total="3">', page)
    assert phases == [("eval-greedy_00003", "held-out, greedy"), ("eval_00003", "held-out, sampled"),
                      ("sft_00003", "SFT: expert episodes"), ("step_00003", "RL")]  # the page's script groups them
    assert "<h2>sft_00003 <small>SFT: expert episodes</small></h2>" in page


def test_a_run_folder_page_grows_by_the_new_files_only(tmp_path):
    """Issue 24: train.py writes the viewer after every step; the page is appended to, not rebuilt from every
    trajectories file. The grown page equals a fresh build of the same files; a file that changed rebuilds it."""
    import os

    from l0_min.viewer import _END_BYTES

    rd, fresh = RunDir(tmp_path / "a" / "run"), RunDir(tmp_path / "b" / "run")
    for r in (rd, fresh):
        r.write_trajectories(1, episodes_step1())
    write_viewer(rd.path, rd.viewer_html)
    first = rd.viewer_html.read_bytes()
    f1 = rd.trajectory_path(1)  # step 1's file becomes garbage of the same size and time: a read would fail
    stat = f1.stat()
    f1.write_bytes(b"x" * (stat.st_size - 1) + b"\n")
    os.utime(f1, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    for r in (rd, fresh):
        r.write_trajectories(2, episodes_step2())
    grown = write_viewer(rd.path, rd.viewer_html).read_bytes()
    assert grown.startswith(first[: -len(_END_BYTES)]) and grown == write_viewer(fresh.path, fresh.viewer_html).read_bytes()
    rd.write_trajectories(2, episodes_step2()[:1])  # a resumed run rewrote step 2: the page is built again
    with pytest.raises(ValueError, match="step_00001.jsonl: not JSON"):
        write_viewer(rd.path, rd.viewer_html)
