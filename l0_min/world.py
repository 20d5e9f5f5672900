"""A synthetic offline world: a seeded, invented encyclopedia and questions answerable only by searching it.

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
(which regenerate the corpus: see `data.corpus_from_tasks`). Arithmetic and comparison tasks also
keep the looked-up `operands`.

The same (seed, n_entities) always gives the same corpus; `n_tasks` only changes how many questions
are drawn (the first k questions do not depend on n_tasks).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from l0_min.episode import Task

# ---------------------------------------------------------------------------------------------
# names

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
    rest = number_words(n % 100) if n % 100 else ""
    return f"{_ONES[n // 100]} hundred" + (f" {rest}" if rest else "")


def _root(rng: random.Random, syllables: int) -> str:
    s = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return s.capitalize()


# ---------------------------------------------------------------------------------------------
# entities


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

    def split(self, held_out: float = 0.2) -> tuple[list[Task], list[Task]]:
        return split(self.tasks, held_out)


def _date_text(y: int, m: int, d: int) -> str:
    return f"{d} {_MONTHS[m - 1]} {y}"


def _make_entities(seed: int, n_entities: int):
    if n_entities < 6:
        raise ValueError(f"make_world: n_entities must be at least 6 (2 people, 2 cities, 2 organisations), got {n_entities}")
    rng = random.Random(f"l0-world-entities-{seed}")
    n_city = max(2, round(n_entities * 0.25))
    n_org = max(2, round(n_entities * 0.35))
    n_person = n_entities - n_city - n_org
    used: set[str] = set()  # every word of every invented name: no word is shared by two names

    def fresh(make):
        for _ in range(1000):
            name = make()
            words = name.lower().split()
            if not any(w in used for w in words) and len(set(words)) == len(words):
                used.update(words)
                return name
        raise ValueError(f"make_world: could not invent {n_entities} distinct names")

    countries = [fresh(lambda: _root(rng, 2) + rng.choice(["ia", "ar", "esh", "ony"])) for _ in range(max(2, n_city // 3))]
    cities = []
    for _ in range(n_city):
        name = fresh(lambda: _root(rng, rng.choice([1, 2])) + rng.choice(_CITY_SUFFIX))
        cities.append(City(name, rng.choice(countries), rng.randint(800, 1700),
                           rng.randint(50, 20000) * 100, rng.choice(_FEATURES)))
    people = []
    for _ in range(n_person):
        name = fresh(lambda: f"{_root(rng, 2)} {_root(rng, 2)}")
        birth = (rng.randint(1780, 1960), rng.randint(1, 12), rng.randint(1, 28))
        people.append(Person(name, birth, rng.choice(cities), rng.choice(_OCCUPATIONS)))
    orgs = []
    for i in range(n_org):
        kind = rng.choice(sorted(_ORG_KIND))
        root = fresh(lambda: _root(rng, rng.choice([2, 3])))
        name = rng.choice(_ORG_KIND[kind]).format(root)
        founder = people[i % len(people)] if i < len(people) else rng.choice(people)
        org = Org(name, kind, founder.birth[0] + rng.randint(22, 60), founder, rng.choice(cities),
                  rng.randint(40, 20000))
        founder.founded.append(org)
        orgs.append(org)
    return people, cities, orgs


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _pages(people, cities, orgs) -> dict[str, list[str]]:
    """Title -> the page's sentences (each a fact a question can rely on)."""
    pages: dict[str, list[str]] = {}
    born_in: dict[str, list[str]] = {}
    for p in people:
        born_in.setdefault(p.city.name, []).append(p.name)
    for c in cities:
        born_here = born_in.get(c.name, [])[:3]
        s = [f"{c.name} is a city in {c.country}.",
             f"{c.name} was founded in {c.founded}.",
             f"{c.name} has a population of {c.population:,}.",
             f"The city is known for {c.feature}."]
        if born_here:
            s.append(f"Notable people born in {c.name} include {', '.join(born_here)}.")
        pages[c.name] = s
    for p in people:
        y, m, d = p.birth
        s = [f"{p.name} (born {_date_text(y, m, d)} in {p.city.name}) is {_a(p.occupation)}.",
             f"{p.name} was born in {y}."]
        for o in p.founded:
            s.append(f"{p.name} founded the {o.name} in {o.founded}.")
        s.append(f"{p.name} is remembered mostly for work as {_a(p.occupation)}.")
        pages[p.name] = s
    for o in orgs:
        pages[o.name] = [f"The {o.name} is {_a(o.kind)} headquartered in {o.city.name}.",
                         f"The {o.name} was founded in {o.founded} by {o.founder.name}.",
                         f"The {o.name} has {o.employees:,} employees."]
    return pages


# ---------------------------------------------------------------------------------------------
# questions


def _num_answers(n: int, unit: str = "") -> list[str]:
    """'12', 'twelve', '12 years', '1,200' ... for a number answer."""
    out = [str(n)]
    if n >= 1000:
        out.append(f"{n:,}")
    w = number_words(n)
    if w:
        out += [w, w.replace("-", " ")]
    if unit:
        out += [f"{a} {unit}" for a in list(out)]
    return list(dict.fromkeys(out))


def _ev(title: str, sentence: str) -> list[str]:
    return [slug(title), sentence]


def _questions(rng: random.Random, people, cities, orgs, pages):
    """Yield one random (template, kind, question, answers, evidence, operands) per call of each
    template; the caller draws templates with weights."""
    P = pages

    def sent(title: str, prefix: str) -> str:
        for s in P[title]:
            if s.startswith(prefix) or prefix in s:
                return s
        raise KeyError(f"{title}: no sentence with {prefix!r}")  # a bug in the templates

    def person_birth(p):  # the page's "born in <year>" sentence
        return _ev(p.name, sent(p.name, f"{p.name} was born in"))

    def person_intro(p):
        return _ev(p.name, P[p.name][0])

    def org_founded(o):
        return _ev(o.name, sent(o.name, f"The {o.name} was founded"))

    def org_hq(o):
        return _ev(o.name, P[o.name][0])

    def city_fact(c, key):
        return _ev(c.name, sent(c.name, key))

    def t_birth_year():
        p = rng.choice(people)
        return ("person_birth_year", "lookup", f"In what year was {p.name} born?", [str(p.birth[0])],
                [person_birth(p)], None)

    def t_birth_date():
        p = rng.choice(people)
        y, m, d = p.birth
        return ("person_birth_date", "lookup", f"On what date was {p.name} born?",
                [_date_text(y, m, d), f"{_MONTHS[m - 1]} {d}, {y}", f"{y}-{m:02d}-{d:02d}"], [person_intro(p)], None)

    def t_birth_city():
        p = rng.choice(people)
        return ("person_birth_city", "lookup", f"In which city was {p.name} born?", [p.city.name],
                [person_intro(p)], None)

    def t_occupation():
        p = rng.choice(people)
        return ("person_occupation", "lookup", f"What is the occupation of {p.name}?", [p.occupation],
                [person_intro(p)], None)

    def t_founder():
        o = rng.choice(orgs)
        return ("org_founder", "lookup", f"Who founded the {o.name}?", [o.founder.name], [org_founded(o)], None)

    def t_org_year():
        o = rng.choice(orgs)
        return ("org_founded_year", "lookup", f"In what year was the {o.name} founded?", [str(o.founded)],
                [org_founded(o)], None)

    def t_org_city():
        o = rng.choice(orgs)
        return ("org_city", "lookup", f"In which city is the {o.name} headquartered?", [o.city.name],
                [org_hq(o)], None)

    def t_employees():
        o = rng.choice(orgs)
        return ("org_employees", "lookup", f"How many employees does the {o.name} have?",
                _num_answers(o.employees, "employees"), [_ev(o.name, P[o.name][2])], None)

    def t_city_country():
        c = rng.choice(cities)
        return ("city_country", "lookup", f"In which country is {c.name}?", [c.country],
                [city_fact(c, " is a city in ")], None)

    def t_city_pop():
        c = rng.choice(cities)
        return ("city_population", "lookup", f"What is the population of {c.name}?",
                _num_answers(c.population, "people"), [city_fact(c, "population")], None)

    def t_city_year():
        c = rng.choice(cities)
        return ("city_founded_year", "lookup", f"In what year was {c.name} founded?", [str(c.founded)],
                [city_fact(c, " was founded in ")], None)

    # -- multi-hop
    def t_founder_birth_year():
        o = rng.choice(orgs)
        p = o.founder
        return ("org_founder_birth_year", "multihop", f"In what year was the founder of the {o.name} born?",
                [str(p.birth[0])], [org_founded(o), person_birth(p)], None)

    def t_person_country():
        p = rng.choice(people)
        return ("person_birth_country", "multihop", f"In which country was {p.name} born?", [p.city.country],
                [person_intro(p), city_fact(p.city, " is a city in ")], None)

    def t_org_city_pop():
        o = rng.choice(orgs)
        return ("org_city_population", "multihop",
                f"What is the population of the city where the {o.name} is headquartered?",
                _num_answers(o.city.population, "people"), [org_hq(o), city_fact(o.city, "population")], None)

    def t_founder_occupation():
        o = rng.choice(orgs)
        return ("org_founder_occupation", "multihop", f"What was the occupation of the founder of the {o.name}?",
                [o.founder.occupation], [org_founded(o), person_intro(o.founder)], None)

    def t_founder_country():
        o = rng.choice(orgs)
        p = o.founder
        return ("org_founder_birth_country", "multihop", f"In which country was the founder of the {o.name} born?",
                [p.city.country], [org_founded(o), person_intro(p), city_fact(p.city, " is a city in ")], None)

    def t_founder_city_year():
        o = rng.choice(orgs)
        p = o.founder
        return ("org_founder_birth_city_founded", "multihop",
                f"In what year was the birthplace of the founder of the {o.name} founded?",
                [str(p.city.founded)], [org_founded(o), person_intro(p), city_fact(p.city, " was founded in ")], None)

    # -- arithmetic
    def t_years_city_person():
        p = rng.choice(people)
        c = rng.choice(cities)
        n = p.birth[0] - c.founded
        return ("years_city_to_birth", "arithmetic", f"How many years after {c.name} was founded was {p.name} born?",
                _num_answers(n, "years"), [city_fact(c, " was founded in "), person_birth(p)], [c.founded, p.birth[0]])

    def t_age_at_founding():
        o = rng.choice(orgs)
        p = o.founder
        n = o.founded - p.birth[0]
        return ("founder_age_at_founding", "arithmetic",
                f"How many years after {p.name} was born was the {o.name} founded?",
                _num_answers(n, "years"), [person_birth(p), org_founded(o)], [p.birth[0], o.founded])

    def t_years_between_orgs():
        a, b = rng.sample(orgs, 2)
        if a.founded == b.founded:
            return None
        if a.founded > b.founded:
            a, b = b, a
        n = b.founded - a.founded
        return ("years_between_orgs", "arithmetic",
                f"How many years passed between the founding of the {a.name} and the founding of the {b.name}?",
                _num_answers(n, "years"), [org_founded(a), org_founded(b)], [a.founded, b.founded])

    def t_combined_pop():
        a, b = rng.sample(cities, 2)
        return ("combined_population", "arithmetic", f"What is the combined population of {a.name} and {b.name}?",
                _num_answers(a.population + b.population, "people"),
                [city_fact(a, "population"), city_fact(b, "population")], [a.population, b.population])

    # -- comparison
    def t_older_org():
        a, b = rng.sample(orgs, 2)
        if a.founded == b.founded:
            return None
        win = a if a.founded < b.founded else b
        return ("older_org", "comparison", f"Which is older, the {a.name} or the {b.name}?", [win.name],
                [org_founded(a), org_founded(b)], [a.founded, b.founded])

    def t_born_first():
        a, b = rng.sample(people, 2)
        if a.birth == b.birth:
            return None
        win = a if a.birth < b.birth else b
        return ("born_first", "comparison", f"Who was born first, {a.name} or {b.name}?", [win.name],
                [person_intro(a), person_intro(b)], [list(a.birth), list(b.birth)])

    def t_larger_city():
        a, b = rng.sample(cities, 2)
        if a.population == b.population:
            return None
        win = a if a.population > b.population else b
        return ("larger_city", "comparison", f"Which city has the larger population, {a.name} or {b.name}?",
                [win.name], [city_fact(a, "population"), city_fact(b, "population")], [a.population, b.population])

    def t_more_employees():
        a, b = rng.sample(orgs, 2)
        if a.employees == b.employees:
            return None
        win = a if a.employees > b.employees else b
        return ("more_employees", "comparison", f"Which has more employees, the {a.name} or the {b.name}?",
                [win.name], [_ev(a.name, P[a.name][2]), _ev(b.name, P[b.name][2])], [a.employees, b.employees])

    lookups = [t_birth_year, t_birth_date, t_birth_city, t_occupation, t_founder, t_org_year, t_org_city,
               t_employees, t_city_country, t_city_pop, t_city_year]
    multihop = [t_founder_birth_year, t_person_country, t_org_city_pop, t_founder_occupation,
                t_founder_country, t_founder_city_year]
    arithmetic = [t_years_city_person, t_age_at_founding, t_years_between_orgs, t_combined_pop]
    comparison = [t_older_org, t_born_first, t_larger_city, t_more_employees]
    return {"lookup": lookups, "multihop": multihop, "arithmetic": arithmetic, "comparison": comparison}


KIND_WEIGHTS = {"lookup": 0.45, "multihop": 0.25, "arithmetic": 0.15, "comparison": 0.15}


def make_world(seed: int = 0, n_entities: int = 60, n_tasks: int | None = None) -> World:
    """A deterministic world: `n_entities` pages and `n_tasks` distinct questions (default 4 per entity).

    Question kinds are drawn with `KIND_WEIGHTS` (45% one-page lookups). Raises ValueError when the
    world is too small for that many distinct questions.
    """
    people, cities, orgs = _make_entities(seed, n_entities)
    pages = _pages(people, cities, orgs)
    corpus = [{"id": slug(t), "title": t, "text": " ".join(s)} for t, s in pages.items()]
    n_tasks = 4 * n_entities if n_tasks is None else n_tasks
    rng = random.Random(f"l0-world-questions-{seed}")
    templates = _questions(rng, people, cities, orgs, pages)
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
        made = rng.choice(templates[kind])()
        if made is None or made[2] in seen:
            continue
        template, kind, question, answers, evidence, operands = made
        seen.add(question)
        support = list(dict.fromkeys(doc for doc, _ in evidence))
        meta = {"kind": kind, "hops": len(support), "template": template, "support": support,
                "evidence": evidence, "seed": seed, "n_entities": n_entities, "source": "world"}
        if operands is not None:
            meta["operands"] = operands
        tasks.append(Task(id=f"world{seed}-{len(tasks):04d}", question=question, answers=answers, meta=meta))
    return World(corpus, tasks, seed)


def split(tasks: list[Task], held_out: float = 0.2) -> tuple[list[Task], list[Task]]:
    """(train, held-out) by a hash of each task id: stable when tasks are added or reordered.

    >>> tr, ho = split(make_world(0, 30).tasks, 0.25)
    >>> len(tr) + len(ho), not set(t.id for t in tr) & set(t.id for t in ho)
    (120, True)
    """
    if not 0.0 <= held_out <= 1.0:
        raise ValueError(f"held_out must be in [0, 1], got {held_out}")
    train, test = [], []
    for t in tasks:
        h = int(hashlib.sha1(t.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (test if h < held_out else train).append(t)
    return train, test
