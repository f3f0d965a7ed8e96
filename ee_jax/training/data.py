"""Tuning and evaluation text that any machine with Python has: no download, no hub.

Two sources (EE-Tuning needs text the model itself finds natural, so its final layer's
distribution is a good teacher):

* the Python standard library's own sources (code and docstrings) — `stdlib_documents`;
* instructions built from the standard library's documented functions — `instructions` —
  which the model answers itself (`ee_jax.training.selfgen`), giving chat-formatted text in
  the model's own words, the distribution it will serve.

Both are split deterministically by a hash of the item into "train" (80%), "calib" (10%,
held apart for choosing exit thresholds) and "eval" (10%), so "eval" and "calib" items are
never trained on. HumanEval is an evaluation set only and is never read here.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

Split = str  # "train" | "calib" | "eval"
SPLITS = ("train", "calib", "eval")
EVAL_PERCENT = 10
CALIB_PERCENT = 10  # the next 10% of hashes: threshold calibration, never trained on
# Folders of the standard library that are tests, vendored data or platform tools.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "idlelib",
               "turtledemo", "__pycache__", "ensurepip", "pydoc_data", "encodings"}


def _split_of(key: str) -> Split:
    bucket = zlib.crc32(key.encode()) % 100
    if bucket < EVAL_PERCENT:
        return "eval"
    return "calib" if bucket < EVAL_PERCENT + CALIB_PERCENT else "train"


def _check_split(split: Split) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = stdlib_dir()
    files = [f for f in root.rglob("*.py")
             if not _SKIP_PARTS.intersection(f.relative_to(root).parts)]
    return tuple(sorted(files))


def stdlib_documents(split: Split, max_chars: int = 6000) -> Iterator[str]:
    """Source files of the standard library (split by file), cut into pieces of at most
    `max_chars` at top-level definition boundaries, in a fixed order."""
    _check_split(split)
    root = stdlib_dir()
    for f in _stdlib_files():
        rel = str(f.relative_to(root))
        if _split_of(rel) != split:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from _pieces(text, max_chars)


def _pieces(text: str, max_chars: int) -> Iterator[str]:
    """Cut at lines that start a top-level statement, so pieces are whole definitions."""
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        starts = line[:1] not in (" ", "\t", "\n", "") and size > 0
        if starts and size + len(line) > max_chars:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece and size:
        yield "".join(piece)[:max_chars * 2]


def _public_modules() -> Iterator[tuple[tuple[str, ...], str, ast.Module]]:
    """(path parts without suffix, source, parsed tree) of public standard-library modules."""
    root = stdlib_dir()
    for f in _stdlib_files():
        rel = f.relative_to(root).with_suffix("")
        if any(p.startswith("_") for p in rel.parts):
            continue
        try:
            text = f.read_text(encoding="utf-8")
            yield rel.parts, text, ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue


@functools.lru_cache(maxsize=1)
def _stdlib_catalog() -> tuple[tuple[tuple[str, str, str], ...], tuple[tuple[str, str], ...]]:
    """Both things read from the standard library's parsed modules, in one pass (parsing
    them is most of the cost: ~2 s each time):
    documented functions: (module, qualified name, first docstring sentence) of public,
    documented functions and methods;
    function headers: (key, source) of documented top-level functions, the `def` line(s) and
    the docstring without the body (a code-completion prompt in HumanEval's shape)."""
    documented, headers = [], []
    for parts, text, tree in _public_modules():
        module = ".".join(parts).removesuffix(".__init__")
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                continue
            items = [(node, node.name)]
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                items += [(m, f"{node.name}.{m.name}") for m in node.body
                          if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)]
            for fn, name in items:
                if any(p.startswith("_") for p in name.split(".")):
                    continue
                doc = ast.get_docstring(fn)
                if not doc:
                    continue
                first = " ".join(doc.strip().split("\n\n")[0].split())
                if 20 <= len(first) <= 200:
                    documented.append((module, name, first))
            if (isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
                    and ast.get_docstring(node) is not None and len(node.body) >= 2
                    and not node.decorator_list):
                header = "".join(lines[node.lineno - 1:node.body[0].end_lineno])
                if 60 <= len(header) <= 1200:
                    headers.append((f"{'.'.join(parts)}.{node.name}", header))
    return tuple(documented), tuple(headers)


def _documented_functions() -> tuple[tuple[str, str, str], ...]:
    return _stdlib_catalog()[0]


_TEMPLATES = (
    "Explain what `{module}.{name}` does in Python and show a short example.",
    "Write a Python function that uses `{module}.{name}`. Its documentation says: {doc}",
    "How would I use `{name}` from the `{module}` module? Give an example.",
    "Describe in two or three sentences what this Python function does: {doc}",
    "Write a small Python script that demonstrates `{module}.{name}`, with comments.",
    "What is `{module}.{name}` for, and when should I avoid it?",
)


def _render(m: str, n: str, d: str) -> str:
    template = _TEMPLATES[zlib.crc32(f"{m}.{n}".encode()) % len(_TEMPLATES)]
    return template.format(module=m, name=n, doc=d)


def _held_out(train: list[str], held: list[str]) -> list[str]:
    """Eval items minus any text that also occurs in train (two functions can share a
    docstring or a header): evaluation text is never trained on."""
    seen = set(train)
    return [x for x in dict.fromkeys(held) if x not in seen]


def _select(split: Split, pairs: list[tuple[str, str]], limit: int | None, seed: int
            ) -> list[str]:
    """pairs: (key, text); split by key, eval and calib made disjoint from train and from each
    other (eval is exactly the set it was before calib existed), shuffled by seed."""
    by: dict[str, list[str]] = {s: [] for s in SPLITS}
    for key, text in pairs:
        by[_split_of(key)].append(text)
    if split == "train":
        items = by["train"]
    elif split == "calib":
        items = _held_out(by["train"] + by["eval"], by["calib"])
    else:
        items = _held_out(by["train"] + by["calib"], by["eval"])
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order[:limit]]


def instructions(split: Split, limit: int | None = None, seed: int = 0) -> list[str]:
    """Instructions about documented standard-library functions, one template each, split
    by function (an eval function never appears in a train instruction), shuffled by seed."""
    _check_split(split)
    return _select(split, [(f"{m}.{n}", _render(m, n, d)) for m, n, d in
                           _documented_functions()], limit, seed)


def _function_headers() -> tuple[tuple[str, str], ...]:
    return _stdlib_catalog()[1]


def code_prompts(split: Split, limit: int | None = None, seed: int = 0) -> list[str]:
    """Function signatures with docstrings from the standard library, for the model to
    complete (its own code, as on HumanEval, without reading HumanEval)."""
    _check_split(split)
    return _select(split, list(_function_headers()), limit, seed)


# Everyday requests (no code, no standard library) for calibrating thresholds on the kind of
# chat a new user sends first (a threshold calibrated on stdlib text alone did not transfer
# to everyday chat). Each topic list has its own phrasing. Written apart from the evaluation's
# everyday chat (`ee_jax.evaluation.prompts.GENERAL_CHAT`, other topics; a test checks that
# the two share no request). Split by a hash of the request into "calib" (half) and "train"
# (half); none is "eval": evaluation uses GENERAL_CHAT.
_EVERYDAY = (
    ("Give me a few practical tips for {}.", (
        "running my first five-kilometre race", "staying focused while working from home",
        "taking better photos with a phone", "making friends after moving to a new city",
        "keeping a small apartment tidy", "learning to play the guitar as an adult",
        "driving safely on icy roads", "getting up earlier in the morning",
        "eating more vegetables", "hosting a dinner party on a budget",
        "reading more books each year", "staying warm while camping in winter",
        "keeping a long car journey with children calm", "drinking more water during the day")),
    ("Explain in simple terms {}.", (
        "how a refrigerator keeps food cold", "what a black hole is", "how ocean tides work",
        "why we have seasons", "how a credit score works", "what DNA does in a cell",
        "how an airplane stays in the air", "why the moon has phases", "how a compass works",
        "why bread dough rises", "how solar panels make electricity",
        "what causes thunder and lightning", "how a microwave oven heats food",
        "why some metals rust")),
    ("Write a short {}.", (
        "poem about a lighthouse keeper", "story about a lost umbrella finding its owner",
        "limerick about a forgetful wizard", "toast for my best friend's birthday",
        "poem about the first snow of winter", "bedtime story about a brave little owl",
        "poem about a train crossing the mountains at night",
        "story about a dog waiting at the door", "poem about an old wooden bridge",
        "fable about a tortoise who wanted to fly", "speech to welcome new club members",
        "poem about a busy market in the morning", "story about two robots who become friends",
        "riddle whose answer is a shadow")),
    ("What is the difference between {}?", (
        "a crocodile and an alligator", "baking soda and baking powder",
        "a comet and an asteroid", "a lake and a pond", "a frog and a toad",
        "jam and jelly", "a hurricane and a tornado", "a rabbit and a hare",
        "a violin and a viola", "a moth and a butterfly", "a college and a university",
        "a cold and the flu", "a turtle and a tortoise", "a mountain and a hill")),
    ("How do I {}?", (
        "remove a coffee stain from a white shirt", "boil an egg so the yolk stays soft",
        "prepare for a job interview", "train a puppy to sit", "clean a cast-iron pan",
        "start keeping a journal", "fold a fitted sheet", "brew a good cup of tea",
        "sharpen a kitchen knife", "plan a surprise party", "unclog a bathroom sink",
        "make a paper airplane that flies far", "knit a simple scarf",
        "choose a good watermelon at the shop")),
    ("Recommend {} and say why.", (
        "a board game for a family evening", "a houseplant for a room with little light",
        "three films for a rainy Sunday", "a hobby that costs very little money",
        "a healthy breakfast I can make in five minutes",
        "a gift for a friend who loves gardening", "a dog breed for a small flat",
        "a few podcasts about history", "a musical instrument for a child to start with",
        "a way to spend a free afternoon in a small town",
        "a card game for two people", "some snacks for a long hike")),
    ("Tell me about {}.", (
        "the building of the Great Wall of China", "the life of Marie Curie",
        "how the Olympic Games began", "the pyramids of ancient Egypt",
        "the invention of the printing press", "the first landing on the moon",
        "the history of chocolate", "the Vikings and their ships", "how coffee spread around "
        "the world", "the migration of monarch butterflies", "the Northern Lights",
        "the history of the bicycle", "the Amazon rainforest", "the invention of the telephone")),
    ("Write {}.", (
        "a message asking my neighbour to water my plants while I am away",
        "an apology to a friend for missing their birthday party",
        "a short thank-you note to a teacher at the end of the year",
        "a note thanking a coworker for helping me with a hard week",
        "an invitation to a garden party next Saturday",
        "a short review of a restaurant where the food was great but the service was slow",
        "a reminder to my team about Friday's meeting",
        "a polite complaint to a shop about a broken kettle",
        "a message congratulating my cousin on a new baby",
        "a short announcement for a lost cat poster",
        "a friendly reply declining a wedding invitation",
        "a welcome message for a new neighbour")),
    ("Why {}?", (
        "do cats purr", "do onions make people cry", "is the ocean salty",
        "do we yawn", "do birds fly south for the winter", "does ice float on water",
        "do stars twinkle", "do we get goosebumps", "is sleep important for memory",
        "do bees make honey", "does the wind blow", "do people get hiccups")),
    ("Plan {}.", (
        "a relaxing weekend at home", "a picnic for six friends in the park",
        "a week of simple dinners for a family of four",
        "a birthday party for a seven-year-old", "a day trip to the seaside by train",
        "a study schedule for learning basic Spanish in three months",
        "a morning routine that leaves time for exercise",
        "a budget for a two-week holiday", "a small vegetable garden on a balcony",
        "a first visit to Rome for two days", "a games night for teenagers",
        "a spring cleaning of a small house")),
)


# More everyday requests for *training* only (tuning data for the exit heads: without them everyday
# chat was 2% of it and its exits agreed least with full depth). Not split: all of them are "train",
# so the "calib" half of _EVERYDAY stays what the shipped calibration used. Topics apart from
# GENERAL_CHAT's (the same test checks).
_EVERYDAY_TRAIN = (
    ("Give me some advice on {}.", (
        "choosing a first car", "talking to a shy child about school", "buying a used bicycle",
        "keeping houseplants alive in winter", "packing a lunch for work every day",
        "writing a birthday card for a grandparent", "organising a messy wardrobe",
        "learning to swim as an adult", "walking a dog that pulls on the lead",
        "getting started with bird watching", "planning meals when money is short",
        "keeping a garden shed in order", "choosing running shoes", "moving house calmly",
        "teaching a teenager to cook", "visiting a museum with small children",
        "sharing a kitchen with roommates", "starting to paint with watercolours",
        "keeping in touch with old friends", "writing a to-do list that works")),
    ("Can you explain {}?", (
        "how a vacuum flask keeps tea hot", "why cakes sink in the middle",
        "how bees find their way home", "how a lock and key work",
        "why the sea looks green in some places", "how a thermostat works",
        "what makes popcorn pop", "how a hot air balloon rises", "why cheese has holes",
        "how a library catalogue works", "how recycling plants sort rubbish",
        "how a sewing machine makes a stitch", "why mirrors swap left and right",
        "how seeds know which way is up", "what a mortgage is", "how a fridge magnet sticks",
        "why our voices sound different on a recording", "how a lighthouse lamp is so bright",
        "why some people are left-handed", "how frost forms on a window")),
    ("Write a few sentences about {}.", (
        "a walk in the woods after rain", "a grandmother's kitchen", "a quiet train station "
        "at dawn", "a child's first day at school", "a summer thunderstorm",
        "an old bookshop on a side street", "a fishing boat coming home",
        "a cat watching birds from a window", "a crowded beach in August",
        "a snowy village at night", "a bakery early in the morning", "a kite on a windy hill",
        "a garden in late summer", "a street musician playing the violin",
        "a long queue at the post office", "a campfire under the stars",
        "a football match in the rain", "a lighthouse in a storm",
        "a farmer's market in spring", "a library on a quiet afternoon")),
    ("What are the pros and cons of {}?", (
        "living in the countryside", "working a four-day week", "owning a cat",
        "buying a second-hand phone", "taking the train instead of flying",
        "learning online instead of in a classroom", "having a big garden",
        "cooking at home every night", "renting instead of buying a home",
        "getting up very early", "keeping chickens in the back garden",
        "travelling alone", "shopping at a local market", "having a smart speaker at home",
        "joining a gym", "reading on an e-reader", "living with roommates",
        "walking to work", "growing your own vegetables", "owning an electric car")),
    ("Suggest {}.", (
        "five questions to ask at a parents' evening", "a name for a pet goldfish",
        "a simple dessert for a summer evening", "a theme for a costume party",
        "some ways to use leftover rice", "a few indoor games for a rainy day",
        "a short stretching routine for the morning", "a packing list for a beach holiday",
        "a topic for a school science project", "a few ways to save electricity at home",
        "a quiet place to read in a busy city", "a present for a new father",
        "some ideas for a first date", "a slogan for a charity bake sale",
        "a few warm soups for winter", "a route for a Sunday bike ride",
        "some songs for a road trip", "a way to remember people's names",
        "a small kindness I could do for a neighbour", "a title for a family cookbook")),
    ("How does {} work?", (
        "a washing machine", "a bicycle gear", "a parachute", "a pressure cooker",
        "a ballpoint pen", "a smoke alarm", "an escalator", "a piano", "a submarine",
        "a traffic light", "a windmill", "a zip", "a vending machine", "a camera lens",
        "a toaster", "an electric kettle", "a sundial", "a doorbell", "a hearing aid",
        "a tide clock")),
    ("Help me write {}.", (
        "a note to leave for a house sitter", "a short bio for a community newsletter",
        "a message asking for a day off work", "a speech for my sister's wedding",
        "a note to my child's teacher about a school trip",
        "a thank-you message for a birthday present", "a post asking neighbours for a ladder",
        "a short notice about a yard sale", "an email to reschedule a dentist appointment",
        "a goodbye card for a colleague who is retiring", "a reply to a friend's holiday postcard",
        "a short advert for guitar lessons", "a message to a landlord about a noisy neighbour",
        "a welcome note for guests staying in my flat", "a request to borrow a tent",
        "a reminder to pay back money I lent", "a get-well-soon card for an uncle",
        "a short introduction for a book club meeting", "an invitation to a barbecue",
        "a polite message to end a phone contract")),
    ("Describe {}.", (
        "how to make a cup of hot chocolate", "what a typical day on a farm looks like",
        "how people celebrated the new year long ago", "a good morning routine",
        "how to set a table for a formal dinner", "the life cycle of a frog",
        "what happens at a job fair", "how to wash a car by hand",
        "what a zookeeper does all day", "the taste of a ripe mango",
        "how a bread oven in a village bakery works", "a walk along a canal",
        "how a school play is put together", "what a librarian does",
        "how to plant a tree", "the sounds of a city at night",
        "how a marathon is organised", "what a pilot checks before take-off",
        "how to pitch a tent", "how honey is collected")),
    ("Is it true that {}?", (
        "goldfish have a three-second memory", "bats are blind", "we only use ten percent "
        "of our brains", "cracking knuckles causes arthritis", "lightning never strikes "
        "the same place twice", "bulls hate the colour red", "carrots help you see in the dark",
        "cats always land on their feet", "chewing gum stays in the stomach for years",
        "hair grows back thicker after shaving", "camels store water in their humps",
        "ostriches bury their heads in the sand", "sugar makes children hyperactive",
        "the Great Wall can be seen from space", "you lose most body heat through your head",
        "dogs see only in black and white", "eating late at night makes you gain weight",
        "swimming after eating is dangerous", "a penny dropped from a tall building can hurt "
        "someone", "bananas grow on trees")),
    ("What should I know before {}?", (
        "adopting a rabbit", "starting a vegetable patch", "going on a long bike tour",
        "buying a sofa", "painting a room", "learning to drive", "going skiing for the first "
        "time", "hosting a sleepover", "joining a choir", "taking up running",
        "visiting a country where I do not speak the language", "getting a tattoo",
        "buying a telescope", "going on a cruise", "keeping bees", "starting a book club",
        "lending money to a friend", "signing up for a marathon", "volunteering at an "
        "animal shelter", "camping in the rain")),
)


@functools.lru_cache(maxsize=1)
def _everyday() -> tuple[str, ...]:
    return tuple(template.format(topic) for template, topics in _EVERYDAY for topic in topics)


def everyday_requests(split: Split, limit: int | None = None, seed: int = 0) -> list[str]:
    """Everyday chat requests: "calib" is half of _EVERYDAY by hash, "train" the other half
    and then _EVERYDAY_TRAIN, shuffled by seed; "eval" has none (evaluation reads
    `prompts.GENERAL_CHAT`)."""
    _check_split(split)
    if split == "eval":
        raise ValueError("everyday requests have no eval split: evaluation uses "
                         "ee_jax.evaluation.prompts.GENERAL_CHAT")
    items = [t for t in _everyday() if ("calib" if zlib.crc32(t.encode()) % 2 else "train")
             == split]
    if split == "train":
        items += [template.format(topic) for template, topics in _EVERYDAY_TRAIN
                  for topic in topics]
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order[:limit]]


def pack(docs: Iterable[Sequence[int]], seq_len: int, sep: int | None,
         max_sequences: int | None = None) -> np.ndarray:
    """Concatenate token lists (each followed by `sep` when given) and cut the stream into
    [N, seq_len] rows; the last partial row is dropped."""
    rows: list[np.ndarray] = []
    buf: list[int] = []
    for doc in docs:
        buf.extend(doc)
        if sep is not None:
            buf.append(sep)
        while len(buf) >= seq_len:
            rows.append(np.asarray(buf[:seq_len], np.int32))
            buf = buf[seq_len:]
            if max_sequences is not None and len(rows) >= max_sequences:
                return np.stack(rows)
    if not rows:
        return np.zeros((0, seq_len), np.int32)
    return np.stack(rows)
