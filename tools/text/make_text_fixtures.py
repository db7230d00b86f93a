"""Text fixtures for cachalot's tokenizers and chat templates (`fixtures/text/`).

Builds, with no downloads:
  r1_style/tokenizer.json          a small byte-level BPE trained with Hugging Face `tokenizers` on the
                                   corpus below, with DeepSeek-V3's pre-tokenizer shape (digits in runs of
                                   1-3, CJK/kana runs, a GPT-style split, then ByteLevel) and R1's specials
  r1_style/tokenizer_config.json   R1's chat template (current revision, text as published on the hub)
  kimi_style/tiktoken.model        the same BPE as tiktoken ranks (base64 token + rank per line)
  kimi_style/tokenizer_config.json Kimi-K2's special tokens (added_tokens_decoder, ids num_base + k as in
                                   K2) and a Kimi-K2-Instruct-style chat template (spec §7.2)
  tokenizer_cases.json             >= 200 strings with the ids Hugging Face `tokenizers` gives for
                                   r1_style and `tiktoken` (Kimi's pat_str, allowed_special="all")
                                   gives for kimi_style, and their decodes
  chat_cases.json                  conversations and `transformers`' apply_chat_template renderings

Run from the repository root:  /work/venv/ref/bin/python tools/text/make_text_fixtures.py
(transformers 5.24.0, tokenizers, tiktoken 0.14). Deterministic: a rerun gives identical files.
"""

import base64
import json
import pathlib
import sys

import tiktoken
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers import AddedToken

OUT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "fixtures/text")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
VOCAB = 1200

CORPUS = """\
The sperm whale dives deep into the cold dark water and hunts squid far below the surface.
A language model reads a sequence of tokens and predicts the next one, one token at a time.
Mixture of experts layers send each token to a few experts chosen by a router.
Latent attention keeps a small compressed cache for every past token.
It's a long way down; they're sure we'll find it, and I've seen what you'd do.
抹香鲸是世界上最大的齿鲸，它能潜到很深的海里捕食鱿鱼。语言模型根据前面的词预测下一个词。
今天天气很好，我们去海边看鲸鱼吧。专家混合模型把每个词交给几个专家来处理。
日本語のテキストも少し入れておきます。クジラは海に住んでいます。
def forward(self, x):
    return self.norm(x + self.attn(x))

fn main() {
    let v: Vec<u32> = (0..10).collect();
    println!("{:?}", v);
}
for (int i = 0; i < 128; i++) { sum += a[i] * b[i]; }
Numbers 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 7168 3.14159 2025-01-20
Emoji 🐋 🐳 😀 👍🏽 ❤️ 🚀 and symbols ( ) [ ] { } < > = + - * / , . ; : ! ? ' " # % & _ | ~ @ $
Café naïve résumé Straße Ångström façade coöperate — “quotes” and ‘single’ … ellipsis
"""

# DeepSeek-V3's pre-tokenizer (tokenizer.json of deepseek-ai/DeepSeek-V3 and R1).
DEEPSEEK_SPLIT = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)

# R1's specials beyond BOS/EOS (names as in R1; ids here are just the next free ones).
R1_ADDED = [
    ("<｜▁pad▁｜>", True),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    ("<think>", False),
    ("</think>", False),
    ("<｜tool▁calls▁begin｜>", False),
    ("<｜tool▁calls▁end｜>", False),
    ("<｜tool▁call▁begin｜>", False),
    ("<｜tool▁call▁end｜>", False),
    ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False),
    ("<｜tool▁output▁begin｜>", False),
    ("<｜tool▁output▁end｜>", False),
    ("<｜tool▁sep｜>", False),
]

# DeepSeek-R1's chat_template (tokenizer_config.json of deepseek-ai/DeepSeek-R1, current revision).
R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- else %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}"
    "{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)

# Kimi-K2's pre-tokenizer (tokenization_kimi.py pat_str; spec §7.2).
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Kimi-K2's named specials: offset from the first special id (= number of ranks).
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}

# A Kimi-K2-Instruct-style template written from the spec (§7.2): default system prompt, role
# headers, `## Return of` tool results, compact tools JSON, tool-call sections.
KIMI_TEMPLATE = """\
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    <|im_system|>system<|im_middle|>
  {%- elif message['role'] == 'user' -%}
    <|im_user|>user<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>assistant<|im_middle|>
  {%- elif message['role'] == 'tool' -%}
    <|im_system|>tool<|im_middle|>
  {%- else -%}
    {{ raise_exception('unknown role: ' + message['role']) }}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {{ '## Return of ' + message['tool_call_id'] + '\\n' }}
  {%- endif -%}
  {%- if message['content'] is string -%}
    {{ message['content'] }}
  {%- elif message['content'] is not none -%}
    {%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    <|tool_calls_section_begin|>
    {%- for tc in message['tool_calls'] -%}
      <|tool_call_begin|>functions.{{ tc['function']['name'] }}:{{ loop.index0 }}<|tool_call_argument_begin|>
      {%- if tc['function']['arguments'] is string -%}{{ tc['function']['arguments'] }}
      {%- else -%}{{ tc['function']['arguments'] | tojson }}{%- endif -%}
      <|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""


def build_hf():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.Split(Regex("[一-龥\u3040-ゟ゠-ヿ]+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(DEEPSEEK_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 3, trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    for content, special in R1_ADDED:
        t = AddedToken(content, normalized=False, special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    return tok


def byte_level_decoder():
    # GPT-2's bytes_to_unicode, inverted.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def build_tiktoken(hf):
    """tiktoken ranks from the HF BPE: rank = HF id - 2 (BOS/EOS are specials in HF's vocab)."""
    dec = byte_level_decoder()
    model = json.loads(hf.to_str())["model"]
    ranks = {}
    for piece, i in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if i < 2:
            continue
        ranks[bytes(dec[ch] for ch in piece)] = i - 2
    assert sorted(ranks.values()) == list(range(len(ranks)))
    n = len(ranks)
    specials = {KIMI_SPECIALS.get(k, f"<|reserved_token_{n + k}|>"): n + k for k in range(256)}
    enc = tiktoken.Encoding(name="kimi_style", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)
    return ranks, specials, enc


def deep_sort_dict(obj):
    """tokenization_kimi.py's: every dict's keys in sorted order, recursively."""
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(x) for x in obj]
    return obj


def kimi_encode(enc, text):
    """tokenization_kimi.py's encode: pieces of <= 400k chars, then runs of <= 25k (non)whitespace."""
    out = []
    for i in range(0, len(text), 400_000):
        for sub in split_runs(text[i : i + 400_000], 25_000):
            out.extend(enc.encode(sub, allowed_special="all", disallowed_special=()))
    return out


def split_runs(s, max_len):
    current_len = 0
    current_is_space = False
    start = 0
    for i in range(len(s)):
        is_space = s[i].isspace()
        if current_is_space ^ is_space:
            current_len = 1
            current_is_space = is_space
        else:
            current_len += 1
            if current_len > max_len:
                yield s[start:i]
                start = i
                current_len = 1
    yield s[start:]


def cases():
    s = []
    english = [
        "Hello, world!", "hello world", "The quick brown fox jumps over the lazy dog.",
        "It's", "they're", "we'll", "I'VE", "you'D", "don't stop", "HELLO World", "CamelCaseWordsHere",
        "snake_case_name", "kebab-case-name", "a", "", " ", "  ", "\n", "\n\n", "\t", " \t \n ",
        "word  word", "word   word    word", "trailing spaces   ", "   leading spaces", "line1\nline2",
        "line1\r\nline2", "para\n\n\npara", "tab\tseparated\tvalues", "e-mail: someone@example.com",
        "https://example.com/path?q=1&r=2#frag", "(parenthesised) [bracketed] {braced}", "a.b.c.d",
        "ellipsis... and more...", "!!!???", "C'est la vie", "Straße", "naïve café", "Ångström",
        "“smart quotes” and ‘single’", "em—dash – en dash", "MIXED case AND Numbers 123abc",
        "A language model reads a sequence of tokens.", "The sperm whale dives deep.",
        "Mixture of experts", "latent attention cache", "ALLCAPS", "x", "Xy", "xY",
    ]
    chinese = [
        "你好", "你好，世界！", "抹香鲸是世界上最大的齿鲸。", "语言模型根据前面的词预测下一个词",
        "今天天气很好", "中文English混合text", "数字123和汉字", "日本語のテキスト", "クジラは海に住んでいます",
        "한국어 텍스트", "Русский текст", "Ελληνικά", "עברית", "العربية", "हिन्दी",
        "专家混合模型", "鲸", "《书名》「引号」", "全角：，。！？", "中文 空格 分隔",
    ]
    code = [
        "def forward(self, x):\n    return self.norm(x + self.attn(x))\n",
        "fn main() {\n    println!(\"hi\");\n}\n", "for (int i = 0; i < 128; i++) { sum += a[i] * b[i]; }",
        "let v: Vec<u32> = (0..10).collect();", "x += 1", "if (a && b || !c) return;", "a->b", "a::b::c",
        "#include <stdio.h>", "// comment", "/* block */", "    indented four", "        indented eight",
        "\tindented tab", "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}", "SELECT * FROM t WHERE id = 42;",
        "<html><body>hi</body></html>", "$ cargo test --release", "x = [i**2 for i in range(10)]",
        "lambda x: x + 1", "@decorator\ndef f(): pass", "0x1F 0b1010 0o777", "1e-5 3.14 -2.5e+10",
        "a_b_c = d_e_f", "__init__", "`backticks`", "~/path/to/file.txt", "C:\\Windows\\System32",
    ]
    numbers = [
        "0", "1", "12", "123", "1234", "12345", "123456", "1234567890", "3.14159", "2025-01-20",
        "100,000,000", "1/2", "50%", "$19.99", "-42", "+7", "007", "1st 2nd 3rd 4th", "٣٤٥", "①②③",
        "12:30:45", "v1.2.3", "10x", "x10", "1e10",
    ]
    emoji = [
        "🐋", "🐳🐋", "😀 smile", "👍🏽", "❤️", "🚀🚀🚀", "👨‍👩‍👧‍👦", "🇫🇷", "emoji🐋inside", "✓ done",
        "→ arrow", "∑ sum ∫ integral", "©®™", "½¼¾", "°C", "µs", "🀄", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "🐋 whale 鲸", "a🐋b",
    ]
    whitespace = [
        " " * 2, " " * 3, " " * 7, " " * 16, "a" + " " * 5 + "b", "\n" * 3, " \n", "\n ", " \n \n",
        "a\n\n\nb", "   \n   ", "\r\n\r\n", "\u00a0nbsp", "a\u3000b", "end\n", "  x  ", "\t\t\t", "x\t\ty",
    ]
    specials_r1 = [
        f"{BOS}Hello", f"Hello{EOS}", "<｜User｜>hi<｜Assistant｜>", "<think>\nreasoning</think>answer",
        "text <think> inside", f"{BOS}{BOS}", "<｜User｜>你好<｜Assistant｜><think>\n", "<|im_end|> not r1",
    ]
    specials_kimi = [
        "[BOS]Hello", "Hello[EOS]", "<|im_user|>user<|im_middle|>hi<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>", "<think>reasoning</think>answer", "[UNK] and [PAD]",
        "<|reserved_token_CHECK|>", "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>",
    ]
    s += english + chinese + code + numbers + emoji + whitespace
    # Combinations, so that every category meets the others.
    mixed = []
    for i, (a, b) in enumerate(zip(english[:30], chinese * 2)):
        mixed.append(f"{a} {b}")
    for i, (a, b) in enumerate(zip(code[:15], emoji * 2)):
        mixed.append(f"{a}{b}")
    for a, b in zip(numbers[:15], whitespace * 2):
        mixed.append(f"{a}{b}{a}")
    s += mixed
    lines = CORPUS.splitlines(keepends=True)
    s += ["".join(lines[i : i + 3]) for i in range(0, len(lines), 2)]
    return s, specials_r1, specials_kimi


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    hf = build_hf()
    r1 = OUT / "r1_style"
    r1.mkdir(exist_ok=True)
    hf.save(str(r1 / "tokenizer.json"))
    r1_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False},
        "pad_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False},
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 16384,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": R1_TEMPLATE,
    }
    (r1 / "tokenizer_config.json").write_text(json.dumps(r1_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    ranks, specials, enc = build_tiktoken(hf)
    kimi = OUT / "kimi_style"
    kimi.mkdir(exist_ok=True)
    with open(kimi / "tiktoken.model", "w") as f:
        for tok_bytes, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok_bytes).decode()} {rank}\n")
    n = len(ranks)
    kimi_config = {
        "added_tokens_decoder": {
            str(n + k): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
            for k, name in sorted(KIMI_SPECIALS.items())
        },
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "chat_template": KIMI_TEMPLATE,
    }
    (kimi / "tokenizer_config.json").write_text(json.dumps(kimi_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # Tokenizer cases.
    common, sp_r1, sp_kimi = cases()
    sp_kimi = [t.replace("CHECK", str(n + 100)) for t in sp_kimi]
    out = []
    for text in common + sp_r1 + sp_kimi:
        ids_hf = hf.encode(text, add_special_tokens=False).ids
        ids_tt = kimi_encode(enc, text)
        out.append(
            {
                "text": text,
                "hf_ids": ids_hf,
                "hf_decoded": hf.decode(ids_hf, skip_special_tokens=False),
                "tiktoken_ids": ids_tt,
                "tiktoken_decoded": enc.decode(ids_tt),
            }
        )
    assert len(out) >= 200, len(out)
    (OUT / "tokenizer_cases.json").write_text(json.dumps({"kimi_num_base_tokens": n, "cases": out}, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")

    # Chat cases, rendered by transformers.
    from transformers import PreTrainedTokenizerFast

    r1_tok = PreTrainedTokenizerFast.from_pretrained(str(r1))
    kimi_tok = PreTrainedTokenizerFast(tokenizer_object=hf, chat_template=KIMI_TEMPLATE, bos_token="[BOS]", eos_token="[EOS]")
    conversations = [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is a whale?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
            {"role": "user", "content": "你好，鲸鱼有多大？"},
        ],
        [
            {"role": "system", "content": "First system."},
            {"role": "system", "content": "Second system."},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "four"},
        ],
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"},
        ],
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    chat = []
    for name, tok in (("r1_style", r1_tok), ("kimi_style", kimi_tok)):
        for i, conv in enumerate(conversations):
            for agp in (True, False):
                for with_tools in (False, True) if name == "kimi_style" else (False,):
                    # Kimi's TikTokenTokenizer.apply_chat_template (tokenization_kimi.py) sorts
                    # the tools' keys at every level (deep_sort_dict) before the template sees
                    # them; this stand-in tokenizer has no such override, so it is done here.
                    kw = {"tools": deep_sort_dict(tools) if name == "kimi_style" else tools} if with_tools else {}
                    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp, **kw)
                    chat.append({"template": name, "messages": conv, "add_generation_prompt": agp, "tools": tools if with_tools else None, "expected": text})
    (OUT / "chat_cases.json").write_text(json.dumps(chat, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"r1_style vocab {hf.get_vocab_size()}, kimi ranks {n}, {len(out)} tokenizer cases, {len(chat)} chat cases")


if __name__ == "__main__":
    main()
