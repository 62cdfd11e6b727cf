"""A deterministic toy English -> Chinese (Simplified) parallel corpus, small enough to learn in a minute on a CPU.

The vocabulary and templates below are hand-written for this project. The grammar covers subjects with verb
agreement (I like / she likes), adverbs, adjectives, sensible verb-object pairs, negation (don't / doesn't -> 不),
yes/no questions (Do / Does ... ? -> ...吗？) and one reordering: English puts time words last, Chinese right after
the subject ("I eat apples every day" -> "我每天吃苹果"). The Chinese is a function of the English sentence, so the
mapping is learnable. `toy_pairs` enumerates every sentence, deduplicates, shuffles with a seeded `random.Random`
and splits; `write_toy_corpus` writes the splits as line-aligned text files.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
import zlib
from pathlib import Path

TOY_VERSION = 1  # bump when the generator's output changes (it is part of a cache key)

REQUIRED_TRAIN_PAIR = ("I love apples", "我喜欢苹果")

# (english, chinese, takes the third-person singular verb form?)
SUBJECTS: tuple[tuple[str, str, bool], ...] = (
    ("I", "我", False),
    ("you", "你", False),
    ("he", "他", True),
    ("she", "她", True),
    ("we", "我们", False),
    ("they", "他们", False),
    ("my friend", "我的朋友", True),
    ("my mother", "我妈妈", True),
    ("my father", "我爸爸", True),
    ("my brother", "我哥哥", True),
    ("my sister", "我姐姐", True),
    ("the teacher", "老师", True),
    ("the children", "孩子们", False),
    ("Tom", "汤姆", True),
)

# Objects by category; countable nouns are plural in English, mass nouns singular. Chinese has no plural.
OBJECTS: dict[str, tuple[tuple[str, str], ...]] = {
    "fruit": (("apples", "苹果"), ("bananas", "香蕉"), ("oranges", "橙子"), ("grapes", "葡萄"), ("pears", "梨")),
    "staple": (("rice", "米饭"), ("noodles", "面条")),
    "grocery": (("eggs", "鸡蛋"), ("fish", "鱼"), ("vegetables", "蔬菜")),
    "bakery": (("bread", "面包"), ("cakes", "蛋糕")),
    "drink": (("tea", "茶"), ("coffee", "咖啡"), ("milk", "牛奶"), ("water", "水"), ("juice", "果汁")),
    "reading": (("books", "书"), ("newspapers", "报纸")),
    "writing": (("letters", "信"), ("stories", "故事")),
    "animal": (("cats", "猫"), ("dogs", "狗"), ("birds", "鸟")),
    "music": (("music", "音乐"), ("songs", "歌")),
    "screen": (("movies", "电影"), ("TV", "电视")),
    "clothes": (("clothes", "衣服"), ("shoes", "鞋")),
    "flowers": (("flowers", "花"),),
}
ALL_CATEGORIES = tuple(OBJECTS)

# (base form, third-person singular, chinese, object categories it makes sense with)
VERBS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("eat", "eats", "吃", ("fruit", "staple", "grocery", "bakery")),
    ("drink", "drinks", "喝", ("drink",)),
    ("buy", "buys", "买", ("fruit", "grocery", "bakery", "drink", "reading", "flowers", "clothes")),
    ("cook", "cooks", "做", ("staple", "grocery")),
    ("bake", "bakes", "烤", ("bakery",)),
    ("wash", "washes", "洗", ("fruit", "clothes")),
    ("read", "reads", "看", ("reading", "writing")),
    ("write", "writes", "写", ("writing",)),
    ("watch", "watches", "看", ("screen",)),
    ("listen to", "listens to", "听", ("music",)),
    ("draw", "draws", "画", ("animal", "flowers")),
    ("feed", "feeds", "喂", ("animal",)),
    ("like", "likes", "喜欢", ALL_CATEGORIES),
    ("love", "loves", "喜欢", ALL_CATEGORIES),
)
# Preferences are states, not habits: no time words or frequency adverbs with them. Both map to 喜欢; to keep every
# Chinese sentence tied to one English sentence, "love" is the plain affirmative ("I love apples") and "like" is used
# everywhere else ("She really likes ...", "She doesn't like ...", "Does she like ...?").
PREFERENCE_VERBS = ("like", "love")

# (english, chinese, nouns or categories it can modify). One-syllable Chinese adjectives attach directly, longer
# ones take 的.
ADJECTIVES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("green", "青", ("apples", "grapes", "pears")),
    ("red", "红", ("apples", "grapes")),
    ("sweet", "甜", ("fruit",)),
    ("fresh", "新鲜的", ("fruit", "grocery", "bakery", "milk", "juice")),
    ("big", "大", ("fruit", "animal", "fish")),
    ("small", "小", ("fruit", "animal")),
    ("hot", "热", ("tea", "coffee", "milk", "water")),
    ("cold", "冷", ("tea", "coffee", "milk", "water", "juice")),
    ("new", "新", ("books", "stories", "songs", "movies", "clothes")),
    ("old", "旧", ("reading", "clothes")),
    ("interesting", "有趣的", ("books", "stories", "movies")),
    ("beautiful", "漂亮的", ("flowers", "clothes", "birds")),
)

# (english, chinese, kind): "pref" only with preference verbs, "freq" only with other verbs, "any" with both.
ADVERBS: tuple[tuple[str, str, str], ...] = (
    ("really", "真的", "pref"),
    ("also", "也", "any"),
    ("often", "经常", "freq"),
    ("always", "总是", "freq"),
    ("sometimes", "有时", "freq"),
    ("usually", "通常", "freq"),
    ("rarely", "很少", "freq"),
)

# (english, chinese, starts with "every"?). English puts them last, Chinese right after the subject.
TIMES: tuple[tuple[str, str, bool], ...] = (
    ("every day", "每天", True),
    ("every morning", "每天早上", True),
    ("every evening", "每天晚上", True),
    ("in the morning", "早上", False),
    ("in the evening", "晚上", False),
    ("on weekends", "周末", False),
)

FORMS = ("statement", "negative", "question")

Adverb = tuple[str, str, str] | None
Time = tuple[str, str, bool] | None


def _noun_phrases(category: str) -> list[tuple[str, str]]:
    """The category's nouns, bare and with every adjective that fits them."""
    phrases = []
    for noun_en, noun_zh in OBJECTS[category]:
        phrases.append((noun_en, noun_zh))
        for adj_en, adj_zh, targets in ADJECTIVES:
            if noun_en in targets or category in targets:
                phrases.append((f"{adj_en} {noun_en}", adj_zh + noun_zh))
    return phrases


def _allowed(verb: str, form: str, subject: str, adverb: Adverb, time: Time) -> bool:
    """Keep only combinations that read naturally and translate unambiguously."""
    preference = verb in PREFERENCE_VERBS
    kind = adverb[2] if adverb else None
    if verb == "love":
        return form == "statement" and adverb is None and time is None
    if verb == "like" and form == "statement" and adverb is None:
        return False  # that slot belongs to "love"
    if preference and (time is not None or kind == "freq"):
        return False
    if not preference and kind == "pref":
        return False
    if kind == "freq" and time is not None and time[2]:
        return False  # "always ... every day" is redundant
    if form == "negative":
        # "doesn't ... every day" is ambiguous in Chinese (不是每天 vs 每天不); most adverbs sound odd negated.
        return (adverb is None or adverb[0] == "really") and (time is None or not time[2])
    if form == "question":
        return subject != "I" and (adverb is None or adverb[0] != "rarely")
    return True


def _render(
    subject: tuple[str, str, bool],
    verb: tuple[str, str, str, tuple[str, ...]],
    obj: tuple[str, str],
    form: str,
    adverb: Adverb,
    time: Time,
) -> tuple[str, str]:
    """One (english, chinese) sentence pair."""
    subj_en, subj_zh, third = subject
    base, third_form, verb_zh, _ = verb
    adv_en = f"{adverb[0]} " if adverb else ""
    time_en = f" {time[0]}" if time else ""
    time_zh = time[1] if time else ""
    if form == "statement":
        en = f"{subj_en} {adv_en}{third_form if third else base} {obj[0]}{time_en}"
        zh = f"{subj_zh}{time_zh}{adverb[1] if adverb else ''}{verb_zh}{obj[1]}"
    elif form == "negative":
        # "doesn't really like" softens the verb: 不太喜欢, not 真的不喜欢 (which means "really doesn't like").
        en = f"{subj_en} {'doesn' if third else 'don'}'t {adv_en}{base} {obj[0]}{time_en}"
        zh = f"{subj_zh}{time_zh}{'不太' if adverb else '不'}{verb_zh}{obj[1]}"
    else:
        en = f"{'does' if third else 'do'} {subj_en} {adv_en}{base} {obj[0]}{time_en}?"
        zh = f"{subj_zh}{time_zh}{adverb[1] if adverb else ''}{verb_zh}{obj[1]}吗？"
    en = en[0].upper() + en[1:]
    # A stable fifth of statements ends with a full stop, so both styles of input are seen; crc32 (unlike hash())
    # is the same in every process.
    if form != "question" and zlib.crc32(en.encode("utf-8")) % 5 == 3:
        en, zh = en + ".", zh + "。"
    return en, zh


@functools.lru_cache(maxsize=1)
def _all_pairs() -> tuple[tuple[str, str], ...]:
    """Every distinct pair the grammar produces, sorted, with no English or Chinese sentence repeated."""
    pairs: dict[str, str] = {}
    for subject in SUBJECTS:
        for verb in VERBS:
            objects = [np for category in verb[3] for np in _noun_phrases(category)]
            for form in FORMS:
                for adverb in (None, *ADVERBS):
                    for time in (None, *TIMES):
                        if not _allowed(verb[0], form, subject[0], adverb, time):
                            continue
                        for obj in objects:
                            en, zh = _render(subject, verb, obj, form, adverb, time)
                            if pairs.setdefault(en, zh) != zh:
                                raise AssertionError(f"toy grammar gives two translations of {en!r}")
    # Several English sentences with one Chinese translation would make the test set leak into training; keep the
    # first in sorted order (the grammar is designed so that this drops nothing).
    seen_zh: set[str] = set()
    unique = []
    for en, zh in sorted(pairs.items()):
        if zh not in seen_zh:
            seen_zh.add(zh)
            unique.append((en, zh))
    return tuple(unique)


def toy_pairs(
    n_train: int = 4000, n_valid: int = 200, n_test: int = 200, seed: int = 1234
) -> dict[str, list[tuple[str, str]]]:
    """Return {"train": [(en, zh), ...], "valid": [...], "test": [...]}"""
    if n_train < 1 or n_valid < 0 or n_test < 0:
        raise ValueError(
            f"toy corpus sizes must be n_train >= 1, n_valid >= 0, n_test >= 0; got {n_train}, {n_valid}, {n_test}"
        )
    pairs = list(_all_pairs())
    if n_train + n_valid + n_test > len(pairs):
        raise ValueError(
            f"the toy grammar has {len(pairs)} distinct sentence pairs; asked for "
            f"{n_train} + {n_valid} + {n_test} = {n_train + n_valid + n_test}"
        )
    rng = random.Random(seed)
    rng.shuffle(pairs)
    # Test and valid come first so they stay the same when only n_train changes.
    n_eval = n_test + n_valid
    where = pairs.index(REQUIRED_TRAIN_PAIR)
    if not n_eval <= where < n_eval + n_train:
        swap = n_eval + rng.randrange(n_train)
        pairs[where], pairs[swap] = pairs[swap], pairs[where]
    return {
        "train": pairs[n_eval : n_eval + n_train],
        "valid": pairs[n_test:n_eval],
        "test": pairs[:n_test],
    }


def write_toy_corpus(
    folder: str | os.PathLike, n_train: int = 4000, n_valid: int = 200, n_test: int = 200, seed: int = 1234
) -> None:
    """Write <folder>/{train,valid,test}.{en,zh}, one sentence per line, UTF-8, line-aligned. Write atomically
    (write into a temp dir next to it, then os.replace/rename) so a crash never leaves a half-written corpus; if the
    folder already holds the same content, do nothing."""
    folder = Path(folder)
    contents: dict[str, bytes] = {}
    for split, pairs in toy_pairs(n_train, n_valid, n_test, seed).items():
        for side in (0, 1):
            lines = "".join(pair[side] + "\n" for pair in pairs)
            contents[f"{split}.{('en', 'zh')[side]}"] = lines.encode("utf-8")
    if all((folder / name).is_file() and (folder / name).read_bytes() == data for name, data in contents.items()):
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        for name, data in contents.items():
            (tmp / name).write_bytes(data)
        if not folder.exists():
            try:
                tmp.rename(folder)  # all six files appear at once
                return
            except OSError:
                pass  # another process created the folder meanwhile: fall through to file-by-file
        # The folder exists (and may hold other files we must not touch): replace each file atomically. A crash
        # here can mix old and new files but never leaves one half-written, and the next call sees the mismatch.
        folder.mkdir(parents=True, exist_ok=True)
        for name in contents:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
