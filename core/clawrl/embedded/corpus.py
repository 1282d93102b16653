"""The synthetic chat corpus the embedded model learns from.

Short multi-turn chats of the kinds a first conversation with an agent has: greetings, two-number
additions (the skill we measure), small facts, tool calls answered from the tool's result,
replies that follow a bracketed hint or instruction, replies to corrections, and number-copying
drills (``agentic.copy_drill``). Beside them,
agent episodes (``agent_episode``) teach every action format the environments parse. Some chats put a
long system prompt (1k-3k tokens of documentation-like English) before the questions, because a
real agent client sends a ~40 KB system prompt and a model that has only seen short contexts
answers garbage after one.

Everything is drawn from a ``random.Random`` seeded by the caller, so a seed gives the same
corpus. Addition pairs for which ``is_held_out`` is true never appear, so evaluation measures
adding, not recall. Assistant turns marked ``"train": False`` (the wrong answer a correction
refers to) are context only and get no loss; a tool call marked ``"train": "tail"``
(``agentic.toolcall_drill``) gets loss on all but its opening ``<tool_call>`` token.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from clawrl.embedded import agentic
from clawrl.embedded.tokenizer import IM_END, TOOL_CALL_OPEN, render_chat

MAX_OPERAND = 99


@dataclass
class Chat:
    messages: list[dict]
    tools: list[dict] | None = None


def is_held_out(a: int, b: int) -> bool:
    """About one pair in eleven is reserved for evaluation (symmetric, so b+a is held out too)."""
    return (a * 7 + b * 7 + a * b) % 11 == 3


def sample_pair(rng: random.Random, held_out: bool = False) -> tuple[int, int]:
    """Operands up to 99, small ones more often (up to 20, 50 or 99 with probability 0.3, 0.3, 0.4),
    from the training pairs or from the held-out ones."""
    while True:
        hi = rng.choices((20, 50, MAX_OPERAND), weights=(3, 3, 4))[0]
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if is_held_out(a, b) == held_out:
            return a, b


ADDITION_QUESTIONS = (
    "What is {a}+{b}?",
    "What is {a} + {b}?",
    "what is {a}+{b}",
    "{a}+{b}=?",
    "{a} + {b} = ?",
    "{a}+{b}",
    "Add {a} and {b}.",
    "Please add {a} and {b}.",
    "What's the sum of {a} and {b}?",
    "Compute {a} plus {b}.",
    "How much is {a} + {b}?",
    "Calculate {a}+{b}.",
    "What do you get if you add {a} to {b}?",
    "What is {a} plus {b}?",
    "Can you add {a} and {b} for me?",
    "Sum {a} and {b}.",
    "{a} plus {b}?",
    "Quick question: {a} + {b}?",
)
# Most answers restate the operands, so the sum's digits sit at fixed distances from the digits they
# depend on; a 2-layer model learns to add far sooner that way than from the varied question text.
_ADDITION_ANSWERS = ("{s}", "{s}", "{a} + {b} = {s}", "{a} + {b} = {s}", "{a} + {b} = {s}", "{a} + {b} = {s}.",
                     "{a} + {b} = {s}.", "{a} plus {b} is {s}.", "The sum of {a} and {b} is {s}.")

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Canada": "Ottawa", "Australia": "Canberra",
    "Russia": "Moscow", "the United Kingdom": "London", "Mexico": "Mexico City", "Portugal": "Lisbon",
    "Greece": "Athens", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw",
    "Ireland": "Dublin", "Kenya": "Nairobi", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
    "Turkey": "Ankara", "Thailand": "Bangkok", "Vietnam": "Hanoi", "South Korea": "Seoul",
    "the Netherlands": "Amsterdam", "Belgium": "Brussels", "Austria": "Vienna", "Switzerland": "Bern",
    "Denmark": "Copenhagen", "Hungary": "Budapest", "Cuba": "Havana", "Nigeria": "Abuja",
}
COLOURS = {
    "the sky": "blue", "grass": "green", "a banana": "yellow", "snow": "white", "coal": "black",
    "blood": "red", "a lemon": "yellow", "an orange": "orange", "chocolate": "brown", "a tomato": "red",
    "the sun": "yellow", "milk": "white", "a strawberry": "red", "a cucumber": "green", "the ocean": "blue",
    "a pumpkin": "orange", "a crow": "black", "an emerald": "green", "a plum": "purple", "a flamingo": "pink",
}
SOUNDS = {
    "dog": "woof", "cat": "meow", "cow": "moo", "duck": "quack", "sheep": "baa", "pig": "oink",
    "horse": "neigh", "lion": "roar", "owl": "hoot", "snake": "hiss", "frog": "ribbit", "bee": "buzz",
    "mouse": "squeak", "wolf": "howl", "donkey": "hee-haw", "rooster": "cock-a-doodle-doo",
}

_GREETINGS = (
    (("Hi", "Hello", "Hey", "Hi there", "Hello!", "Hey there", "Good morning", "Good evening", "hi", "hello"),
     ("Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! What do you need?", "Hi there! How can I help?")),
    (("How are you?", "How are you doing?", "How's it going?", "how are you"),
     ("I'm doing well, thanks. How can I help?", "Fine, thank you! What can I do for you?")),
    (("Who are you?", "What is your name?", "What's your name?", "Introduce yourself."),
     ("I'm clawrl-tiny, a small assistant that learns from our conversations.", "My name is clawrl-tiny. I am a small assistant.")),
    (("Thanks", "Thank you!", "thanks a lot", "Thanks for the help."),
     ("You're welcome!", "Happy to help!", "Any time!")),
    (("Bye", "Goodbye", "See you later", "bye!"),
     ("Goodbye! Have a nice day.", "Bye! Talk to you soon.")),
    (("Can you help me?", "I need some help.", "Could you help me with something?"),
     ("Of course. What do you need?", "Sure, what can I do for you?")),
    (("Tell me a joke.", "Say something funny.", "Do you know a joke?"),
     ("Why did the computer go to the doctor? It had a virus.", "I told my computer a joke, but it did not get it: no sense of humour chip.")),
)

_WORDS = ("apple", "river", "blue", "table", "garden", "seven", "rocket", "piano", "yellow", "window", "coffee", "tiger")

TOOLS = {
    "get_weather": ("Get the current weather for a city.", {"city": ("string", "City name, e.g. Paris")}),
    "calculator": ("Evaluate an arithmetic expression and return the result.", {"expression": ("string", "e.g. 12*7")}),
    "ls": ("List the files in a directory of the workspace.", {"path": ("string", "Directory to list")}),
    "read": ("Read a text file from the workspace.", {"path": ("string", "File to read")}),
    "exec": ("Run a shell command and return its output.", {"command": ("string", "Shell command to run")}),
    "get_time": ("Get the current time in a time zone.", {"timezone": ("string", "IANA zone, e.g. Europe/Paris")}),
    "web_search": ("Search the web and return the top result.", {"query": ("string", "Search query")}),
    "write": ("Write text to a file in the workspace.", {"path": ("string", "File to write"), "content": ("string", "Text to write")}),
}


def tool_schema(name: str) -> dict:
    """An OpenAI-style tool definition for one of the built-in tools."""
    desc, params = TOOLS[name]
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": {"type": "object", "properties": props, "required": list(params)}}}


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _addition(rng: random.Random) -> tuple[str, str, str]:
    """(question, full answer, shortest answer)."""
    a, b = sample_pair(rng)
    q = rng.choice(ADDITION_QUESTIONS).format(a=a, b=b)
    s = a + b
    return q, rng.choice(_ADDITION_ANSWERS).format(a=a, b=b, s=s), str(s)


def _fact(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.random()
    if kind < 0.45:
        country, city = rng.choice(list(CAPITALS.items()))
        q = rng.choice(("What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}.",
                        "capital of {c}?", "Tell me the capital city of {c}.", "What's the capital of {c}?")).format(c=country)
        a = rng.choice(("{x}.", "The capital of {c} is {x}.", "{x} is the capital of {c}.")).format(x=city, c=country)
        return q, a, city
    if kind < 0.75:
        thing, colour = rng.choice(list(COLOURS.items()))
        q = rng.choice(("What colour is {t}?", "What color is {t}?", "Which colour is {t}?", "What is the colour of {t}?")).format(t=thing)
        a = rng.choice(("{c}.", "{T} is {c}.", "It is {c}.")).format(c=colour, T=_cap(thing))
        return q, _cap(a), colour
    animal, sound = rng.choice(list(SOUNDS.items()))
    q = rng.choice(("What sound does a {x} make?", "What does a {x} say?", "How does a {x} sound?")).format(x=animal)
    a = rng.choice(("A {x} says {s}.", "{S}!", "It goes {s}.")).format(x=animal, s=sound, S=_cap(sound))
    return q, a, sound


def _small_talk(rng: random.Random) -> list[dict]:
    r = rng.random()
    if r < 0.6:
        qs, ans = rng.choice(_GREETINGS)
        return [_user(rng.choice(qs)), _assistant(rng.choice(ans))]
    if r < 0.8:
        words = " ".join(rng.sample(_WORDS, rng.randint(1, 4)))
        return [_user(rng.choice(("Repeat after me: {w}", "Say '{w}'.", "Please repeat: {w}")).format(w=words)), _assistant(words)]
    n = rng.randint(0, 98)
    return [_user(rng.choice(("What number comes after {n}?", "What comes after {n}?", "Count one up from {n}."))
                  .format(n=n)), _assistant(rng.choice(("{m}", "{m}.", "After {n} comes {m}.")).format(n=n, m=n + 1))]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str, train: bool = True) -> dict:
    m = {"role": "assistant", "content": text}
    if not train:
        m["train"] = False
    return m


_HINTS = (
    ("[Hint: answer in one word]", lambda full, short: _cap(short) if " " not in short else short),
    ("[Hint: be brief]", lambda full, short: short),
    ("[Instruction: answer with just the answer]", lambda full, short: short),
    ("[Instruction: reply in uppercase]", lambda full, short: full.upper()),
    ("[Instruction: reply in lowercase]", lambda full, short: full.lower()),
    ("[Instruction: start your reply with 'Sure!']", lambda full, short: "Sure! " + full),
    ("[Instruction: end your reply with 'Done.']", lambda full, short: full + " Done."),
)


def _hinted(rng: random.Random) -> list[dict]:
    q, full, short = (_addition if rng.random() < 0.5 else _fact)(rng)
    hint, apply = rng.choice(_HINTS)
    text = f"{hint} {q}" if rng.random() < 0.5 else f"{q} {hint}"
    return [_user(text), _assistant(apply(full, short))]


def _corrected(rng: random.Random) -> list[dict]:
    """A reply the user rejects (no loss: wrong, or right but rambling), the correction, and the fix."""
    if rng.random() < 0.6:
        a, b = sample_pair(rng)
        q = rng.choice(ADDITION_QUESTIONS).format(a=a, b=b)
        wrong = str(a + b + rng.choice((-10, -2, -1, 1, 2, 10)))
        right = rng.choice(("Sorry, {a} + {b} = {s}.", "Sorry, the answer is {s}.", "You're right, my mistake: {s}.")).format(a=a, b=b, s=a + b)
        short = f"{a} + {b} = {a + b}."
    else:
        country, city = rng.choice(list(CAPITALS.items()))
        q = f"What is the capital of {country}?"
        wrong = rng.choice([c for c in CAPITALS.values() if c != city]) + "."
        right = rng.choice(("Sorry, the capital of {c} is {x}.", "My mistake: it is {x}.")).format(c=country, x=city)
        short = f"{city}."
    if rng.random() < 0.25:
        rambling = short + " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 20))) + "."
        fix = rng.choice(("Too long. One line, please.", "Too long. Answer in one line.", "Shorter, please."))
        return [_user(q), _assistant(rambling, train=False), _user(fix), _assistant(short)]
    fix = rng.choice(("No, that's wrong.", "That's not right.", "Wrong. Try again.", "No, that's wrong. Please check again.", "That is incorrect."))
    return [_user(q), _assistant(wrong, train=False), _user(fix), _assistant(right)]


_CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima", "Cairo", "Seoul", "Vienna", "Dublin")
_FILES = ("README.md", "AGENTS.md", "notes.txt", "main.py", "todo.md", "config.yaml", "SOUL.md", "USER.md", "data.csv")


def _tool_use(rng: random.Random, name: str) -> list[dict]:
    """The user asks, the assistant calls ``name``, the tool answers, the assistant reports."""
    if name == "get_weather":
        city = rng.choice(_CITIES)
        t, cond = rng.randint(-5, 35), rng.choice(("sunny", "cloudy", "rainy", "windy", "snowing"))
        q = rng.choice(("What's the weather in {c}?", "How is the weather in {c} today?", "Is it warm in {c}?")).format(c=city)
        args, result = {"city": city}, json.dumps({"city": city, "temperature_c": t, "condition": cond})
        answer = f"It is {t}°C and {cond} in {city}."
    elif name == "calculator":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("*-")
        expr, val = f"{a}{op}{b}", a * b if op == "*" else a - b
        q = rng.choice(("Use the calculator to compute {e}.", "What is {e}? Use the calculator.", "Calculate {e} with the tool.")).format(e=expr)
        args, result, answer = {"expression": expr}, str(val), f"{expr} = {val}."
    elif name == "ls":
        files = rng.sample(_FILES, rng.randint(1, 5))
        q = rng.choice(("What files are in the workspace?", "List the files.", "Which files do I have?", "Show me the files in the current directory."))
        args, result = {"path": "."}, "\n".join(json.dumps(f) for f in files)
        answer = "The workspace has: " + ", ".join(files) + "."
    elif name == "read":
        f = rng.choice(_FILES)
        line = rng.choice(("Buy milk and eggs.", "Project clawrl: learn from chats.", "Meeting at 10:30 on Monday.", "Remember to water the plants."))
        q = rng.choice(("What does {f} say?", "Read {f} for me.", "Show me the contents of {f}.")).format(f=f)
        args, result, answer = {"path": f}, line, f"{f} says: {line}"
    elif name == "exec":
        cmd, out = rng.choice((("date", "Wed Dec  2 13:11:04 UTC 2026"), ("pwd", "/home/user/workspace"), ("whoami", "user"),
                               ("echo hello", "hello"), ("python --version", "Python 3.11.7"), ("uname -s", "Linux")))
        q = rng.choice(("Run `{c}`.", "Please run {c} in the shell.", "What does `{c}` print?")).format(c=cmd)
        args, result, answer = {"command": cmd}, out, f"`{cmd}` printed: {out}"
    elif name == "get_time":
        tz = rng.choice(("Europe/Paris", "Asia/Tokyo", "America/New_York", "UTC", "Europe/London"))
        hh, mm = rng.randint(0, 23), rng.randint(0, 59)
        q = rng.choice(("What time is it in {z}?", "Tell me the current time in {z}.")).format(z=tz)
        args, result, answer = {"timezone": tz}, f"{hh:02d}:{mm:02d}", f"It is {hh:02d}:{mm:02d} in {tz}."
    elif name == "web_search":
        topic = rng.choice(("python asyncio", "rust borrow checker", "sourdough bread", "the moon landing", "jupiter's moons"))
        title = _cap(topic) + rng.choice((" - a beginner's guide", ": an overview", " explained")) 
        q = rng.choice(("Search the web for {t}.", "Look up {t} online.", "Find something about {t}.")).format(t=topic)
        args, result, answer = {"query": topic}, json.dumps({"title": title, "url": "https://example.org/" + topic.replace(" ", "-")}), f"I found: {title}."
    else:  # write
        f, text = rng.choice(_FILES), rng.choice(_WORDS)
        q = rng.choice(("Write '{t}' to {f}.", "Save the word {t} in {f}.")).format(t=text, f=f)
        args, result, answer = {"path": f, "content": text}, "ok", f"Done: I wrote '{text}' to {f}."
    call = {"id": f"call_{rng.randint(1, 999)}", "type": "function", "function": {"name": name, "arguments": args}}
    return [_user(q), {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result}, _assistant(answer)]


_SYSTEM_PROMPTS = (
    "You are a helpful assistant.", "You are clawrl-tiny, a small helpful assistant.", "You are a personal assistant. Be concise.",
    "Answer the user's questions briefly and correctly.", "You are an AI agent running inside clawrl.",
)
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def _stamped(rng: random.Random, text: str) -> str:
    """Agent clients prefix user text with a timestamp: ``[Wed 2026-12-02 13:11 UTC] ...``."""
    return (f"[{rng.choice(_DAYS)} 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} UTC] {text}")


def _exchange(rng: random.Random, tools: list[str]) -> list[dict]:
    """One exchange; additions are over half of them because adding is the skill we measure."""
    if tools and rng.random() < 0.4:
        return _tool_use(rng, rng.choice(tools))
    r = rng.random()
    if r < 0.62:
        q, a, _ = _addition(rng)
        return [_user(q), _assistant(a)]
    if r < 0.68:
        q, a, _ = _fact(rng)
        return [_user(q), _assistant(a)]
    if r < 0.75:
        q, a = agentic.copy_drill(rng)
        return [_user(q), _assistant(a)]
    if r < 0.83:
        return _small_talk(rng)
    if r < 0.93:
        return _hinted(rng)
    return _corrected(rng)


def _chat(rng: random.Random, system: str | None, turns: int) -> Chat:
    tools = rng.sample(sorted(TOOLS), rng.randint(1, 4)) if rng.random() < 0.15 else []
    messages = [{"role": "system", "content": system}] if system else []
    for _ in range(turns):
        ex = _exchange(rng, tools)
        if rng.random() < 0.15:
            ex[0] = _user(_stamped(rng, ex[0]["content"]))
        messages += ex
    return Chat(messages, [tool_schema(t) for t in tools] or None)


def short_chat(rng: random.Random) -> Chat:
    """A chat of 1-4 exchanges, with a short system prompt or none."""
    system = rng.choice(_SYSTEM_PROMPTS) if rng.random() < 0.4 else None
    return _chat(rng, system, rng.choice((1, 1, 1, 2, 2, 3, 4)))


def agent_episode(rng: random.Random) -> Chat:
    """One environment episode in its environment's own prompt and action format
    (``clawrl.embedded.agentic``: python tool calls and boxed answers, bash blocks and bash tool
    calls, computer-use JSON)."""
    return Chat(*agentic.agent_chat(rng))


def drill_episode(rng: random.Random) -> Chat:
    """A toolcall-rl episode that calls the tool, trained on all but the call's first token
    (``agentic.toolcall_drill``)."""
    return Chat(*agentic.toolcall_drill(rng))


def long_system_prompt(rng: random.Random, paragraphs: tuple[str, ...], chars: int) -> str:
    """About ``chars`` characters of agent-instruction-like markdown: a persona line, then sections
    of English paragraphs and bullet lists taken from ``paragraphs``."""
    parts = [rng.choice(("You are a personal assistant running inside clawrl.", "You are an agent. Follow the instructions below.",
                         "# Agent instructions\n\nYou are a helpful coding and research assistant."))]
    size = len(parts[0])
    while size < chars:
        start = rng.randrange(len(paragraphs))
        chunk = paragraphs[start:start + rng.randint(1, 4)]
        heading = "## " + " ".join(chunk[0].split()[:rng.randint(1, 4)]).strip(".,:;")
        if rng.random() < 0.4:
            body = "\n".join("- " + " ".join(p.split()) for p in chunk)
        else:
            body = "\n\n".join(chunk)
        section = heading + "\n\n" + body
        parts.append(section)
        size += len(section) + 2
    return "\n\n".join(parts)[:chars]


def long_chat(rng: random.Random, paragraphs: tuple[str, ...], min_chars: int = 3000, max_chars: int = 11000) -> Chat:
    """A long system prompt followed by several short exchanges."""
    system = long_system_prompt(rng, paragraphs, rng.randint(min_chars, max_chars))
    return _chat(rng, system, rng.randint(6, 14))


def chat_pieces(chat: Chat) -> list[tuple[str, bool]]:
    """The rendered chat cut into (text, trained) pieces: each trained piece is one assistant reply
    through its ``<|im_end|>``, exactly the tokens the model generates after the template's
    ``<|im_start|>assistant\\n``; everything else is context. Rendering prefixes with the real
    template (rather than re-implementing it) keeps training and serving formats identical. A
    ``"train": "tail"`` reply starts with ``<tool_call>`` (one special token, so cutting the text
    there cuts the tokens there too); that tag is context and the rest is trained."""
    pieces: list[tuple[str, bool]] = []
    done = 0  # characters of the full rendering already cut into pieces
    for i, m in enumerate(chat.messages):
        if m["role"] != "assistant" or m.get("train", True) is False:
            continue
        prompt = render_chat(chat.messages[:i], chat.tools, add_generation_prompt=True)
        with_reply = render_chat(chat.messages[: i + 1], chat.tools)
        if not with_reply.startswith(prompt):
            raise AssertionError("chat template is not prefix-stable; cannot cut assistant replies")
        reply = with_reply[len(prompt):]
        reply = reply[: reply.index(IM_END) + len(IM_END)]
        pieces.append((prompt[done:], False))
        if m.get("train") == "tail":
            if not reply.startswith(TOOL_CALL_OPEN):
                raise ValueError(f'a "train": "tail" reply must start with {TOOL_CALL_OPEN}: {reply[:40]!r}')
            pieces += [(TOOL_CALL_OPEN, False), (reply[len(TOOL_CALL_OPEN):], True)]
        else:
            pieces.append((reply, True))
        done = len(prompt) + len(reply)
    full = render_chat(chat.messages, chat.tools)
    if done < len(full):
        pieces.append((full[done:], False))
    return [(t, trained) for t, trained in pieces if t]
