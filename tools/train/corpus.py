"""Training corpus and tokenizer for the shipped small model (`assets/cachalot-tiny-r1`).

Corpus: the English fortune cookies of Debian's `fortunes` + `fortunes-min` packages
(`apt-get install -y fortunes`, files under /usr/share/games/fortunes). Licence: Debian's
/usr/share/doc/fortunes/copyright puts the package under the BSD licence of the Regents of the
University of California (fortune-mod 1.99.1, Debian main); see assets/cachalot-tiny-r1/README.md.

Every cookie is cleaned (terminal overstrike sequences `X\\b` removed, trailing blanks stripped),
exact duplicates are dropped, the cookies are shuffled with a fixed seed and 5 % are held out.
Both parts are written in the fortune file format itself: each cookie followed by a line holding
a single `%`.

Tokenizer: byte-level BPE trained with the `tokenizers` library on the training part only, with
DeepSeek-V3/R1's own pre-tokenizer (the three regex splits + ByteLevel of R1's tokenizer.json), the
R1 special tokens and R1's chat template.
"""

import hashlib
import json
import random
import re
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
# ascii-art is pictures, translate-me is Latin/French/German.
EXCLUDED_FILES = {"ascii-art", "translate-me"}
CORPUS_SEED = 1234
EVAL_FRACTION = 0.05
# eval.txt ships with the model: cap it (the first cookies of the held-out part, in held-out order).
EVAL_MAX_BYTES = 200_000

# ------------------------------------------------------------------------------------------------
# DeepSeek-R1 special tokens (spec deepseek-v3-r1-kimi-k2.md section 7.1)
# ------------------------------------------------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
TOOL_TOKENS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
# R1 layout: BOS 0, EOS 1, pad 2 first; the chat / think / tool tokens after the BPE vocabulary.
LEADING_SPECIALS = [BOS, EOS, PAD]
TRAILING_TOKENS = [USER, ASSISTANT, THINK, END_THINK] + TOOL_TOKENS
# As in R1, <think> / </think> are added tokens that are not "special" (they decode as text).
NON_SPECIAL = {THINK, END_THINK}
VOCAB_SIZE = 4096

# DeepSeek-V3/R1 tokenizer.json pre-tokenizer: three isolated regex splits (digit runs of 1-3, CJK /
# kana runs, a GPT-style word / punctuation split), then ByteLevel without its own regex.
R1_SPLIT_REGEXES = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]

# DeepSeek-R1's chat template (tokenizer_config.json of deepseek-ai/DeepSeek-R1, MIT licence):
# BOS, all system prompts joined by "\n\n", <｜User｜>content, <｜Assistant｜> + the content after the
# last </think> + EOS, the tool-call / tool-output blocks, and the generation prompt
# <｜Assistant｜><think>\n. Jinja string literals carry `\n` escapes, as in the original file.
R1_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- else %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"
    "{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)

_OVERSTRIKE = re.compile(r".\x08")


def clean_cookie(text: str) -> str:
    """Remove terminal overstrike (`_\\bx` underline, `x\\bx` bold) and trailing blanks per line."""
    prev = None
    while prev != text:
        prev, text = text, _OVERSTRIKE.sub("", text)
    text = text.replace("\x08", "")
    lines = [ln.rstrip() for ln in text.split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def read_cookies(fortune_dir: Path = FORTUNE_DIR):
    """All cookies of the English files, in file-name order, cleaned and de-duplicated.

    Returns (cookies, files) where files lists (name, sha256 of the raw file, count)."""
    if not fortune_dir.is_dir():
        raise SystemExit(f"{fortune_dir}: not found; install the corpus with `apt-get install -y fortunes`")
    cookies, seen, files = [], set(), []
    for f in sorted(fortune_dir.iterdir()):
        if f.suffix in (".dat", ".u8") or f.is_symlink() or f.name in EXCLUDED_FILES or not f.is_file():
            continue
        raw = f.read_bytes()
        text = raw.decode("utf-8")
        n = 0
        for part in re.split(r"^%\n", text, flags=re.M):
            c = clean_cookie(part)
            if not c.strip() or c in seen:
                continue
            seen.add(c)
            cookies.append(c)
            n += 1
        files.append((f.name, hashlib.sha256(raw).hexdigest(), n))
    return cookies, files


def split_corpus(cookies, seed=CORPUS_SEED, eval_fraction=EVAL_FRACTION):
    order = list(range(len(cookies)))
    random.Random(seed).shuffle(order)
    n_eval = round(len(cookies) * eval_fraction)
    held = [cookies[i] for i in order[:n_eval]]
    train = [cookies[i] for i in order[n_eval:]]
    return train, held


def as_fortune_file(cookies) -> str:
    """The fortune file format: every cookie followed by a line with a single '%'."""
    return "".join(c + "\n%\n" for c in cookies)


def eval_subset(held, max_bytes=EVAL_MAX_BYTES):
    out, size = [], 0
    for c in held:
        b = len((c + "\n%\n").encode("utf-8"))
        if size + b > max_bytes:
            break
        out.append(c)
        size += b
    return out


def build_corpus():
    cookies, files = read_cookies()
    train, held = split_corpus(cookies)
    shipped = eval_subset(held)
    meta = {
        "source": str(FORTUNE_DIR),
        "files": [{"name": n, "sha256": h, "cookies": k} for n, h, k in files],
        "excluded_files": sorted(EXCLUDED_FILES),
        "cookies": len(cookies),
        "train_cookies": len(train),
        "held_out_cookies": len(held),
        "eval_txt_cookies": len(shipped),
        "split_seed": CORPUS_SEED,
    }
    return as_fortune_file(train), as_fortune_file(shipped), meta


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def train_tokenizer(train_text: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in R1_SPLIT_REGEXES]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # add_special_tokens=True prepends BOS, as R1's tokenizer does (add_bos_token: true).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]),
        ]
    )
    n_bpe = VOCAB_SIZE - len(TRAILING_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in LEADING_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One training sequence per cookie (with its '%' line), so merges never span two cookies.
    tok.train_from_iterator(train_text.split("\n%\n"), trainer=trainer)
    assert tok.get_vocab_size() == n_bpe, tok.get_vocab_size()
    tok.add_tokens([AddedToken(t, special=t not in NON_SPECIAL, normalized=False) for t in TRAILING_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    for i, t in enumerate(LEADING_SPECIALS):
        assert tok.token_to_id(t) == i, t
    for i, t in enumerate(TRAILING_TOKENS):
        assert tok.token_to_id(t) == n_bpe + i, t
    return tok


def tokenizer_config(model_max_length):
    """tokenizer_config.json in R1's shape (R1: add_bos_token true, LlamaTokenizerFast; we name the
    generic PreTrainedTokenizerFast, which loads tokenizer.json as is)."""

    def added(content, special):
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": special}

    n_bpe = VOCAB_SIZE - len(TRAILING_TOKENS)
    decoder = {str(i): added(t, True) for i, t in enumerate(LEADING_SPECIALS)}
    for i, t in enumerate(TRAILING_TOKENS):
        decoder[str(n_bpe + i)] = added(t, t not in NON_SPECIAL)
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": BOS,
        "chat_template": R1_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "legacy": True,
        "model_max_length": model_max_length,
        "pad_token": PAD,
        "sp_model_kwargs": {},
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer(tok, out_dir: Path, model_max_length):
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
