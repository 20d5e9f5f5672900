"""Question answering with search (L0's task): the agent searches a corpus with `web_search` / `read_page`
and submits a short answer, scored by exact match (0.9 EM + 0.1 for answering) with F1 beside it.

    env = make_env(cfg)
    env.tasks("synthetic:train")   # the synthetic world below (data.synthetic_*), or "synthetic:heldout"
    env.tasks("hotpotqa")          # a benchmark name or a file (`load_tasks`: HotpotQA, MuSiQue, NQ, ...)

Search runs over the tasks' own paragraphs (HotpotQA / MuSiQue contexts, the world's pages) unless
tools.search / tools.corpus say otherwise (l0_min.search).

The synthetic world: a seeded, invented encyclopedia and questions answerable only by searching it.

People, cities (in invented countries) and organisations get invented names and facts (dates,
populations, head counts), one encyclopedia page each. Questions are 1- to 3-hop lookups,
arithmetic over looked-up numbers, and comparisons. A model cannot know the answers, so a rising
reward means it learned to search, read and compute.

    >>> w = make_world(seed=0, n_entities=30)
    >>> len(w.corpus), w.corpus[0]["id"] == slug(w.corpus[0]["title"])
    (30, True)
    >>> sorted({t.meta["kind"] for t in w.tasks})
    ['arithmetic', 'comparison', 'lookup', 'multihop']

Every task's meta says how to answer it: `support` (the page ids, in the order they are needed),
`evidence` ([page id, sentence] pairs, each sentence verbatim in that page), `template`, `kind`
(lookup | multihop | arithmetic | comparison), `hops` (pages needed), and `seed` / `n_entities`
(which regenerate the corpus: see `corpus_from_tasks`). Arithmetic and comparison tasks also
keep the looked-up `operands`.

The same (seed, n_entities) always gives the same corpus; `n_tasks` only changes how many questions
are drawn (the first k questions do not depend on n_tasks).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from l0_min import data
from l0_min.answers import answer_reward, exact_match, f1_score, has_answer, token_f1
from l0_min.config import is_number
from l0_min.envs import TaskEnvBase, settings
from l0_min.episode import Episode, Step, Task

# ---------------------------------------------------------------------------------------- names

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr",
           "tr", "st", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ae", "ei"]
_CODAS = ["", "", "", "", "n", "r", "l", "s", "m", "nd", "rk"]
_CITY_SUFFIX = ["holm", "mere", "vik", "stad", "ford", "grad", "haven", "dal", "burg", "wick"]
_ORG_KIND = {  # kind -> name patterns ({} is an invented root)
    "company": ["{} Shipworks", "{} Lumber Company", "{} Mills", "{} Instruments", "{} Glassworks"],
    "university": ["University of {}", "{} Institute of Technology", "{} College"],
    "museum": ["{} Museum of Art", "{} Natural History Museum"],
    "orchestra": ["{} Philharmonic", "{} Chamber Orchestra"],
    "bank": ["{} Savings Bank", "Bank of {}"],
}
_OCCUPATIONS = ["painter", "chemist", "architect", "engineer", "composer", "merchant", "botanist",
                "cartographer", "astronomer", "novelist", "physician", "sculptor"]
_FEATURES = ["its salt marshes", "a stone bridge with nine arches", "an annual lantern festival",
             "its copper mines", "a lighthouse on the northern cliffs", "its terraced vineyards",
             "a covered market", "its clock tower", "the old canal district", "its winter fair"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def slug(title: str) -> str:
    """Page id of a title.

    >>> slug("University of Drenvik")
    'university-of-drenvik'
    """
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def number_words(n: int) -> str | None:
    """English words for 0..999 (None above).

    >>> number_words(42), number_words(115), number_words(1000)
    ('forty-two', 'one hundred fifteen', None)
    """
    if n < 0 or n > 999:
        return None
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("-" + _ONES[n % 10] if n % 10 else "")
    return f"{_ONES[n // 100]} hundred" + (f" {number_words(n % 100)}" if n % 100 else "")


def _root(rng: random.Random, syllables: int) -> str:
    s = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return s.capitalize()


# --------------------------------------------------------------------- entities and their pages


@dataclass
class City:
    name: str
    country: str
    founded: int
    population: int
    feature: str


@dataclass
class Person:
    name: str
    birth: tuple[int, int, int]  # year, month, day
    city: City
    occupation: str
    founded: list = field(default_factory=list)  # organisations


@dataclass
class Org:
    name: str
    kind: str
    founded: int
    founder: Person
    city: City
    employees: int


@dataclass
class World:
    corpus: list[dict]  # [{id, title, text}]
    tasks: list[Task]
    seed: int = 0


def _date_text(y: int, m: int, d: int) -> str:
    return f"{d} {_MONTHS[m - 1]} {y}"


def _make_entities(seed: int, n_entities: int):
    if n_entities < 6:
        raise ValueError(f"make_world: n_entities must be at least 6 (2 people, 2 cities, 2 organisations), got {n_entities}")
    rng = random.Random(f"l0-world-entities-{seed}")
    n_city = max(2, round(n_entities * 0.25))
    n_org = max(2, round(n_entities * 0.35))
    used: set[str] = set()  # every word of every invented name: no word is shared by two names

    def fresh(make):
        for _ in range(1000):
            words = (name := make()).lower().split()
            if not any(w in used for w in words) and len(set(words)) == len(words):
                used.update(words)
                return name
        raise ValueError(f"make_world: could not invent {n_entities} distinct names")

    countries = [fresh(lambda: _root(rng, 2) + rng.choice(["ia", "ar", "esh", "ony"]))
                 for _ in range(max(2, n_city // 3))]
    cities = []
    for _ in range(n_city):
        name = fresh(lambda: _root(rng, rng.choice([1, 2])) + rng.choice(_CITY_SUFFIX))
        cities.append(City(name, rng.choice(countries), rng.randint(800, 1700), rng.randint(50, 20000) * 100,
                           rng.choice(_FEATURES)))
    people = []
    for _ in range(n_entities - n_city - n_org):
        name = fresh(lambda: f"{_root(rng, 2)} {_root(rng, 2)}")
        birth = (rng.randint(1780, 1960), rng.randint(1, 12), rng.randint(1, 28))
        people.append(Person(name, birth, rng.choice(cities), rng.choice(_OCCUPATIONS)))
    orgs = []
    for i in range(n_org):
        kind = rng.choice(sorted(_ORG_KIND))
        root = fresh(lambda: _root(rng, rng.choice([2, 3])))
        name = rng.choice(_ORG_KIND[kind]).format(root)
        founder = people[i % len(people)] if i < len(people) else rng.choice(people)
        orgs.append(Org(name, kind, founder.birth[0] + rng.randint(22, 60), founder, rng.choice(cities),
                        rng.randint(40, 20000)))
        founder.founded.append(orgs[-1])
    return people, cities, orgs


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _pages(people, cities, orgs) -> dict[str, dict[str, str]]:
    """Title -> the page's sentences by name (each a fact a question can rely on); the text is their join."""
    pages: dict[str, dict[str, str]] = {}
    for c in cities:
        born_here = [p.name for p in people if p.city is c][:3]
        pages[c.name] = {"country": f"{c.name} is a city in {c.country}.",
                         "founded": f"{c.name} was founded in {c.founded}.",
                         "population": f"{c.name} has a population of {c.population:,}.",
                         "feature": f"The city is known for {c.feature}."}
        if born_here:
            pages[c.name]["people"] = f"Notable people born in {c.name} include {', '.join(born_here)}."
    for p in people:
        y, m, d = p.birth
        pages[p.name] = {"intro": f"{p.name} (born {_date_text(y, m, d)} in {p.city.name}) is {_a(p.occupation)}.",
                         "born": f"{p.name} was born in {y}.",
                         **{o.name: f"{p.name} founded the {o.name} in {o.founded}." for o in p.founded},
                         "work": f"{p.name} is remembered mostly for work as {_a(p.occupation)}."}
    for o in orgs:
        pages[o.name] = {"hq": f"The {o.name} is {_a(o.kind)} headquartered in {o.city.name}.",
                         "founded": f"The {o.name} was founded in {o.founded} by {o.founder.name}.",
                         "employees": f"The {o.name} has {o.employees:,} employees."}
    return pages


# ------------------------------------------------------------------------------------ questions


def _num_answers(n: int, unit: str = "") -> list[str]:
    """'12', 'twelve', '12 years', '1,200' ... for a number answer."""
    out = [str(n)] + ([f"{n:,}"] if n >= 1000 else [])
    if w := number_words(n):
        out += [w, w.replace("-", " ")]
    if unit:
        out += [f"{a} {unit}" for a in out]
    return list(dict.fromkeys(out))


def _templates(rng: random.Random, people, cities, orgs, pages) -> dict[str, list]:
    """kind -> templates (name, draw, make): `draw()` picks the entities, `make(*entities)` gives
    (question, answers, evidence[, operands]), or None when the two entities of a comparison tie."""

    def one(pool):
        return lambda: (rng.choice(pool),)

    def two(pool):
        return lambda: rng.sample(pool, 2)

    def ev(entity, fact: str) -> list[str]:  # [page id, the sentence of the page that states `fact`]
        return [slug(entity.name), pages[entity.name][fact]]

    def years(question, n, evidence, operands):
        return question, _num_answers(n, "years"), evidence, operands

    def compare(question, a, b, va, vb, fact, larger, via=()):  # via: the evidence that leads to `a`
        if va == vb:
            return None
        return question, [(a if (va > vb) == larger else b).name], [*via, ev(a, fact), ev(b, fact)], [va, vb]

    def birth_date(p):
        y, m, d = p.birth
        answers = [_date_text(y, m, d), f"{_MONTHS[m - 1]} {d}, {y}", f"{y}-{m:02d}-{d:02d}"]
        return f"On what date was {p.name} born?", answers, [ev(p, "intro")]

    def between_orgs(a, b):
        if a.founded == b.founded:
            return None
        a, b = sorted((a, b), key=lambda o: o.founded)
        return years(f"How many years passed between the founding of the {a.name} and the founding of the {b.name}?",
                     b.founded - a.founded, [ev(a, "founded"), ev(b, "founded")], [a.founded, b.founded])

    return {
        "lookup": [
            ("person_birth_year", one(people),
             lambda p: (f"In what year was {p.name} born?", [str(p.birth[0])], [ev(p, "born")])),
            ("person_birth_date", one(people), birth_date),
            ("person_birth_city", one(people),
             lambda p: (f"In which city was {p.name} born?", [p.city.name], [ev(p, "intro")])),
            ("person_occupation", one(people),
             lambda p: (f"What is the occupation of {p.name}?", [p.occupation], [ev(p, "intro")])),
            ("org_founder", one(orgs), lambda o: (f"Who founded the {o.name}?", [o.founder.name], [ev(o, "founded")])),
            ("org_founded_year", one(orgs),
             lambda o: (f"In what year was the {o.name} founded?", [str(o.founded)], [ev(o, "founded")])),
            ("org_city", one(orgs),
             lambda o: (f"In which city is the {o.name} headquartered?", [o.city.name], [ev(o, "hq")])),
            ("org_employees", one(orgs), lambda o: (f"How many employees does the {o.name} have?",
                                                    _num_answers(o.employees, "employees"), [ev(o, "employees")])),
            ("city_country", one(cities),
             lambda c: (f"In which country is {c.name}?", [c.country], [ev(c, "country")])),
            ("city_population", one(cities), lambda c: (f"What is the population of {c.name}?",
                                                        _num_answers(c.population, "people"), [ev(c, "population")])),
            ("city_founded_year", one(cities),
             lambda c: (f"In what year was {c.name} founded?", [str(c.founded)], [ev(c, "founded")])),
        ],
        "multihop": [
            ("org_founder_birth_year", one(orgs),
             lambda o: (f"In what year was the founder of the {o.name} born?", [str(o.founder.birth[0])],
                        [ev(o, "founded"), ev(o.founder, "born")])),
            ("person_birth_country", one(people), lambda p: (f"In which country was {p.name} born?", [p.city.country],
                                                             [ev(p, "intro"), ev(p.city, "country")])),
            ("org_city_population", one(orgs),
             lambda o: (f"What is the population of the city where the {o.name} is headquartered?",
                        _num_answers(o.city.population, "people"), [ev(o, "hq"), ev(o.city, "population")])),
            ("org_founder_occupation", one(orgs),
             lambda o: (f"What was the occupation of the founder of the {o.name}?", [o.founder.occupation],
                        [ev(o, "founded"), ev(o.founder, "intro")])),
            ("org_founder_birth_country", one(orgs),
             lambda o: (f"In which country was the founder of the {o.name} born?", [o.founder.city.country],
                        [ev(o, "founded"), ev(o.founder, "intro"), ev(o.founder.city, "country")])),
            ("org_founder_birth_city_founded", one(orgs),
             lambda o: (f"In what year was the birthplace of the founder of the {o.name} founded?",
                        [str(o.founder.city.founded)],
                        [ev(o, "founded"), ev(o.founder, "intro"), ev(o.founder.city, "founded")])),
        ],
        "arithmetic": [
            ("years_city_to_birth", lambda: (rng.choice(people), rng.choice(cities)),
             lambda p, c: years(f"How many years after {c.name} was founded was {p.name} born?", p.birth[0] - c.founded,
                                [ev(c, "founded"), ev(p, "born")], [c.founded, p.birth[0]])),
            ("founder_age_at_founding", one(orgs),
             lambda o: years(f"How many years after {o.founder.name} was born was the {o.name} founded?",
                             o.founded - o.founder.birth[0], [ev(o.founder, "born"), ev(o, "founded")],
                             [o.founder.birth[0], o.founded])),
            ("years_between_orgs", two(orgs), between_orgs),
            ("combined_population", two(cities),
             lambda a, b: (f"What is the combined population of {a.name} and {b.name}?",
                           _num_answers(a.population + b.population, "people"),
                           [ev(a, "population"), ev(b, "population")], [a.population, b.population])),
        ],
        "comparison": [
            ("older_org", two(orgs), lambda a, b: compare(
                f"Which is older, the {a.name} or the {b.name}?", a, b, a.founded, b.founded, "founded", False)),
            ("born_first", two(people), lambda a, b: compare(
                f"Who was born first, {a.name} or {b.name}?", a, b, list(a.birth), list(b.birth), "intro", False)),
            ("larger_city", two(cities), lambda a, b: compare(
                f"Which city has the larger population, {a.name} or {b.name}?", a, b, a.population, b.population,
                "population", True)),
            ("more_employees", two(orgs), lambda a, b: compare(
                f"Which has more employees, the {a.name} or the {b.name}?", a, b, a.employees, b.employees,
                "employees", True)),
        ],
        # 3-hop variants of the two-page kinds: the first entity is named only through an organisation's founder
        # or headquarters (make_world draws them in a random stream of their own)
        "arithmetic3": [
            ("years_city_to_founder_birth", lambda: (rng.choice(orgs), rng.choice(cities)),
             lambda o, c: years(f"How many years after {c.name} was founded was the founder of the {o.name} born?",
                                o.founder.birth[0] - c.founded, [ev(o, "founded"), ev(o.founder, "born"),
                                                                 ev(c, "founded")], [c.founded, o.founder.birth[0]])),
            ("years_birthplace_to_org", one(orgs),
             lambda o: years(f"How many years after the birthplace of the founder of the {o.name} was founded was the "
                             f"{o.name} founded?", o.founded - o.founder.city.founded,
                             [ev(o, "founded"), ev(o.founder, "intro"), ev(o.founder.city, "founded")],
                             [o.founder.city.founded, o.founded])),
        ],
        "comparison3": [
            ("founder_born_first", lambda: (rng.choice(orgs), rng.choice(people)), lambda o, p: None if p is o.founder
             else compare(f"Who was born first, the founder of the {o.name} or {p.name}?", o.founder, p,
                          list(o.founder.birth), list(p.birth), "intro", False, [ev(o, "founded")])),
            ("larger_hq_city", lambda: (rng.choice(orgs), rng.choice(cities)), lambda o, c: None if c is o.city
             else compare(f"Which city has the larger population, the city where the {o.name} is headquartered or "
                          f"{c.name}?", o.city, c, o.city.population, c.population, "population", True, [ev(o, "hq")])),
        ],
    }


KIND_WEIGHTS = {"lookup": 0.45, "multihop": 0.25, "arithmetic": 0.15, "comparison": 0.15}
THREE_HOP_SHARE = 1 / 3  # of arithmetic and comparison tasks: 3-hop variants (multihop has 3-hop templates of its own)


def make_world(seed: int = 0, n_entities: int = 60, n_tasks: int | None = None) -> World:
    """A deterministic world: `n_entities` pages and `n_tasks` distinct questions (default 4 per entity).

    Question kinds are drawn with `KIND_WEIGHTS` (45% one-page lookups); a `THREE_HOP_SHARE` of arithmetic and
    comparison questions are replaced by a 3-hop variant drawn from a random stream of its own, so every other
    question keeps its place and id. Raises ValueError when the world is too small for that many distinct questions.
    """
    people, cities, orgs = _make_entities(seed, n_entities)
    pages = _pages(people, cities, orgs)
    corpus = [{"id": slug(t), "title": t, "text": " ".join(s.values())} for t, s in pages.items()]
    n_tasks = 4 * n_entities if n_tasks is None else n_tasks
    rng = random.Random(f"l0-world-questions-{seed}")
    templates = _templates(rng, people, cities, orgs, pages)
    rng3 = random.Random(f"l0-world-3hop-{seed}")
    variants = _templates(rng3, people, cities, orgs, pages)
    kinds, weights = zip(*KIND_WEIGHTS.items())
    tasks: list[Task] = []
    seen: set[str] = set()
    attempts = 0
    while len(tasks) < n_tasks:
        attempts += 1
        if attempts > 50 * n_tasks + 1000:
            raise ValueError(f"make_world(seed={seed}, n_entities={n_entities}): only {len(tasks)} distinct "
                             f"questions, {n_tasks} asked; use more entities or fewer tasks")
        kind = rng.choices(kinds, weights)[0]
        template, draw, make = rng.choice(templates[kind])
        made = make(*draw())
        if made is None or made[0] in seen:
            continue
        question, answers, evidence, *operands = made
        seen.add(question)
        if f"{kind}3" in variants and rng3.random() < THREE_HOP_SHARE:  # its 3-hop variant instead, if that is new
            name, draw3, make3 = rng3.choice(variants[f"{kind}3"])
            if (made3 := make3(*draw3())) is not None and made3[0] not in seen:
                template, (question, answers, evidence, *operands) = name, made3
                seen.add(question)
        support = list(dict.fromkeys(doc for doc, _ in evidence))
        meta = {"kind": kind, "hops": len(support), "template": template, "support": support,
                "evidence": evidence, "seed": seed, "n_entities": n_entities, "source": "world"}
        if operands:
            meta["operands"] = operands[0]
        tasks.append(Task(id=f"world{seed}-{len(tasks):04d}", question=question, answers=answers, meta=meta))
    return World(corpus, tasks, seed)


# ---- the expert: a scripted solver that writes real NB-Agent steps (the SFT cold start's episodes)


@functools.lru_cache(maxsize=8)
def _docs(seed: int, n_entities: int) -> dict[str, dict]:
    return {d["id"]: d for d in _world_corpus(seed, n_entities)}


def expert_actions(task: Task, snippet_chars: int | None = None) -> list[str]:
    """The actions of a scripted solver for a world task: search each support page by its title (the
    sentences just read go into the next <think>), then compute the answer in code and submit it. A task
    from a file (no world pages) gets one step that submits its first gold answer.

    >>> t = next(t for t in make_world(0, 30).tasks if t.meta["template"] == "years_between_orgs")
    >>> for a in expert_actions(t): print(a)
    <think>I search for University of Grelugo.</think>
    <code>print(web_search("University of Grelugo"))</code>
    <think>The University of Grelugo was founded in 1898 by Deinei Kegand. Next I search for Zesten Mills.</think>
    <code>print(web_search("Zesten Mills"))</code>
    <think>The Zesten Mills was founded in 1914 by Berir Fothes.</think>
    <code>submit_final_answer(str(1914 - 1898))</code>

    That form needs the search results to show whole pages. Where a result's snippet (the first `snippet_chars`
    characters of the page: tools.snippet_chars) leaves out a sentence the task needs, each page takes two steps:
    search, then read the page by its ref; the next search's cell first writes the sentence it needed into the
    notepad, which a context rebuild keeps; the last cell computes the answer in code. 2 pages: 5 steps; 3 pages: 7.

    >>> t = next(t for t in make_world(0, 30).tasks if t.meta["template"] == "older_org")
    >>> for a in expert_actions(t, snippet_chars=40): print(a)
    <think>I search for Stotrem Museum of Art.</think>
    <code>print(web_search("Stotrem Museum of Art"))</code>
    <think>I read the page of Stotrem Museum of Art.</think>
    <code>print(read_page("stotrem-museum-of-art"))</code>
    <think>I note it and search for Stefu Glassworks.</think>
    <code>notepad.facts.append("The Stotrem Museum of Art was founded in 1994 by Gostond Postas.")
    print(web_search("Stefu Glassworks"))</code>
    <think>I read the page of Stefu Glassworks.</think>
    <code>print(read_page("stefu-glassworks"))</code>
    <think>I compute the answer from the notepad and this page.</think>
    <code>submit_final_answer("Stotrem Museum of Art" if 1994 < 1839 else "Stefu Glassworks")</code>
    """
    m = task.meta
    if "support" not in m:  # a task from a file: no pages to read; the expert shows the format and the gold answer
        return [f"<think>The answer is {task.answers[0]}.</think>\n<code>submit_final_answer({json.dumps(task.answers[0])})</code>"]
    docs = _docs(m["seed"], m["n_entities"])
    pages = [docs[p]["title"] for p in m["support"]]
    read = [" ".join(s for p, s in m["evidence"] if p == page) for page in m["support"]]
    answer = json.dumps(next((a for a in task.answers if a in " ".join(read)), task.answers[0]))  # as written there
    if m["kind"] == "arithmetic":  # the expression over the looked-up numbers that gives the gold number
        a, b = m["operands"]
        sums = {f"{a} + {b}": a + b, f"{b} - {a}": b - a, f"{a} - {b}": a - b}
        answer = next(f"str({e})" for e, value in sums.items() if str(value) in task.answers)
    if snippet_chars is None or all(s in docs[p]["text"][:snippet_chars] for p, s in m["evidence"]):
        actions = [f'<think>I search for {pages[0]}.</think>\n<code>print(web_search("{pages[0]}"))</code>']
        for seen, page in zip(read, pages[1:]):
            actions.append(f'<think>{seen} Next I search for {page}.</think>\n<code>print(web_search("{page}"))</code>')
        return actions + [f"<think>{read[-1]}</think>\n<code>submit_final_answer({answer})</code>"]
    if m["kind"] == "comparison":  # the two pages compared are the last two; the operator gives the gold one
        (a, b), (x, y) = m["operands"], pages[-2:]
        answer = f'"{x}" if {a} {"<" if (a < b) == (task.answers[0] == x) else ">"} {b} else "{y}"'
    actions, note = [], ""
    for page, ref, fact in zip(pages, m["support"], read):
        actions += [f"<think>I {'note it and ' * bool(note)}search for {page}.</think>\n"
                    f'<code>{note}print(web_search("{page}"))</code>',
                    f'<think>I read the page of {page}.</think>\n<code>print(read_page("{ref}"))</code>']
        note = f"notepad.facts.append({json.dumps(fact)})\n"
    return actions + [f"<think>I compute the answer from the notepad and this page.</think>\n"
                      f"<code>submit_final_answer({answer})</code>"]  # the last page's sentence is used at once


# ------------------------------------ the official scores (hotpot_evaluate_v1.py / SQuAD v1.1)
def official_normalize(s: str) -> str:
    """hotpot_evaluate_v1.py's normalize_answer, exactly: lower, drop string.punctuation, drop the
    articles a/an/the, collapse white space. (ASCII-only: "’" and full-width letters stay.)

    >>> official_normalize("The  U.S.A.!"), official_normalize("“Tokyo”")
    ('usa', '“tokyo”')
    """
    s = "".join(ch for ch in s.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def official_em(prediction: str | None, golds: Iterable[str]) -> float:
    """Best exact match over the aliases, official normalisation. An unanswered prediction (None,
    blank or only punctuation: `rewards.has_answer`) scores 0, where the script would match "" == ""."""
    return float(has_answer(prediction) and any(official_normalize(prediction) == official_normalize(g) for g in golds))


def official_f1(prediction: str | None, golds: Iterable[str]) -> float:
    """Best token F1 over the aliases, as hotpot_evaluate_v1.py's f1_score (0.0 unanswered).

    >>> official_f1("Barack Obama", ["Obama"]), official_f1("no", ["no way"]), official_f1(None, ["x"])
    (0.6666666666666666, 0.0, 0.0)
    """
    p = official_normalize(prediction) if has_answer(prediction) else None
    return max(token_f1(p, official_normalize(g)) for g in golds) if p is not None else 0.0


# ------------------------------------- the papers' tables (evaluate.py): official scores, the judge, the layout
# The papers' columns: L0's judged SimpleQA, then Search-R1's seven in the order its tables print them (a task's
# meta "benchmark" is the canonical name: ALIASES maps the other names files give one)
PAPER_ORDER = [("simpleqa", "SimpleQA"), ("nq", "NQ"), ("triviaqa", "TriviaQA"), ("popqa", "PopQA"),
               ("hotpotqa", "HotpotQA"), ("2wikimultihopqa", "2Wiki"), ("musique", "MuSiQue"), ("bamboogle", "Bamboogle")]


def paper_table(summaries: list[dict]) -> str:
    """Several runs as the papers lay them out: a row per (model, mode), a column per benchmark of
    PAPER_ORDER present (a mixed run per source), the official EM in percent, then F1 in a table of its own;
    a judged SimpleQA shows the judge's accuracy and F-score, which "Avg." (of EM, or F1) leaves out. A later
    summary of the same model, mode and bench replaces an earlier.

    >>> s = lambda b, em: {"model": "m", "mode": "agent", "bench": b, "metrics": {"official_em": em, "official_f1": em + 0.1}}
    >>> print(paper_table([s("bamboogle", 0.2), s("hotpotqa", 0.4)]))
    EM
    | model | mode | HotpotQA | Bamboogle | Avg. |
    | --- | --- | ---: | ---: | ---: |
    | m | agent | 40.0 | 20.0 | 30.0 |
    <BLANKLINE>
    F1
    | model | mode | HotpotQA | Bamboogle | Avg. |
    | --- | --- | ---: | ---: | ---: |
    | m | agent | 50.0 | 30.0 | 40.0 |
    """
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for s in summaries:
        for bench, m in (s["metrics"].get("sources") or {s["bench"]: s["metrics"]}).items():
            cells.setdefault((s["model"], s["mode"]), {})[benchmark_name(bench)] = m
    present = {b for row in cells.values() for b in row}
    benches = [(b, name) for b, name in PAPER_ORDER if b in present] + [(b, b) for b in sorted(present - dict(PAPER_ORDER).keys())]
    judged = {b for b, _ in benches if b == "simpleqa" and any(row.get(b, {}).get("judge") for row in cells.values())}
    line, pct = (lambda cells: "| " + " | ".join(cells) + " |"), (lambda v: f"{100 * v:.1f}")
    tables = []
    for metric, judge_metric, title in (("official_em", "accuracy", "EM"), ("official_f1", "f_score", "F1")):
        heads = [f"{name} {'acc' if title == 'EM' else 'F'}" if b in judged else name for b, name in benches]
        lines = [title, line(["model", "mode", *heads] + ["Avg."] * (len(benches) > 1)),
                 line(["---", "---"] + ["---:"] * (len(benches) + (len(benches) > 1)))]
        for (model, mode), row in cells.items():
            values = [None if b not in row else (row[b].get("judge") or {}).get(judge_metric) if b in judged else row[b][metric]
                      for b, _ in benches]  # fmt: skip
            if len(benches) > 1:
                plain = [v for (b, _), v in zip(benches, values) if v is not None and b not in judged]
                values.append(sum(plain) / len(plain) if plain else None)
            lines.append(line([model, mode] + ["-" if v is None else pct(v) for v in values]))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


JUDGE_PROMPT = """You are grading an answer to a factual question. Compare the predicted answer with the gold \
answer and choose one grade.

A) CORRECT: the predicted answer contains the gold answer's meaning and says nothing that contradicts it. \
Differences in capitalisation, punctuation, word order, spelling of names, or extra context that does not \
contradict the gold answer are fine. A number must match the gold answer to the precision the question \
asks for (e.g. "about 3,500" is fine for "3,518" only if the question does not ask for an exact figure). \
Hedged answers are correct only if the hedge still commits to the gold answer.
B) INCORRECT: the predicted answer contradicts the gold answer, names a different entity, date or number, \
or lists several candidates of which some are wrong.
C) NOT_ATTEMPTED: the predicted answer does not commit to any answer (e.g. "I don't know", "I could not \
find it", an empty answer, or only a restatement of the question), and contradicts nothing.

Judge only whether the predicted answer matches the gold answer; do not use your own knowledge to \
second-guess the gold answer.

Question: {question}
Gold answer: {gold}
Predicted answer: {predicted}

Reply with one letter, A, B or C, and nothing else."""


def judge_prompt(question: str, gold: str | Iterable[str], predicted: str | None) -> str:
    """SimpleQA's grader prompt (l0_min.evaluation.judge_record); several gold aliases are joined with " | "."""
    gold_text = gold if isinstance(gold, str) else " | ".join(gold)
    return JUDGE_PROMPT.format(question=question.strip(), gold=gold_text.strip(),
                               predicted=(predicted or "").strip() or "(no answer)")


# --------------------------------------------- benchmark files: the public QA layouts (l0_min.data reads the rows)
_FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
BENCHMARKS = {  # name -> (hub dataset repo, file in it); FlashRAG files are in the `flashrag` layout
    "simpleqa": ("basicv8vc/SimpleQA", "simple_qa_test_set.csv"), "hotpotqa": (_FLASHRAG, "hotpotqa/dev.jsonl"),
    "musique": (_FLASHRAG, "musique/dev.jsonl"), "2wikimultihopqa": (_FLASHRAG, "2wikimultihopqa/dev.jsonl"),
    "bamboogle": (_FLASHRAG, "bamboogle/test.jsonl"), "nq": (_FLASHRAG, "nq/test.jsonl"),
    "triviaqa": (_FLASHRAG, "triviaqa/test.jsonl"),
}
ALIASES = {"2wiki": "2wikimultihopqa", "2wikimqa": "2wikimultihopqa", "nq_open": "nq", "nq-open": "nq",
           "simple_qa": "simpleqa", "hotpot": "hotpotqa", "hotpot_qa": "hotpotqa", "trivia_qa": "triviaqa",
           "tq": "triviaqa", "pop_qa": "popqa"}  # other names files give a benchmark (Search-R1's data_source)


def benchmark_name(name: str) -> str:
    """The canonical name of a benchmark: "2wiki" -> "2wikimultihopqa"."""
    return ALIASES.get(name.strip().lower(), name.strip().lower())


def load_tasks(spec: str, cfg=None, limit: int | None = None) -> data.Tasks:
    """QA tasks of a benchmark name (BENCHMARKS; data.data_dir, $L0_MIN_DATA or the hub) or a file of any layout
    `detect_layout` knows: simpleqa, qa (HotpotQA, 2Wiki), musique, csv_qa (Bamboogle), answers (NQ-open),
    triviaqa, flashrag. Aliases joined with `<|answer_split|>` are split; a row's `data_source` becomes its
    `meta["benchmark"]` (canonical: ALIASES)."""
    spec = spec if Path(spec.strip()).is_file() else benchmark_name(spec)
    return data.load(spec, BENCHMARKS, parser, cfg, limit)


def detect_layout(row: dict) -> str:
    """The layout of a row, from its fields.

    >>> detect_layout({"question": "q", "golden_answers": ["a"]})
    'flashrag'
    >>> detect_layout({"Question": "q", "Answer": "a"}), detect_layout({"id": "d1", "title": "T", "text": "x"})
    ('csv_qa', 'corpus')
    """
    keys = set(row)
    if "question" not in keys and ({"title", "text"} <= keys or keys & {"contents", "wikipedia_title"}):
        return "corpus"
    if "golden_answers" in keys:
        return "flashrag"
    if {"problem", "answer"} <= keys:
        return "simpleqa"
    if isinstance(row.get("answer"), str) and "\n#### " in row["answer"]:
        return "gsm8k"
    if "paragraphs" in keys or "answer_aliases" in keys:
        return "musique"
    if isinstance(row.get("Answer"), dict) or isinstance(row.get("answer"), dict):
        return "triviaqa"
    if {"Question", "Answer"} <= keys:
        return "csv_qa"
    if "question" in keys and (isinstance(row.get("answer"), list) or isinstance(row.get("answers"), list)):
        return "answers"
    if {"question", "answer"} <= keys:
        return "qa"
    raise data.RowError(f"unknown layout, fields: {sorted(keys)[:12]}")


def _alias_list(v, key: str) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise data.RowError(f"field '{key}' must be a list of strings, got {type(v).__name__}")
    if bad := [a for a in v if not (isinstance(a, str) or is_number(a))]:
        raise data.RowError(f"field '{key}' has a non-string answer {bad[0]!r}")
    return [str(a).strip() for a in v]


def split_answers(answers: list[str]) -> list[str]:
    """Aliases joined with "<|answer_split|>" split apart, blanks and exact repeats dropped (scores take
    the best alias, so spellings that normalise alike may stay).

    >>> split_answers(["Tokyo<|answer_split|> Tokio", "", "Tokyo", "tokyo"])
    ['Tokyo', 'Tokio', 'tokyo']
    """
    return list(dict.fromkeys(p.strip() for a in answers for p in a.split("<|answer_split|>") if p.strip()))


def _context(v) -> list[list]:
    """HotpotQA context as [[title, [sentences]]], from the release form or HF's {title, sentences}."""
    if isinstance(v, dict) and "title" in v and "sentences" in v:
        v = [[t, s] for t, s in zip(v["title"], v["sentences"])]
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                          and isinstance(p[1], list) for p in v):
        raise data.RowError("field 'context' must be [[title, [sentences]], ...]")
    return [[t, [str(s) for s in sents]] for t, sents in v]


def _paragraphs(v) -> list[dict]:
    if not isinstance(v, list) or not all(isinstance(p, dict) and "title" in p and "paragraph_text" in p for p in v):
        raise data.RowError("field 'paragraphs' must be a list of {title, paragraph_text, ...}")
    return v


def parser(benchmark: str | None, path):
    """The row parser of one file (data.load_file): the first row's layout is the file's."""
    layout = None

    def parse(row: dict) -> tuple[str, list[str], dict]:
        nonlocal layout
        layout = layout or detect_layout(row)
        if layout in ("corpus", "gsm8k"):
            raise data.DataError(f"a corpus (documents with a title and text), not questions: pass it as tools.corpus="
                                 f"{path}" if layout == "corpus" else "a GSM8K file: the math environment reads it (env math, "
                                 "evaluate.py --env math)")  # fmt: skip
        q, answers, meta = _parse(layout, row)
        meta["benchmark"] = benchmark_name(str(row.get("data_source") or benchmark or layout))
        return q, answers, meta
    return parse


def _parse(layout: str, row: dict) -> tuple[str, list[str], dict]:
    """(question, answers, meta) of one row of a layout."""
    text, meta = data.text_field, {}
    if layout == "simpleqa":
        q, answers = text(row, "problem"), [text(row, "answer")]
        md = row.get("metadata") or None
        if isinstance(md, str) and md.strip():
            try:
                md = ast.literal_eval(md)
            except (ValueError, SyntaxError):
                raise data.RowError("field 'metadata' is not a Python-literal dict") from None
        if md is not None and not isinstance(md, dict):
            raise data.RowError(f"field 'metadata' must be a dict, got {type(md).__name__}")
        meta.update(md or {})
    elif layout == "qa":
        q, answers = text(row, "question"), [text(row, "answer")]
        meta.update({k: row[k] for k in ("type", "level", "supporting_facts", "evidences") if k in row})
        if row.get("context"):
            meta["context"] = _context(row["context"])
    elif layout == "musique":
        q = text(row, "question")
        answers = [text(row, "answer")] + _alias_list(row.get("answer_aliases") or [], "answer_aliases")
        meta["paragraphs"] = _paragraphs(row.get("paragraphs") or [])
        meta.update({k: row[k] for k in ("answerable", "question_decomposition") if k in row})
    elif layout == "csv_qa":
        q, answers = text(row, "Question"), [text(row, "Answer")]
    elif layout == "answers":
        q = text(row, "question")
        key = "answer" if "answer" in row else "answers"
        answers = _alias_list(row[key], key)
    elif layout == "triviaqa":
        qk, ak = ("Question", "Answer") if "Question" in row else ("question", "answer")
        q, a = text(row, qk), row[ak]
        low = {k.lower(): v for k, v in a.items()}
        value = low.get("value")
        if not isinstance(value, str) or not value.strip():
            raise data.RowError(f"field '{ak}' has no 'Value'")
        # (NormalizedAliases are the same aliases, normalised)
        answers = [value] + _alias_list(low.get("aliases") or [], f"{ak}.Aliases")
    elif layout == "flashrag":
        q, answers = text(row, "question"), _alias_list(row["golden_answers"], "golden_answers")
        md = row.get("metadata") or {}
        if isinstance(md, dict):
            meta.update(md)
            if md.get("context"):
                meta["context"] = _context(md["context"])
            if md.get("paragraphs"):
                meta["paragraphs"] = _paragraphs(md["paragraphs"])
    if not (answers := split_answers(answers)):
        raise data.RowError("no non-empty answer")
    return q, answers, meta


# ----------------------------------------------- corpora: what web_search / read_page search
def doc_id(title: str, text: str) -> str:
    """Stable id of a paragraph: a hash of its title and text (independent of which tasks are loaded).

    >>> doc_id("Ed Wood", "Edward Davis Wood Jr. was an American filmmaker.")
    'p-cc03405bdb'
    """
    return "p-" + hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=8)
def _world_corpus(seed: int, n_entities: int) -> tuple:
    return tuple(make_world(seed, n_entities, n_tasks=0).corpus)


def corpus_from_tasks(tasks: list[Task]) -> list[dict]:
    """The union of the tasks' own paragraphs, deduplicated: HotpotQA/2Wiki `context`, MuSiQue
    `paragraphs`, and the synthetic world's pages. [] when the tasks carry none.

    >>> t = Task("1", "q", ["a"], {"context": [["Ed Wood", ["Ed Wood was", " a director."]]]})
    >>> corpus_from_tasks([t, t])
    [{'id': 'p-fe3483079e', 'title': 'Ed Wood', 'text': 'Ed Wood was a director.'}]
    """
    docs: dict[str, dict] = {}
    for t in tasks:
        m = t.meta
        if m.get("source") == "world":
            for d in _world_corpus(m["seed"], m["n_entities"]):
                docs.setdefault(d["id"], dict(d))
        for title, text in ([(title, "".join(sents)) for title, sents in m.get("context") or []]
                            + [(p["title"], p["paragraph_text"]) for p in m.get("paragraphs") or []]):
            if text := text.strip():
                docs.setdefault(doc_id(title, text), {"id": doc_id(title, text), "title": title, "text": text})
    return list(docs.values())


def kilt_passages(title: str, paragraphs: list[str], words: int = 100) -> list[str]:
    """A KILT page as passages of `words` words (DPR-style chunks of the page's running text).
    The title line, "Section::::" headings and "BULLET::::" markers are dropped.

    >>> kilt_passages("A", ["A\\n", "one two three\\n", "Section::::History.\\n", "BULLET::::- four five\\n"], words=2)
    ['one two', 'three four', 'five']
    """
    stream: list[str] = []
    for i, p in enumerate(paragraphs):
        p = p.strip()
        if not p or (i == 0 and p == title.strip()) or p.startswith("Section::::"):
            continue
        stream += p.replace("BULLET::::-", "").replace("BULLET::::", "").split()
    return [" ".join(stream[j:j + words]) for j in range(0, len(stream), words)]


def load_corpus(path: str | Path, passage_words: int = 100) -> list[dict]:
    """Documents {id, title, text} of a JSONL/JSON/parquet corpus in one of the forms {id, title, text},
    KILT {wikipedia_id?, wikipedia_title, text: [paragraphs]} (split into passages of `passage_words`
    words, ids "<wikipedia_id or title>#<k>"), or wiki-18 DPR {id, contents: '"Title"\\ntext'}.
    A bad row or a repeated id is a DataError naming file and row."""
    path = Path(path)
    stem = path.name.split(".")[0]
    docs, seen = [], {}
    for i, row in data.read_records(path):
        try:
            if isinstance(row, Exception):
                raise row
            if not isinstance(row, dict):
                raise data.RowError(f"expected an object, got {type(row).__name__}")
            rid = data.row_id(row) or f"{stem}:{i}"
            if "contents" in row:
                if not isinstance(row["contents"], str):
                    raise data.RowError("field 'contents' must be a string")
                first, _, text = row["contents"].partition("\n")
                new = [(rid, first.strip().strip('"'), text.strip())]
            elif "wikipedia_title" in row:
                if not isinstance(row.get("text"), list):
                    raise data.RowError("KILT row: field 'text' must be a list of paragraphs")
                title = data.text_field(row, "wikipedia_title")
                base = str(row.get("wikipedia_id") or title)
                passages = kilt_passages(title, row["text"], passage_words)
                new = [(f"{base}#{k}", title, t) for k, t in enumerate(passages)]
            elif "text" in row and "title" in row:
                if not isinstance(row["text"], str) or not isinstance(row["title"], str):
                    raise data.RowError("fields 'title' and 'text' must be strings")
                new = [(rid, row["title"].strip(), row["text"].strip())]
            else:
                raise data.RowError(f"not a corpus row ({{id, title, text}}, KILT or wiki-18); fields: {sorted(row)[:12]}")
            for did, title, text in new:
                if did in seen:
                    raise data.RowError(f"duplicate document id {did!r} (first at row {seen[did]})")
                seen[did] = i
                docs.append({"id": did, "title": title, "text": text})
        except data.RowError as e:
            raise data.DataError(f"{path}: row {i}: {e}") from None
    if not docs:
        raise data.DataError(f"{path}: no documents")
    return docs


# ------------------------- step rewards (reward.step_weight): information gain over the gold chain, per-hop metrics
REDUNDANT = 0.1  # the cost of a step whose tools served nothing new (StepSearch's redundancy penalty)


def chain_seen(ep: Episode, snippet_chars: int) -> list[list[float]] | None:
    """How much of each page of a world task's gold chain (meta["support"], in order) the host's tools had served by
    the end of each step: 1 once the facts the task needs from it were served (a read_page of it, or a search
    snippet, its first `snippet_chars` characters, holding its evidence sentences), 0.5 while a search only listed
    it (its ref: the way to it). Read from what the tool server recorded (Step.served), never from what the agent
    printed, which could name any page. None for a task without a world chain."""
    m = ep.task.meta
    if m.get("source") != "world" or "support" not in m:
        return None
    docs, chain = _docs(m["seed"], m["n_entities"]), m["support"]
    whole = {p: all(t in docs[p]["text"][:snippet_chars] for q, t in m["evidence"] if q == p) for p in chain}
    by_title, seen, out = {docs[p]["title"]: p for p in chain}, dict.fromkeys(chain, 0.0), []
    for step in ep.steps:
        for tool, page in step.served:
            if tool == "web_search" and page in seen:
                seen[page] = max(seen[page], 1.0 if whole[page] else 0.5)
            elif tool == "read_page" and page in by_title:
                seen[by_title[page]] = 1.0
        out.append([seen[p] for p in chain])
    return out


def info_gain(ep: Episode, snippet_chars: int, redundant: float = REDUNDANT) -> list[float]:
    """QA's step rewards, StepSearch's two terms over the gold chain: a step earns the share of the chain it first
    brought into view (`chain_seen`: 1 / |chain| a page, half of it for a page only listed), paid only where the
    episode submitted an answer (as StepSearch pays no step score without one: reading and never answering earns
    nothing); a step whose tools served nothing new (a repeated query, a page read again) costs `redundant`,
    answered or not. Gains sum to at most 1 an episode. 0 a step for a task without a world chain.

    >>> t = next(t for t in make_world(0, 30).tasks if t.meta["template"] == "older_org")
    >>> t.meta["support"]
    ['stotrem-museum-of-art', 'stefu-glassworks']
    >>> search, read = ("web_search", "stotrem-museum-of-art"), ("read_page", "Stotrem Museum of Art")
    >>> steps = [Step([], [], [], served=s) for s in ([search], [read], [read], [], [("read_page", "Stefu Glassworks")])]
    >>> info_gain(Episode(t, steps, final_answer="Stefu Glassworks"), snippet_chars=40)
    [0.25, 0.25, -0.1, 0.0, 0.5]
    >>> info_gain(Episode(t, steps, final_answer=None), snippet_chars=40)
    [0.0, 0.0, -0.1, 0.0, 0.0]
    """
    seen = chain_seen(ep, snippet_chars)
    if seen is None:
        return [0.0] * len(ep.steps)
    pay, before, served, out = has_answer(ep.final_answer) / len(ep.task.meta["support"]), [0.0], set(), []
    for step, now in zip(ep.steps, seen):
        new = {tuple(x) for x in step.served} - served
        out.append(round(pay * (sum(now) - sum(before)) - redundant * bool(step.served and not new), 12))
        served, before = served | new, now
    return out


def hop_metrics(ep: Episode, snippet_chars: int) -> dict[str, float]:
    """Per-hop success of a world task (none for another): "hop<k>" 1 where the k-th page of the chain had its facts
    served (`chain_seen`); "ref_missed" 1 where a read_page found no page (a mistyped ref), "ref_recovered" 1
    where a page was read after that."""
    if (seen := chain_seen(ep, snippet_chars)) is None:
        return {}
    reads = [page for s in ep.steps for tool, page in s.served if tool == "read_page"]
    docs = _docs(ep.task.meta["seed"], ep.task.meta["n_entities"])
    titles = {d["title"] for d in docs.values()}
    miss = next((i for i, page in enumerate(reads) if page not in titles), None)
    last = seen[-1] if seen else [0.0] * len(ep.task.meta["support"])
    return {**{f"hop{k}": float(v == 1.0) for k, v in enumerate(last, 1)}, "ref_missed": float(miss is not None),
            "ref_recovered": float(miss is not None and any(page in titles for page in reads[miss + 1:]))}


# ------------------------------------------------------------------------------- the environment

SYSTEM_PROMPT = """\
You solve tasks by writing Python in a Jupyter notebook. Each step, write your reasoning in \
<think>...</think>, then one code cell in <code>...</code>. The cell runs in a persistent kernel \
and you get its output in <output>...</output>.

Preloaded in the kernel:
- web_search(query, k=3): search results; print them to see each title, ref and snippet
- read_page(ref): the text of the page with that ref
- notepad: your memory. notepad.todo and notepad.facts are lists, notepad.draft is a string, \
notepad.render() shows it all. When the context gets long, old steps are dropped, but the notepad \
and your variables survive.
- submit_final_answer(answer): give a short final answer. Only this ends the task.

Example step:
<think>I need the capital of France. I will note the plan and search.</think>
<code>notepad.todo.append("find the capital of France")
print(web_search("capital of France"))</code>"""

# One solved task as earlier chat turns (`agent.worked_example`): a small model copies the shape of
# a real exchange far more reliably than a description of it. Its tools' output is shown as they print.
WORKED_EXAMPLE = (
    {"role": "user", "content": "Task: In which year was the Orlen Bridge opened?\nYou have 3 steps."},
    {"role": "assistant", "content": "<think>I should search for the Orlen Bridge and read the results.</think>\n"
                                     "<code>print(web_search(\"Orlen Bridge opened\"))</code>"},
    {"role": "user", "content": "<output>\n[1] Orlen Bridge (ref: orlen-bridge)\n    The Orlen Bridge was opened in "
                                "1894 after six years of work.\n</output>\n[2 steps left]"},
    {"role": "assistant", "content": "<think>The result says the bridge was opened in 1894. I submit that.</think>\n"
                                     "<code>submit_final_answer(\"1894\")</code>"},
)  # fmt: skip


@dataclass
class Settings:  # config envs.qa
    entities: int = 60  # the size of the invented encyclopedia of synthetic tasks
    answer_metric: str = "em"  # em | f1: what reward.em_weight multiplies


class QA(TaskEnvBase):
    metrics = ("em", "f1")  # training: the reward's Unicode-aware match; evaluate.py: the papers' official scores first
    eval_metrics = ("official_em", "official_f1", "em", "f1")
    tools = ("web_search", "read_page")
    system_prompt, worked_example = SYSTEM_PROMPT, WORKED_EXAMPLE

    def __init__(self, cfg):
        super().__init__(cfg)
        self.settings = settings(cfg, "qa", Settings)
        if self.settings.answer_metric not in ("em", "f1"):
            raise ValueError(f"envs.qa.answer_metric must be 'em' or 'f1', got {self.settings.answer_metric!r}")

    def synthetic(self, seed: int, n: int) -> list[Task]:  # the world of data.synthetic_* and envs.qa.entities
        return make_world(seed, self.settings.entities, n).tasks

    def load(self, source: str, limit: int | None = None) -> list[Task]:  # a benchmark name or a file
        return load_tasks(source, self.cfg.data, limit)

    def score(self, ep: Episode) -> dict[str, float]:
        """L0's answer reward (0.9 * EM + 0.1 * answered; envs.qa.answer_metric "f1" puts F1 in place of EM), with
        the official EM / F1 of the papers' tables beside the training reward's Unicode-aware ones, and a world task's
        per-hop metrics (`hop_metrics`)."""
        r, pred, golds = self.cfg.reward, ep.final_answer, ep.task.answers
        em, f1 = exact_match(pred, golds), f1_score(pred, golds)
        core = answer_reward(pred, f1 if self.settings.answer_metric == "f1" else em, r.em_weight, r.has_answer_weight)
        return {"core": core, "em": em, "f1": f1, "has_answer": float(has_answer(pred)),
                "official_em": official_em(pred, golds), "official_f1": official_f1(pred, golds),
                **hop_metrics(ep, self.cfg.tools.snippet_chars)}

    def step_rewards(self, ep: Episode) -> list[float]:
        return info_gain(ep, self.cfg.tools.snippet_chars)

    def judge_prompt(self, question: str, golds: list[str], prediction: str | None) -> str:
        return judge_prompt(question, golds, prediction)

    def report(self, summaries: list[dict]) -> str:
        return paper_table(summaries)

    def expert(self, task: Task) -> list[str]:
        return expert_actions(task, self.cfg.tools.snippet_chars)

    def corpus(self, tasks: list[Task]) -> list[dict]:
        """tools.corpus (a corpus file: l0_min.search's bm25 indexes it) if set, else the tasks' own paragraphs."""
        return load_corpus(self.cfg.tools.corpus) if self.cfg.tools.corpus else corpus_from_tasks(tasks)


def make_env(cfg) -> QA:
    return QA(cfg)
